"""What Byzantine-robust aggregation costs a round: W1 (N = 1,000 × 60 images, S = 100,
K = 5, B = 12, logistic regression) with each aggregator of :mod:`scaffold_jax.robust`
against the mean round, for SCAFFOLD and FedAvg.

``rounds``: the programs (``mean``, ``median``, ``trimmed_mean``, ``krum``, ``multikrum``,
``geomed``, ``cclip``, ``median`` with ``bucket_size = 2``, and with an attack on, ALIE at
f = 0.2, ``alie_mean`` and ``alie_median``) are all compiled first, then timed interleaved
in one process (``--repeats`` passes of R rounds each): min and median ms a round, their
ratios to ``mean``'s and the median of the per-pass ratios (paired), with each program's
compile time and XLA temp memory (``compiled.memory_analysis()``). Every program uses
``weighting = "uniform"`` (a robust aggregator requires it), the mean as well.

``alone``: each aggregator by itself, jitted, on ``[S, D]`` float32 rows (D = 7,850,
FedAvg's message, and 15,700, SCAFFOLD's Δy and Δc), interleaved, ms a call; what it
adds to a round is at least this.

``sort``: the median's sort against other ways to the same median (XLA's ``sort`` on the
transposed rows, a bitonic min/max network sketched here, numpy's ``np.median``).

``hlo``: the sorts in each aggregator's compiled program (from
``jax.jit(...).lower(...).compile().as_text()``): their shapes, the dimension sorted and
how many operands each sorts, the cost that bounds the median, trimmed mean and Krum.

The targets (the issue's): median and trimmed mean ≤ 1.3× the mean round, Krum ≤ 1.5×,
cclip and geomed ≤ 1.5×; they are checked in the printed summary and the JSON.

Examples:
  python benchmarks/bench_robust.py --out benchmarks/results/robust.json
  python benchmarks/bench_robust.py --quick
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import workloads
from bench_machine import describe
from common import engine_parser, peak_rss_mib, ratio_rows, write_json
from workloads import compiled_rounds

import scaffold_jax as sj
from scaffold_jax import robust
from scaffold_jax.robust import aggregators
from scaffold_jax.robust.aggregators.sorting import sort_rows
from scaffold_jax.types import resolve_hparams

FRACTION = 0.2  # the attacked rows' byzantine_fraction

#: label -> (aggregator, its hyper-parameters, attack)
VARIANTS = {
    "mean": ("mean", {}, "none"),
    "median": ("median", {}, "none"),
    "trimmed_mean": ("trimmed_mean", {}, "none"),
    "krum": ("krum", {}, "none"),
    "multikrum": ("multikrum", {}, "none"),
    "geomed": ("geomed", {}, "none"),
    "cclip": ("cclip", {}, "none"),
    "median_bucket2": ("median", {"bucket_size": 2}, "none"),
    "alie_mean": ("mean", {}, "alie"),
    "alie_median": ("median", {}, "alie"),
}

#: label -> the issue's bound on its round against the mean round
TARGETS = {"median": 1.3, "trimmed_mean": 1.3, "krum": 1.5, "cclip": 1.5, "geomed": 1.5}


def program(w, name, data, problem, label):
    """``(run, state, compile_s, temp_bytes)`` of R rounds of one variant."""
    aggregator, chosen, attack = VARIANTS[label]
    algorithm = workloads.make_algorithm(name, problem.loss_fn)
    algorithm = robust.attacked(algorithm, attack)
    algorithm = robust.robustly_aggregated(algorithm, aggregator)
    sim = sj.Simulation(algorithm, problem, w.plan, w.clients_per_round, weighting="uniform")
    extra = {**chosen, **({"byzantine_fraction": FRACTION} if attack != "none" else {})}
    hp = resolve_hparams(algorithm, {**workloads.make_hparams(name), **extra})
    state, key = sim.init(data), jr.key(0)
    run, compile_s, temp = compiled_rounds(sim, hp, state, data, key, w.rounds)
    return run, state, compile_s, temp


def bench_rounds(args, w, data, problem) -> list[dict]:
    rows = []
    for name in args.algorithms:
        programs, info = {}, {}
        for label in VARIANTS:
            run, state, compile_s, temp = program(w, name, data, problem, label)
            programs[label] = (run, state)
            info[label] = {"compile_s": compile_s, "temp_bytes": temp}
            print(f"{name} {label}: compiled in {compile_s:.2f} s", flush=True)
        wall, _, _ = workloads._interleaved(
            programs, args.repeats, dict.fromkeys(programs, w.rounds), stateless=()
        )
        mine = ratio_rows(name, wall, info, base="mean")
        for row in mine:
            times = wall[row["variant"]]
            row["ms_per_round_all"] = [1e3 * t for t in times]
            if row["variant"] == "alie_median":  # against the attacked mean of each pass
                row["vs_alie_mean_paired"] = float(np.median(np.divide(times, wall["alie_mean"])))
            target = TARGETS.get(row["variant"])
            if target is not None:
                row["target"] = target
                row["target_met_median"] = row["vs_mean_median"] <= target
                row["target_met_paired"] = row["vs_mean_paired"] <= target
        rows += mine
    return rows


def _aggregators(size: int):
    """label -> f(rows, mask, key, centre) -> [D] of each aggregator at its defaults (the
    mean: the masked mean the plain round takes)."""
    f = jnp.float32(0)

    def mean(rows, mask, key, centre):
        m = mask.astype(rows.dtype)
        return (m @ rows) / jnp.maximum(m.sum(), 1.0)

    def bucketed_median(rows, mask, key, centre):
        means, bmask, _ = aggregators.bucket(rows, mask, key, 2)
        return aggregators.median(means, bmask)

    return {
        "mean": mean,
        "median": lambda r, m, k, c: aggregators.median(r, m),
        "trimmed_mean": lambda r, m, k, c: aggregators.trimmed_mean(r, m, 0.1),
        "krum": lambda r, m, k, c: aggregators.krum(r, m, f)[0],
        "multikrum": lambda r, m, k, c: aggregators.multikrum(r, m, f, m.sum() - f)[0],
        "geomed": lambda r, m, k, c: aggregators.geomed(r, m, 8),
        "cclip": lambda r, m, k, c: aggregators.cclip(r, m, c, 1.0, 1),
        "median_bucket2": bucketed_median,
    }


def bench_alone(args, cohort: int, sizes) -> list[dict]:
    """ms a call of each aggregator alone, jitted, on ``[cohort, D]`` rows, interleaved."""
    out = []
    for size in sizes:
        rows = jr.normal(jr.key(0), (cohort, size)) * 0.01
        mask = jnp.ones(cohort, bool)
        key, centre = jr.key(1), jnp.zeros(size)
        fns = {k: jax.jit(f) for k, f in _aggregators(size).items()}
        compile_s, temp = {}, {}
        for label, fn in fns.items():
            start = time.perf_counter()
            compiled = fn.lower(rows, mask, key, centre).compile()
            compile_s[label] = time.perf_counter() - start
            temp[label] = (workloads.memory_stats(compiled) or {}).get("temp_size_in_bytes")
            jax.block_until_ready(fn(rows, mask, key, centre))
        calls = 5 if args.quick else 20
        times = {k: [] for k in fns}
        for _ in range(args.repeats * 2):
            for label, fn in fns.items():
                start = time.perf_counter()
                for _ in range(calls):
                    result = fn(rows, mask, key, centre)
                jax.block_until_ready(result)
                times[label].append((time.perf_counter() - start) / calls)
        base = float(np.median(times["mean"]))
        for label in fns:
            row = {
                "aggregator": label,
                "rows": cohort,
                "size": size,
                "ms_min": 1e3 * min(times[label]),
                "ms_median": 1e3 * float(np.median(times[label])),
                "vs_mean_median": float(np.median(times[label])) / base,
                "compile_s": compile_s[label],
                "temp_bytes": temp[label],
            }
            out.append(row)
            print(
                f"alone [{cohort}, {size}] {label:15s} {row['ms_min']:8.3f} ms (median "
                f"{row['ms_median']:.3f}, {row['vs_mean_median']:.1f}x the mean)",
                flush=True,
            )
    return out


_SORT = re.compile(
    r"=\s*(\([^=]*?\)|\S+)\s+sort\((.*?)\),\s*dimensions=\{(\d+)\}(?:,\s*is_stable=(\w+))?"
)


def sorts(text: str) -> list[dict]:
    """The sort instructions of an optimised HLO module's text: result shape(s), the
    dimension sorted, the number of operands (a multi-operand sort carries keys and
    indices) and whether it is stable."""
    return [
        {
            "shape": shape,
            "dimension": int(dim),
            "operands": operands.count("%"),
            "stable": stable == "true",
        }
        for shape, operands, dim, stable in _SORT.findall(text)
    ]


def bench_hlo(args, w, data, problem, cohort: int, size: int) -> dict:
    """The sorts in each aggregator's compiled program on ``[cohort, size]`` rows, and in
    the compiled one-round program of each algorithm with the median."""
    rows = jnp.zeros((cohort, size))
    mask, key, centre = jnp.ones(cohort, bool), jr.key(1), jnp.zeros(size)
    out = {"aggregator": {}, "round_median": {}}
    for label, fn in _aggregators(size).items():
        text = jax.jit(fn).lower(rows, mask, key, centre).compile().as_text()
        out["aggregator"][label] = {
            "sorts": sorts(text),
            "instructions": sum(1 for line in text.splitlines() if " = " in line),
        }
        print(f"hlo [{cohort}, {size}] {label:15s} sorts: {sorts(text)}", flush=True)
    for name in args.algorithms:
        algorithm = robust.robustly_aggregated(
            workloads.make_algorithm(name, problem.loss_fn), "median"
        )
        sim = sj.Simulation(algorithm, problem, w.plan, w.clients_per_round, weighting="uniform")
        hp = resolve_hparams(algorithm, workloads.make_hparams(name))
        lowered = sim.run_rounds.lower(hp, sim.init(data), data, jr.key(0), num_rounds=1)
        found = sorts(lowered.compile().as_text())
        out["round_median"][name] = found
        print(f"hlo {name} median round sorts: {found}", flush=True)
    return out


def _bitonic_median(rows):
    """The coordinate-wise median of all ``[S, D]`` rows by the package's bitonic min/max
    network (:func:`scaffold_jax.robust.aggregators.sorting.sort_rows`), the column's middle
    read as :func:`aggregators.median` reads it, without its masking: the network's own
    cost beside XLA's ``sort``."""
    count = rows.shape[0]
    ordered = sort_rows(rows)
    return 0.5 * (ordered[(count - 1) // 2] + ordered[count // 2])


def bench_sort(args, cohort: int, sizes) -> list[dict]:
    """What the median's sort costs: XLA's ``sort`` of ``[S, D]`` along the clients (as
    :func:`aggregators.median` runs it), the same on the transposed ``[D, S]`` along its
    last axis, a bitonic min/max network (:func:`_bitonic_median`), numpy's ``np.median``
    (introselect) and the masked mean, interleaved, ms a call."""
    out = []
    for size in sizes:
        rows = jr.normal(jr.key(0), (cohort, size))
        host = np.asarray(rows)
        mask = jnp.ones(cohort, bool)
        fns = {
            "mean": jax.jit(lambda r: jnp.mean(r, axis=0)),
            "median (xla sort, axis 0)": jax.jit(lambda r, m=mask: aggregators.median(r, m)),
            "xla sort of [D, S], last axis": jax.jit(lambda r: jnp.sort(r.T, axis=1)[:, 0]),
            "bitonic min/max network": jax.jit(_bitonic_median),
            "numpy np.median (host)": lambda r, h=host: np.median(h, axis=0),
        }
        expected = np.median(host, axis=0)
        times = {k: [] for k in fns}
        for label, fn in fns.items():
            got = jax.block_until_ready(fn(rows))
            if "median" in label or "bitonic" in label:
                np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)
        calls = 2 if args.quick else 5
        for _ in range(args.repeats):
            for label, fn in fns.items():
                start = time.perf_counter()
                for _ in range(calls):
                    result = fn(rows)
                jax.block_until_ready(result)
                times[label].append((time.perf_counter() - start) / calls)
        for label in fns:
            row = {"what": label, "rows": cohort, "size": size,
                   "ms_min": 1e3 * min(times[label]),
                   "ms_median": 1e3 * float(np.median(times[label]))}  # fmt: skip
            out.append(row)
            print(f"sort [{cohort}, {size}] {label:32s} {row['ms_min']:8.3f} ms (median "
                  f"{row['ms_median']:.3f})", flush=True)  # fmt: skip
    return out


def _load() -> dict:
    top = subprocess.run(["top", "-bn1"], capture_output=True, text=True).stdout.splitlines()
    return {"load_average": os.getloadavg(), "top": top[:15]}


def main(argv=None) -> dict:
    parser = engine_parser(__doc__)
    parser.add_argument("--parts", nargs="+", default=["rounds", "alone", "sort", "hlo"])
    args = parser.parse_args(argv)
    w = workloads.get_workload("W1", quick=args.quick)
    data = workloads.make_data(w)
    problem = workloads.make_problem(w)
    params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(problem.params))
    print(w.describe(), f"params {params}", flush=True)
    result = {
        "workload": w.describe(),
        "machine": describe(),
        "load_before": _load(),
        "variants": {k: list(v) for k, v in VARIANTS.items()},
        "byzantine_fraction_attacked": FRACTION,
        "targets": TARGETS,
        "repeats": args.repeats,
        "rounds_per_call": w.rounds,
        "command": "python benchmarks/bench_robust.py " + " ".join(argv or os.sys.argv[1:]),
    }
    if "rounds" in args.parts:
        result["rows"] = bench_rounds(args, w, data, problem)
    if "alone" in args.parts:
        result["alone"] = bench_alone(args, w.clients_per_round, (params, 2 * params))
    if "sort" in args.parts:
        result["sort"] = bench_sort(args, w.clients_per_round, (params, 2 * params))
    if "hlo" in args.parts:
        result["hlo"] = bench_hlo(args, w, data, problem, w.clients_per_round, params)
    result["peak_rss_mib"] = peak_rss_mib()
    result["load_after"] = _load()
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB", flush=True)
    for row in result.get("rows", []):
        if "target" in row:
            print(
                f"target {row['algorithm']:9s} {row['variant']:13s} <= {row['target']}x: "
                f"median {row['vs_mean_median']:.2f}x, paired {row['vs_mean_paired']:.2f}x "
                f"-> {'met' if row['target_met_median'] else 'MISSED'}",
                flush=True,
            )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
