"""The round's fixed cost: the engine's round against the plainest JAX program of the
same math, in time and in what the compiled program executes.

Per workload and algorithm (SCAFFOLD, FedAvg):

* ``engine``: ``Simulation.run_rounds``, R rounds as one compiled program.
* ``floor``: the same math written as plainly as JAX allows: gather the S clients' rows
  and batches (ids and batch indices drawn on the host beforehand, so sampling costs the
  floor nothing), K vmapped local steps (SCAFFOLD's corrected step y ← y − η(g − c_i + c)),
  aggregate, scatter the client table, R rounds in one ``lax.scan``. Nothing a run
  records (losses, metrics) and no checks: a lower bound, not a rival.
* ``floor_draws``: the same, drawing each round's ids (``jr.choice`` without replacement)
  and batch rows (``jr.randint``) on the device, as the plainest program a user would
  write does: the engine draws them too, so this is the like-for-like floor.

Both are timed interleaved (one call of R rounds per program in turn, the minimum and the
median over ``--repeats``), and their optimised HLO is read for its structure per round:
the operations and fusions executed (each computation's top-level instructions, a while
loop's body times its trip count where XLA knows it; a loop whose count is data, like the
local steps of an epochs plan, counted once and listed), while loops, sorts, host transfers
and copies. On an accelerator each executed top-level operation is roughly a kernel launch,
so that count, not the CPU time, is what a fixed cost of milliseconds is made of; and as
``launch_ops``, the operations that run a kernel (not tuples, their elements, parameters,
constants or bitcasts), each random-bits loop counted as one (XLA's CPU lowering rolls
jax.random's threefry hash into a loop of 5 trips; an accelerator runs it as one fused
kernel).

Workloads: ``tiny`` (N = 100 × 8 examples, d = 16, 2 classes, S = 10, K = 5, B = 2) and
``W1`` (benchmarks/workloads.py). Also measured: ``Simulation.run``'s cost per call
beyond its rounds on a warm simulation.

  python benchmarks/bench_fixed_cost.py --out benchmarks/results/fixed_cost.json
  python benchmarks/bench_fixed_cost.py --quick          # a smoke test (seconds)
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import workloads  # noqa: E402
from common import write_json  # noqa: E402

import scaffold_jax as sj  # noqa: E402

LR = 0.05


def tiny_data(num_clients: int = 100, per_client: int = 8, dim: int = 16, seed: int = 0):
    """The tiny workload's data: Gaussian features, labels of a random linear teacher."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_clients * per_client, dim)).astype(np.float32)
    y = (x @ rng.normal(size=dim) > 0).astype(np.int32)
    clients = [
        {
            "x": x[i * per_client : (i + 1) * per_client],
            "y": y[i * per_client : (i + 1) * per_client],
        }
        for i in range(num_clients)
    ]
    return sj.data.from_client_arrays(clients, test={"x": x[:200], "y": y[:200]})


def setups(quick: bool):
    """``{name: (problem, data, plan, S, R)}``."""
    tiny = tiny_data(num_clients=40 if quick else 100)
    out = {
        "tiny": (
            sj.models.logistic_regression((16,), 2),
            tiny,
            sj.BatchPlan.fixed(2, 5),
            10,
            20 if quick else 200,
        )
    }
    w = workloads.get_workload("W1", quick=quick)
    out["W1"] = (
        workloads.make_problem(w),
        workloads.make_data(w),
        w.plan,
        w.clients_per_round,
        w.rounds,
    )
    return out


def engine(name, problem, data, plan, s, rounds):
    """``(run, state, compiled)``: the engine's R rounds compiled once."""
    algorithm = (
        sj.scaffold(problem.loss_fn, option=2) if name == "scaffold" else sj.fedavg(problem.loss_fn)
    )
    sim = sj.Simulation(algorithm, problem, plan, s)
    hp = sj.types.resolve_hparams(algorithm, sj.hparams(client_lr=LR))
    state, key = sim.init(data), jr.key(0)
    compiled = sim.run_rounds.lower(hp, state, data, key, num_rounds=rounds).compile()
    return (lambda st: compiled(hp, st, data, key)[0]), state, compiled


def floor(name, problem, data, plan, s, rounds, seed=1, device_draws=False):
    """``(run, state, compiled)``: the plainest program of the same math (module docstring);
    with ``device_draws`` it draws each round's ids (``jr.choice`` without replacement) and
    batch rows (``jr.randint``) itself, as the plainest on-device program would."""
    n = data.num_clients
    k, b = plan.shape(int(data.max_count))
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(np.stack([rng.choice(n, s, replace=False) for _ in range(rounds)]), jnp.int32)
    counts = np.asarray(data.counts)[np.asarray(ids)]
    rows = rng.integers(0, 2**31, (rounds, s, k, b)) % counts[..., None, None]
    rows = jnp.asarray(rows + np.asarray(data.offsets)[np.asarray(ids)][..., None, None], jnp.int32)
    if device_draws:  # the scan carries round keys instead of drawn ids and rows
        ids, rows = jr.split(jr.key(seed), rounds), None
    all_counts, all_offsets = jnp.asarray(data.counts), jnp.asarray(data.offsets)
    examples = data.examples
    scaffold = name == "scaffold"

    def grad(p, batch):
        return jax.grad(lambda q: jnp.mean(problem.loss_fn(q, batch)))(p)

    def client(x, c, c_i, batch_rows):
        def step(y, r):
            g = grad(y, jax.tree.map(lambda a: a[r], examples))
            if scaffold:
                g = jax.tree.map(lambda g_, ci, c_: g_ - ci + c_, g, c_i, c)
            return jax.tree.map(lambda y_, g_: y_ - LR * g_, y, g), None

        y, _ = jax.lax.scan(step, x, batch_rows)
        dy = jax.tree.map(jnp.subtract, y, x)
        dc = (
            jax.tree.map(lambda ci, c_, d: -ci + c_ - d / (k * LR), c_i, c, dy) if scaffold else c_i
        )
        return dy, dc

    @jax.jit
    def run(state):
        def one(carry, round_inputs):
            x, c, table = carry
            round_ids, batch_rows = round_inputs
            if device_draws:
                pick, rows_key = jr.split(round_ids)
                round_ids = jr.choice(pick, n, (s,), replace=False)
                counts_now = all_counts[round_ids][:, None, None]
                batch_rows = jr.randint(rows_key, (s, k, b), 0, counts_now)
                batch_rows = batch_rows + all_offsets[round_ids][:, None, None]
            c_i = jax.tree.map(lambda t: t[round_ids], table)
            dy, dc = jax.vmap(client, in_axes=(None, None, 0, 0))(x, c, c_i, batch_rows)
            x = jax.tree.map(lambda a, d: a + jnp.mean(d, axis=0), x, dy)
            if scaffold:
                c = jax.tree.map(lambda a, d: a + jnp.sum(d, axis=0) / n, c, dc)
                table = jax.tree.map(lambda t, ci, d: t.at[round_ids].set(ci + d), table, c_i, dc)
            return (x, c, table), None

        out, _ = jax.lax.scan(one, state, (ids, rows))
        return out

    x = jax.tree.map(jnp.asarray, problem.params)
    zeros = jax.tree.map(jnp.zeros_like, x)
    state = (x, zeros, jax.tree.map(lambda a: jnp.zeros((n, *a.shape), a.dtype), x))
    return run, state, run.lower(state).compile()


# ------------------------------------------------------------------- program structure
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
# The opcode is the first " word(" after the "=": shapes (tuples too) hold none.
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(
    r"(?:body|condition|to_apply|true_computation|false_computation|calls)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
# Operations that name or reshape buffers and run no kernel.
_FREE = {"get-tuple-element", "tuple", "parameter", "constant", "bitcast"}
# A while loop of jax.random's hash (its op_name names the random function it serves).
_RANDOM = re.compile(
    r'op_name="[^"]*(?:threefry|_randint|_uniform|_bits|_gumbel|_permutation|_choice)'
)


def structure(hlo: str, rounds: int) -> dict:
    """What the optimised HLO executes per round (module docstring): ``ops`` (top-level
    operations and fusions), ``whiles``, ``sorts``, ``host_transfers``, ``copies`` and the
    while loops whose trip count is data (counted once)."""
    bodies: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        match = _COMPUTATION.match(line)
        if match and "=" not in line.split("{")[0].split("(")[0]:
            current = match.group(1)
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None and _INSTRUCTION.match(line):
            bodies[current].append(line)
    unknown: list[str] = []
    memo: dict[str, dict] = {}

    def count(name: str) -> dict:
        if name in memo:
            return memo[name]
        fields = ("ops", "launch_ops", "whiles", "random_loops", "sorts", "host_transfers",
                  "copies")  # fmt: skip
        total = dict.fromkeys(fields, 0)
        for line in bodies.get(name, []):
            op = _INSTRUCTION.match(line).group(1)
            total["ops"] += 1
            total["launch_ops"] += op not in _FREE
            total["sorts"] += op == "sort"
            total["copies"] += op in ("copy", "copy-start")
            total["host_transfers"] += op in ("infeed", "outfeed", "send", "recv") or (
                op == "custom-call" and "host" in line.lower()
            )
            called = _CALLED.findall(line)
            if op == "fusion":
                continue  # one launch, whatever it fuses
            if op == "while":
                total["whiles"] += 1
                # A random-bits loop: XLA's CPU lowering rolls the threefry hash into a
                # loop of 5 trips; on an accelerator it is one fused kernel, so it counts
                # as one launch however many operations it executes here.
                random = _RANDOM.search(line) is not None
                total["random_loops"] += random
                trip = _TRIP.search(line)
                if trip is None:
                    unknown.append(name)
                times = int(trip.group(1)) if trip else 1
                for callee in called:
                    for key, value in count(callee).items():
                        if not (random and key == "launch_ops"):
                            total[key] += times * value
            elif op == "conditional":
                branches = _BRANCHES.search(line)
                names = (
                    [b.strip().lstrip("%") for b in branches.group(1).split(",")]
                    if branches
                    else called
                )
                worst = max((count(b) for b in names), key=lambda c: c["ops"], default=None)
                for key, value in (worst or {}).items():
                    total[key] += value
            elif op in ("call", "async-start"):
                for callee in called:
                    for key, value in count(callee).items():
                        total[key] += value
        memo[name] = total
        return total

    whole = count(entry)
    per_round = {key: round(value / rounds, 1) for key, value in whole.items()}
    return {**per_round, "data_dependent_whiles": len(unknown)}


# ----------------------------------------------------------------------------- timing
def interleaved(programs: dict, repeats: int, rounds: int) -> dict:
    """Each ``(run, state)`` called once per repeat in turn (the first a warm-up); ms per
    round: the minimum and the median."""
    states = {k: s for k, (_, s) in programs.items()}
    times: dict[str, list[float]] = {k: [] for k in programs}
    for repeat in range(repeats + 1):
        for k, (run, _) in programs.items():
            start = time.perf_counter()
            states[k] = jax.block_until_ready(run(states[k]))
            if repeat:
                times[k].append((time.perf_counter() - start) * 1e3 / rounds)
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


def run_overhead(problem, data, plan, s, calls: int = 5) -> dict:
    """``Simulation.run``'s wall time per call beyond its rounds, on a warm simulation:
    a 2-round run minus the time its compiled rounds take alone (ms)."""
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, plan, s)
    hp = sj.hparams(client_lr=LR)
    sim.run(data, hp, num_rounds=2, eval_every=2)  # compiles everything once
    resolved = sj.types.resolve_hparams(sim.algorithm, hp)
    state = sim.init(data)
    compiled = sim.run_rounds.lower(resolved, state, data, jr.key(0), num_rounds=2).compile()
    whole, rounds_only = [], []
    for _ in range(calls):
        start = time.perf_counter()
        sim.run(data, hp, num_rounds=2, eval_every=2)
        whole.append(time.perf_counter() - start)
        start = time.perf_counter()
        state = jax.block_until_ready(compiled(resolved, state, data, jr.key(0))[0])
        rounds_only.append(time.perf_counter() - start)
    return {"run_ms": 1e3 * min(whole), "rounds_ms": 1e3 * min(rounds_only),
            "beyond_rounds_ms": 1e3 * (min(whole) - min(rounds_only))}  # fmt: skip


def sampler_share(repeats: int) -> dict:
    """The tiny SCAFFOLD round with the default sampler, with a one-draw stand-in in its
    place (S consecutive ids from a random start: not uniform, only a cost probe), and
    the device-drawing floor, interleaved: µs per round (min, median)."""
    from scaffold_jax import sampling

    problem, data, plan, s, rounds = setups(False)["tiny"]
    programs = {"engine": engine("scaffold", problem, data, plan, s, rounds)[:2]}
    default = sampling.sample_clients
    sampling.sample_clients = lambda key, n, k: (
        (jnp.arange(k, dtype=jnp.int32) * 7 + jr.randint(key, (), 0, n)) % n
    )
    try:
        programs["one_draw_sampler"] = engine("scaffold", problem, data, plan, s, rounds)[:2]
    finally:
        sampling.sample_clients = default
    drawing = floor("scaffold", problem, data, plan, s, rounds, device_draws=True)
    programs["floor_draws"] = drawing[:2]
    timing = interleaved(programs, repeats, rounds)
    return {k: (1e3 * lo, 1e3 * mid) for k, (lo, mid) in timing.items()}


def sampler_costs() -> list[dict]:
    """µs per draw of S distinct ids among N (jitted, 100 draws a call, min of 5): the
    default (Floyd's), top-k of N uniforms, top-k of N random words, ``jr.choice``."""
    from scaffold_jax.sampling import sample_clients

    candidates = {
        "floyd": sample_clients,
        "topk_uniform": lambda key, n, s: jax.lax.top_k(jr.uniform(key, (n,)), s)[1],
        "topk_bits": lambda key, n, s: jax.lax.top_k(jr.bits(key, (n,), jnp.uint32), s)[1],
        "choice": lambda key, n, s: jr.choice(key, n, (s,), replace=False),
    }
    rows = []
    for n, s in [(100, 10), (1000, 100), (10_000, 1000), (1_000_000, 100)]:
        row = {"num_clients": n, "clients_per_round": s}
        for name, draw in candidates.items():

            def hundred(key, draw=draw, n=n, s=s):
                def one(i, acc):
                    return acc + jnp.sum(draw(jr.fold_in(key, i), n, s).astype(jnp.int32))

                return jax.lax.fori_loop(0, 100, one, jnp.int32(0))

            run = jax.jit(hundred)
            run(jr.key(0)).block_until_ready()
            best = float("inf")
            for repeat in range(5):
                start = time.perf_counter()
                run(jr.key(repeat + 1)).block_until_ready()
                best = min(best, time.perf_counter() - start)
            row[f"{name}_us"] = best / 100 * 1e6
        rows.append(row)
        print(f"N = {n}, S = {s}: " + ", ".join(
            f"{k} {row[f'{k}_us']:.1f} us" for k in candidates), flush=True)  # fmt: skip
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes (seconds)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument(
        "--samplers",
        action="store_true",
        help="instead: the default sampler's share of the tiny round, and what drawing S "
        "of N ids costs by four methods (~8 min, most of it jr.choice at N = 10^6)",
    )
    args = parser.parse_args(argv)
    if args.samplers:
        share = sampler_share(args.repeats)
        for k, (lo, mid) in share.items():
            print(f"tiny SCAFFOLD, {k}: {lo:.1f} us/round (median {mid:.1f})", flush=True)
        result = {"tiny_round_us": share, "draw_us": sampler_costs()}
        if args.out:
            write_json(args.out, result)
        return
    rows = []
    for workload, (problem, data, plan, s, rounds) in setups(args.quick).items():
        for name in ("scaffold", "fedavg"):
            built = {
                "engine": engine(name, problem, data, plan, s, rounds),
                "floor": floor(name, problem, data, plan, s, rounds),
                "floor_draws": floor(name, problem, data, plan, s, rounds, device_draws=True),
            }
            timing = interleaved(
                {k: (r, st) for k, (r, st, _) in built.items()}, args.repeats, rounds
            )
            shape = {k: structure(c.as_text(), rounds) for k, (_, _, c) in built.items()}
            row = {"workload": workload, "algorithm": name, "rounds": rounds}
            for k in built:
                row[f"{k}_ms_min"], row[f"{k}_ms_median"] = timing[k]
                row.update({f"{k}_{field}": value for field, value in shape[k].items()})
            for k in ("floor", "floor_draws"):
                row[f"time_ratio_{k}"] = row["engine_ms_min"] / row[f"{k}_ms_min"]
                row[f"ops_ratio_{k}"] = row["engine_ops"] / row[f"{k}_ops"]
                row[f"launch_ratio_{k}"] = row["engine_launch_ops"] / row[f"{k}_launch_ops"]
            rows.append(row)
            print(
                f"{workload:5s} {name:8s} engine {row['engine_ms_min']:.3f} ms/round (median "
                f"{row['engine_ms_median']:.3f}); floor {row['floor_ms_min']:.3f} "
                f"({row['time_ratio_floor']:.2f}x), drawing on the device "
                f"{row['floor_draws_ms_min']:.3f} ({row['time_ratio_floor_draws']:.2f}x); "
                f"ops/round {row['engine_ops']:.0f} vs {row['floor_ops']:.0f} / "
                f"{row['floor_draws_ops']:.0f}; random loops as one launch "
                f"{row['engine_launch_ops']:.0f} vs {row['floor_launch_ops']:.0f} / "
                f"{row['floor_draws_launch_ops']:.0f} ({row['launch_ratio_floor']:.2f}x / "
                f"{row['launch_ratio_floor_draws']:.2f}x); whiles {row['engine_whiles']:.1f} "
                f"(random {row['engine_random_loops']:.1f}) vs {row['floor_whiles']:.1f} / "
                f"{row['floor_draws_whiles']:.1f}; sorts {row['engine_sorts']:.1f} vs "
                f"{row['floor_draws_sorts']:.1f}; copies {row['engine_copies']:.1f} vs "
                f"{row['floor_copies']:.1f}; data-dependent whiles "
                f"{row['engine_data_dependent_whiles']}",
                flush=True,
            )
    problem, data, plan, s, _ = setups(args.quick)["tiny"]
    overhead = run_overhead(problem, data, plan, s)
    print(
        f"Simulation.run on a warm simulation: {overhead['run_ms']:.1f} ms a call, "
        f"{overhead['beyond_rounds_ms']:.1f} ms beyond its rounds",
        flush=True,
    )
    if args.out:
        device = {"backend": jax.default_backend(), "device": str(jax.devices()[0])}
        write_json(args.out, {"rows": rows, "run_overhead": overhead, **device})


if __name__ == "__main__":
    main()
