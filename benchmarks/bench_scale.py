"""Scale: a million stateful SCAFFOLD clients on one machine, and the client axis sharded.

Three measurements, each configuration in a FRESH subprocess (so a peak RSS belongs to
one configuration, and a forced device count can be set before jax is imported):

1. ``memory``: rounds/s and peak RSS for N ∈ {10⁴, 10⁵, 10⁶} SCAFFOLD clients with
   procedural Synthetic(1, 1) data (d = 60, 10 classes, 20 examples each), S = 1000,
   K = 10, B = 10, multinomial logistic regression (P = 610 parameters), control table
   in float32 and bfloat16 (stored as uint16 bit patterns, 2 bytes a value). The table is
   built in one allocation (:func:`scaffold_jax.init_state` with a one-device
   :class:`~scaffold_jax.layout.ClientMesh`) and donated to the
   compiled rounds. Reported per run: the table's bytes, XLA's memory analysis of the
   compiled block (arguments, outputs, aliased = updated in place, temporaries), the
   steady-state rounds/s, the time of the sampler alone, and the peak RSS. Then a linear
   fit of peak RSS on N per dtype, whose slope is compared with P × bytes per client.
   One extra run builds the table with the plain :func:`scaffold_jax.init_state` (its
   jitted broadcast also allocates the table once; the run checks that).
2. ``sharded``: the sharded round (a :class:`~scaffold_jax.layout.ClientMesh` layout) on 1,
   2 and 8 forced CPU devices, N = 10⁵, the same workload: rounds/s and the per-device
   sizes of the compiled program.
3. ``accuracy``: what the bfloat16 table does to a real run: Fashion-MNIST, 100 clients of
   the paper's 0%-similarity split, 20 per round, logistic regression, the paper's batch
   plan (0.2 of the local data, 1 epoch), η_l = 0.1, 100 rounds, seed 0; final test
   accuracy with float32 vs bfloat16 control variates.

Usage:
  python benchmarks/bench_scale.py [--out benchmarks/results/scale_cpu2.json]
      [--sizes 10000 100000 1000000] [--devices 1 2 8] [--skip-accuracy] ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from common import peak_rss_mib, write_json

THEORY_NOTE = "P x bytes per client (P = 610 parameters of the 60x10 logistic regression + bias)"


def machine() -> dict:
    import jax

    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "load_average_at_start": os.getloadavg(),
    }


# ---------------------------------------------------------------------- the children
def _workload(args, num_clients: int, dtype: str):
    import jax.numpy as jnp

    import scaffold_jax as sj
    from scaffold_jax.data.synthetic import procedural_synthetic

    # No test set: evaluation is not part of the round being measured.
    data = procedural_synthetic(
        num_clients, 1.0, 1.0, sizes=args.examples_per_client, num_test_clients=0
    )
    problem = sj.models.logistic_regression((60,), 10)
    algorithm = sj.scaffold(problem.loss_fn, control_dtype=jnp.dtype(dtype))
    plan = sj.BatchPlan.fixed(batch_size=args.batch_size, num_steps=args.local_steps)
    return data, problem, algorithm, plan


def _memory_stats(compiled) -> dict:
    stats = compiled.memory_analysis()
    names = ("argument", "output", "alias", "temp", "generated_code")
    return {f"{n}_bytes": int(getattr(stats, f"{n}_size_in_bytes", 0) or 0) for n in names}


def _time_program(compiled, hp, state, data, key, rounds: int, repeats: int):
    """Steady-state seconds per round (best of ``repeats`` calls, after a warm-up)."""
    import jax

    state, _ = compiled(hp, state, data, key)
    jax.block_until_ready(state)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        state, _ = compiled(hp, state, data, key)
        jax.block_until_ready(state)
        best = min(best, (time.perf_counter() - start) / rounds)
    return best, state


def _sampler_seconds(num_clients: int, clients_per_round: int, repeats: int = 3) -> float:
    import jax
    import jax.random as jr

    from scaffold_jax.sampling import sample_clients

    sample = jax.jit(lambda k: sample_clients(k, num_clients, clients_per_round))
    sample(jr.key(0)).block_until_ready()
    best = float("inf")
    for i in range(repeats):
        start = time.perf_counter()
        sample(jr.key(i + 1)).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def child_memory(args) -> dict:
    import jax
    import jax.random as jr

    import scaffold_jax as sj
    from scaffold_jax import layout

    n, dtype = args.num_clients, args.dtype
    data, problem, algorithm, plan = _workload(args, n, dtype)
    sim = sj.Simulation(algorithm, problem, plan, args.clients_per_round)
    rss_before_state = peak_rss_mib()
    if args.init == "plain":
        state = sj.init_state(algorithm, problem.params, n)
    else:
        mesh = layout.ClientMesh(layout.client_mesh(jax.devices()[:1]))
        state = sj.init_state(algorithm, problem.params, n, mesh)
    jax.block_until_ready(state)
    rss_after_state = peak_rss_mib()
    table_bytes = sum(a.nbytes for a in jax.tree.leaves(state.clients))
    hp, key = sj.hparams(client_lr=0.1), jr.key(0)
    start = time.perf_counter()
    compiled = sim.run_rounds.lower(hp, state, data, key, num_rounds=args.rounds).compile()
    compile_s = time.perf_counter() - start
    row = {
        "num_clients": n,
        "dtype": dtype,
        "init": args.init,
        "params_per_client": sum(a.size for a in jax.tree.leaves(problem.params)),
        "table_bytes": table_bytes,
        # bfloat16 controls are stored as their uint16 bit patterns (in-place scatter).
        "table_storage_dtype": str(jax.tree.leaves(state.clients)[0].dtype),
        "compile_s": compile_s,
        "xla": _memory_stats(compiled),
        "peak_rss_before_state_mib": rss_before_state,
        "peak_rss_after_state_mib": rss_after_state,
    }
    if args.repeats > 0:
        seconds, state = _time_program(compiled, hp, state, data, key, args.rounds, args.repeats)
        row["round_s"] = seconds
        row["rounds_per_s"] = 1.0 / seconds
        row["sampler_s"] = _sampler_seconds(n, args.clients_per_round)
        # The table must still be the one buffer that came in: donated and updated in place.
        row["table_bytes_after"] = sum(a.nbytes for a in jax.tree.leaves(state.clients))
    row["peak_rss_mib"] = peak_rss_mib()
    row["load_average"] = os.getloadavg()  # the machine is shared: context for the timings
    return row


def child_sharded(args) -> dict:
    import jax
    import jax.random as jr

    import scaffold_jax as sj
    from scaffold_jax import layout

    data, problem, algorithm, plan = _workload(args, args.num_clients, args.dtype)
    sim = sj.Simulation(
        algorithm, problem, plan, args.clients_per_round, layout=layout.ClientMesh()
    )
    state, data = sim.init(data), sim.layout.place_data(data)
    hp, key = sj.hparams(client_lr=0.1), jr.key(0)
    start = time.perf_counter()
    compiled = sim.run_rounds.lower(hp, state, data, key, num_rounds=args.rounds).compile()
    compile_s = time.perf_counter() - start
    seconds, state = _time_program(compiled, hp, state, data, key, args.rounds, args.repeats)
    table = jax.tree.leaves(state.clients)
    return {
        "devices": jax.device_count(),
        "num_clients": args.num_clients,
        "dtype": args.dtype,
        "compile_s": compile_s,
        "round_s": seconds,
        "rounds_per_s": 1.0 / seconds,
        "table_bytes": sum(a.nbytes for a in table),
        "table_bytes_per_device": sum(a.addressable_shards[0].data.nbytes for a in table),
        "xla_per_device": _memory_stats(compiled),
        "peak_rss_mib": peak_rss_mib(),
        "load_average": os.getloadavg(),
    }


def child_accuracy(args) -> dict:
    import jax.numpy as jnp

    import scaffold_jax as sj
    from scaffold_jax.data import partition, sources

    ds = sources.load("fashion_mnist")
    parts = partition.similarity_split(ds.train["y"], 100, 0.0, 0)
    data = sj.from_partition(ds.train, parts, test=ds.test)
    problem = sj.models.logistic_regression(ds.train["x"].shape[1:], ds.num_classes)
    plan = sj.BatchPlan.fraction_of_data(0.2, 1)
    out = {
        "dataset": f"{ds.name} from {ds.source}",
        "setup": "100 clients, 0% similarity, S = 20, batches of 0.2 of the local data "
        "x 1 epoch, logistic regression, client_lr 0.1, seed 0",
        "rounds": args.accuracy_rounds,
    }
    for dtype in ("float32", "bfloat16"):
        alg = sj.scaffold(problem.loss_fn, control_dtype=jnp.dtype(dtype))
        sim = sj.Simulation(alg, problem, plan, clients_per_round=20)
        result = sim.run(
            data, sj.hparams(client_lr=0.1), num_rounds=args.accuracy_rounds, eval_every=10
        )
        out[dtype] = {
            "final_test_accuracy": result.final("test_accuracy"),
            "final_test_loss": result.final("test_loss"),
            "final_train_loss": result.final("train_loss"),
            "test_accuracy_curve": [
                [r["round"], round(r["test_accuracy"], 4)] for r in result.records
            ],
        }
    out["accuracy_difference_bf16_minus_f32"] = (
        out["bfloat16"]["final_test_accuracy"] - out["float32"]["final_test_accuracy"]
    )
    return out


CHILDREN = {"memory": child_memory, "sharded": child_sharded, "accuracy": child_accuracy}


# ------------------------------------------------------------------------ the parent
def spawn(args, kind: str, devices: int = 1, **options) -> dict:
    """Runs one child in a fresh interpreter; returns its JSON result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind]
    for name in (
        "rounds",
        "repeats",
        "clients_per_round",
        "local_steps",
        "batch_size",
        "examples_per_client",
        "accuracy_rounds",
    ):
        cmd += [f"--{name.replace('_', '-')}", str(options.get(name, getattr(args, name)))]
    for name in ("num_clients", "dtype", "init"):
        if name in options:
            cmd += [f"--{name.replace('_', '-')}", str(options[name])]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def linear_fit(rows: list[dict]) -> dict:
    """Least-squares peak RSS = a + b·N per dtype; b against P × bytes."""
    import numpy as np

    fits = {}
    for dtype in sorted({r["dtype"] for r in rows}):
        sel = [r for r in rows if r["dtype"] == dtype and r["init"] == "direct"]
        if len(sel) < 2:
            continue
        n = np.array([r["num_clients"] for r in sel], np.float64)
        rss = np.array([r["peak_rss_mib"] for r in sel]) * 2**20
        slope, intercept = np.polyfit(n, rss, 1)
        theory = sel[0]["params_per_client"] * (4 if dtype == "float32" else 2)
        residual = rss - (intercept + slope * n)
        fits[dtype] = {
            "bytes_per_client": float(slope),
            "theory_bytes_per_client": theory,
            "slope_over_theory": float(slope / theory),
            "constant_mib": float(intercept / 2**20),
            "max_residual_mib": float(np.max(np.abs(residual)) / 2**20),
        }
    return fits


def print_tables(result: dict) -> None:
    mib = 2**20
    print("\n1. N clients on one CPU device (S = 1000, K = 10, B = 10, P = 610)")
    print(
        f"{'N':>9} {'dtype':8} {'init':6} {'table MiB':>9} {'peak RSS MiB':>12} "
        f"{'rounds/s':>8} {'sampler ms':>10} {'XLA alias MiB':>13} {'XLA temp MiB':>12} {'load':>5}"
    )
    for r in result["memory"]:
        rps = f"{r['rounds_per_s']:8.2f}" if "rounds_per_s" in r else f"{'-':>8}"
        smp = f"{r['sampler_s'] * 1e3:10.1f}" if "sampler_s" in r else f"{'-':>10}"
        print(
            f"{r['num_clients']:>9} {r['dtype']:8} {r['init']:6} {r['table_bytes'] / mib:9.1f} "
            f"{r['peak_rss_mib']:12.0f} {rps} {smp} {r['xla']['alias_bytes'] / mib:13.1f} "
            f"{r['xla']['temp_bytes'] / mib:12.1f} {r['load_average'][0]:5.1f}"
        )
    for dtype, fit in result.get("fit", {}).items():
        print(
            f"fit {dtype}: peak RSS = {fit['constant_mib']:.0f} MiB + N x "
            f"{fit['bytes_per_client']:.0f} B (theory {fit['theory_bytes_per_client']} B; "
            f"ratio {fit['slope_over_theory']:.3f}; max residual {fit['max_residual_mib']:.0f} MiB)"
        )
    if result.get("sharded"):
        print("\n2. The sharded round on forced CPU devices (all on the same 2 cores)")
        print(
            f"{'devices':>7} {'N':>8} {'rounds/s':>8} {'table MiB/device':>16} "
            f"{'XLA args MiB/dev':>16} {'XLA temp MiB/dev':>16} {'compile s':>9} {'load':>5}"
        )
        for r in result["sharded"]:
            x = r["xla_per_device"]
            print(
                f"{r['devices']:>7} {r['num_clients']:>8} {r['rounds_per_s']:8.2f} "
                f"{r['table_bytes_per_device'] / mib:16.1f} {x['argument_bytes'] / mib:16.1f} "
                f"{x['temp_bytes'] / mib:16.1f} {r['compile_s']:9.1f} {r['load_average'][0]:5.1f}"
            )
    acc = result.get("accuracy")
    if acc:
        print(f"\n3. bfloat16 control table on a real run: {acc['dataset']}; {acc['setup']}")
        for dtype in ("float32", "bfloat16"):
            a = acc[dtype]
            print(
                f"{dtype:9} final test accuracy {a['final_test_accuracy']:.4f}  test loss "
                f"{a['final_test_loss']:.4f}  train loss {a['final_train_loss']:.4f}"
            )
        print(f"difference (bf16 - f32): {acc['accuracy_difference_bf16_minus_f32']:+.4f}")


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**4, 10**5, 10**6])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--sharded-clients", type=int, default=10**5)
    parser.add_argument("--clients-per-round", type=int, default=1000)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--examples-per-client", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per compiled program")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls (best is kept)")
    parser.add_argument("--accuracy-rounds", type=int, default=100)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-plain-init", action="store_true")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    # Child-only options.
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--num-clients", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--init", default="direct", choices=["direct", "plain"])
    args = parser.parse_args(argv)

    if args.child:
        print("RESULT " + json.dumps(CHILDREN[args.child](args)), flush=True)
        return None

    result = {"workload": vars(args), "machine": machine(), "theory": THEORY_NOTE}
    result["memory"] = []
    for n in args.sizes:
        for dtype in args.dtypes:
            row = spawn(args, "memory", num_clients=n, dtype=dtype, init="direct")
            print(json.dumps(row), flush=True)
            result["memory"].append(row)
    if not args.skip_plain_init:
        row = spawn(
            args, "memory", num_clients=max(args.sizes), dtype="float32", init="plain", repeats=0
        )
        print(json.dumps(row), flush=True)
        result["memory"].append(row)
    result["fit"] = linear_fit(result["memory"])
    result["sharded"] = []
    for devices in args.devices:
        row = spawn(
            args, "sharded", devices=devices, num_clients=args.sharded_clients, dtype="float32"
        )
        print(json.dumps(row), flush=True)
        result["sharded"].append(row)
    if not args.skip_accuracy:
        result["accuracy"] = spawn(args, "accuracy")
    result["machine"]["load_average_at_end"] = os.getloadavg()
    print_tables(result)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
