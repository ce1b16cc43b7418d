"""The ONE host loop: evaluation cadence, record sinks, checkpoints and resume, signals,
divergence policy.

Single runs (:func:`run`, what :meth:`Simulation.run` calls), sweeps (:meth:`Sweep.run`,
the host half of :mod:`scaffold_jax.sweep`) and the command line all run their compiled
programs through :func:`drive`. What differs between them is a :class:`Task`: the compiled
block of rounds, the evaluation that turns a state into records, and the divergence
policy, ``raise`` for a single run (:class:`DivergenceError` naming the round) or
``freeze`` per config in a sweep (inside the compiled round; the loop then never stops).
The modules: :mod:`~scaffold_jax.loop.driver` (:func:`drive`: the schedule, checkpoints and
resume, signals), :mod:`~scaffold_jax.loop.single` (single runs),
:mod:`~scaffold_jax.loop.sweeps` (sweeps) and :mod:`~scaffold_jax.loop.identity` (what a
resume must agree on).
"""

from scaffold_jax.loop.driver import (
    CHECKPOINT_SHARE,
    RECORDED_ROUND_METRICS,
    Diverged,
    DivergenceError,
    Outcome,
    Record,
    RunTerminated,
    Task,
    drive,
    sigterm_exits,
)
from scaffold_jax.loop.identity import ABSENT, check_same_run, differences, run_identity
from scaffold_jax.loop.single import RunResult, Simulation, run
from scaffold_jax.loop.sweeps import Sweep, SweepResult, sweep
from scaffold_jax.versions import accept_new_versions, library_versions

__all__ = [
    "ABSENT", "CHECKPOINT_SHARE", "RECORDED_ROUND_METRICS", "Diverged", "DivergenceError",
    "Outcome", "Record", "RunResult", "RunTerminated", "Simulation", "Sweep", "SweepResult",
    "Task", "accept_new_versions", "check_same_run", "differences", "drive",
    "library_versions", "run", "run_identity", "sigterm_exits", "sweep",
]  # fmt: skip
