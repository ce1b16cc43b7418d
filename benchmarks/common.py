"""Helpers shared by the benchmark scripts: the usual arguments, peak memory and writing a
JSON result."""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path
from typing import Any

import numpy as np


def engine_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a script that times engine programs interleaved: ``--quick``,
    ``--algorithms``, ``--repeats`` and ``--out`` (described by ``doc``'s first paragraph)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="test-sized data (seconds)")
    parser.add_argument("--algorithms", nargs="+", default=["scaffold", "fedavg"])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per program")
    parser.add_argument("--out", help="write the JSON result here")
    return parser


def peak_rss_mib() -> float:
    """Peak resident set of this process (``VmHWM``), MiB.

    Read from /proc rather than ``getrusage``: on Linux ``ru_maxrss`` survives ``exec``, so
    a benchmark started by a big parent (``run_all.py``) would report the parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_json(path: str | Path | None, result: Any) -> None:
    """Writes ``result`` to ``path`` (indented; parent folders created); no-op for None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


def ratio_rows(
    algorithm: str, wall: dict[str, list[float]], info: dict[str, dict], base: str = "plain"
) -> list[dict]:
    """One row per variant of ``wall`` (``{variant: seconds per round of each timed
    call}``, interleaved, call r of every variant in the same pass): min and median ms per
    round, their ratios to ``base``'s, and the median of the per-pass ratios (``paired``:
    each call against the base call of its own pass, which cancels the machine's slow
    drifts), with the variant's ``info`` (compile time, temp memory...); each row is
    printed."""
    rows = []
    best, median = min(wall[base]), float(np.median(wall[base]))
    for label, times in wall.items():
        row = {
            "algorithm": algorithm,
            "variant": label,
            "ms_per_round_min": 1e3 * min(times),
            "ms_per_round_median": 1e3 * float(np.median(times)),
            f"vs_{base}": min(times) / best,
            f"vs_{base}_median": float(np.median(times)) / median,
            f"vs_{base}_paired": float(np.median(np.divide(times, wall[base]))),
            **info[label],
        }
        rows.append(row)
        extra = "  ".join(
            f"{k} {v / 2**20:.1f} MiB" if k.endswith("bytes") else f"{k} {v:.4g}"
            for k, v in info[label].items()
            if v is not None
        )
        print(
            f"{algorithm:9s} {label:19s} {row['ms_per_round_min']:7.2f} ms/round (median "
            f"{row['ms_per_round_median']:.2f}) {row[f'vs_{base}']:5.2f}x {base} (median "
            f"{row[f'vs_{base}_median']:.2f}x, paired {row[f'vs_{base}_paired']:.2f}x)  {extra}",
            flush=True,
        )
    return rows
