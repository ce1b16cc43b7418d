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
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax.random as jr
import numpy as np

from scaffold_jax import algorithms, models, results
from scaffold_jax.data import partition, sources
from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.data.federated import FederatedData, from_partition
from scaffold_jax.simulate import DivergenceError, Simulation
from scaffold_jax.types import Algorithm, HParams, Problem
from scaffold_jax.types import hparams as build_hparams

ALGORITHM_NAMES = ("scaffold", "fedavg", "fedprox", "sgd")
PARTITIONS = ("similarity", "dirichlet", "shards", "iid")
BATCH_PLANS = ("fraction", "epochs", "fixed", "full")
MODELS = ("logreg", "mlp")
WEIGHTINGS = ("uniform", "num_examples")
CONTROL_DTYPES = ("float32", "bfloat16")
# How the paper's tables name the algorithms.
DISPLAY = {"sgd": "SGD", "scaffold": "SCAFFOLD", "fedavg": "FedAvg", "fedprox": "FedProx"}


class ConfigError(ValueError):
    """An invalid configuration; the message names every bad field, its value and the
    allowed range."""


# =====================================================================================
# RunConfig: one run, validated in one place
# =====================================================================================
def _opt(default: Any, help: str, kind: str, choices: Sequence[str] | None = None):
    """A config field with CLI metadata: ``kind`` is int, float, str, bool, floats, ints."""
    meta = {"help": help, "kind": kind, "choices": tuple(choices) if choices else None}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class RunConfig:
    """Everything one ``scaffold-jax run`` needs; :meth:`validate` checks it all.

    Fields left at ``None`` are resolved from the others (the ``resolved_*`` methods): the
    partition from whichever partition setting is given (default: the paper's 0%
    similarity), the batch plan from the local-step settings (default: the paper's
    batches of 0.2 of the client's data, 1 epoch; SGD: one full-batch step), S from
    ``client_fraction`` (default 0.2, the paper's 20%).

    A config file (TOML or JSON) holds these fields as top-level keys; an unknown key is
    an error, so a typo never silently falls back to a default. The ``config.json`` a run
    writes is itself a valid config file.
    """

    algorithm: str = _opt("scaffold", "federated algorithm", "str", ALGORITHM_NAMES)
    scaffold_option: str = _opt(
        "II", "SCAFFOLD control update: II (the paper's default) or I", "str", ("I", "II")
    )
    control_dtype: str = _opt(
        "float32", "storage dtype of SCAFFOLD's client controls", "str", CONTROL_DTYPES
    )
    prox_mu: float = _opt(1.0, "FedProx proximal weight mu (the paper fixes 1)", "float")
    client_lr: float = _opt(0.1, "client (local) step size eta_l", "float")
    server_lr: float = _opt(1.0, "server (global) step size eta_g", "float")
    weighting: str = _opt("uniform", "server aggregation weights", "str", WEIGHTINGS)
    dataset: str = _opt("fashion_mnist", "dataset", "str", sources.DATASETS)
    data_dir: str | None = _opt(None, "folder of IDX files for the dataset", "str")
    download: bool = _opt(False, "let TFDS download the dataset (needs internet)", "bool")
    max_train_examples: int | None = _opt(
        None, "use a random subset of this many training examples", "int"
    )
    max_test_examples: int | None = _opt(
        None, "use a random subset of this many test examples", "int"
    )
    partition: str | None = _opt(None, "how examples are split over clients", "str", PARTITIONS)
    similarity: float | None = _opt(
        None, "similarity split: percent of i.i.d. data per client, 0..100", "float"
    )
    dirichlet_alpha: float | None = _opt(None, "Dirichlet label-skew concentration", "float")
    shards_per_client: int | None = _opt(None, "label shards per client", "int")
    model: str = _opt("logreg", "model", "str", MODELS)
    hidden_sizes: list[int] = _opt([256, 256], "MLP hidden layer widths", "ints")
    num_clients: int = _opt(100, "number of clients N", "int")
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
    targets: list[float] = _opt([0.5, 0.6, 0.7, 0.8], "target test accuracies", "floats")
    seed: int = _opt(0, "seed of the partition, sampling and batches", "int")
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
        check.choice("algorithm", self.algorithm, ALGORITHM_NAMES)
        check.choice("scaffold_option", _option_name(self.scaffold_option), ("I", "II"))
        check.choice("control_dtype", self.control_dtype, CONTROL_DTYPES)
        check.number("prox_mu", self.prox_mu, low=0.0, what="finite and >= 0")
        check.number("client_lr", self.client_lr, low=0.0, strict=True, what="finite and > 0")
        check.number("server_lr", self.server_lr, low=0.0, strict=True, what="finite and > 0")
        check.choice("weighting", self.weighting, WEIGHTINGS)
        if check.type("dataset", self.dataset, str, "a dataset name"):
            try:
                sources.canonical_name(self.dataset)
            except ValueError:
                errors.append(
                    f"dataset = {self.dataset!r} is invalid: it must be one of "
                    f"{', '.join(sources.DATASETS)}."
                )
        check.type("data_dir", self.data_dir, str, "a folder path", optional=True)
        check.type("download", self.download, bool, "true or false")
        check.integer("max_train_examples", self.max_train_examples, low=1, optional=True)
        check.integer("max_test_examples", self.max_test_examples, low=1, optional=True)
        self._validate_partition(check, errors)
        check.choice("model", self.model, MODELS)
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
        if check.type("targets", self.targets, (list, tuple), "a list of accuracies"):
            for t in self.targets:
                if not _is_number(t) or not 0.0 < float(t) <= 1.0:
                    errors.append(
                        f"targets = {list(self.targets)!r} is invalid: every target must be "
                        "an accuracy in (0, 1]."
                    )
                    break
        check.integer("seed", self.seed, low=0)
        check.type("out", self.out, str, "a folder path", optional=True)
        if errors:
            raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
        return self

    def _validate_partition(self, check: _Checker, errors: list[str]) -> None:
        given = {
            "similarity": self.similarity,
            "dirichlet": self.dirichlet_alpha,
            "shards": self.shards_per_client,
        }
        field_of = {
            "similarity": "similarity",
            "dirichlet": "dirichlet_alpha",
            "shards": "shards_per_client",
        }
        check.number(
            "similarity", self.similarity, low=0.0, high=100.0, optional=True,
            what="a percentage in [0, 100] (0 = label-sorted, 100 = i.i.d.)",
        )  # fmt: skip
        check.number(
            "dirichlet_alpha", self.dirichlet_alpha, low=0.0, strict=True, optional=True,
            what="finite and > 0",
        )  # fmt: skip
        check.integer("shards_per_client", self.shards_per_client, low=1, optional=True)
        if self.partition is not None:
            if not check.choice("partition", self.partition, PARTITIONS):
                return
            for kind, value in given.items():
                if value is not None and kind != self.partition:
                    errors.append(
                        f"{field_of[kind]} = {value!r} does not apply to partition = "
                        f"{self.partition!r}; remove it or set partition = {kind!r}."
                    )
        else:
            set_kinds = [k for k, v in given.items() if v is not None]
            if len(set_kinds) > 1:
                fields = ", ".join(f"{field_of[k]} = {given[k]!r}" for k in set_kinds)
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
        """``(kind, arguments)`` of the partition after defaults."""
        kind = self.partition
        if kind is None:
            kind = (
                "dirichlet"
                if self.dirichlet_alpha is not None
                else "shards"
                if self.shards_per_client is not None
                else "similarity"
            )
        if kind == "similarity":
            return kind, {"similarity": 0.0 if self.similarity is None else self.similarity}
        if kind == "dirichlet":
            alpha = 0.5 if self.dirichlet_alpha is None else self.dirichlet_alpha
            return kind, {"alpha": alpha}
        if kind == "shards":
            shards = 2 if self.shards_per_client is None else self.shards_per_client
            return kind, {"shards_per_client": shards}
        return kind, {}

    def resolved_plan(self) -> BatchPlan:
        """The :class:`BatchPlan` after defaults (see the class docstring)."""
        kind = self.batch_plan
        if kind is None:
            if self.local_steps is not None:
                kind = "fixed" if self.batch_size is not None else "full"
            elif self.batch_size is not None:
                kind = "epochs"
            elif (
                self.algorithm == "sgd"
                and self.local_epochs is None
                and (self.batch_fraction is None)
            ):
                kind = "full"  # the paper's SGD: one gradient on the client's full data
            else:
                kind = "fraction"
        if kind == "full":
            return BatchPlan.full(self.local_steps or 1)
        if kind == "fixed":
            return BatchPlan.fixed(self.batch_size, self.local_steps)
        if kind == "epochs":
            return BatchPlan.epochs(self.batch_size, self.local_epochs or 1)
        return BatchPlan.fraction_of_data(self.batch_fraction or 0.2, self.local_epochs or 1)

    def resolved_clients_per_round(self) -> int:
        if self.clients_per_round is not None:
            return int(self.clients_per_round)
        fraction = 0.2 if self.client_fraction is None else float(self.client_fraction)
        return max(1, min(self.num_clients, round(fraction * self.num_clients)))

    def resolved_out(self) -> str:
        if self.out:
            return self.out
        return f"results/{self.algorithm}-{sources.canonical_name(self.dataset).replace('/', '-')}"

    def hparams(self) -> HParams:
        mu = self.prox_mu if self.algorithm == "fedprox" else 0.0
        return build_hparams(client_lr=self.client_lr, server_lr=self.server_lr, prox_mu=mu)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _option_name(option: Any) -> Any:
    return {1: "I", 2: "II", "1": "I", "2": "II", "i": "I", "ii": "II"}.get(option, option)


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
        self, name, value, low=None, high=None, strict=False, optional=False, what=None
    ) -> bool:
        if value is None and optional:
            return False
        what = what or "a finite number"
        if not _is_number(value) or not math.isfinite(float(value)):
            return self._bad(name, value, what)
        v = float(value)
        if low is not None and (v < low or (strict and v == low)):
            return self._bad(name, value, what)
        if high is not None and v > high:
            return self._bad(name, value, what)
        return True


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
    nested = [k for k, v in values.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(
            f"config file {path}: keys {nested} are tables; every field is a top-level key."
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


def load_dataset(
    name: str,
    data_dir: str | None = None,
    download: bool = False,
    max_train_examples: int | None = None,
    max_test_examples: int | None = None,
    seed: int = 0,
) -> sources.Dataset:
    """Loads a dataset (see :func:`scaffold_jax.data.sources.load`), optionally a random
    subset of it (:func:`subset_dataset`)."""
    ds = sources.load(name, data_dir, allow_download=download)
    return subset_dataset(ds, max_train_examples, max_test_examples, seed)


def make_partition(
    labels: np.ndarray, num_clients: int, kind: str, args: Mapping[str, Any], seed: int
) -> list[np.ndarray]:
    """Client index lists from a partition kind (``similarity``, ``dirichlet``, ``shards``,
    ``iid``) and its arguments."""
    if kind == "similarity":
        return partition.similarity_split(labels, num_clients, args["similarity"], seed)
    if kind == "dirichlet":
        return partition.dirichlet_split(labels, num_clients, args["alpha"], seed)
    if kind == "shards":
        return partition.shard_split(labels, num_clients, args["shards_per_client"], seed)
    if kind == "iid":
        return partition.iid_split(len(labels), num_clients, seed)
    raise ValueError(f"partition {kind!r} is unknown; use one of {PARTITIONS}.")


def make_problem(
    model: str, dataset: sources.Dataset, hidden_sizes: Sequence[int] = (256, 256), seed=0
) -> Problem:
    """The model of a run as a :class:`Problem` (logistic regression starts at zero; the
    MLP from ``jax.random.key(seed)``)."""
    shape = tuple(np.shape(dataset.train["x"])[1:])
    if model == "logreg":
        return models.logistic_regression(shape, dataset.num_classes)
    if model == "mlp":
        return models.mlp(shape, dataset.num_classes, tuple(hidden_sizes), key=jr.key(seed))
    raise ValueError(f"model {model!r} is unknown; use one of {MODELS}.")


def make_algorithm(name: str, loss_fn, option: Any = "II", control_dtype="float32") -> Algorithm:
    """An algorithm by name; SCAFFOLD takes its option (I / II) and control dtype."""
    if name == "scaffold":
        return algorithms.make(
            name, loss_fn, option=_option_name(option), control_dtype=control_dtype
        )
    return algorithms.make(name, loss_fn)


def build(config: RunConfig, dataset: sources.Dataset | None = None) -> Built:
    """Validates ``config`` and builds its data, model, algorithm and simulation.

    Args:
      config: the run's configuration.
      dataset: an already loaded dataset (skips loading; ``max_*_examples`` still apply).

    Raises:
      ConfigError: an invalid config.
      FileNotFoundError: the dataset is nowhere to be found (the message says where it
        looked and how to get it).
    """
    config.validate()
    if dataset is None:
        dataset = sources.load(config.dataset, config.data_dir, allow_download=config.download)
    dataset = subset_dataset(
        dataset, config.max_train_examples, config.max_test_examples, config.seed
    )
    kind, args = config.resolved_partition()
    if config.num_clients > len(dataset.train["y"]):
        raise ConfigError(
            f"num_clients = {config.num_clients} is invalid: the training set has only "
            f"{len(dataset.train['y'])} examples; it must be at most that."
        )
    parts = make_partition(dataset.train["y"], config.num_clients, kind, args, config.seed)
    data = from_partition(dataset.train, parts, test=dataset.test)
    problem = make_problem(config.model, dataset, config.hidden_sizes, config.seed)
    algorithm = make_algorithm(
        config.algorithm, problem.loss_fn, config.scaffold_option, config.control_dtype
    )
    plan = config.resolved_plan()
    clients_per_round = config.resolved_clients_per_round()
    simulation = Simulation(algorithm, problem, plan, clients_per_round, config.weighting)
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
    return Built(dataset, data, problem, algorithm, plan, simulation, config.hparams(), info)


# =====================================================================================
# Progress
# =====================================================================================
class Progress:
    """A tqdm bar over rounds (round, latest accuracy, rounds/s), fed by evaluation records.

    The bar is created at the first record after round 0, i.e. after compilation, so its
    rate is the steady-state rounds/s. Disabled (a no-op) when ``enabled`` is False or
    tqdm is not installed. Writes to stderr, so stdout stays clean for tables.
    """

    def __init__(self, total: int, desc: str = "", enabled: bool = True, leave: bool = True):
        self.total, self.desc, self.leave = int(total), desc, leave
        self.enabled = enabled
        self.bar = None
        self.done = 0

    def __call__(self, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        if self.bar is None and int(record["round"]) == 0:
            return  # round 0 comes before the round program compiles: not a rate sample
        if self.bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                self.enabled = False
                return
            # Started at the first record after round 0: the first chunk (which includes
            # compiling) is the bar's initial value, so its rate is the steady state.
            self.done = int(record["round"])
            self.bar = tqdm(
                total=self.total, initial=self.done, desc=self.desc, unit="round",
                leave=self.leave, dynamic_ncols=True, file=sys.stderr, mininterval=0.5,
            )  # fmt: skip
        step = int(record["round"]) - self.done
        if step > 0:
            self.bar.update(step)
            self.done += step
        postfix = {}
        for key, label in (("test_accuracy", "acc"), ("error", "err"), ("test_loss", "loss")):
            if key in record and results.is_finite_number(record[key]):
                postfix[label] = f"{record[key]:.4g}"
                break
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def write(self, text: str) -> None:
        """Prints a line without breaking the bar."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text)


class CellProgress:
    """A tqdm bar over the cells of a protocol (one cell = one η_l grid), with a line per
    finished cell; plain lines on stderr without tqdm, nothing when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.enabled, self.total, self.done = enabled, int(total), 0
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=self.total, desc=desc, unit="cell", file=sys.stderr)

    def step(self, text: str) -> None:
        """Reports one finished cell."""
        self.done += 1
        if not self.enabled:
            return
        line = f"[{self.done}/{self.total}] {text}"
        if self.bar is None:
            print(line, file=sys.stderr)
            return
        self.bar.write(line, file=sys.stderr)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# =====================================================================================
# scaffold-jax run
# =====================================================================================
def run(
    config: RunConfig,
    out: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    quiet: bool = False,
    dataset: sources.Dataset | None = None,
) -> dict[str, Any]:
    """Runs one experiment and writes its folder (see :mod:`scaffold_jax.results`).

    Args:
      config: the run's configuration (validated here).
      out: the output folder (default ``config.out`` or ``results/<algorithm>-<dataset>``).
      overwrite: replace a folder that holds a run.
      quiet: no progress bar and no printed summary.
      dataset: an already loaded dataset (e.g. in a notebook).

    Returns:
      The summary (what ``summary.json`` holds).

    Raises:
      ConfigError: an invalid config. FileExistsError: the folder holds a run.
      FileNotFoundError: the dataset is missing.
      scaffold_jax.simulate.DivergenceError: the model became NaN/Inf (the folder keeps
        the records made before and says ``"status": "diverged"``).
    """
    config.validate()
    folder = Path(out if out is not None else config.resolved_out())
    # Refuse an occupied folder before spending time on data and compilation.
    results.check_folder(folder, overwrite, dry_run=True)
    built = build(config, dataset)
    series = config.algorithm
    progress = Progress(config.rounds, desc=series, enabled=not quiet)
    to_save = config.to_dict()
    to_save["out"] = str(folder)
    with results.RunWriter(folder, to_save, config.targets, overwrite=overwrite) as writer:
        writer.add(experiment="run", **built.info)

        def on_record(record):
            writer.record(series, record)
            progress(record)

        try:
            result = built.simulation.run(
                built.data,
                built.hparams,
                num_rounds=config.rounds,
                eval_every=config.eval_every,
                seed=config.seed,
                callback=on_record,
            )
        except DivergenceError as err:
            writer.close("diverged", error=str(err))
            raise
        finally:
            progress.close()
        writer.describe(
            series,
            algorithm=config.algorithm,
            client_lr=config.client_lr,
            server_lr=config.server_lr,
            compile_seconds=round(result.compile_seconds, 3),
            run_seconds=round(result.run_seconds, 3),
            seconds_per_round=round(result.run_seconds / config.rounds, 6),
            rounds_per_second=round(config.rounds / max(result.run_seconds, 1e-9), 3),
            mean_client_drift=float(np.mean(result.round_metrics["client_drift"])),
        )
        summary = writer.finish()
    if not quiet:
        print(format_run_summary(summary, folder))
    return summary


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
        f"rounds to target accuracy: {reached}",
        f"compile {info.get('compile_seconds', 0):.1f} s, run {info.get('run_seconds', 0):.1f} s "
        f"({info.get('rounds_per_second', 0):.1f} rounds/s)",
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


def run_grid(
    simulation: Simulation,
    data,
    client_lrs: Sequence[float],
    num_rounds: int,
    eval_every: int,
    seed: int = 0,
    prox_mu: float = 0.0,
    use_sweep: bool = True,
) -> tuple[list[GridRun], dict[str, float]]:
    """Runs ``simulation`` for every η_l of a grid from its initial params.

    With ``use_sweep`` the grid is ONE vmapped program (:func:`scaffold_jax.sweep.sweep`):
    a single compilation, and on an accelerator the whole grid for about the price of one
    run. Otherwise (or if the sweep module cannot be imported) it loops over
    :meth:`Simulation.run`, which still compiles once because η_l is data.

    Returns:
      ``(runs, timing)`` with ``timing = {"compile_seconds", "run_seconds"}``.
    """
    lrs = [float(lr) for lr in client_lrs]
    if use_sweep:
        try:
            from scaffold_jax import sweep as sweep_module
        except ImportError:  # pragma: no cover - the sweep module is part of the package
            use_sweep = False
    if use_sweep:
        grid_hp, seeds, _ = sweep_module.grid(client_lr=lrs, prox_mu=prox_mu, seeds=seed)
        result = sweep_module.sweep(simulation, data, grid_hp, seeds, num_rounds, eval_every)
        runs = []
        for j, lr in enumerate(lrs):
            records = [
                {k: v for k, v in r.items() if k not in ("config", "status", "seconds")}
                for r in result.records[j]
            ]
            runs.append(
                GridRun(
                    lr,
                    records,
                    np.asarray(result.round_metrics["client_drift"][j]),
                    bool(result.diverged[j]),
                )
            )
        timing = {"compile_seconds": result.compile_seconds, "run_seconds": result.run_seconds}
        return runs, timing
    runs, timing = [], {"compile_seconds": 0.0, "run_seconds": 0.0}
    for lr in lrs:
        try:
            res = simulation.run(
                data,
                build_hparams(client_lr=lr, prox_mu=prox_mu),
                num_rounds=num_rounds,
                eval_every=eval_every,
                seed=seed,
            )
            diverged = False
        except DivergenceError as err:
            # A grid expects some step sizes to blow up: keep the records made before.
            res, diverged = err.result, True
        records = [{k: v for k, v in r.items() if k != "seconds"} for r in res.records]
        drift = np.full(num_rounds, np.nan)
        measured = np.asarray(res.round_metrics.get("client_drift", []), np.float64)
        drift[: min(len(measured), num_rounds)] = measured[:num_rounds]
        runs.append(GridRun(lr, records, drift, diverged))
        timing["compile_seconds"] += res.compile_seconds
        timing["run_seconds"] += res.run_seconds
    return runs, timing


def choose(
    runs: Sequence[GridRun],
    target: float | None,
    metric: str = "test_accuracy",
    higher_is_better: bool = True,
) -> tuple[GridRun, int | None]:
    """The paper's selection: the η_l reaching ``target`` in the fewest rounds.

    Ties (equal rounds, or nobody reaching the target) go to the better best value of
    ``metric`` over the run; a diverged run ranks last. With ``target=None`` the best
    value alone decides (Table 5's "best accuracy within the horizon").

    Returns:
      ``(chosen run, its rounds to target or None)``.
    """

    def key(run: GridRun):
        rounds = (
            None
            if target is None
            else results.rounds_to_target(run.records, target, metric, higher_is_better)
        )
        best = results.best_value(run.records, metric, higher_is_better)
        best = -math.inf if best is None else (best if higher_is_better else -best)
        # A step size that diverged is unusable even if it got there first.
        return (run.diverged, rounds is None, rounds if rounds is not None else 0, -best), rounds

    scored = [(key(r), r) for r in runs]
    (_, rounds), chosen = min(scored, key=lambda item: item[0][0])
    return chosen, rounds
