"""What identifies a run, for resumes: the config in its canonical form (a resumed command
must ask for the same thing) and what the built run adds (N, the data's fingerprint, the
model and the algorithm's options), which the checkpoints of every cell carry."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaffold_jax import results
from scaffold_jax.data.federated import FederatedData
from scaffold_jax.experiments.build import Built
from scaffold_jax.experiments.config import RunConfig, declared_hparams, declared_options
from scaffold_jax.registry import ConfigError
from scaffold_jax.tree import tree_digest

CHECKPOINTS = "checkpoints"  # the run folder's checkpoint directory
#: Fields a resumed run may change: they do not change what the rounds compute.
RESUMABLE_CHANGES = ("rounds", "eval_every", "targets", "out", "plugins", "train_eval_examples")


def data_fingerprint(data: FederatedData) -> str:
    """SHA-256 of a dataset's arrays (a materialised one's examples, counts and test set; a
    procedural one's keys, constants and counts): two runs on the same fingerprint trained
    on the same data, client for client."""
    return tree_digest(
        (data.examples, data.counts, data.test) if hasattr(data, "examples") else data
    )


def run_identity(config: RunConfig, built: Built, fingerprint: str | None = None) -> dict:
    """What, beyond the engine's own identity (:func:`scaffold_jax.loop.run_identity`),
    fixes a command-line run's result: the data (name, source, folder, subset sizes,
    partition, N and a fingerprint of the arrays: ``fingerprint`` if the caller has it),
    the model and the algorithm's options; in the form it has after a JSON round trip."""
    identity = {
        "dataset": built.info["dataset"],
        # A dataset read back from its cache names the cache file: the origin counts.
        "dataset_source": _origin(built.info["dataset_source"]),
        "data_dir": config.data_dir,
        "max_train_examples": config.max_train_examples,
        "max_test_examples": config.max_test_examples,
        "partition": built.info["partition"],
        "num_clients": built.info["num_clients"],
        "data_fingerprint": fingerprint or data_fingerprint(built.data),
        "model": config.model,
        "model_options": config.resolved("model"),
        "algorithm_options": config.resolved_options(),
    }
    return json.loads(json.dumps(identity, default=str))


def _origin(source: str) -> str:
    """``"<file> (cache of <origin>)"`` → ``<origin>``; other sources as they are."""
    head, sep, rest = str(source).partition(" (cache of ")
    return rest[:-1] if sep and rest.endswith(")") else source


def canonical(values: Mapping[str, Any]) -> dict[str, Any]:
    """A saved or current config (plus a sweep's own keys) in the form two equal runs
    share: every field, and the options of the chosen entries with their defaults filled
    in (an explicit default equals an omitted one; a ``config.json`` of an earlier version,
    which held other entries' options at their defaults as fields, equals today's)."""
    values = json.loads(json.dumps(dict(values), default=str))  # tuples as lists, as saved
    declared = {*RunConfig.field_names(), *declared_hparams(), *declared_options()}
    known = {k: v for k, v in values.items() if k in declared}
    rest = {k: v for k, v in values.items() if k not in declared}
    config = RunConfig(**known)
    out = config.to_dict()
    del out["options"]  # each chosen entry's option is a key of its own, to name it in diffs
    for kind, _, _ in config.chosen():
        out.update(config.resolved(kind))
    return json.loads(json.dumps({**out, **rest}, default=str))


def check_resumable(folder: Path, config: dict[str, Any]) -> None:
    """Refuses ``--resume`` of a folder that holds a run of another configuration."""
    saved = canonical(json.loads((folder / results.CONFIG_FILE).read_text()))
    config = canonical(config)
    diffs = [
        f"{k}: {saved.get(k)!r} in the run, {v!r} now"
        for k, v in config.items()
        if k not in RESUMABLE_CHANGES and saved.get(k) != v
    ]
    if diffs:
        raise ConfigError(
            f"--resume: {folder} holds another run ({'; '.join(diffs)}). Resume with the same "
            f"settings (only {', '.join(RESUMABLE_CHANGES)} may change), or start a new run "
            "in another folder (or with --overwrite)."
        )
