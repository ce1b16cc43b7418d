"""Fingerprints of the compiled round programs: did an engine refactor change what runs?

For each workload (``--quick`` shapes of W1, W3, W6 and W4's CNN) and algorithm, the
``Simulation.run_rounds`` program is lowered and compiled on this backend, its optimised
HLO text stripped of source locations (file names, line numbers and stack frames, which
move with any edit), and hashed. Two commits whose fingerprints are equal run the same
XLA program, so their single runs take the same time and give the same bits: a stronger
and quieter check than timing both on a shared machine. A differing fingerprint says only
that the program changed; time it then (bench_workloads.py, bench_models.py).

Examples (compare two checkouts):
  python benchmarks/program_fingerprints.py --out before.json
  git checkout other && python benchmarks/program_fingerprints.py --compare before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import workloads  # noqa: E402
from common import write_json  # noqa: E402

import scaffold_jax as sj  # noqa: E402

ALGORITHMS = [
    "scaffold",
    "scaffold-I",
    "fedavg",
    "fedprox",
    "feddyn",
    "fednova",
    "mime",
    "mimelite",
]


def fingerprint(compiled_text: str) -> str:
    """The HLO text from the first computation on, without source locations, hashed."""
    lines = compiled_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY")))
    body = "\n".join([lines[0], *lines[start:]])
    body = re.sub(r",? ?metadata=\{[^}]*\}", "", body)
    body = re.sub(r",? ?stack_frame_id=\d+", "", body)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def programs():
    """``(workload, algorithm, Simulation, data)`` for every program fingerprinted."""
    for name in ("W1", "W3", "W6"):
        w = workloads.get_workload(name, quick=True)
        data, problem = workloads.make_data(w), workloads.make_problem(w)
        for alg in ALGORITHMS:
            algorithm = workloads.make_algorithm(alg, problem.loss_fn)
            yield name, alg, sj.Simulation(algorithm, problem, w.plan, w.clients_per_round), data
    import bench_models

    w = bench_models.QUICK["W4"]
    data, _ = bench_models.make_data(w)
    problem = bench_models.make_problem(w)
    for alg in ("scaffold", "fedavg"):
        algorithm = workloads.make_algorithm(alg, problem.loss_fn)
        yield "W4", alg, sj.Simulation(algorithm, problem, w.plan, w.clients_per_round), data


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the fingerprints here (JSON)")
    parser.add_argument("--compare", help="fingerprints of another checkout (JSON) to compare")
    args = parser.parse_args(argv)
    found = {}
    for name, alg, sim, data in programs():
        hp = workloads.make_hparams(alg, sim.algorithm)
        lowered = sim.run_rounds.lower(hp, sim.init(data), data, jr.key(0), num_rounds=2)
        found[f"{name}/{alg}"] = fingerprint(lowered.compile().as_text())
    other = json.loads(Path(args.compare).read_text())["programs"] if args.compare else {}
    print(f"| program | fingerprint | {'same as --compare' if other else ''} |")
    print("|---|---|---|")
    for key, value in found.items():
        same = "" if not other else ("same" if other.get(key) == value else "**changed**")
        print(f"| {key} | {value} | {same} |")
    out = {"jax": jax.__version__, "backend": jax.default_backend(), "programs": found}
    write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
