"""Where the test suite's time goes: per test file, its tests' seconds, how many XLA programs
they compiled and the seconds spent tracing, lowering and compiling them.

    SCAFFOLD_JAX_TEST_COMPILE_LOG=/tmp/clog .venv/bin/python -m pytest -n auto --dist loadfile
    python benchmarks/test_durations.py /tmp/clog [--top 25]

tests/conftest.py writes one JSON line per test into ``<log>.<worker>`` when the variable is
set. Seconds are wall seconds in the test's own worker (setup, call and teardown; a
module-scoped fixture counts in the test that first asks for it); compilations are those of
the worker process, not of the command-line subprocesses some tests start ("subprocess"
then holds the rest of the test's time in practice).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json


def load(prefix: str) -> list[dict]:
    lines = []
    for path in sorted(glob.glob(f"{prefix}.*")):
        with open(path) as f:
            lines += [json.loads(line) for line in f if line.strip()]
    return lines


def by_file(lines: list[dict]) -> list[dict]:
    files: dict[str, dict] = collections.defaultdict(collections.Counter)
    for line in lines:
        row = files[line["test"].split("::")[0]]
        row["tests"] += 1
        for key in ("seconds", "compiles", "compile", "trace", "lower"):
            row[key] += line.get(key, 0)
    rows = [{"file": name, **counts} for name, counts in files.items()]
    return sorted(rows, key=lambda r: -r["seconds"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the SCAFFOLD_JAX_TEST_COMPILE_LOG prefix")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    lines = load(args.log)
    total = sum(line["seconds"] for line in lines)
    compile_total = sum(line.get(k, 0) for line in lines for k in ("compile", "trace", "lower"))
    print(f"{len(lines)} tests, {total:.0f} worker-seconds, of which {compile_total:.0f} s "
          f"tracing/lowering/compiling in the workers\n")  # fmt: skip
    print("| file | tests | seconds | programs compiled | compile s | trace+lower s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in by_file(lines)[: args.top]:
        print(f"| {r['file']} | {r['tests']} | {r['seconds']:.1f} | {r['compiles']} "
              f"| {r['compile']:.1f} | {r['trace'] + r['lower']:.1f} |")  # fmt: skip
    print("\n| slowest tests | seconds | compiled | compile s |")
    print("|---|---:|---:|---:|")
    for line in sorted(lines, key=lambda x: -x["seconds"])[: args.top]:
        print(f"| {line['test']} | {line['seconds']:.1f} | {line.get('compiles', 0)} "
              f"| {line.get('compile', 0):.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
