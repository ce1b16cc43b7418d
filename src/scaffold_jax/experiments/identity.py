"""What identifies a run, for resumes: the config in its canonical form (a resumed command
must ask for the same thing) and what the built run adds (N, the data's fingerprint, the
model and the algorithm's options), which the checkpoints of every cell carry."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaffold_jax import loop, results
from scaffold_jax.data.federated import data_fingerprint  # noqa: F401  (re-exported)
from scaffold_jax.experiments.build import Built
from scaffold_jax.experiments.config import (
    OPTION_OWNERS,
    RunConfig,
    declared_hparams,
    declared_options,
)
from scaffold_jax.registry import ConfigError, code_of
from scaffold_jax.types import STEP_SIZES

CHECKPOINTS = "checkpoints"  # the run folder's checkpoint directory
#: Fields a resumed run may change: they do not change what the rounds compute or what a
#: record measures (the data's folder may move: its fingerprint is compared instead).
RESUMABLE_CHANGES = (
    "rounds", "eval_every", "targets", "out", "plugins", "data_dir", "download",
    # What a finished run leaves on disk, not what it computes.
    "keep_checkpoints",
    # Ways of fixing privacy hyper-parameters, which the resolved hparams compare: a target
    # epsilon is a noise multiplier calibrated for the planned rounds.
    "dp_epsilon", "dp_adaptive_quantile",
)  # fmt: skip


def config_identity(config: RunConfig, built: Built, fingerprint: str | None = None) -> dict:
    """What fixes a command-line run's result: the simulation's identity
    (:func:`scaffold_jax.loop.run_identity`, without a run's hyper-parameters and seed,
    which a cell's configs vary; the data's ``fingerprint`` if the caller has it) and, on
    top, what only the config says: the data (name, subset sizes, partition; not the
    folder it was read from), the model, the algorithm's options by their config keys and
    the code of every chosen entry defined outside scaffold_jax (a plugin file's content
    hash)."""
    facts = {
        "dataset": built.info["dataset"],
        "max_train_examples": config.max_train_examples,
        "max_test_examples": config.max_test_examples,
        "partition": built.info["partition"],
        "model": config.model,
        "model_options": config.resolved("model"),
        "algorithm_options": config.resolved_options(),
    }
    if fingerprint:
        facts["data_fingerprint"] = fingerprint
    code = plugin_code(config)
    if code:  # only then: the identities of runs made of built-in entries stay as they were
        facts["plugin_code"] = code
    return loop.run_identity(built.simulation, built.data, more=facts)


def plugin_code(config: RunConfig) -> dict[str, dict[str, str]]:
    """``{"<kind> <name>": {module: "<file> sha256 <digest>"}}`` of the chosen entries
    whose code lives outside scaffold_jax (see :func:`scaffold_jax.registry.code_of`)."""
    out = {}
    for kind, name, _ in config.chosen():
        code = code_of(OPTION_OWNERS[kind][name])
        if code:
            out[f"{kind} {name}"] = code
    return out


def canonical(values: Mapping[str, Any]) -> dict[str, Any]:
    """A saved or current config (plus a sweep's own keys) in the form two equal runs
    share: every field, and the options of the chosen entries with their defaults filled
    in (an explicit default equals an omitted one; a ``config.json`` of an earlier version,
    which held other entries' options at their defaults as fields, equals today's)."""
    values = json.loads(json.dumps(dict(values), default=str))  # tuples as lists, as saved
    declared = {*RunConfig.field_names(), *declared_hparams(), *declared_options()}
    known = {k: v for k, v in values.items() if k in declared}
    rest = {k: v for k, v in values.items() if k not in declared}
    # A command's config.json lays the values it was given over its first cell's.
    config = RunConfig.from_dict(known, strict=False)
    out = config.to_dict()
    del out["options"]  # each chosen entry's option is a key of its own, to name it in diffs
    for kind, _, _ in config.chosen():
        out.update(config.resolved(kind))
    # The algorithm's hyper-parameters at their values (an explicit default equals an
    # omitted one; another algorithm's, which validation lets pass only at its default,
    # is left out).
    try:
        resolved = config.resolved_hparams()
    except ValueError:  # an invalid config: compared as given (validation names it)
        resolved = dict(config.hparams)
    out["hparams"] = {k: float(v) for k, v in resolved.items() if k not in STEP_SIZES}
    # What the run computes, not how it was spelled: the entries compressed (all, or the
    # same names in another order), the device rows its clients read (not the file's
    # path), a sweep's axes as sets of values (each value is its own cell or config;
    # a vmapped program's order is compared by its checkpoints' identity).
    if "compress_entries" in out:
        out["compress_entries"] = _compressed_entries(config, out["compress_entries"])
    if out.get("profile_file") is not None:
        out["profile_file"] = _profile_rows(config, out["profile_file"])
    if isinstance(rest.get("grid"), Mapping):
        rest["grid"] = {k: _sorted(v) for k, v in rest["grid"].items()}
    return json.loads(json.dumps({**out, **rest}, default=str))


def _compressed_entries(config: RunConfig, entries: Any) -> Any:
    """``compress_entries`` as the uplink entries it chooses: ``all`` when it names every
    one the algorithm's clients send, else the names sorted (the order is not used); as
    given when it names none validly (validation says so)."""
    from scaffold_jax.compression import ALL, chosen_entries
    from scaffold_jax.experiments import resolve
    from scaffold_jax.wrappers import turned_off

    try:  # the algorithm's own clients' entries: every wrapper off
        plain = resolve.make_algorithm(config.replace(**turned_off()))
        names = set(chosen_entries(plain, entries))
        sent = set(chosen_entries(plain, ALL))
    except (ValueError, TypeError, KeyError, AttributeError):
        return entries
    return ALL if names == sent else ",".join(sorted(names))


def _profile_rows(config: RunConfig, path: Any) -> Any:
    """A profile file as the identity of the rows the run's clients read (the file's
    content, not its path); as given when it cannot be read (validation says so)."""
    from scaffold_jax.participation.clock import FileProfiles

    try:
        return FileProfiles(path=str(path)).identity(int(config.num_clients))
    except (ValueError, TypeError, OSError):
        return path


def _sorted(values: Any) -> Any:
    try:
        return sorted(values)
    except TypeError:
        return values


def short_digest(values: Mapping[str, Any]) -> str:
    """8 hex digits of SHA-256 over ``values`` as sorted JSON (a default folder's suffix:
    equal settings give equal digests, tuples and lists alike)."""
    text = json.dumps(values, sort_keys=True, default=list)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


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
        hint = ""
        noise = ("hparams", "dp_noise_multiplier")
        if _get(saved, noise) != _get(config, noise) and config.get("dp_epsilon") is not None:
            hint = (
                f" dp_epsilon calibrates the noise for the planned rounds, so other rounds "
                f"mean other noise: to run on with the run's noise give --dp-noise-multiplier "
                f"{_get(saved, noise)} instead of --dp-epsilon (the records then report the "
                "epsilon spent, above the target)."
            )
        raise ConfigError(
            f"--resume: {folder} holds another run ({'; '.join(diffs)}). Resume with the same "
            f"settings (only {', '.join(RESUMABLE_CHANGES)} may change), or start a new run "
            f"in another folder (or with --overwrite).{hint}"
        )


def _get(values: Mapping[str, Any], path: tuple[str, str]) -> Any:
    inner = values.get(path[0])
    return inner.get(path[1]) if isinstance(inner, Mapping) else None
