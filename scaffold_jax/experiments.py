"""Experiments: one federated run from a validated config, and η_l grids of runs.

Used by the ``scaffold-jax`` command (:mod:`scaffold_jax.cli`), by the paper's protocols
(:mod:`scaffold_jax.paper`) and usable from Python or a notebook:

* :func:`run`: one federated run described by a :class:`RunConfig` (algorithm, dataset
  and partition, model, N and S, the batch plan, step sizes, rounds, evaluation cadence,
  targets, seed, output folder), written to its folder by a
  :class:`~scaffold_jax.results.RunWriter`;
* :func:`build`: the dataset, problem, algorithm and simulation a config describes;
* :func:`run_grid` and :func:`choose`: a simulation over an η_l grid (one vmapped
  program, :mod:`scaffold_jax.sweep`, or a loop) and the paper's choice among the runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.random as jr
import numpy as np

from scaffold_jax import models, results
from scaffold_jax import sweep as sweep_module
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.data import natural, partition, sources
from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.data.federated import FederatedData, from_partition, with_client_tests
from scaffold_jax.data.partition import DEFAULT_PARTITIONER, PARTITIONERS
from scaffold_jax.engine import MAX_SEED, SEED_WHY, Simulation
from scaffold_jax.loop import DivergenceError
from scaffold_jax.models import MODELS
from scaffold_jax.progress import Progress
from scaffold_jax.registry import PLUGIN_HINT, Registry, RegistryUnion, load_plugins
from scaffold_jax.types import (
    STATE_POLICIES,
    STEP_SIZES,
    Algorithm,
    HParam,
    HParams,
    Problem,
    format_hparams,
    resolve_hparams,
)

BATCH_PLANS = ("fraction", "epochs", "fixed", "full")
WEIGHTINGS = ("uniform", "num_examples")


def declared_hparams() -> dict[str, HParam]:
    """Every hyper-parameter beyond the step sizes that a registered algorithm declares
    (the first declaration of a name wins), read at each call: plugins may add some."""
    out: dict[str, HParam] = {}
    for _, spec in ALGORITHMS.items():
        for name, hparam in spec.hparams.items():
            if name not in STEP_SIZES:
                out.setdefault(name, hparam)
    return out


def declared_options() -> dict[str, Any]:
    """Every factory option (``{config key: Option}``) a registered algorithm declares."""
    out: dict[str, Any] = {}
    for _, spec in ALGORITHMS.items():
        for name, option in spec.options.items():
            out.setdefault(name, option)
    return out


#: Every dataset a config may name: the pooled ones (split over clients by a partitioner)
#: and the naturally federated ones (their clients come with the data).
DATASETS = RegistryUnion("dataset", sources.DATASETS, natural.NATURAL_DATASETS)


class ConfigError(ValueError):
    """An invalid configuration; the message names every bad field, its value and the
    allowed range."""


# =====================================================================================
# RunConfig: one run, validated in one place
# =====================================================================================
def _opt(default: Any, help: str, kind: str, choices: Sequence[str] | Registry | None = None):
    """A config field with CLI metadata: ``kind`` is int, float, str, bool, floats, ints.

    A :class:`~scaffold_jax.registry.Registry` as ``choices`` is kept as it is, not copied:
    whoever reads the choices (the command line, when it builds its parser) sees the
    entries registered by then, plugins' included.
    """
    if not isinstance(choices, Registry):
        choices = tuple(choices) if choices else None
    meta = {"help": help, "kind": kind, "choices": choices}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class RunConfig:
    """Everything one ``scaffold-jax run`` needs; :meth:`validate` checks it all.

    Fields left at ``None`` are resolved from the others (the ``resolved_*`` methods): the
    partition from whichever partition setting is given (default: the paper's 0%
    similarity), the batch plan from the local-step settings (default: the paper's
    batches of 0.2 of the client's data, 1 epoch; SGD: one full-batch step), S from
    ``client_fraction`` (default 0.2, the paper's 20%).

    Algorithms declare their own hyper-parameters and factory options (see
    :mod:`scaffold_jax.algorithms`); a config holds them in the tables ``hparams`` and
    ``options``, or as top-level keys of the same names (``prox_mu = 0.5``,
    ``scaffold_option = "I"``), which :meth:`from_dict` moves into those tables. A value for
    a name the chosen algorithm does not declare is an error, unless it is the default of
    the algorithm that does (a ``config.json`` of an earlier version holds every such
    field).

    A config file (TOML or JSON) holds these fields as top-level keys; an unknown key is
    an error, so a typo never silently falls back to a default. The ``config.json`` a run
    writes is itself a valid config file.
    """

    algorithm: str = _opt("scaffold", "federated algorithm", "str", ALGORITHMS)
    plugins: list[str] = _opt(
        [], "modules or .py files to import first (they register algorithms, models...)", "strs"
    )
    client_lr: float = _opt(0.1, "client (local) step size eta_l", "float")
    server_lr: float = _opt(1.0, "server (global) step size eta_g", "float")
    hparams: dict[str, float] = _opt(
        {}, "the algorithm's other declared hyper-parameters, e.g. {prox_mu = 1.0}", "table"
    )
    options: dict[str, Any] = _opt(
        {}, "the algorithm's factory options, e.g. {scaffold_option = 'I'}", "table"
    )
    weighting: str = _opt("uniform", "server aggregation weights", "str", WEIGHTINGS)
    dataset: str = _opt(
        "fashion_mnist",
        "dataset: an image dataset split over clients by the partition, or a naturally "
        "federated one (shakespeare, femnist) that brings its clients",
        "str",
        DATASETS,
    )
    data_dir: str | None = _opt(
        None,
        "where the dataset is: a folder of IDX files; Shakespeare: Gutenberg's raw_data.txt "
        "(default: the `shakespeare` package's texts); FEMNIST: LEAF JSON or TFF HDF5 files",
        "str",
    )
    min_client_examples: int | None = _opt(
        None, "natural datasets: drop clients with fewer training examples", "int"
    )
    client_holdout: float | None = _opt(
        None,
        "hold out this fraction of every client's examples as its own test set, for the "
        "per-client metrics (natural datasets use each client's own test split)",
        "float",
    )
    download: bool = _opt(False, "let TFDS download the dataset (needs internet)", "bool")
    max_train_examples: int | None = _opt(
        None, "use a random subset of this many training examples", "int"
    )
    max_test_examples: int | None = _opt(
        None, "use a random subset of this many test examples", "int"
    )
    partition: str | None = _opt(None, "how examples are split over clients", "str", PARTITIONERS)
    similarity: float | None = _opt(
        None, "similarity split: percent of i.i.d. data per client, 0..100", "float"
    )
    dirichlet_alpha: float | None = _opt(None, "Dirichlet label-skew concentration", "float")
    shards_per_client: int | None = _opt(None, "label shards per client", "int")
    model: str = _opt("logreg", "model", "str", MODELS)
    hidden_sizes: list[int] = _opt([256, 256], "MLP hidden layer widths", "ints")
    resnet_width: int = _opt(64, "ResNet-18: channels of the first stage (even)", "int")
    resnet_norm: str = _opt(
        "group",
        "ResNet-18: GroupNorm, or BatchNorm with running statistics (see --state-policy)",
        "str",
        models.RESNET_NORMS,
    )
    state_policy: str = _opt(
        "average",
        "a model's running statistics (BatchNorm's): averaged over the sampled clients like "
        "the params, or kept by each client as its own (FedBN's statistics)",
        "str",
        STATE_POLICIES,
    )
    lstm_hidden: int = _opt(256, "char LSTM: units of each LSTM layer", "int")
    embed_dim: int = _opt(8, "char LSTM: width of the character embedding", "int")
    num_clients: int = _opt(
        100,
        "number of clients N (a natural dataset: N of its clients, drawn with the partition seed)",
        "int",
    )
    clients_per_round: int | None = _opt(None, "clients sampled per round S", "int")
    client_fraction: float | None = _opt(
        None, "fraction of clients sampled per round (default 0.2)", "float"
    )
    batch_plan: str | None = _opt(None, "local batch plan", "str", BATCH_PLANS)
    local_epochs: int | None = _opt(None, "local epochs (fraction / epochs plans)", "int")
    local_steps: int | None = _opt(None, "local steps K (fixed / full plans)", "int")
    batch_size: int | None = _opt(None, "batch size B (fixed / epochs plans)", "int")
    batch_fraction: float | None = _opt(
        None, "batch as a fraction of the client's data (0.2 = 5 steps per epoch)", "float"
    )
    rounds: int = _opt(100, "communication rounds", "int")
    eval_every: int = _opt(5, "evaluate every this many rounds", "int")
    train_eval_examples: int = _opt(
        4096,
        "training examples train_loss is evaluated on: a fixed uniform subsample, an "
        "unbiased estimate (0: all of them, the exact objective)",
        "int",
    )
    targets: list[float] = _opt([0.5, 0.6, 0.7, 0.8], "target test accuracies", "floats")
    seed: int = _opt(
        0,
        "seed of the model's initial params and of the root key of client sampling and "
        "minibatches; also of the data (subsets, partition) unless partition_seed is set",
        "int",
    )
    partition_seed: int | None = _opt(
        None,
        "seed of the data alone: the example subsets (max_train/test_examples), the split "
        "over clients, the held-out client tests and a natural dataset's draw of clients "
        "(default: seed)",
        "int",
    )
    out: str | None = _opt(None, "output folder (default results/<algorithm>-<dataset>)", "str")

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "config") -> RunConfig:
        """Builds a config from a mapping; unknown keys are errors (with a suggestion).

        Raises:
          ConfigError: unknown keys.
        """
        values = dict(values)
        if "plugins" in values and isinstance(values["plugins"], (list, tuple)):
            _load_plugins(values["plugins"])  # they may declare the names used below
        tables = {}
        for table in _TABLES:
            given = values.pop(table, None)
            if given is not None and not isinstance(given, Mapping):
                raise ConfigError(
                    f"{table} = {given!r} is invalid: it must be a table of names and values."
                )
            tables[table] = dict(given or {})
        hparams, options = tables["hparams"], tables["options"]
        for name in declared_hparams():
            if name in values:
                hparams[name] = values.pop(name)
        for name in declared_options():
            if name in values:
                options[name] = values.pop(name)
        values["hparams"], values["options"] = hparams, options
        known = cls.field_names()
        unknown = [k for k in values if k not in known]
        if unknown:
            lines = []
            for key in unknown:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                lines.append(f"unknown {where} key {key!r}{hint}")
            raise ConfigError("; ".join(lines) + f". Known keys: {', '.join(known)}.")
        return cls(**dict(values))

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ validation
    def validate(self) -> RunConfig:
        """Checks every field; returns self so calls chain.

        Raises:
          ConfigError: listing every invalid field as ``field = value is invalid: it
            must be ...``.
        """
        errors: list[str] = []
        check = _Checker(errors)
        if check.type("plugins", self.plugins, (list, tuple), "a list of modules or .py files"):
            try:
                _load_plugins(self.plugins)
            except ConfigError as err:
                errors.append(str(err))
        if check.registered("algorithm", self.algorithm, ALGORITHMS):
            self._validate_algorithm(check, errors)
        for name, value in (("client_lr", self.client_lr), ("server_lr", self.server_lr)):
            check.number(name, value, low=0.0, strict=True, what="finite and > 0", float32=True)
        check.choice("weighting", self.weighting, WEIGHTINGS)
        if check.type("dataset", self.dataset, str, "a dataset name"):
            if self.is_natural:
                self._validate_natural(errors)
            else:
                try:
                    sources.canonical_name(self.dataset)
                except ValueError:
                    errors.append(
                        f"dataset = {self.dataset!r} is invalid: it must be one of "
                        f"{', '.join(DATASETS)}; {PLUGIN_HINT}."
                    )
                if self.min_client_examples is not None:
                    errors.append(
                        f"min_client_examples = {self.min_client_examples!r} applies to "
                        "naturally federated datasets only "
                        f"({', '.join(natural.NATURAL_DATASETS)}); remove it."
                    )
        check.integer("min_client_examples", self.min_client_examples, low=1, optional=True)
        check.number(
            "client_holdout", self.client_holdout, low=0.0, high=1.0, strict=True,
            optional=True, what="a fraction in (0, 1)",
        )  # fmt: skip
        if self.client_holdout is not None and self.is_natural:
            errors.append(
                f"client_holdout = {self.client_holdout!r} cannot be set with dataset = "
                f"{self.dataset!r}: its clients have their own test splits."
            )
        for name in ("resnet_width", "lstm_hidden", "embed_dim"):
            check.integer(name, getattr(self, name), low=1)
        check.choice("resnet_norm", self.resnet_norm, models.RESNET_NORMS)
        if check.choice("state_policy", self.state_policy, STATE_POLICIES):
            if self.state_policy != "average" and not self._keeps_statistics():
                errors.append(
                    f"state_policy = {self.state_policy!r} applies to a model with running "
                    "statistics (resnet18 with resnet_norm = 'batch', or a plugin model "
                    f"that takes state_policy); model = {self.model!r} keeps none."
                )
        check.type("data_dir", self.data_dir, str, "a folder path", optional=True)
        check.type("download", self.download, bool, "true or false")
        check.integer("max_train_examples", self.max_train_examples, low=1, optional=True)
        check.integer("max_test_examples", self.max_test_examples, low=1, optional=True)
        self._validate_partition(check, errors)
        check.registered("model", self.model, MODELS)
        if check.type("hidden_sizes", self.hidden_sizes, (list, tuple), "a list of integers"):
            if not self.hidden_sizes or any(
                isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in self.hidden_sizes
            ):
                errors.append(
                    f"hidden_sizes = {list(self.hidden_sizes)!r} is invalid: it must be a "
                    "non-empty list of integers >= 1."
                )
        if check.integer("num_clients", self.num_clients, low=1):
            if check.integer(
                "clients_per_round",
                self.clients_per_round,
                low=1,
                high=self.num_clients,
                optional=True,
                what=f"an integer in [1, num_clients = {self.num_clients}]",
            ):
                pass
        check.number(
            "client_fraction",
            self.client_fraction,
            low=0.0,
            high=1.0,
            strict=True,
            optional=True,
            what="in (0, 1]",
        )
        if self.clients_per_round is not None and self.client_fraction is not None:
            errors.append(
                f"clients_per_round = {self.clients_per_round} and client_fraction = "
                f"{self.client_fraction} are both set: give one of them."
            )
        self._validate_plan(check, errors)
        check.integer("rounds", self.rounds, low=1)
        check.integer("eval_every", self.eval_every, low=1)
        check.integer("train_eval_examples", self.train_eval_examples, low=0)
        if check.type("targets", self.targets, (list, tuple), "a list of accuracies"):
            for t in self.targets:
                if not _is_number(t) or not 0.0 < t <= 1.0:
                    errors.append(
                        f"targets = {list(self.targets)!r} is invalid: every target must be "
                        "an accuracy in (0, 1]."
                    )
                    break
        for name in ("seed", "partition_seed"):
            check.integer(
                name,
                getattr(self, name),
                low=0,
                high=MAX_SEED,
                optional=name == "partition_seed",
                what=f"an integer >= 0 and <= {MAX_SEED}{SEED_WHY}",
            )
        if (
            check.type("out", self.out, str, "a folder path", optional=True)
            and not self.out.strip()
        ):
            errors.append(
                f"out = {self.out!r} is invalid: it must be a folder path (an empty one would "
                "write into the working folder); give a folder, or leave out unset for "
                "results/<algorithm>-<dataset>."
            )
        if errors:
            raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
        return self

    @property
    def is_natural(self) -> bool:
        """Whether :attr:`dataset` is naturally federated (its clients come with it)."""
        return isinstance(self.dataset, str) and self.dataset in natural.NATURAL_DATASETS

    def _validate_natural(self, errors: list[str]) -> None:
        """A natural dataset brings its clients: no partition, no example subset."""
        spec = natural.NATURAL_DATASETS[self.dataset]
        if spec.needs_data_dir and self.data_dir is None:
            errors.append(
                f"dataset = {self.dataset!r} needs data_dir (--data-dir): {spec.description}."
            )
        given = [f for f in ("partition", *_partition_fields()) if getattr(self, f) is not None]
        if given:
            errors.append(
                f"{', '.join(given)} cannot be set with dataset = {self.dataset!r}: its clients "
                "come with the data; remove them (num_clients picks how many of its clients)."
            )
        if self.max_train_examples is not None:
            errors.append(
                f"max_train_examples = {self.max_train_examples} cannot be set with dataset = "
                f"{self.dataset!r} (a random subset of examples would break its clients); use "
                "num_clients or min_client_examples instead."
            )

    def _validate_algorithm(self, check: _Checker, errors: list[str]) -> None:
        """The ``hparams`` and ``options`` tables against what the algorithm declares."""
        spec = ALGORITHMS[self.algorithm]
        for table, declared_here, everywhere in (
            ("hparams", spec.hparams, declared_hparams()),
            ("options", spec.options, declared_options()),
        ):
            values = getattr(self, table)
            if not check.type(table, values, Mapping, "a table of names and values"):
                continue
            for name, value in values.items():
                if name in STEP_SIZES:
                    errors.append(
                        f"{table}.{name} is invalid: set the step size {name} as its own field."
                    )
                elif name in declared_here:
                    self._check_declared(check, name, value, declared_here[name])
                elif name not in everywhere:
                    errors.append(
                        f"{table}.{name} is unknown: no registered algorithm declares it "
                        f"({self.algorithm} takes {', '.join(declared_here) or 'none'})."
                    )
                elif not self._check_declared(check, name, value, everywhere[name]):
                    pass  # out of range: said already
                elif _parsed(everywhere[name], value) != _parsed(
                    everywhere[name], _default(everywhere[name])
                ):
                    why = spec.refuses.get(name)
                    takes = ", ".join(k for k in declared_here if k not in STEP_SIZES) or "none"
                    errors.append(
                        f"{name} = {value!r} does not apply to algorithm = "
                        f"{self.algorithm!r}"
                        + (
                            f": {why}."
                            if why
                            else f", which takes {takes}; remove it or choose an algorithm "
                            "that declares it."
                        )
                    )

    @staticmethod
    def _check_declared(check: _Checker, name: str, value: Any, declared: Any) -> bool:
        """Checks ``value`` against its declaration; False (with a message) when bad."""
        if isinstance(declared, HParam):
            low_ok = "finite and >= 0" if declared.allow_zero else "finite and > 0"
            return check.number(
                name, value, low=0.0, strict=not declared.allow_zero, what=low_ok, float32=True
            )
        try:
            parsed = declared.parse(value)
        except ValueError as err:
            check.errors.append(f"{name} = {value!r} is invalid: {err}")
            return False
        if declared.choices is not None and parsed not in declared.choices:
            return check.choice(name, value, declared.choices)
        return True

    def _keeps_statistics(self) -> bool:
        """Whether the model, with this config's options, keeps running statistics (its
        registry entry says: resnet18 with BatchNorm, a plugin model that takes
        ``state_policy``)."""
        if self.model not in MODELS:
            return False
        spec = MODELS[self.model]
        return spec.statistics_with({k: getattr(self, k) for k in spec.options})

    def _validate_partition(self, check: _Checker, errors: list[str]) -> None:
        # The fields' own ranges; which partitioner takes which field is the registry's.
        check.number(
            "similarity", self.similarity, low=0.0, high=100.0, optional=True,
            what="a percentage in [0, 100] (0 = label-sorted, 100 = i.i.d.)",
        )  # fmt: skip
        check.number(
            "dirichlet_alpha", self.dirichlet_alpha, low=0.0, strict=True, optional=True,
            what="finite and > 0",
        )  # fmt: skip
        check.integer("shards_per_client", self.shards_per_client, low=1, optional=True)
        owner = _partition_fields()
        given = {f: getattr(self, f) for f in owner if getattr(self, f, None) is not None}
        if self.partition is not None:
            if not check.registered("partition", self.partition, PARTITIONERS):
                return
            takes = PARTITIONERS[self.partition].params
            for field in takes:
                if field not in self.field_names():
                    errors.append(
                        f"partition = {self.partition!r} takes the field {field!r}, which "
                        "this config does not have."
                    )
            for field, value in given.items():
                if field not in takes:
                    errors.append(
                        f"{field} = {value!r} does not apply to partition = "
                        f"{self.partition!r}; remove it or set partition = {owner[field]!r}."
                    )
        elif len({owner[f] for f in given}) > 1:
            fields = ", ".join(f"{f} = {v!r}" for f, v in given.items())
            errors.append(f"{fields} are conflicting partition settings: give one of them.")

    def _validate_plan(self, check: _Checker, errors: list[str]) -> None:
        check.integer("local_epochs", self.local_epochs, low=1, optional=True)
        check.integer("local_steps", self.local_steps, low=1, optional=True)
        check.integer("batch_size", self.batch_size, low=1, optional=True)
        check.number(
            "batch_fraction", self.batch_fraction, low=0.0, high=1.0, strict=True,
            optional=True, what="in (0, 1] (the paper uses 0.2)",
        )  # fmt: skip
        fields = {
            "local_epochs": self.local_epochs,
            "local_steps": self.local_steps,
            "batch_size": self.batch_size,
            "batch_fraction": self.batch_fraction,
        }
        uses = {
            "fraction": ("local_epochs", "batch_fraction"),
            "epochs": ("local_epochs", "batch_size"),
            "fixed": ("local_steps", "batch_size"),
            "full": ("local_steps",),
        }
        needs = {"epochs": ("batch_size",), "fixed": ("local_steps", "batch_size")}
        if self.batch_plan is not None:
            if not check.choice("batch_plan", self.batch_plan, BATCH_PLANS):
                return
            for name, value in fields.items():
                if value is not None and name not in uses[self.batch_plan]:
                    errors.append(
                        f"{name} = {value!r} does not apply to batch_plan = "
                        f"{self.batch_plan!r}, which uses {' and '.join(uses[self.batch_plan])}."
                    )
            for name in needs.get(self.batch_plan, ()):
                if fields[name] is None:
                    errors.append(f"batch_plan = {self.batch_plan!r} needs {name}.")
            return
        if self.local_steps is not None and self.local_epochs is not None:
            errors.append(
                f"local_steps = {self.local_steps} and local_epochs = {self.local_epochs} are "
                "both set: give K steps or a number of epochs, not both."
            )
        if self.batch_size is not None and self.batch_fraction is not None:
            errors.append(
                f"batch_size = {self.batch_size} and batch_fraction = {self.batch_fraction} "
                "are both set: give one of them."
            )
        if self.local_steps is not None and self.batch_fraction is not None:
            errors.append(
                f"local_steps = {self.local_steps} does not combine with batch_fraction = "
                f"{self.batch_fraction}: use local_epochs (0.2 = 5 steps per epoch)."
            )

    # ------------------------------------------------------------------ resolution
    def resolved_partition(self) -> tuple[str, dict[str, Any]]:
        """``(partitioner name, its split keywords)`` after defaults.

        The partitioner is ``partition``, else the one that takes the field that is set,
        else :data:`~scaffold_jax.data.partition.DEFAULT_PARTITIONER`; each of its
        parameters comes from its config field, or its declared default when the field is
        unset.
        """
        kind = self.partition
        if kind is None:
            owner = _partition_fields()
            kind = next(
                (owner[f] for f in owner if getattr(self, f, None) is not None),
                DEFAULT_PARTITIONER,
            )
        params = PARTITIONERS[kind].params
        return kind, {
            keyword: default if getattr(self, field) is None else getattr(self, field)
            for field, (keyword, default) in params.items()
        }

    def resolved_plan(self) -> BatchPlan:
        """The :class:`BatchPlan` after defaults (see the class docstring)."""
        kind = self.batch_plan
        if kind is None:
            if self.local_steps is not None:
                kind = "fixed" if self.batch_size is not None else "full"
            elif self.batch_size is not None:
                kind = "epochs"
            elif (
                ALGORITHMS[self.algorithm].default_plan == "full"
                and self.local_epochs is None
                and (self.batch_fraction is None)
            ):
                kind = "full"  # e.g. the paper's SGD: one gradient on the client's full data
            else:
                kind = "fraction"
        if kind == "full":
            return BatchPlan.full(self.local_steps or 1)
        if kind == "fixed":
            return BatchPlan.fixed(self.batch_size, self.local_steps)
        if kind == "epochs":
            return BatchPlan.epochs(self.batch_size, self.local_epochs or 1)
        return BatchPlan.fraction_of_data(self.batch_fraction or 0.2, self.local_epochs or 1)

    def resolved_partition_seed(self) -> int:
        """The seed of the data (subsets, split, held-out tests, natural client draw)."""
        return self.seed if self.partition_seed is None else int(self.partition_seed)

    def resolved_clients_per_round(self) -> int:
        if self.clients_per_round is not None:
            return int(self.clients_per_round)
        fraction = 0.2 if self.client_fraction is None else float(self.client_fraction)
        return max(1, min(self.num_clients, round(fraction * self.num_clients)))

    def resolved_out(self) -> str:
        if self.out:
            return self.out
        return f"results/{self.algorithm}-{sources.canonical_name(self.dataset).replace('/', '-')}"

    def resolved_hparams(self) -> HParams:
        """The algorithm's declared hyper-parameters: the step sizes, the ``hparams``
        table, and the declared defaults for the rest (names it does not declare left
        out)."""
        spec = ALGORITHMS[self.algorithm]
        # Built with this config's options: they may change what it declares (FedDyn
        # with a server optimizer declares server_lr).
        algorithm = spec.build(lambda params, batch: 0.0, **self.resolved_options())
        given = {k: v for k, v in self.hparams.items() if k in algorithm.hparams}
        steps = {"client_lr": self.client_lr, "server_lr": self.server_lr}
        # resolve_hparams drops a default step size the algorithm does not declare.
        return resolve_hparams(algorithm, {**steps, **given})

    def resolved_options(self) -> dict[str, Any]:
        """The algorithm's factory options (``{config key: value}``, parsed, defaults
        filled in; names it does not declare left out)."""
        spec = ALGORITHMS[self.algorithm]
        return {
            name: option.parse(self.options.get(name, option.default))
            for name, option in spec.options.items()
        }


def config_reference() -> str:
    """The config key reference (``docs/config.md``) as Markdown, generated from
    :class:`RunConfig` (every field: flag, type, default, help, choices) and from what the
    registered algorithms declare (their hyper-parameters and options).

    ``python -m scaffold_jax.docs`` (``make docs``) writes it; a test checks that the
    committed file equals what this returns, so it cannot go stale. Run it in a process
    without plugins: what they register would be listed too.
    """

    def cell(value: Any) -> str:
        return "—" if value is None or value == "" else f"`{json.dumps(value)}`"

    def text(value: str) -> str:
        return value.replace("|", "\\|")

    lines = [
        "# Config keys",
        "",
        "Generated by `python -m scaffold_jax.docs` (`make docs`) from",
        "`scaffold_jax.experiments.RunConfig` and the algorithm registry: do not edit by",
        "hand (`tests/test_docs.py` checks that it is current).",
        "",
        "A config file (TOML or JSON; `scaffold-jax run --config FILE`) holds these keys at",
        "its top level; an unknown key is an error. Every key is also a flag of",
        "`scaffold-jax run`, `sweep` and `diagnose` (`client_lr` is `--client-lr`), and",
        "flags override the file. A key left at `—` (None) is resolved from the others",
        "(see `RunConfig`). [`examples/scaffold_fmnist.toml`](../examples/scaffold_fmnist.toml)",
        "is a complete example.",
        "",
        "| key | flag | type | default | meaning |",
        "|---|---|---|---|---|",
    ]
    defaults = RunConfig()
    for field in dataclasses.fields(RunConfig):
        meta = field.metadata
        meaning = meta["help"]
        if meta.get("choices"):
            meaning += ". One of: " + ", ".join(f"`{c}`" for c in meta["choices"])
        flag = "(see below)" if meta["kind"] == "table" else f"`--{field.name.replace('_', '-')}`"
        if field.name == "plugins":
            flag = "`--plugin` (repeatable)"
        lines.append(
            f"| `{field.name}` | {flag} | {meta['kind']} | "
            f"{cell(getattr(defaults, field.name))} | {text(meaning)} |"
        )
    lines += [
        "",
        "## Declared hyper-parameters",
        "",
        "An algorithm declares the hyper-parameters it reads besides the step sizes; they go",
        "in the `hparams` table or at the top level (`prox_mu = 0.1`), or as a flag",
        "(`--prox-mu 0.1`), and are an axis of `scaffold-jax sweep --grid`. A value for a",
        "name the chosen algorithm does not declare is an error.",
        "",
        "| key | flag | default | declared by | meaning |",
        "|---|---|---|---|---|",
    ]

    def owners(table: str, name: str) -> str:
        return ", ".join(f"`{n}`" for n, spec in ALGORITHMS.items() if name in getattr(spec, table))

    for name, hparam in declared_hparams().items():
        lines.append(
            f"| `{name}` | `--{name.replace('_', '-')}` | {cell(hparam.default)} | "
            f"{owners('hparams', name)} | {text(hparam.help)} |"
        )
    lines += [
        "",
        "## Declared options",
        "",
        "Factory options an algorithm declares (they choose its variant, not a number to",
        "sweep); in the `options` table, at the top level or as a flag.",
        "",
        "| key | flag | default | declared by | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, option in declared_options().items():
        meaning = option.help
        if option.choices:
            meaning += ". One of: " + ", ".join(f"`{c}`" for c in option.choices)
        lines.append(
            f"| `{name}` | `--{name.replace('_', '-')}` | {cell(option.default)} | "
            f"{owners('options', name)} | {text(meaning)} |"
        )
    return "\n".join(lines) + "\n"


def _partition_fields() -> dict[str, str]:
    """Config field -> the first registered partitioner that takes it (read at each call:
    a plugin may have registered partitioners since import)."""
    owner: dict[str, str] = {}
    for name, spec in PARTITIONERS.items():
        for field in spec.params:
            owner.setdefault(field, name)
    return owner


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _default(declared: Any) -> Any:
    return declared.default


def _parsed(declared: Any, value: Any) -> Any:
    """A declared option's value in its canonical form (a hyper-parameter's as it is)."""
    try:
        return declared.parse(value) if hasattr(declared, "parse") else value
    except ValueError:
        return value


def _load_plugins(specs: Sequence[str]) -> None:
    try:
        load_plugins(specs)
    except ValueError as err:
        raise ConfigError(f"plugins = {list(specs)!r} is invalid: {err}") from err


class _Checker:
    """Collects ``field = value is invalid: it must be ...`` messages."""

    def __init__(self, errors: list[str]):
        self.errors = errors

    def _bad(self, name: str, value: Any, what: str) -> bool:
        self.errors.append(f"{name} = {value!r} is invalid: it must be {what}.")
        return False

    def type(self, name, value, types, what, optional=False) -> bool:
        if value is None and optional:
            return False
        if isinstance(value, bool) and bool not in (
            types if isinstance(types, tuple) else (types,)
        ):
            return self._bad(name, value, what)
        if not isinstance(value, types):
            return self._bad(name, value, what)
        return True

    def choice(self, name, value, choices) -> bool:
        if value not in choices:
            return self._bad(name, value, "one of " + ", ".join(repr(c) for c in choices))
        return True

    def registered(self, name: str, value: Any, registry: Registry) -> bool:
        """``value`` must name an entry of ``registry``, as registered when this runs."""
        if isinstance(value, str) and value in registry:
            return True
        close = difflib.get_close_matches(str(value), registry.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        names = ", ".join(repr(n) for n in registry)
        return self._bad(name, value, f"one of {names}{hint}; {PLUGIN_HINT}")

    def integer(self, name, value, low=None, high=None, optional=False, what=None) -> bool:
        if value is None and optional:
            return False
        if what is None:
            what = "an integer" + (f" >= {low}" if low is not None else "")
            what += f" and <= {high}" if high is not None else ""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            return self._bad(name, value, what)
        if (low is not None and value < low) or (high is not None and value > high):
            return self._bad(name, value, what)
        return True

    def number(
        self,
        name,
        value,
        low=None,
        high=None,
        strict=False,
        optional=False,
        what=None,
        float32=False,
    ) -> bool:
        """``float32``: the value becomes a float32 array (a hyper-parameter), so it must
        also be finite THERE (1e39 is finite in Python but inf in float32)."""
        if value is None and optional:
            return False
        what = what or "a finite number"
        try:
            v = float(value) if _is_number(value) else math.nan
        except OverflowError:  # an int beyond float64
            v = math.nan
        if not math.isfinite(v):
            return self._bad(name, value, what)
        if low is not None and (v < low or (strict and v == low)):
            return self._bad(name, value, what)
        if high is not None and v > high:
            return self._bad(name, value, what)
        if float32 and abs(v) > _FLOAT32_MAX:
            return self._bad(
                name,
                value,
                f"{what}, and at most {_FLOAT32_MAX:.8g} (the largest float32; the step sizes "
                "and hyper-parameters are float32, where a larger value becomes inf)",
            )
        return True


_FLOAT32_MAX = float(np.finfo(np.float32).max)


_TABLES = ("hparams", "options")


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a TOML (``.toml``) or JSON (``.json``) config file into a flat dict.

    Raises:
      ConfigError: a missing or unparsable file, an unknown extension, or a non-flat
        document (only top-level keys are fields).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist.")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10: the tomli backport
                import tomli as tomllib  # type: ignore[no-redef]
            values = tomllib.loads(path.read_text())
        elif suffix == ".json":
            values = json.loads(path.read_text())
        else:
            raise ConfigError(f"config file {path} has extension {suffix!r}; use .toml or .json.")
    except ConfigError:
        raise
    except Exception as err:  # tomllib and json raise their own decode errors
        raise ConfigError(f"config file {path} could not be parsed: {err}") from err
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a table/object of fields.")
    nested = [k for k, v in values.items() if isinstance(v, dict) and k not in _TABLES]
    if nested:
        raise ConfigError(
            f"config file {path}: keys {nested} are tables; every field is a top-level key "
            f"(only {' and '.join(_TABLES)} are tables)."
        )
    return values


# =====================================================================================
# Building a run
# =====================================================================================
class Built(NamedTuple):
    """A run ready to go: the data, problem, algorithm and compiled-to-be simulation."""

    dataset: sources.Dataset
    data: FederatedData
    problem: Problem
    algorithm: Algorithm
    plan: BatchPlan
    simulation: Simulation
    hparams: HParams
    info: dict[str, Any]


def subset_dataset(
    dataset: sources.Dataset,
    max_train_examples: int | None = None,
    max_test_examples: int | None = None,
    seed: int = 0,
) -> sources.Dataset:
    """A random subset of a dataset's splits (``numpy.random.default_rng(seed)``), kept in
    the original order; ``None`` keeps a split whole."""
    rng = np.random.default_rng(seed)

    def subset(split: dict, limit: int | None) -> dict:
        n = len(split["y"])
        if limit is None or limit >= n:
            return split
        keep = np.sort(rng.choice(n, size=int(limit), replace=False))
        return {k: np.asarray(v)[keep] for k, v in split.items()}

    return dataset._replace(
        train=subset(dataset.train, max_train_examples),
        test=subset(dataset.test, max_test_examples),
    )


def make_problem(
    model: str,
    dataset: sources.Dataset,
    options: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> Problem:
    """The model registered as ``model`` (:data:`scaffold_jax.models.MODELS`), sized for
    ``dataset``, as a :class:`Problem`.

    Args:
      model: a registered model name.
      dataset: gives the example shape and the number of classes.
      options: config fields by name, e.g. ``config.to_dict()``; the model takes those it
        declares (the MLP: ``hidden_sizes``).
      seed: its initial params come from ``jax.random.key(seed)`` (logistic regression
        starts at zero whatever the seed).
    """
    shape = tuple(np.shape(dataset.train["x"])[1:])
    return models.build(model, shape, dataset.num_classes, key=jr.key(seed), options=options)


def load_dataset(config: RunConfig) -> sources.Dataset | natural.ClientDataset:
    """The dataset ``config`` names, as read: before any subset or split (a natural
    dataset: all its clients with at least ``min_client_examples`` examples). Handing it to
    :func:`build` as ``dataset`` skips reading it again, e.g. for every setting of a sweep.

    Raises:
      FileNotFoundError: the dataset is nowhere to be found.
    """
    if config.is_natural:
        params = {}
        if config.min_client_examples is not None:
            params["min_examples"] = config.min_client_examples
        return natural.load(config.dataset, config.data_dir, **params)
    return sources.load(config.dataset, config.data_dir, allow_download=config.download)


def natural_clients(config: RunConfig, clients: natural.ClientDataset | None = None):
    """``(pooled dataset, partition, client tests, "natural", {...})`` of a naturally
    federated dataset: ``num_clients`` of its clients, drawn with the partition seed (all of them
    when it has exactly that many), each with its own test examples (the client tests),
    which pooled are the test set (``max_test_examples`` subsets that pool only).

    Raises:
      ConfigError: ``num_clients`` above the number of clients the data has.
    """
    if clients is None:
        clients = load_dataset(config)
    available = clients.num_clients
    if config.num_clients > available:
        raise ConfigError(
            f"num_clients = {config.num_clients} is invalid: {config.dataset} has "
            f"{available} clients (with min_client_examples = {config.min_client_examples}); "
            f"it must be at most {available}."
        )
    seed = config.resolved_partition_seed()
    if config.num_clients < available:
        rng = np.random.default_rng(seed)
        clients = clients.select(np.sort(rng.choice(available, config.num_clients, replace=False)))
    dataset = subset_dataset(natural.as_dataset(clients), None, config.max_test_examples, seed)
    args = {"clients_available": available, "min_client_examples": config.min_client_examples}
    return dataset, natural.client_indices(clients), clients.client_tests(), "natural", args


def build(
    config: RunConfig, dataset: sources.Dataset | natural.ClientDataset | None = None
) -> Built:
    """Validates ``config`` and builds its data, model, algorithm and simulation.

    Args:
      config: the run's configuration.
      dataset: an already loaded dataset, e.g. from :func:`load_dataset` (skips loading;
        ``max_*_examples`` and the partition still apply).

    Raises:
      ConfigError: an invalid config.
      FileNotFoundError: the dataset is nowhere to be found (the message says where it
        looked and how to get it).
    """
    config.validate()
    client_tests = None
    if config.is_natural:
        dataset, parts, client_tests, kind, args = natural_clients(config, dataset)
    else:
        if dataset is None:
            dataset = load_dataset(config)
        seed = config.resolved_partition_seed()
        dataset = subset_dataset(dataset, config.max_train_examples, config.max_test_examples, seed)
        kind, args = config.resolved_partition()
        if config.num_clients > len(dataset.train["y"]):
            raise ConfigError(
                f"num_clients = {config.num_clients} is invalid: the training set has only "
                f"{len(dataset.train['y'])} examples; it must be at most that."
            )
        split = PARTITIONERS[kind].split
        parts = split(dataset.train["y"], config.num_clients, seed=seed, **args)
        if config.client_holdout is not None:
            parts, held = partition.hold_out(parts, config.client_holdout, seed)
            client_tests = [{k: np.asarray(v)[ix] for k, v in dataset.train.items()} for ix in held]
    data = from_partition(dataset.train, parts, test=dataset.test)
    if client_tests is not None:
        data = with_client_tests(data, client_tests)
    problem = make_problem(config.model, dataset, config.to_dict(), config.seed)
    algorithm = ALGORITHMS[config.algorithm].build(problem.loss_fn, **config.resolved_options())
    plan = config.resolved_plan()
    clients_per_round = config.resolved_clients_per_round()
    simulation = Simulation(
        algorithm,
        problem,
        plan,
        clients_per_round,
        config.weighting,
        train_eval_examples=config.train_eval_examples or None,
    )
    num_steps, batch_width = plan.shape(data.max_count)
    info = {
        "dataset": dataset.name,
        "dataset_source": dataset.source,
        "num_train_examples": int(data.num_examples),
        "num_test_examples": int(len(dataset.test["y"])),
        "num_classes": int(dataset.num_classes),
        "partition": {"kind": kind, **args},
        "labels_per_client_median": float(
            np.median(
                partition.summary(dataset.train["y"], parts, dataset.num_classes).labels_per_client
            )
        ),
        "num_clients": int(data.num_clients),
        "clients_per_round": clients_per_round,
        "batch_plan": dataclasses.asdict(plan),
        "max_local_steps": int(num_steps),
        "max_batch_size": int(batch_width),
    }
    hparams = config.resolved_hparams()
    return Built(dataset, data, problem, algorithm, plan, simulation, hparams, info)


# =====================================================================================
# scaffold-jax run
# =====================================================================================
CHECKPOINTS = "checkpoints"  # the run folder's checkpoint directory
#: Fields a resumed run may change: they do not change what the rounds compute.
RESUMABLE_CHANGES = ("rounds", "eval_every", "targets", "out", "plugins", "train_eval_examples")


def data_fingerprint(data: FederatedData) -> str:
    """SHA-256 of a materialised dataset's arrays (examples, counts, test set): two runs
    on the same fingerprint trained on the same data, client for client."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves((data.examples, data.counts, data.test)):
        array = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def run_identity(config: RunConfig, built: Built) -> dict[str, Any]:
    """What, beyond the engine's own identity (:func:`scaffold_jax.loop.run_identity`),
    fixes a command-line run's result: the data (name, source, folder, subset sizes,
    partition and a fingerprint of the arrays), the model and the algorithm's options."""
    model_options = {k: getattr(config, k) for k in models.MODELS[config.model].options}
    return {
        "dataset": built.info["dataset"],
        # A dataset read back from its cache names the cache file: the origin counts.
        "dataset_source": _origin(built.info["dataset_source"]),
        "data_dir": config.data_dir,
        "max_train_examples": config.max_train_examples,
        "max_test_examples": config.max_test_examples,
        "partition": built.info["partition"],
        "data_fingerprint": data_fingerprint(built.data),
        "model": config.model,
        "model_options": model_options,
        "algorithm_options": config.resolved_options(),
    }


def _origin(source: str) -> str:
    """``"<file> (cache of <origin>)"`` → ``<origin>``; other sources as they are."""
    head, sep, rest = str(source).partition(" (cache of ")
    return rest[:-1] if sep and rest.endswith(")") else source


def _has_checkpoint(directory: Path) -> bool:
    from scaffold_jax import checkpoint  # imported late: orbax is slow to import

    return checkpoint.latest_round(directory) is not None


def check_resumable(folder: Path, config: dict[str, Any]) -> None:
    """Refuses ``--resume`` of a folder that holds a run of another configuration."""
    saved = json.loads((folder / results.CONFIG_FILE).read_text())
    config = json.loads(json.dumps(config, default=str))  # tuples as lists, as saved
    # A setting the run's version did not have yet ran at its default.
    defaults = json.loads(json.dumps(dataclasses.asdict(RunConfig()), default=str))
    saved = {**{k: v for k, v in defaults.items() if k not in saved}, **saved}
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


def run(
    config: RunConfig,
    out: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    quiet: bool = False,
    dataset: sources.Dataset | None = None,
    resume: bool = False,
    checkpoint: bool = True,
    checkpoint_every: int | None = None,
    checkpoint_minutes: float = 5.0,
    tensorboard: bool = False,
) -> dict[str, Any]:
    """Runs one experiment and writes its folder (see :mod:`scaffold_jax.results`).

    The run checkpoints into ``<out>/checkpoints`` (every ``checkpoint_every`` rounds,
    default every evaluation, and at the end of any block once ``checkpoint_minutes``
    have passed since the last save; the newest two are kept), so a killed run continues
    with ``resume=True`` (``--resume``) bit for bit: the records are cut back to the
    restored checkpoint and rewritten from there (each evaluation round exactly once),
    and the summary and plots are an uninterrupted run's. A resume with other data,
    partition, model, algorithm options or hyper-parameters is refused naming each
    difference; more rounds or another evaluation cadence are allowed.

    Args:
      config: the run's configuration (validated here).
      out: the output folder (default ``config.out`` or ``results/<algorithm>-<dataset>``).
      overwrite: replace a folder that holds a run.
      quiet: no progress bar and no printed summary.
      dataset: an already loaded dataset (e.g. in a notebook).
      resume: continue the run the folder holds (from its newest checkpoint; from round 0
        when it holds none; a folder without a run simply starts it).
      checkpoint: write checkpoints (orbax); False: none.
      checkpoint_every: checkpoint period in rounds (default: ``config.eval_every``).
      checkpoint_minutes: save at least this often (at block ends).
      tensorboard: also write every record's metrics as TensorBoard scalars (step: the
        round) into ``<out>/tensorboard`` (:class:`scaffold_jax.results.TensorBoardSink`).

    Returns:
      The summary (what ``summary.json`` holds).

    Raises:
      ConfigError: an invalid config, or a resume with another configuration.
      FileExistsError: the folder holds a run (or is in use by a live one).
      FileNotFoundError: the dataset is missing.
      scaffold_jax.loop.DivergenceError: the model became NaN/Inf (the folder keeps
        the records made before and says ``"status": "diverged"``).
      scaffold_jax.results.RunFolderError: the folder cannot be written (full disk...).
    """
    from scaffold_jax import loop

    config.validate()
    folder = Path(out if out is not None else config.resolved_out())
    to_save = config.to_dict()
    to_save["out"] = str(folder)
    # Refuse an occupied folder (or a resume of another run) before loading data.
    if resume and not (folder / results.CONFIG_FILE).is_file():
        # Nothing was written yet (killed while loading or compiling): a scheduler that
        # always passes --resume simply starts the run.
        print(f"nothing to resume in {folder}: starting the run.", file=sys.stderr)
        resume = False
    if resume:
        check_resumable(folder, to_save)
        results.check_lock(folder)
    else:
        results.check_folder(folder, overwrite, dry_run=True)
    series = config.algorithm
    if tensorboard and importlib.util.find_spec("tensorboardX") is None:
        # Before the data loads: a missing extra fails in a second, not minutes.
        raise ConfigError(
            "--tensorboard needs tensorboardX: pip install 'scaffold-jax[tensorboard]'."
        )
    progress = Progress(config.rounds, desc=series, enabled=not quiet)
    with progress.phase(f"loading {config.dataset} and building the run"):
        built = build(config, dataset)
    info = built.info
    progress.write(
        f"{built_summary(built)}; {info['clients_per_round']} clients a round, up to "
        f"{info['max_local_steps']} local steps of {info['max_batch_size']} examples"
    )
    directory = folder / CHECKPOINTS
    # Only a complete checkpoint counts (a save killed half-way leaves a temporary folder).
    restore = resume and checkpoint and directory.is_dir() and _has_checkpoint(directory)
    title = (
        f"{series} on {built.info['dataset']}: N = {built.info['num_clients']}, "
        f"S = {built.info['clients_per_round']}, η_l = {config.client_lr:g}"
    )
    accuracy, loss = results.DEFAULT_PLOTS
    plots = (
        accuracy._replace(title=title, target=tuple(config.targets)),
        loss._replace(title=title),
    )
    with results.RunWriter(
        folder, to_save, config.targets, overwrite=overwrite, plots=plots, resume=resume
    ) as writer:
        writer.add(experiment="run", **built.info)
        board = None
        if tensorboard:
            if not resume:  # a replaced run's events would mix with this one's
                shutil.rmtree(folder / results.TENSORBOARD_DIR, ignore_errors=True)
            board = results.TensorBoardSink(folder)
            writer.files.append(results.TENSORBOARD_DIR)
        if resume and not restore:
            writer.reset_records([])  # nothing was saved: start again at round 0
            if board is not None:
                board.purge_from(0)

        def on_restore(records):
            writer.reset_records(records, series)
            if board is not None:  # the rounds after the checkpoint run again
                board.purge_from(records[-1]["round"] + 1 if records else 0)
            # The rounds before the checkpoint ran in another process: not in the rate.
            progress.rebase(records[-1]["round"] if records else 0)

        def on_record(record):
            writer.record(series, record)
            if board is not None:
                board(record)
            progress(record)

        try:
            result = loop.run(
                built.simulation,
                built.data,
                built.hparams,
                num_rounds=config.rounds,
                eval_every=config.eval_every,
                seed=config.seed,
                callback=on_record,
                checkpoint_dir=directory if checkpoint else None,
                checkpoint_every=checkpoint_every if checkpoint else None,
                keep_checkpoints=2,
                resume=restore,
                identity=run_identity(config, built),
                on_restore=on_restore,
                checkpoint_seconds=60.0 * checkpoint_minutes if checkpoint else None,
                phase=progress.phase,
            )
        except DivergenceError as err:
            writer.close("diverged", error=str(err))
            raise
        finally:
            progress.close()
            if board is not None:
                board.close()
        rounds_run = max(len(result.client_ids), 1)
        writer.describe(
            series,
            algorithm=config.algorithm,
            # Only what the algorithm declares (FedDyn has no server_lr; only FedProx a μ).
            hparams={k: float(v) for k, v in built.hparams.items()},
            compile_seconds=round(result.compile_seconds, 3),
            run_seconds=round(result.run_seconds, 3),
            # The rounds alone: evaluations (a pass over the test set and a training
            # subsample) are timed apart, so rounds/s measures the simulator.
            round_seconds=round(result.round_seconds, 3),
            eval_seconds=round(result.eval_seconds, 3),
            seconds_per_round=round(result.round_seconds / rounds_run, 6),
            rounds_per_second=round(rounds_run / max(result.round_seconds, 1e-9), 3),
            resumed_from=result.resumed_from,
        )
        drift = result.round_metrics.get("client_drift")
        if drift is not None and len(drift):  # rounds run by this process (none: resumed done)
            writer.describe(series, mean_client_drift=float(np.mean(drift)))
        summary = writer.finish()
    if not quiet:
        print(format_run_summary(summary, folder))
    return summary


def built_summary(built: Built) -> str:
    """One line on the data a run was built from (after its loading phase)."""
    info = built.info
    return (
        f"{info['dataset']}: {info['num_train_examples']} training examples over "
        f"{info['num_clients']} clients ({info['partition']['kind']} partition)"
    )


def format_run_summary(summary: Mapping[str, Any], folder: Path | str) -> str:
    """A few lines for the terminal: dataset, rounds to targets, timing, files."""
    (name, info), *_ = summary["runs"].items()
    reached = ", ".join(
        f"{t}: {results.format_rounds(r, info.get('last_round', 0))}"
        for t, r in info.get("rounds_to_target", {}).items()
    )
    best = info.get("best_test_accuracy")
    lines = [
        f"{name} on {summary.get('dataset')} ({summary.get('dataset_source')}): "
        f"best test accuracy {best:.4f}"
        if best is not None
        else f"{name}",
        f"hyper-parameters: {format_hparams(info.get('hparams', {}))}",
        f"rounds to target accuracy: {reached}",
        f"compile {info.get('compile_seconds', 0):.1f} s, rounds "
        f"{info.get('round_seconds', 0):.1f} s ({info.get('rounds_per_second', 0):.1f} "
        f"rounds/s), evaluation {info.get('eval_seconds', 0):.1f} s",
        f"wrote {folder}/: {', '.join(summary.get('files', []))}",
    ]
    return "\n".join(lines)


# =====================================================================================
# Step-size grids: one vmapped program per grid (scaffold_jax.sweep), or a loop
# =====================================================================================
class GridRun(NamedTuple):
    """One η_l of a grid: its records and the per-round client drift.

    Attributes:
      client_lr: η_l.
      records: evaluation records (``round``, ``test_loss``, ... as Simulation.run).
      client_drift: ``[R]`` mean ‖y_i − x‖ of each round (NaN once diverged).
      diverged: whether the run produced a NaN/Inf.
    """

    client_lr: float
    records: list[dict[str, Any]]
    client_drift: np.ndarray
    diverged: bool


_SWEEP_KEYS = ("config", "status", "seconds")  # a sweep record's own; GridRun has its fields


def run_grid(
    simulation: Simulation,
    data,
    client_lrs: Sequence[float],
    num_rounds: int,
    eval_every: int,
    seed: int = 0,
    hparams: Mapping[str, float] | None = None,
) -> tuple[list[GridRun], dict[str, float]]:
    """Runs ``simulation`` for every η_l of a grid from its initial params, as ONE vmapped
    program (:func:`scaffold_jax.sweep.sweep`; each η_l equals its own single run).

    ``hparams``: the other hyper-parameters, fixed for the whole grid (names the
    algorithm does not declare are left out; undeclared ones take their defaults).

    Returns:
      ``(runs, timing)`` with ``timing = {"compile_seconds", "run_seconds"}``.
    """
    lrs = [float(lr) for lr in client_lrs]
    declared = simulation.algorithm.hparams
    fixed = {k: float(v) for k, v in (hparams or {}).items() if k in declared}
    grid_hp, seeds, _ = sweep_module.grid(client_lr=lrs, seeds=seed, **fixed)
    result = sweep_module.sweep(simulation, data, grid_hp, seeds, num_rounds, eval_every)
    runs = [
        GridRun(
            lr,
            [{k: v for k, v in r.items() if k not in _SWEEP_KEYS} for r in result.records[j]],
            np.asarray(result.round_metrics["client_drift"][j]),
            bool(result.diverged[j]),
        )
        for j, lr in enumerate(lrs)
    ]
    return runs, {"compile_seconds": result.compile_seconds, "run_seconds": result.run_seconds}


def choose(
    runs: Sequence[GridRun],
    target: float | None,
    metric: str = "test_accuracy",
    higher_is_better: bool = True,
) -> tuple[GridRun, int | None]:
    """The η_l of a grid chosen by the package's one step-size selection policy,
    :func:`scaffold_jax.results.select` (the one ``sweep`` uses too; its docstring gives
    the order of the criteria). Each run of a grid is one seed, so each η_l is a group of
    one: a diverged η_l ranks last, then the fewest rounds to ``target`` (with
    ``target=None``: skipped, Table 5's "best accuracy within the horizon"), then the
    better best value of ``metric``, the lower final training loss and the smaller η_l.

    Returns:
      ``(chosen run, its rounds to target or None)``.
    """
    candidates = [
        results.Candidate({"client_lr": run.client_lr}, run.records, run.diverged) for run in runs
    ]
    best, _ = results.select(candidates, target, metric, higher_is_better)
    chosen = runs[best["configs"][0]]
    rounds = (
        None
        if target is None
        else results.rounds_to_target(chosen.records, target, metric, higher_is_better)
    )
    return chosen, rounds
