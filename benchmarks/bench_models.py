"""W4 (a FEMNIST-shaped CNN) and W5 (Shakespeare, char LSTM): the engine against the
per-client loop and the bare per-client work, in one process, interleaved.

====== ============================================ ===== ==================== ==========
name   clients × examples                           S     local steps          model
====== ============================================ ===== ==================== ==========
W4     500 × 200, 28×28 uint8, 62 classes           50    K = 10, B = 20       cnn
W5     100 Shakespeare roles (real text if the      10    K = 10, B = 10       char_lstm
       ``shakespeare`` package is installed, else
       random ids), 80 characters, 90 classes
====== ============================================ ===== ==================== ==========

Programs, each timed for whole rounds (min of ``--repeats``, interleaved):

* ``engine``: ``Simulation.run_rounds`` as users get it (``client_chunk="auto"``: on CPU a
  convolutional model runs one client at a time, see ``Simulation.resolve_client_chunk``).
* ``loop``: the per-client loop of ``workloads.loop_program`` (a jitted client function
  called from Python once per sampled client, then a jitted server update).
* ``bare``: the same per-client gradient work on pre-gathered ``[S, K, B, ...]`` batches,
  one client at a time (``lax.map``) of a K-step ``lax.scan``: no sampling, masks, client
  table or control variates.
* ``--before`` (W4 only): the engine with the model's convolutions as flax's ``nn.Conv``
  (autodiff's transposed-layout gradients, slow inside XLA CPU's loops) and the former
  automatic chunking (vmapped clients: grouped convolutions); one round, timed once.

Examples:
  python benchmarks/bench_models.py --workload W4 --algorithms scaffold fedavg --before
  python benchmarks/bench_models.py --workload W5 --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import workloads  # noqa: E402
from common import peak_rss_mib, write_json  # noqa: E402

import scaffold_jax as sj  # noqa: E402
from scaffold_jax import models  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ModelWorkload:
    name: str
    num_clients: int
    per_client: int
    clients_per_round: int
    plan: sj.BatchPlan
    model: str
    rounds: int = 2


WORKLOADS = {
    "W4": ModelWorkload("W4", 500, 200, 50, sj.BatchPlan.fixed(20, 10), "cnn"),
    "W5": ModelWorkload("W5", 100, 0, 10, sj.BatchPlan.fixed(10, 10), "char_lstm"),
}
QUICK = {
    "W4": dataclasses.replace(
        WORKLOADS["W4"],
        num_clients=20,
        per_client=40,
        clients_per_round=4,
        plan=sj.BatchPlan.fixed(10, 2),
        rounds=1,
    ),  # fmt: skip
    "W5": dataclasses.replace(
        WORKLOADS["W5"], num_clients=8, clients_per_round=2, plan=sj.BatchPlan.fixed(4, 2), rounds=1
    ),  # fmt: skip
}


def make_data(w: ModelWorkload, seed: int = 0):
    """``(FederatedData, description)``."""
    rng = np.random.default_rng(seed)
    if w.model == "cnn":
        clients = [
            {"x": rng.integers(0, 256, (w.per_client, 28, 28), dtype=np.uint8),
             "y": rng.integers(0, 62, w.per_client).astype(np.int32)}
            for _ in range(w.num_clients)
        ]  # fmt: skip
        test = {"x": clients[0]["x"][:100], "y": clients[0]["y"][:100]}
        return sj.from_client_arrays(clients, test=test), "synthetic 28×28 uint8 images"
    try:
        from scaffold_jax.data import shakespeare

        ds = shakespeare.load()
        keep = np.sort(rng.choice(ds.num_clients, w.num_clients, replace=False))
        ds = ds.select(keep)
        clients = [ds.train_client(i) for i in range(ds.num_clients)]
        what = f"Shakespeare roles ({int(ds.train_counts.sum())} windows)"
    except FileNotFoundError:
        sizes = rng.integers(100, 3000, w.num_clients)
        clients = [
            {"x": rng.integers(0, 90, (n, 80)).astype(np.int32),
             "y": rng.integers(0, 90, n).astype(np.int32)}
            for n in sizes
        ]  # fmt: skip
        what = "random character ids (the shakespeare package is not installed)"
    test = {"x": clients[0]["x"][:100], "y": clients[0]["y"][:100]}
    return sj.from_client_arrays(clients, test=test), what


def make_problem(w: ModelWorkload, flax_conv: bool = False) -> sj.Problem:
    if w.model == "char_lstm":
        return models.build("char_lstm", (80,), 90, key=jr.key(0))
    if flax_conv:
        return models.classification_problem(_FlaxCNN(62), (28, 28), jr.key(0))
    return models.build("cnn", (28, 28), 62, key=jr.key(0))


class _FlaxCNN(models.CNN):
    """The CNN as it was before :class:`scaffold_jax.models.Conv`: flax's ``nn.Conv``."""

    @nn.compact
    def __call__(self, x):
        h = models._images(x, "cnn")
        for i, features in enumerate(self.conv_features):
            h = nn.relu(nn.Conv(features, (5, 5), padding="SAME", name=f"conv_{i}")(h))
            h = nn.max_pool(h, (2, 2), strides=(2, 2))
        h = h.reshape((h.shape[0], -1))
        h = nn.relu(models.Dense(self.hidden, name="hidden")(h))
        return models.Dense(self.num_classes, name="output")(h)


def bare_program(w: ModelWorkload, sim, data, seed: int = 1):
    k, b = sim.plan.shape(data.max_count)
    s = w.clients_per_round
    ids = jnp.arange(s, dtype=jnp.int32)
    keys = jax.vmap(lambda i: jr.fold_in(jr.key(seed), i))(ids)
    batches, mask = jax.vmap(lambda i, key: data.client_batches(i, key, sim.plan))(ids, keys)
    loss_fn = sim.problem.loss_fn
    lr = 0.05

    def client(p, cb):
        def step(q, batch):
            g = jax.grad(lambda r: jnp.mean(loss_fn(r, batch)))(q)
            return jax.tree.map(lambda a, gg: a - lr * gg, q, g), None

        return jax.lax.scan(step, p, cb)[0]

    @jax.jit
    def run(x):
        def one(p, _):
            p, cb = jax.lax.optimization_barrier((p, batches))
            y = jax.lax.map(lambda c: client(p, c), cb)
            return jax.tree.map(lambda a: jnp.mean(a, axis=0), y), None

        return jax.lax.scan(one, x, None, length=w.rounds)[0]

    del mask, k, b
    return run, sim.problem.params


def measure(
    w: ModelWorkload, name: str, data, repeats: int, before: bool, client_chunk="auto"
) -> dict:
    problem = make_problem(w)
    alg = workloads.make_algorithm(name, problem.loss_fn)
    sim = sj.Simulation(alg, problem, w.plan, w.clients_per_round, client_chunk=client_chunk)
    hp = workloads.make_hparams(name, alg)
    state, key = sim.init(data), jr.key(0)
    start = time.perf_counter()
    compiled = sim.run_rounds.lower(hp, state, data, key, num_rounds=w.rounds).compile()
    compile_s = time.perf_counter() - start
    engine = lambda st: compiled(hp, st, data, key)[0]  # noqa: E731
    bare, x0 = bare_program(w, sim, data)
    start = time.perf_counter()
    jax.block_until_ready(bare(x0))
    bare_compile_s = time.perf_counter() - start
    loop = workloads.loop_program(sim, data, hp)
    loop_state = sim.init(data)
    loop_state = loop(loop_state)  # compiles
    jax.block_until_ready(loop_state)
    programs = {"engine": (engine, state), "bare": (bare, x0), "loop": (loop, loop_state)}
    rounds = {"engine": w.rounds, "bare": w.rounds, "loop": 1}
    # Interleaved, after one warm-up pass (workloads._interleaved, as bench_workloads.py).
    times, _, _ = workloads._interleaved(programs, repeats, rounds, stateless=("bare",))
    best = {k: min(v) * 1e3 for k, v in times.items()}
    row = {
        "workload": w.name,
        "algorithm": name,
        "client_chunk": sim.resolve_client_chunk(data),
        "engine_ms": best["engine"],
        "loop_ms": best["loop"],
        "bare_ms": best["bare"],
        "loop_over_engine": best["loop"] / best["engine"],
        "engine_over_bare": best["engine"] / best["bare"],
        "compile_s": compile_s,
        "bare_compile_s": bare_compile_s,
        "all_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
        "peak_rss_mib": peak_rss_mib(),
    }
    if before and w.model == "cnn":
        old = make_problem(w, flax_conv=True)
        old_alg = workloads.make_algorithm(name, old.loss_fn)
        chunk = _former_chunk(sim, data)
        old_sim = sj.Simulation(old_alg, old, w.plan, w.clients_per_round, client_chunk=chunk)
        old_state = old_sim.init(data)
        program = old_sim.run_rounds.lower(hp, old_state, data, key, num_rounds=1).compile()
        t = time.perf_counter()
        jax.block_until_ready(program(hp, old_state, data, key)[0])
        row["before_ms"] = (time.perf_counter() - t) * 1e3
        row["before_over_engine"] = row["before_ms"] / row["engine_ms"]
        row["before_chunk"] = old_sim.client_chunk
    return row


def _former_chunk(sim, data):
    """The chunk "auto" chose before convolutional models ran one client at a time."""
    per_client = sim.client_bytes(data)
    from scaffold_jax.resources import CLIENT_CHUNK_BYTES, balanced_chunk

    return balanced_chunk(sim.clients_per_round, max(1, CLIENT_CHUNK_BYTES // per_client))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="W4", choices=sorted(WORKLOADS))
    parser.add_argument("--algorithms", nargs="*", default=["scaffold", "fedavg"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    parser.add_argument("--before", action="store_true", help="W4: also time the former CNN")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument(
        "--client-chunk", default="auto", help="the engine's client_chunk (auto, none or N)"
    )
    args = parser.parse_args(argv)
    w = (QUICK if args.quick else WORKLOADS)[args.workload]
    data, what = make_data(w)
    print(f"{w.name}: {what}, {data.num_clients} clients, S={w.clients_per_round}, "
          f"{w.plan}, {w.model}; {jax.devices()[0].device_kind}", flush=True)  # fmt: skip
    rows = []
    for name in args.algorithms:
        chunk = {"auto": "auto", "none": None}.get(args.client_chunk.lower())
        chunk = int(args.client_chunk) if chunk is None and args.client_chunk.isdigit() else chunk
        row = measure(w, name, data, args.repeats, args.before, chunk)
        rows.append(row)
        extra = (f", before {row['before_ms']:.0f} ms ({row['before_over_engine']:.1f}×)"
                 if "before_ms" in row else "")  # fmt: skip
        print(f"{w.name} {name:<9} engine {row['engine_ms']:8.1f} ms  loop {row['loop_ms']:8.1f} "
              f"ms  bare {row['bare_ms']:8.1f} ms  loop/engine {row['loop_over_engine']:.2f}  "
              f"engine/bare {row['engine_over_bare']:.2f}  compile {row['compile_s']:.1f} s"
              f"{extra}", flush=True)  # fmt: skip
    out = {"workload": dataclasses.asdict(w) | {"plan": repr(w.plan)}, "data": what, "rows": rows}
    if args.out:
        write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
