"""Fingerprints of the compiled round programs: did an engine refactor change what runs?

For each workload (``--quick`` shapes of W1, W3, W6 and W4's CNN) and algorithm, and for
W1 with differential privacy (SCAFFOLD, FedAvg with adaptive clipping, Mime's private
pre-round pass), with each participation model (availability, stragglers, dropouts,
Poisson sampling) and as a sweep (2 seeds x 3 step sizes, the vmapped configs axis), the
``Simulation.run_rounds`` (``Sweep.run_rounds``) program is lowered and compiled on this
backend, its optimised
HLO text stripped of source locations (file names, line numbers and stack frames, which
move with any edit), and hashed. Two commits whose fingerprints are equal run the same
XLA program, so their single runs take the same time and give the same bits: a stronger
and quieter check than timing both on a shared machine. A differing fingerprint says only
that the program changed; time it then (bench_workloads.py, bench_models.py).

Beside each fingerprint, the program's structure per round (bench_fixed_cost.structure):
its kernel launches (operations that run a kernel, a random-bits loop as one) and its
loops whose trip count is data (on an accelerator each trip of one reads its condition
back to the host). A loop whose trip count is data is counted as one trip, so a launch
count beside one is a lower bound.

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
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import workloads  # noqa: E402
from bench_fixed_cost import structure  # noqa: E402
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
    "sgd",
    "scaffnew",
    "fedexp",
]


def fingerprint(compiled_text: str) -> str:
    """The HLO text from the first computation on, without source locations, hashed."""
    lines = compiled_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY")))
    body = "\n".join([lines[0], *lines[start:]])
    body = re.sub(r",? ?metadata=\{[^}]*\}", "", body)
    body = re.sub(r",? ?stack_frame_id=\d+", "", body)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


PRIVATE = {  # name: (algorithm, its hyper-parameters beyond make_hparams')
    "dp-scaffold": ("scaffold", {"dp_noise_multiplier": 1.0}),
    "dp-fedavg-adaptive": ("fedavg", {"dp_noise_multiplier": 1.0, "dp_clip_lr": 0.2}),
    "dp-mime": ("mime", {"dp_noise_multiplier": 1.0}),
}
PARTICIPATION = {  # name: (sampler, participation.make's arguments)
    "availability": (
        "uniform",
        {"availability": "markov", "options": {"availability_rate": 0.5}},
    ),
    "stragglers": ("uniform", {"stragglers": "uniform", "options": {"straggler_min_steps": 1}}),
    "dropouts": ("uniform", {"dropouts": "bernoulli", "options": {"dropout_rate": 0.3}}),
    "poisson": ("poisson", {}),
}


def programs():
    """``(workload, algorithm, Simulation, data, hparams)`` for every single-run program."""
    for name in ("W1", "W3", "W6"):
        w = workloads.get_workload(name, quick=True)
        data, problem = workloads.make_data(w), workloads.make_problem(w)
        for alg in ALGORITHMS:
            algorithm = workloads.make_algorithm(alg, problem.loss_fn)
            # Scaffnew's controls need every client in every round.
            cohort = data.num_clients if alg == "scaffnew" else w.clients_per_round
            sim = sj.Simulation(algorithm, problem, w.plan, cohort)
            yield name, alg, sim, data, workloads.make_hparams(alg, algorithm)
        if name != "W1":
            continue
        for variant, (alg, extra) in PRIVATE.items():
            algorithm = sj.privacy.private(workloads.make_algorithm(alg, problem.loss_fn))
            sim = sj.Simulation(algorithm, problem, w.plan, w.clients_per_round)
            hp = sj.hparams(**dict(workloads.make_hparams(alg)), **extra)
            yield name, variant, sim, data, sim.resolve_hparams(hp)
        for variant, (sampler, models) in PARTICIPATION.items():
            algorithm = workloads.make_algorithm("scaffold", problem.loss_fn)
            sim = sj.Simulation(
                algorithm, problem, w.plan, w.clients_per_round,
                sampler=sj.sampling.make(sampler), participation=sj.participation.make(**models),
            )  # fmt: skip
            yield (
                name,
                f"scaffold+{variant}",
                sim,
                data,
                workloads.make_hparams("scaffold", algorithm),
            )
    import bench_models

    w = bench_models.QUICK["W4"]
    data, _ = bench_models.make_data(w)
    problem = bench_models.make_problem(w)
    for alg in ("scaffold", "fedavg"):
        algorithm = workloads.make_algorithm(alg, problem.loss_fn)
        sim = sj.Simulation(algorithm, problem, w.plan, w.clients_per_round)
        yield "W4", alg, sim, data, workloads.make_hparams(alg, algorithm)


def sweep_program(name: str, alg: str):
    """The lowered ``Sweep.run_rounds`` of 2 seeds x 3 step sizes of one workload."""
    w = workloads.get_workload(name, quick=True)
    data, problem = workloads.make_data(w), workloads.make_problem(w)
    algorithm = workloads.make_algorithm(alg, problem.loss_fn)
    sweep = sj.sweep.Sweep(sj.Simulation(algorithm, problem, w.plan, w.clients_per_round))
    grid = sweep.resolve_grid(sj.sweep.grid(client_lr=[0.01, 0.03, 0.1])[0], 3)
    grid = sj.HParams({k: jnp.broadcast_to(v, (2, 3)) for k, v in grid.items()})
    carry = sweep.init(data, num_seeds=2, group_size=3)
    return sweep.run_rounds.lower(grid, carry, data, jr.split(jr.key(0), 2), num_rounds=2)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the fingerprints here (JSON)")
    parser.add_argument("--compare", help="fingerprints of another checkout (JSON) to compare")
    args = parser.parse_args(argv)
    found, shapes = {}, {}

    def record(key: str, compiled) -> None:
        text = compiled.as_text()
        found[key] = fingerprint(text)
        shape = structure(text, rounds=2)
        shapes[key] = {k: shape[k] for k in ("launch_ops", "data_dependent_whiles")}
        print(key, found[key], shapes[key], flush=True, file=sys.stderr)

    for name, alg, sim, data, hp in programs():
        lowered = sim.run_rounds.lower(hp, sim.init(data), data, jr.key(0), num_rounds=2)
        record(f"{name}/{alg}", lowered.compile())
    for name, alg in (("W1", "scaffold"), ("W1", "fedavg"), ("W6", "scaffold")):
        record(f"{name}/sweep-{alg}", sweep_program(name, alg).compile())
    before = json.loads(Path(args.compare).read_text()) if args.compare else {}
    other, other_shapes = before.get("programs", {}), before.get("structure", {})
    print("| program | fingerprint | launches/round | loops whose trip count is data |"
          + (" same as --compare |" if other else ""))  # fmt: skip
    print("|---|---|---|---|" + ("---|" if other else ""))
    for key, value in found.items():
        launches, loops = shapes[key]["launch_ops"], shapes[key]["data_dependent_whiles"]
        if key in other_shapes:
            was = other_shapes[key]
            launches = f"{was['launch_ops']} -> {launches}"
            loops = f"{was['data_dependent_whiles']} -> {loops}"
        same = "" if not other else (" same |" if other.get(key) == value else " **changed** |")
        print(f"| {key} | {value} | {launches} | {loops} |{same}")
    out = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "programs": found,
        "structure": shapes,
    }
    write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
