"""What realistic participation costs a round: W1 with every participation model off
(today's round) and with each one on: cyclic and Markov availability, uniform and speed
stragglers, Bernoulli dropouts, and all three kinds at once.

All programs are compiled first and then timed interleaved in one process (min and median
of ``--repeats`` calls of R rounds each), with their compile time and XLA's temp memory.
A straggler round does less gradient work than the plain one (K_i <= K steps) and a
dropped client's work is skipped, so those rows may run faster than the plain round; the
ratio that bounds the models' own cost is the availability rows' (a full [N] draw and a
top-k over N every round) and ``all`` (every model's bookkeeping at once).

Examples:
  python benchmarks/bench_participation.py --out benchmarks/results/participation.json
  python benchmarks/bench_participation.py --quick
"""

from __future__ import annotations

import jax.random as jr
import workloads
from common import engine_parser, write_json
from workloads import compiled_rounds, variant_rows

import scaffold_jax as sj
from scaffold_jax import participation
from scaffold_jax.types import resolve_hparams

#: label -> participation.make(...) arguments (options at their declared defaults).
VARIANTS = {
    "plain": {},
    "cyclic": {"availability": "cyclic"},
    "markov": {"availability": "markov"},
    "stragglers_uniform": {"stragglers": "uniform"},
    "stragglers_speed": {"stragglers": "speed"},
    "dropouts": {"dropouts": "bernoulli"},
    "all": {"availability": "markov", "stragglers": "uniform", "dropouts": "bernoulli"},
}


def program(w, name, data, problem, models: dict):
    """``(run, state, compile_s, temp_bytes)`` of R rounds of one variant."""
    algorithm = workloads.make_algorithm(name, problem.loss_fn)
    sim = sj.Simulation(
        algorithm,
        problem,
        w.plan,
        w.clients_per_round,
        participation=participation.make(**models),
    )
    hp = resolve_hparams(algorithm, workloads.make_hparams(name))
    state, key = sim.init(data), jr.key(0)
    run, compile_s, temp = compiled_rounds(sim, hp, state, data, key, w.rounds)
    return run, state, compile_s, temp


def main(argv=None) -> dict:
    parser = engine_parser(__doc__)
    args = parser.parse_args(argv)
    w = workloads.get_workload("W1", quick=args.quick)
    data = workloads.make_data(w)
    problem = workloads.make_problem(w)
    print(w.describe(), flush=True)
    rows = variant_rows(
        args.algorithms, list(VARIANTS), args.repeats, w.rounds,
        lambda name, label: program(w, name, data, problem, VARIANTS[label]),
    )  # fmt: skip
    result = {"workload": w.describe(), "variants": VARIANTS, "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
