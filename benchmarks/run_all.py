"""Runs every benchmark of issue 6 and writes ``benchmarks/results/<machine>.json``.

1. the machine (``bench_machine.py``): dense matmul GFLOP/s and memory bandwidth, measured
   before and after the workloads (a shared machine's peak moves; both are kept, and the
   larger is the denominator of "% of peak");
2. every workload × algorithm (``bench_workloads.py``), each in a FRESH process so that
   its peak RSS is its own: engine, engine with all S clients in one vmap, bare, bare_tuned and the
   per-client loop; then the ablation (change → ms/round) on W1 and W3.

Usage:
  python benchmarks/run_all.py                    # the full run (~20-30 min on 2 cores)
  python benchmarks/run_all.py --quick    # smoke test (~5 min), writes <machine>-quick.json
  python benchmarks/run_all.py --workloads W1 W3 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_machine  # noqa: E402
import bench_workloads  # noqa: E402
from common import write_json  # noqa: E402

ABLATION = {"W1": ["fedavg", "scaffold"], "W3": ["fedavg", "scaffold"]}


def _subprocess(name: str, quick: bool, repeats: int, algorithms, ablation) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{name}.json"
        cmd = [sys.executable, str(HERE / "bench_workloads.py"), "--workload", name]
        cmd += ["--repeats", str(repeats), "--out", str(out), "--algorithms", *algorithms]
        if quick:
            cmd.append("--quick")
        if ablation:
            cmd += ["--ablation", *ablation]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def run_workload(name: str, quick: bool, repeats: int, algorithms, ablation: list[str]) -> dict:
    """Each algorithm in a fresh process (its own peak RSS), then the ablation."""
    start = time.perf_counter()
    result = None
    for algorithm in algorithms:
        part = _subprocess(name, quick, repeats, [algorithm], [])
        if result is None:
            result = part
        else:
            result["rows"] += part["rows"]
    if ablation:
        part = _subprocess(name, quick, repeats, [], ablation)
        result = result or part
        result["ablation"] = part["ablation"]
    result["wall_s"] = time.perf_counter() - start
    return result


def _fmt(value, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown(summary: dict) -> str:
    """The results and ablation tables of a run, in Markdown (for benchmarks/README.md)."""
    peak = summary["peak_gflops"]
    lines = [
        "| workload | algorithm | engine ms | vmap-all ms | bare ms | tuned ms | engine/bare "
        "| engine/tuned | vmap-all/engine | loop/engine | compile s | RSS MiB | GFLOP/s "
        "| % peak |",
        "|" + "---|" * 14,
    ]
    for result in summary["workloads"].values():
        for r in result["rows"]:
            lines.append(
                _row(
                    [
                        r["workload"],
                        r["algorithm"],
                        _fmt(r["engine_ms"], "{:.1f}"),
                        _fmt(r.get("unchunked_ms"), "{:.1f}"),
                        _fmt(r["bare_ms"], "{:.1f}"),
                        _fmt(r["bare_tuned_ms"], "{:.1f}"),
                        _fmt(r["engine_over_bare"], "{:.2f}"),
                        _fmt(r["engine_over_bare_tuned"], "{:.2f}"),
                        _fmt(r.get("unchunked_over_engine"), "{:.2f}"),
                        _fmt(r.get("loop_over_engine"), "{:.1f}"),
                        _fmt(r["compile_s"], "{:.1f}"),
                        _fmt(r.get("engine_rss_mib"), "{:.0f}"),
                        _fmt(r["engine_gflops"], "{:.1f}"),
                        _fmt(r["engine_gflops"] / peak, "{:.0%}"),
                    ]
                )
            )
    mib = 2**20
    lines += [
        "",
        "| workload | algorithm | data MiB | table MiB | temp MiB (engine) | temp MiB (vmap-all) "
        "| aliased MiB | RSS MiB: baseline | before engine | engine (resident) "
        "| engine (peak) |",
        "|" + "---|" * 11,
    ]
    for result in summary["workloads"].values():
        for r in result["rows"]:
            m, pm = r["memory_analysis"] or {}, r.get("unchunked_memory_analysis") or {}
            lines.append(
                _row(
                    [
                        r["workload"],
                        r["algorithm"],
                        f"{r['data_bytes'] / mib:.0f}",
                        f"{r['client_table_bytes'] / mib:.1f}",
                        _fmt(m.get("temp_size_in_bytes", 0) / mib, "{:.0f}"),
                        _fmt(pm["temp_size_in_bytes"] / mib if pm else None, "{:.0f}"),
                        _fmt(m.get("alias_size_in_bytes", 0) / mib, "{:.1f}"),
                        _fmt(result.get("peak_rss_baseline_mib"), "{:.0f}"),
                        _fmt(r.get("current_rss_before_engine_mib"), "{:.0f}"),
                        _fmt(r.get("current_rss_engine_mib"), "{:.0f}"),
                        _fmt(r.get("engine_rss_mib"), "{:.0f}"),
                    ]
                )
            )
    ablation = [a for res in summary["workloads"].values() for a in res.get("ablation", [])]
    if ablation:
        lines += [
            "",
            "| workload | algorithm | variant | ms/round | CPU ms/round | compile s |",
            "|---|---|---|---|---|---|",
        ]
        for a in ablation:
            lines.append(
                f"| {a['workload']} | {a['algorithm']} | {a['variant']} | {a['ms']:.1f} "
                f"| {a['cpu_ms']:.1f} | {a['compile_s']:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="scaled-down workloads")
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2", "W2-mlp", "W3"])
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=["scaffold", "scaffold-I", "fedavg", "fedprox", "sgd"],
    )
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (quick: 1)")
    parser.add_argument("--no-ablation", action="store_true")
    parser.add_argument("--out", default=None, help="default benchmarks/results/<machine>.json")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)

    start = time.perf_counter()
    machine = bench_machine.measure(quick=args.quick)
    print(
        f"{machine['cpu_model']} ({machine['cpu_count']} CPUs): matmul "
        f"{machine['peak_gflops']:.1f} GFLOP/s, stream {machine['stream_gbps']:.1f} GB/s",
        flush=True,
    )
    results = {}
    for name in args.workloads:
        ablation = [] if args.no_ablation else ABLATION.get(name, [])
        results[name] = run_workload(name, args.quick, repeats, args.algorithms, ablation)
    machine_after = bench_machine.measure(quick=args.quick)
    peak = max(machine["peak_gflops"], machine_after["peak_gflops"])
    rows, ablation_rows = [], []
    for result in results.values():
        for row in result["rows"]:
            # One denominator for the whole run: the best matmul seen before or after.
            for key in ("engine", "best", "bare", "bare_tuned"):
                row[f"{key}_peak_fraction"] = row[f"{key}_gflops"] / peak
            row["peak_fraction"] = row["best_peak_fraction"]
            rows.append(row)
        ablation_rows += result.get("ablation", [])
    summary = {
        "machine": machine,
        "machine_after": machine_after,
        "peak_gflops": peak,
        "quick": args.quick,
        "repeats": repeats,
        "wall_s": time.perf_counter() - start,
        "workloads": results,
    }
    slug = bench_machine.machine_slug(machine) + ("-quick" if args.quick else "")
    out = Path(args.out) if args.out else HERE / "results" / f"{slug}.json"
    write_json(out, summary)
    out.with_suffix(".md").write_text(markdown(summary) + "\n")
    print()
    print(bench_workloads.format_table(rows))
    if ablation_rows:
        print()
        print(bench_workloads.format_table(ablation_rows, bench_workloads.ABLATION_COLUMNS))
    print(f"\nwrote {out} and {out.with_suffix('.md').name} ({summary['wall_s']:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
