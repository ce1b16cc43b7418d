"""What a resumed run must agree on: the ONE identity of a simulation's runs
(:func:`run_identity`: single runs, sweeps and the command line's cells all build theirs
with it) and the check of a checkpoint's against it (:func:`check_same_run`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from scaffold_jax import engine
from scaffold_jax.data.federated import data_fingerprint
from scaffold_jax.registry import ConfigError
from scaffold_jax.sampling import uniform
from scaffold_jax.types import HParams, format_hparams
from scaffold_jax.versions import check_versions, library_versions


def run_identity(
    simulation: engine.Simulation,
    data,
    hparams: HParams | None = None,
    seed: int | None = None,
    configs: Sequence[Mapping[str, Any]] | None = None,
    more: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What fixes the results of ``simulation`` on ``data``, which a resumed run must agree
    on, in the form it has after a JSON round trip: the library versions, the algorithm and
    its options, the data (N and its fingerprint), plan, S, weighting, sampler,
    participation models (device profiles included) and execution (FedBuff's); a single
    run's ``hparams`` (the declared ones, resolved) and ``seed``, or a sweep chunk's
    ``configs``, or neither (a command-line cell's,
    :func:`scaffold_jax.experiments.identity.config_identity`); then ``more``, the caller's
    facts (its ``data_fingerprint`` is not taken again), laid over the rest: its form of a key (the
    command line's ``algorithm_options``, by config key) is the one compared."""
    more = dict(more or {})
    identity = {
        "versions": library_versions(),
        "algorithm": simulation.algorithm.name,
        "algorithm_options": dict(simulation.algorithm.options),
        "data_fingerprint": more.get("data_fingerprint") or data_fingerprint(data),
        "num_clients": int(data.num_clients),
        "clients_per_round": simulation.clients_per_round,
        "weighting": simulation.weighting,
        "plan": repr(simulation.plan),
    }
    if seed is not None:
        identity["seed"] = int(seed)
    if hparams is not None:
        identity["hparams"] = {k: np.asarray(v).tolist() for k, v in hparams.items()}
    if configs is not None:
        identity["configs"] = list(configs)
    # Each of these only when not the default: identities written before it existed resume.
    if simulation.weighting_options:
        identity["weighting_options"] = simulation.weighting_options
    if simulation.sampler is not uniform:
        identity["sampler"] = _describe(simulation.sampler)
    if simulation.participation.describe():
        identity["participation"] = {
            kind: _model_identity(model, int(data.num_clients))
            for kind, model in simulation.participation._asdict().items()
        }
    if simulation.execution is not None:  # FedBuff's M, B and staleness weighting
        identity["execution"] = repr(simulation.execution)
    personal = simulation.personalization
    if personal is not None and personal != type(personal)():  # what the records measure
        identity["personalization"] = personal._asdict()
    return json.loads(json.dumps({**identity, **more}, default=str))


def _model_identity(model, num_clients: int) -> str:
    """A participation model as its identity compares it: what the run computes with it
    where the model says (file profiles: the rows its clients read, not the file's path),
    else its repr."""
    identity = getattr(model, "identity", None)
    return identity(num_clients) if callable(identity) else repr(model)


def _describe(fn) -> str:
    """A sampler as ``module.name(keyword=value, ...)``, a ``functools.partial`` unwrapped
    (what :func:`scaffold_jax.sampling.make` returns)."""
    keywords = getattr(fn, "keywords", {})
    fn = getattr(fn, "func", fn)
    args = ", ".join(f"{k}={v!r}" for k, v in sorted(keywords.items()))
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}({args})"


#: What an identity without the key ran with, where a default can be named: the command
#: line names its uniform sampler; identities from before samplers existed, and sweeps'
#: from before they named theirs, ran it.
ABSENT = {"sampler": _describe(uniform)}


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple]:
    """``(key, saved value, current value)`` for each key of ``current`` that ``saved``
    holds another value of (a key it lacks: :data:`ABSENT`'s value, else None), library
    versions apart (:func:`~scaffold_jax.versions.check_versions` compares those)."""
    then = {key: saved.get(key, ABSENT.get(key)) for key in current}
    return [(k, then[k], v) for k, v in current.items() if k != "versions" and then[k] != v]


def check_same_run(saved: dict[str, Any] | None, current: Mapping[str, Any], where: str) -> None:
    """Raises ValueError naming every difference between two run identities."""
    if saved is None:
        return  # written by checkpoint.save() directly: nothing to compare

    def show(key, value):
        if key == "hparams" and isinstance(value, dict):
            return f"({format_hparams(value)})"
        return repr(value)

    diffs = [
        f"{k}: {show(k, then)} in the checkpoint, {show(k, v)} now"
        for k, then, v in differences(saved, current)
    ]
    if diffs:
        raise ConfigError(
            f"cannot resume from {where}: it belongs to a different run ({'; '.join(diffs)}). "
            "Resume with the same algorithm, data, batch plan, S, weighting, hparams and "
            "seed, or start a new run in another checkpoint directory."
        )
    check_versions(saved, where)
