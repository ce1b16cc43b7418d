"""What a user waits for besides the rounds: start-up (compilation, and the persistent
compilation cache) and evaluation (the training loss on a subsample or on every example).

1. Start-up: the same ``scaffold-jax run`` (Fashion-MNIST, the default config, 4 rounds)
   three times in fresh processes: with an empty compilation cache, again with the cache
   it filled, and with ``--no-compile-cache``. Wall time of the whole command and the
   compile time it reports.
2. Evaluation: on the same data (60,000 training images, 10,000 test), the compiled
   evaluation with the training loss on the default 4,096-example subsample, on every
   example, and without it, timed interleaved in one process, next to one round.

Examples:
  python benchmarks/bench_startup.py --out benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import write_json

ROOT = Path(__file__).resolve().parent.parent


def startup(cache: Path, out: Path, *extra: str) -> dict:
    env = {**os.environ, "SCAFFOLD_JAX_COMPILE_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    argv = ["run", "--dataset", "fashion_mnist", "--rounds", "4", "--eval-every", "2"]
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "scaffold_jax.cli", *argv, "--out", str(out), "--quiet",
         "--overwrite", *extra],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - start
    (info,) = json.loads((out / "summary.json").read_text())["runs"].values()
    return {"wall_s": wall, "compile_s": info["compile_seconds"]}


def evaluation(repeats: int) -> dict:
    import jax
    import jax.random as jr

    from scaffold_jax import experiments

    built = experiments.build(experiments.RunConfig(dataset="fashion_mnist"))
    data, sim, hp = built.data, built.simulation, built.hparams
    variants = {
        "subsample_4096": sim,
        "all_examples": sim.replace(train_eval_examples=None),
        "no_train_loss": sim.replace(evaluators=sim.evaluators[:1]),
    }
    server = sim.algorithm.init(built.problem.params)[0]
    programs = {k: v.evaluate.lower(server, data).compile() for k, v in variants.items()}
    state = sim.init(data)
    one_round = sim.round.lower(hp, state, data, jr.key(0)).compile()
    times: dict[str, list[float]] = {k: [] for k in [*programs, "round"]}
    for repeat in range(repeats + 1):
        for k, program in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(program(server, data))
            if repeat:
                times[k].append(time.perf_counter() - start)
        start = time.perf_counter()
        state, _ = one_round(hp, state, data, jr.key(0))
        jax.block_until_ready(state)
        if repeat:
            times["round"].append(time.perf_counter() - start)
    best = {k: 1e3 * min(v) for k, v in times.items()}
    return {
        "train_examples": data.num_examples,
        "best_ms": best,
        "all_over_subsample": float(
            np.median(np.divide(times["all_examples"], times["subsample_4096"]))
        ),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = {
            "first (empty cache)": startup(tmp / "cache", tmp / "a"),
            "second (cache filled)": startup(tmp / "cache", tmp / "b"),
            "--no-compile-cache": startup(tmp / "cache", tmp / "c", "--no-compile-cache"),
        }
    for name, r in runs.items():
        print(f"start-up {name}: {r['wall_s']:.1f} s wall, compile {r['compile_s']:.2f} s")
    ev = evaluation(args.repeats)
    best = ev["best_ms"]
    print(
        f"evaluation on {ev['train_examples']} training examples: train loss on a 4,096 "
        f"subsample {best['subsample_4096']:.1f} ms, on all {best['all_examples']:.1f} ms "
        f"({ev['all_over_subsample']:.1f}×), test only {best['no_train_loss']:.1f} ms; one "
        f"round {best['round']:.1f} ms",
        flush=True,
    )
    result = {"startup": runs, "evaluation": ev}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
