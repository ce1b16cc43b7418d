"""What communication accounting and uplink compression cost a round: W1 with the
accounting's two counts removed from the program (``no_accounting``: the round before
issue 42), the plain round (accounting on, always), and each compressor on every uplink
entry: qsgd 8 and 4 bits, topk 1% and 10% with error feedback, randk 1%, signef.

All programs are compiled first and then timed interleaved in one process (min and median
of ``--repeats`` calls of R rounds each), with their compile time and XLA's temp memory.
Then, apart: one client's compression of a params-sized vector alone (topk's stable sort
over every entry against signef's and qsgd's elementwise work), and the bytes of the
error-feedback residual table at N = 10^5 for W1's model (from ``jax.eval_shape``: what
``Simulation.init`` allocates, float32 and bfloat16).

Examples:
  python benchmarks/bench_compression.py --out benchmarks/results/compression.json
  python benchmarks/bench_compression.py --quick
"""

from __future__ import annotations

import time
from unittest import mock

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import workloads
from common import engine_parser, write_json
from workloads import compiled_rounds, variant_rows

import scaffold_jax as sj
from scaffold_jax.compression import COMPRESSORS, compressed
from scaffold_jax.engine import aggregation
from scaffold_jax.tree import tree_bytes
from scaffold_jax.types import resolve_hparams

#: label -> (compressor, its hyper-parameters).
VARIANTS = {
    "no_accounting": ("none", {}),
    "plain": ("none", {}),
    "qsgd_8": ("qsgd", {"compress_bits": 8.0}),
    "qsgd_4": ("qsgd", {"compress_bits": 4.0}),
    "topk_1%": ("topk", {"compress_fraction": 0.01}),
    "topk_10%": ("topk", {"compress_fraction": 0.1}),
    "randk_1%": ("randk", {"compress_fraction": 0.01}),
    "signef": ("signef", {}),
}


def _without_counts(round_metrics):
    def patched(*args, **kwargs):
        metrics = round_metrics(*args, **kwargs)
        metrics.pop("downloads"), metrics.pop("uploads")
        return metrics

    return patched


def program(w, name, data, problem, label):
    """``(run, state, compile_s, temp_bytes)`` of R rounds of one variant."""
    compressor, extra = VARIANTS[label]
    algorithm = compressed(workloads.make_algorithm(name, problem.loss_fn), compressor)
    sim = sj.Simulation(algorithm, problem, w.plan, w.clients_per_round)
    hp = resolve_hparams(algorithm, {**workloads.make_hparams(name), **extra})
    state, key = sim.init(data), jr.key(0)
    patch = (
        mock.patch.object(aggregation, "round_metrics", _without_counts(aggregation.round_metrics))
        if label == "no_accounting"
        else mock.patch.object(aggregation, "round_metrics", aggregation.round_metrics)
    )
    with patch:
        run, compile_s, temp = compiled_rounds(sim, hp, state, data, key, w.rounds)
    return run, state, compile_s, temp


def compressor_alone(size: int, repeats: int) -> list[dict]:
    """ms of one client's compression of a ``size``-entry vector, per compressor."""
    v = jr.normal(jr.key(0), (size,))
    e = jnp.zeros((size,))
    rows = []
    for label, (name, extra) in VARIANTS.items():
        if name == "none":
            continue
        spec = COMPRESSORS[name]
        hp = {**{k: h.default for k, h in spec.hparams.items()}, **extra}
        residual = e if spec.compressor.error_feedback else None
        fn = jax.jit(lambda v, k, r, hp=hp, c=spec.compressor: c.apply(v, k, r, hp))
        jax.block_until_ready(fn(v, jr.key(1), residual))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(v, jr.key(1), residual))
            times.append(time.perf_counter() - start)
        rows.append({"variant": label, "size": size, "ms_min": 1e3 * min(times),
                     "ms_median": 1e3 * float(np.median(times))})  # fmt: skip
        print(f"{label:>10} alone on {size} entries: {1e3 * min(times):.3f} ms (min)", flush=True)
    return rows


def residual_table(problem, num_clients: int) -> dict[str, int]:
    """Bytes of the client tables at ``num_clients`` (SCAFFOLD's c_i and topk's residuals
    of Δy and Δc), from shapes alone."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        algorithm = compressed(sj.scaffold(problem.loss_fn), "topk", residual_dtype=dtype)
        like = jax.eval_shape(
            lambda a=algorithm: sj.engine.initial_state(a, problem.params, num_clients)
        )
        out[f"controls_bytes_{dtype}"] = tree_bytes(like.clients)
        out[f"residuals_bytes_{dtype}"] = tree_bytes(like.messages)
    print(f"N = {num_clients}: {out}", flush=True)
    return out


def main(argv=None) -> dict:
    parser = engine_parser(__doc__)
    args = parser.parse_args(argv)
    w = workloads.get_workload("W1", quick=args.quick)
    data = workloads.make_data(w)
    problem = workloads.make_problem(w)
    print(w.describe(), flush=True)
    rows = variant_rows(
        args.algorithms, list(VARIANTS), args.repeats, w.rounds,
        lambda name, label: program(w, name, data, problem, label),
    )  # fmt: skip
    size = tree_bytes(problem.params) // 4
    result = {
        "workload": w.describe(),
        "variants": {k: list(v) for k, v in VARIANTS.items()},
        "rows": rows,
        "compressor_alone": compressor_alone(size, args.repeats * 4),
        "tables_at_1e5_clients": residual_table(problem, 10**5),
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
