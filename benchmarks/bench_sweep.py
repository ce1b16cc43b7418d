"""Benchmark: a step-size × seed grid of SCAFFOLD as one vmapped sweep against sequential runs.

``--workload W1`` (the default) is the round benchmark's: N = 1000 clients × 60 examples
of 28×28 uint8 images, 10 classes, logistic regression, S = 100 clients per round, K = 5
local steps of B = 12 (``BatchPlan.fixed(12, 5)``). ``--workload W4`` is the CNN's
(benchmarks/bench_models.py): N = 500 × 200 images, 62 classes, the McMahan CNN, S = 50,
K = 10, B = 20. Every size can be overridden (``--clients-per-round 10`` makes W4 fit a
few minutes on 2 cores). The data are synthetic with the real shapes and a learnable
signal (a faint class prototype under pixel noise), so accuracy moves.

Two ways to run the same C = step sizes × seeds configs for R rounds:

* sequential: ``Simulation.run`` once per config; the compiled round program is reused
  from the first run (only its compilation is reported as compile time);
* sweep: :func:`scaffold_jax.sweep.sweep`, all configs under ``vmap`` in one program.

Both evaluate at round 0 and every ``--eval-every`` rounds (default: only at the end).
Other processes share a CPU, so with ``--repeats n`` the two modes alternate n times and
each keeps its best (and median) time. Reported: configs×rounds per second (compilation
excluded), their ratio, compile seconds, and the process's peak RSS after each mode's
first pass (sequential runs first, so the sweep's figure is the peak of both). Results go
to ``--out`` (JSON) and a table is printed.

Examples:
  python benchmarks/bench_sweep.py --rounds 30 --repeats 3 --out sweep.json
  python benchmarks/bench_sweep.py --num-clients 100 --rounds 3 --step-sizes 2 --seeds 2
  python benchmarks/bench_sweep.py --workload W4 --clients-per-round 10 --step-sizes 4 \
      --seeds 1 --rounds 2 --repeats 5
"""

from __future__ import annotations

import argparse
import platform

import jax
import numpy as np
from common import peak_rss_mib, write_json

import scaffold_jax as sj
from scaffold_jax.results import summarize
from scaffold_jax.sweep import grid, sweep

# Per workload: (model, classes, N, examples per client, S, K, B, min η_l, max η_l); the
# CNN diverges at η_l = 1, so its grid stops at 0.1.
WORKLOADS = {
    "W1": ("logreg", 10, 1000, 60, 100, 5, 12, 0.01, 1.0),
    "W4": ("cnn", 62, 500, 200, 50, 10, 20, 0.003, 0.1),
}


def synthetic_images(
    num_clients: int, per_client: int, num_test: int, num_classes: int = 10, seed: int = 0
):
    """uint8 28×28 images: a faint random prototype per class under heavy pixel noise,
    split i.i.d. over the clients (learnable, but not in a handful of steps)."""
    rng = np.random.default_rng(seed)
    prototypes = rng.uniform(-1.0, 1.0, size=(num_classes, 28, 28)).astype(np.float32)

    def examples(n):
        y = rng.integers(0, num_classes, n).astype(np.int32)
        pixels = 128.0 + 20.0 * prototypes[y] + rng.normal(scale=60.0, size=(n, 28, 28))
        return {"x": np.clip(pixels, 0, 255).astype(np.uint8), "y": y}

    train = examples(num_clients * per_client)
    parts = np.arange(num_clients * per_client).reshape(num_clients, per_client)
    return sj.from_partition(train, list(parts), test=examples(num_test))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    parser.add_argument("--num-clients", type=int, default=None)
    parser.add_argument("--examples-per-client", type=int, default=None)
    parser.add_argument("--test-examples", type=int, default=2000)
    parser.add_argument("--clients-per-round", type=int, default=None)
    parser.add_argument("--local-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--step-sizes", type=int, default=8, help="η_l values (log-spaced)")
    parser.add_argument("--min-lr", type=float, default=None)
    parser.add_argument("--max-lr", type=float, default=None)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--target", type=float, default=0.5, help="accuracy for the summary")
    parser.add_argument("--max-configs-per-chunk", type=int, default=None)
    parser.add_argument("--skip-sequential", action="store_true")
    parser.add_argument(
        "--repeats", type=int, default=5, help="alternate the modes this often (blocks)"
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    model, num_classes, *sizes = WORKLOADS[args.workload]
    names = (
        "num_clients",
        "examples_per_client",
        "clients_per_round",
        "local_steps",
        "batch_size",
        "min_lr",
        "max_lr",
    )
    for name, default in zip(names, sizes, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)

    data = synthetic_images(
        args.num_clients, args.examples_per_client, args.test_examples, num_classes
    )
    problem = sj.models.build(model, (28, 28), num_classes, key=jax.random.key(0))
    plan = sj.BatchPlan.fixed(args.batch_size, args.local_steps)
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, plan, args.clients_per_round)
    lrs = np.geomspace(args.min_lr, args.max_lr, args.step_sizes)
    hp, seeds, configs = grid(client_lr=lrs, seeds=list(range(args.seeds)))
    num_configs, rounds = len(configs), args.rounds
    out = {
        "workload": {
            "name": args.workload,
            "model": model,
            "algorithm": "scaffold",
            "num_clients": args.num_clients,
            "examples_per_client": args.examples_per_client,
            "clients_per_round": args.clients_per_round,
            "local_steps": args.local_steps,
            "batch_size": args.batch_size,
            "configs": num_configs,
            "step_sizes": lrs.tolist(),
            "seeds": args.seeds,
            "rounds": rounds,
            "eval_every": args.eval_every or rounds,
        },
        "environment": {
            "jax": jax.__version__,
            "devices": [str(d) for d in jax.devices()],
            "python": platform.python_version(),
        },
    }

    def run_sequential():
        compile_s, run_s, accuracy, final_params = 0.0, 0.0, [], []
        for config in configs:
            result = sim.run(
                data, sj.hparams(config["client_lr"]), rounds, args.eval_every, seed=config["seed"]
            )
            compile_s += result.compile_seconds
            run_s += result.run_seconds
            accuracy.append(result.final("test_accuracy"))
            final_params.append(jax.tree.map(np.asarray, result.state.server.params))
        return compile_s, run_s, np.asarray(accuracy), final_params

    def run_sweep():
        return sweep(
            sim,
            data,
            hp,
            seeds,
            rounds,
            args.eval_every,
            targets=(args.target,),
            max_configs_per_chunk=args.max_configs_per_chunk,
        )

    # Other processes share the CPU: the two modes alternate and each keeps its best run.
    samples = {"sequential": [], "sweep": []}
    compile_seconds, peak = {}, {}
    final_params = accuracy = None
    for _ in range(args.repeats):
        if not args.skip_sequential:
            compile_s, run_s, accuracy, final_params = run_sequential()
            compile_seconds.setdefault("sequential", compile_s)
            peak.setdefault("sequential", peak_rss_mib())
            samples["sequential"].append(run_s)
        result = run_sweep()
        compile_seconds.setdefault("sweep", result.compile_seconds)
        peak.setdefault("sweep", peak_rss_mib())
        samples["sweep"].append(result.run_seconds)
    rows = []
    for name in ("sequential", "sweep"):
        if not samples[name]:
            continue
        best_s = min(samples[name])
        out[name] = {
            "compile_seconds": compile_seconds[name],
            "run_seconds": best_s,
            "run_seconds_samples": samples[name],
            "config_rounds_per_second": num_configs * rounds / best_s,
            "config_rounds_per_second_median": num_configs
            * rounds
            / float(np.median(samples[name])),
            "peak_rss_mib": peak[name],
        }
        rows.append((name, out[name]))
    out["sweep"].update(
        {
            "chunk_size": result.chunk_size,
            "chunk_shape": list(result.chunk_shape),
            "num_chunks": result.num_chunks,
            "bytes_per_config": result.bytes_per_config,
            "diverged": int(result.diverged.sum()),
        }
    )
    if final_params is not None:
        out["speedup"] = (
            out["sweep"]["config_rounds_per_second"] / out["sequential"]["config_rounds_per_second"]
        )
        out["speedup_median"] = (
            out["sweep"]["config_rounds_per_second_median"]
            / out["sequential"]["config_rounds_per_second_median"]
        )
        final = result.final("test_accuracy")
        out["max_abs_diff_final_test_accuracy"] = float(np.nanmax(np.abs(final - accuracy)))
        # Each config against its own single run: the largest difference of the final
        # weights relative to that run's largest weight, per step size. Round-off of the
        # batched products (about 1e-6 after a round) stays there for stable step sizes and
        # grows exponentially for unstable ones, as between any two builds of one run.
        swept = result.server_states.params
        diffs = {}
        for j, (config, params) in enumerate(zip(configs, final_params, strict=True)):
            pairs = zip(jax.tree.leaves(params), jax.tree.leaves(swept), strict=True)
            diff = max(
                float(np.max(np.abs(s[j] - p)) / max(np.max(np.abs(p)), 1e-30)) for p, s in pairs
            )
            key = f"{config['client_lr']:.4g}"
            diffs[key] = max(diffs.get(key, 0.0), float(diff))
        out["max_rel_diff_final_params_by_client_lr"] = diffs
    best = summarize(result, args.target)["scaffold"]["best"]
    out["best"] = {k: best[k] for k in ("hparams", "rounds_mean", "rounds_std", "final_value_mean")}

    print(
        f"{args.workload} ({model}) SCAFFOLD, {num_configs} configs "
        f"({args.step_sizes} step sizes × {args.seeds} seeds) "
        f"× {rounds} rounds; N={args.num_clients}, S={args.clients_per_round}, "
        f"K={args.local_steps}, B={args.batch_size}; {jax.devices()[0].platform}"
    )
    print("| mode | compile s | best run s | configs×rounds/s (best) | (median) | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for name, row in rows:
        print(
            f"| {name} | {row['compile_seconds']:.2f} | {row['run_seconds']:.2f} "
            f"| {row['config_rounds_per_second']:.2f} "
            f"| {row['config_rounds_per_second_median']:.2f} | {row['peak_rss_mib']:.0f} |"
        )
    if "speedup" in out:
        print(
            f"sweep / sequential: {out['speedup']:.2f}× (best of {args.repeats}), "
            f"{out['speedup_median']:.2f}× (median)"
        )
        diffs = out["max_rel_diff_final_params_by_client_lr"]
        print(
            "sweep vs single runs, max relative |Δ final params| by η_l: "
            + ", ".join(f"{lr}: {d:.1e}" for lr, d in diffs.items())
        )
    print(
        f"chunks: {out['sweep']['num_chunks']} of {out['sweep']['chunk_size']} configs "
        f"({out['sweep']['chunk_shape'][0]} seeds × {out['sweep']['chunk_shape'][1]}) "
        f"({out['sweep']['bytes_per_config'] / 2**20:.1f} MiB per config estimated)"
    )
    write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
