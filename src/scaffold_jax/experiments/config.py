"""The configuration of a run: :class:`RunConfig`, validated in one place, the option tables
it derives from the registries (:func:`declared_hparams`, :func:`declared_options`), config
files and the generated key reference."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scaffold_jax import participation, sampling
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.data import assembly, natural, sources, synthetic
from scaffold_jax.data.batching import PLANS, BatchPlan
from scaffold_jax.data.partition import DEFAULT_PARTITIONER, PARTITIONERS
from scaffold_jax.engine import MAX_ROUNDS, MAX_SEED, ROUNDS_WHY, SEED_WHY
from scaffold_jax.models import MODELS
from scaffold_jax.privacy import ADAPTIVE_CLIP_LR, MECHANISMS, accounting
from scaffold_jax.registry import (
    PLUGIN_HINT,
    ConfigError,
    Registry,
    RegistryUnion,
    factory_kwargs,
    in_one_line,
    load_plugins,
)
from scaffold_jax.types import (
    FLOAT32_TINY,
    STATE_POLICIES,
    STEP_SIZES,
    Algorithm,
    HParam,
    HParams,
    resolve_hparams,
)
from scaffold_jax.weighting import WEIGHTINGS

MAX_CLIENTS = 2**31 - 1  # client ids are int32

#: The privacy mechanism a config that sets any ``dp_*`` value without naming one gets.
DEFAULT_MECHANISM = "gaussian"


def declared_hparams() -> dict[str, HParam]:
    """Every hyper-parameter beyond the step sizes that a registered algorithm or privacy
    mechanism declares (the first declaration of a name wins), read at each call: plugins
    may add some."""
    out: dict[str, HParam] = {}
    for _, spec in [*ALGORITHMS.items(), *MECHANISMS.items()]:
        for name, hparam in spec.hparams.items():
            if name not in STEP_SIZES:
                out.setdefault(name, hparam)
    return out


#: Every dataset a config may name: the pooled ones (split over clients by a partitioner)
#: and the naturally federated ones (their clients come with the data).
DATASETS = RegistryUnion("dataset", sources.DATASETS, natural.NATURAL_DATASETS, synthetic.FAMILIES)

#: The registries whose entries declare options, by the config key that names the entry.
OPTION_OWNERS: dict[str, Registry] = {
    "algorithm": ALGORITHMS,
    "model": MODELS,
    "partition": PARTITIONERS,
    "dataset": DATASETS,
    "sampler": sampling.SAMPLERS,
    "batch_plan": PLANS,
    "weighting": WEIGHTINGS,
    "privacy": MECHANISMS,
    **participation.KINDS,
}


def declared_options(kinds: Sequence[str] = tuple(OPTION_OWNERS)) -> dict[str, Any]:
    """Every option (``{config key: Option}``) a registered entry of ``kinds`` declares
    (the first declaration of a name wins), read at each call: plugins may add some."""
    out: dict[str, Any] = {}
    for kind in kinds:
        for _, entry in OPTION_OWNERS[kind].items():
            for name, option in entry.options.items():
                out.setdefault(name, option)
    return out


def option_owners(name: str) -> list[tuple[str, str]]:
    """``(kind, entry)`` of the entries that declare the option ``name``, e.g.
    ``[("model", "mlp")]``."""
    return [
        (kind, entry)
        for kind, registry in OPTION_OWNERS.items()
        for entry, spec in registry.items()
        if name in spec.options
    ]


# =====================================================================================
# RunConfig: one run, validated in one place
# =====================================================================================
def _opt(
    default: Any,
    help: str,
    kind: str,
    choices: Sequence[str] | Registry | None = None,
    builds: bool = False,
):
    """A config field with CLI metadata: ``kind`` is int, float, str, bool, floats, ints;
    ``builds``: the field shapes the data or the model (what ``diagnose`` measures).

    A :class:`~scaffold_jax.registry.Registry` as ``choices`` is kept as it is, not copied:
    whoever reads the choices (the command line, when it builds its parser) sees the
    entries registered by then, plugins' included.
    """
    if not isinstance(choices, Registry):
        choices = tuple(choices) if choices else None
    meta = {"help": help, "kind": kind, "choices": choices, "builds": builds}
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

    Algorithms declare their own hyper-parameters, and every registered algorithm, model,
    partitioner and dataset declares its own options (:class:`~scaffold_jax.registry.Option`:
    name, kind, default, help, range); no field here names one of them. A config holds
    them in the tables ``hparams`` and ``options``, or as top-level keys of the same names
    (``prox_mu = 0.5``, ``similarity = 50``, ``hidden_sizes = [32]``), which the
    constructor moves into those tables (``RunConfig(similarity=50).options``), and reads
    them back as attributes (``config.similarity``: the given value, None when unset). A
    value for an option the chosen entries do not declare is an error, unless it is the
    default of the entry that does (a ``config.json`` of an earlier version holds every
    such field).

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
        {},
        "the options the chosen algorithm, model, partitioner and dataset declare, e.g. "
        "{scaffold_option = 'I', hidden_sizes = [32]}",
        "table",
    )
    weighting: str = _opt("uniform", "server aggregation weights", "str", WEIGHTINGS)
    dataset: str = _opt(
        "fashion_mnist",
        "dataset: a pooled one split over clients by the partition, a naturally "
        "federated one (shakespeare, femnist) that brings its clients, or a synthetic "
        "family generated for N clients (quadratic, synthetic, procedural_synthetic)",
        "str",
        DATASETS,
        builds=True,
    )
    data_dir: str | None = _opt(
        None,
        "where the dataset is: a folder of IDX files; Shakespeare: Gutenberg's raw_data.txt "
        "(default: the `shakespeare` package's texts); FEMNIST: LEAF JSON or TFF HDF5 files",
        "str",
        builds=True,
    )
    client_holdout: float | None = _opt(
        None,
        "hold out this fraction of every client's examples as its own test set, for the "
        "per-client metrics (natural datasets use each client's own test split)",
        "float",
        builds=True,
    )
    download: bool = _opt(
        False, "let TFDS download the dataset (needs internet)", "bool", builds=True
    )
    max_train_examples: int | None = _opt(
        None,
        "use a random subset of this many training examples",
        "int",
        builds=True,
    )
    max_test_examples: int | None = _opt(
        None,
        "use a random subset of this many test examples",
        "int",
        builds=True,
    )
    partition: str | None = _opt(
        None, "how examples are split over clients", "str", PARTITIONERS, builds=True
    )
    model: str = _opt("logreg", "model", "str", MODELS, builds=True)
    num_clients: int = _opt(
        100,
        "number of clients N (a natural dataset: N of its clients, drawn with the partition seed)",
        "int",
        builds=True,
    )
    clients_per_round: int | None = _opt(None, "clients sampled per round S", "int")
    sampler: str = _opt(
        sampling.DEFAULT_SAMPLER,
        "which S clients take part in a round (uniform: S of N; poisson: each client with "
        "probability S/N)",
        "str",
        sampling.SAMPLERS,
    )
    privacy: str | None = _opt(
        None,
        "user-level differential privacy: gaussian (each client's whole message clipped to "
        "dp_clip, Gaussian noise on the sum; any --dp-* setting chooses it)",
        "str",
        MECHANISMS,
    )
    availability: str = _opt(
        participation.DEFAULTS["availability"],
        "which clients can be sampled in a round: always, cyclic (G groups in turn, "
        "Semi-Cyclic SGD), markov (on/off spells), trace (a recorded log)",
        "str",
        participation.AVAILABILITY,
    )
    stragglers: str = _opt(
        participation.DEFAULTS["stragglers"],
        "how many of its local steps a client completes: none (all), uniform (K_i uniform "
        "in [k_min, K]), speed (a fixed device speed times a per-round load)",
        "str",
        participation.STRAGGLERS,
    )
    dropouts: str = _opt(
        participation.DEFAULTS["dropouts"],
        "whose updates are lost after training: none, bernoulli (each with dropout_rate)",
        "str",
        participation.DROPOUTS,
    )
    client_fraction: float | None = _opt(
        None, "fraction of clients sampled per round (default 0.2)", "float"
    )
    batch_plan: str | None = _opt(
        None,
        "local batch plan (default: inferred from the plan options given; fraction, or "
        "the algorithm's own, e.g. SGD's full)",
        "str",
        PLANS,
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
        builds=True,
    )
    partition_seed: int | None = _opt(
        None,
        "seed of the data alone: the example subsets (max_train/test_examples), the split "
        "over clients, the held-out client tests and a natural dataset's draw of clients "
        "(default: seed)",
        "int",
        builds=True,
    )
    out: str | None = _opt(
        None,
        "output folder (default results/<algorithm>-<dataset>-<digest of the settings>)",
        "str",
    )

    # ------------------------------------------------------------------ construction
    def __init__(self, **values: Any):
        values = _route(values, "RunConfig")
        for field in dataclasses.fields(self):
            if field.name in values:
                value = values[field.name]
            elif field.default_factory is not dataclasses.MISSING:
                value = field.default_factory()
            else:
                value = field.default
            setattr(self, field.name, value)
        if self.privacy is None and _privacy_settings(self.hparams, self.options):
            self.privacy = DEFAULT_MECHANISM

    def __getattr__(self, name: str) -> Any:
        # A declared option reads as an attribute: its given value, None when unset.
        options = self.__dict__.get("options")
        if not name.startswith("_") and isinstance(options, Mapping):
            if name in declared_options():
                return options.get(name)
        raise AttributeError(f"RunConfig has no field or declared option {name!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def data_fields(cls) -> tuple[str, ...]:
        """The fields that build the data and the model (the dataset, its subsets and
        partition, N, the model, the seeds)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["builds"])

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "config") -> RunConfig:
        """Builds a config from a mapping; unknown keys are errors (with a suggestion).

        Raises:
          ConfigError: unknown keys.
        """
        return cls(**_route(values, where))

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` (fields, or declared hyper-parameters and options by
        name; an option set to None is unset)."""
        return RunConfig(**{**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def chosen(self) -> list[tuple[str, str, Mapping[str, Any]]]:
        """``(kind, name, declared options)`` of the entries this config chooses: its
        algorithm, model, dataset and (for a pooled dataset) partitioner; unknown names
        are left out (validation names them)."""
        out = []
        named = [
            ("algorithm", self.algorithm),
            ("sampler", self.sampler),
            ("weighting", self.weighting),
        ]
        if self.privacy is not None:
            named.append(("privacy", self.privacy))
        named += [(kind, getattr(self, kind)) for kind in participation.KINDS]
        if self.batch_plan is None or self.batch_plan in PLANS:
            named.append(("batch_plan", self.resolved_plan_kind()))
        if not self.brings_problem:
            named.append(("model", self.model))
        for kind, name in named:
            if isinstance(name, str) and name in OPTION_OWNERS[kind]:
                out.append((kind, name, OPTION_OWNERS[kind][name].options))
        dataset = self.canonical_dataset()
        if dataset is not None:
            out.append(("dataset", dataset, DATASETS[dataset].options))
            if assembly.kind_of(dataset) == "pooled":
                kind = self.resolved_partition_kind()
                if kind in PARTITIONERS:
                    out.append(("partition", kind, PARTITIONERS[kind].options))
        return out

    def chose(self, kind: str) -> bool:
        """Whether this config chooses an entry of ``kind`` (no partitioner for natural or
        synthetic data, no model for a family that brings its own problem)."""
        return any(what == kind for what, _, _ in self.chosen())

    def canonical_dataset(self) -> str | None:
        """The registered name of :attr:`dataset` (aliases resolved), None if unknown."""
        if not isinstance(self.dataset, str):
            return None
        if self.dataset in DATASETS:
            return self.dataset
        try:
            return sources.canonical_name(self.dataset)
        except ValueError:
            return None

    def resolved(self, kind: str) -> dict[str, Any]:
        """The options of the chosen entry of ``kind`` (``"model"``, ``"partition"``...):
        every one it declares, given or at its default; ``{}`` if it chooses none."""
        for what, _, declared in self.chosen():
            if what == kind:
                return {
                    name: _parsed(opt, self.options.get(name, opt.default))
                    for name, opt in declared.items()
                }
        return {}

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
            self._validate_hparams(check, errors)
        self._validate_options(errors)
        for name, value in (("client_lr", self.client_lr), ("server_lr", self.server_lr)):
            check.number(name, value, low=0.0, strict=True, what="finite and > 0", float32=True)
        check.registered("weighting", self.weighting, WEIGHTINGS)
        if check.type("dataset", self.dataset, str, "a dataset name"):
            if self.is_natural:
                self._validate_natural(errors)
            elif self.is_synthetic:
                self._validate_synthetic(errors)
            elif self.canonical_dataset() is None:
                errors.append(
                    f"dataset = {self.dataset!r} is invalid: it must be one of "
                    f"{', '.join(DATASETS)}; {PLUGIN_HINT}."
                )
        check.number(
            "client_holdout", self.client_holdout, low=0.0, high=1.0, strict=True,
            optional=True, what="a fraction in (0, 1)",
        )  # fmt: skip
        if self.client_holdout is not None and self.is_natural:
            errors.append(
                f"client_holdout = {self.client_holdout!r} cannot be set with dataset = "
                f"{self.dataset!r}: its clients have their own test splits."
            )
        policy = self.options.get("state_policy") if isinstance(self.options, Mapping) else None
        if policy in STATE_POLICIES and policy != "average" and not self._keeps_statistics():
            errors.append(
                f"state_policy = {policy!r} applies to a model with running statistics "
                "(resnet18 with resnet_norm = 'batch', or a plugin model that takes "
                f"state_policy); model = {self.model!r} keeps none."
            )
        check.type("data_dir", self.data_dir, str, "a folder path", optional=True)
        check.type("download", self.download, bool, "true or false")
        check.integer("max_train_examples", self.max_train_examples, low=1, optional=True)
        check.integer("max_test_examples", self.max_test_examples, low=1, optional=True)
        self._validate_partition(check, errors)
        check.registered("model", self.model, MODELS)
        check.registered("sampler", self.sampler, sampling.SAMPLERS)
        how = None
        if all([check.registered(k, getattr(self, k), r) for k, r in participation.KINDS.items()]):
            how = self._validate_participation(errors)
        said = len(errors)
        if check.integer(
            "num_clients", self.num_clients, low=1, high=MAX_CLIENTS,
            what=f"an integer in [1, {MAX_CLIENTS}] (client ids are int32)",
        ):  # fmt: skip
            check.integer(
                "clients_per_round",
                self.clients_per_round,
                low=1,
                high=self.num_clients,
                optional=True,
                what=f"an integer in [1, num_clients = {self.num_clients}]",
            )
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
        counts_ok = len(errors) == said
        # The private algorithm's own checks need the cohort S: valid client counts first.
        if self.privacy is not None and check.registered("privacy", self.privacy, MECHANISMS):
            if counts_ok:
                self._validate_privacy(errors, how)
        self._validate_plan(check, errors)
        check.integer(
            "rounds", self.rounds, low=1, high=MAX_ROUNDS,
            what=f"an integer >= 1 and <= {MAX_ROUNDS}{ROUNDS_WHY}",
        )  # fmt: skip
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
                "results/<algorithm>-<dataset>-<digest>."
            )
        if errors:
            raise ConfigError(in_one_line("invalid config", errors))
        return self

    @property
    def is_natural(self) -> bool:
        """Whether :attr:`dataset` is naturally federated (its clients come with it)."""
        return assembly.kind_of(self.dataset) == "natural"

    @property
    def is_synthetic(self) -> bool:
        """Whether :attr:`dataset` is a synthetic family (generated for N clients)."""
        return assembly.kind_of(self.dataset) == "synthetic"

    @property
    def brings_problem(self) -> bool:
        """Whether the dataset brings its own problem (the quadratics: no model)."""
        return self.is_synthetic and synthetic.FAMILIES[self.dataset].brings_problem

    def _validate_synthetic(self, errors: list[str]) -> None:
        """A synthetic family is generated for N clients: nothing to read, split or subset."""
        given = [
            f for f in ("partition", "data_dir", "max_train_examples", "max_test_examples",
                        "client_holdout", *_partition_fields())
            if getattr(self, f) is not None
        ]  # fmt: skip
        if given:
            errors.append(
                f"{', '.join(dict.fromkeys(given))} cannot be set with dataset = "
                f"{self.dataset!r}: it is generated for num_clients clients from the data seed "
                "(its own options set it); remove them."
            )
        if self.brings_problem and self.model != RunConfig.__dataclass_fields__["model"].default:
            errors.append(
                f"model = {self.model!r} cannot be set with dataset = {self.dataset!r}: it "
                "brings its own loss (no model); remove it."
            )

    def _validate_natural(self, errors: list[str]) -> None:
        """A natural dataset brings its clients: no partition, no example subset."""
        spec = natural.NATURAL_DATASETS[self.dataset]
        if spec.needs_data_dir and self.data_dir is None:
            errors.append(
                f"dataset = {self.dataset!r} needs data_dir (--data-dir): {spec.description}."
            )
        given = [f for f in ("partition", *_partition_fields()) if getattr(self, f) is not None]
        given = list(dict.fromkeys(given))
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

    def _validate_hparams(self, check: _Checker, errors: list[str]) -> None:
        """The ``hparams`` table against what the algorithm declares."""
        spec = ALGORITHMS[self.algorithm]
        declared_here, everywhere = dict(spec.hparams), declared_hparams()
        if self.privacy in MECHANISMS:
            declared_here.update(MECHANISMS[self.privacy].hparams)
        if not check.type("hparams", self.hparams, Mapping, "a table of names and values"):
            return
        for name, value in self.hparams.items():
            if name in STEP_SIZES:
                errors.append(
                    f"hparams.{name} is invalid: set the step size {name} as its own field."
                )
            elif name in declared_here:
                self._check_declared(check, name, value, declared_here[name])
            elif name not in everywhere:
                errors.append(
                    f"hparams.{name} is unknown: no registered algorithm declares it "
                    f"({self.algorithm} takes {', '.join(declared_here) or 'none'})."
                )
            elif self._check_declared(check, name, value, everywhere[name]) and (
                value != everywhere[name].default
            ):
                takes = ", ".join(k for k in declared_here if k not in STEP_SIZES) or "none"
                errors.append(
                    f"{name} = {value!r} does not apply to algorithm = {self.algorithm!r}, "
                    f"which takes {takes}; remove it or choose an algorithm that declares it."
                )

    def _validate_options(self, errors: list[str]) -> None:
        """The ``options`` table against what the chosen entries declare: a chosen entry's
        option is checked against its declaration; another entry's must hold its default
        (an earlier ``config.json`` holds them all); a name nobody declares is unknown."""
        if not isinstance(self.options, Mapping):
            errors.append(
                f"options = {self.options!r} is invalid: it must be a table of names and values."
            )
            return
        chosen = {name: (kind, entry, opt) for kind, entry, table in self.chosen()
                  for name, opt in table.items()}  # fmt: skip
        everywhere, hparams = declared_options(), declared_hparams()  # read once, not per name
        for name, value in self.options.items():
            if name in STEP_SIZES or name in hparams:
                errors.append(
                    f"options.{name} is invalid: {name} is a hyper-parameter; set it as "
                    f"{name} = ... or in the hparams table."
                )
            elif name in chosen:
                _option_error(errors, name, value, chosen[name][2])
            elif name not in everywhere:
                close = difflib.get_close_matches(name, list(everywhere), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                errors.append(
                    f"options.{name} is unknown{hint}: no registered algorithm, model, "
                    f"partitioner or dataset declares it; {PLUGIN_HINT}."
                )
            elif (
                self.canonical_dataset() is not None
                and name in _partition_fields()
                and (assembly.kind_of(self.canonical_dataset()) != "pooled")
            ):
                continue  # said by _validate_natural / _validate_synthetic
            elif _option_error(errors, name, value, everywhere[name]) and _parsed(
                everywhere[name], value
            ) != _parsed(everywhere[name], everywhere[name].default):
                owner_kind = option_owners(name)[0][0]
                owners = [repr(e) for k, e in option_owners(name) if k == owner_kind]
                why = ALGORITHMS[self.algorithm].refuses.get(name) if (
                    self.algorithm in ALGORITHMS
                ) else None  # fmt: skip
                mine = [f"{k} = {e!r}" for k, e, _ in self.chosen() if k == owner_kind]
                fix = (
                    f"remove it or set {owner_kind} = {owners[0]}"
                    if len(owners) == 1
                    else f"it is an option of {owner_kind} {', '.join(owners)}: remove it or "
                    "choose one of them"
                )
                errors.append(
                    f"{name} = {value!r} does not apply to {', '.join(mine) or 'this config'}"
                    + (f": {why}." if why else f"; {fix}.")
                )

    def build_participation(self) -> participation.Participation:
        """The :class:`~scaffold_jax.participation.Participation` this config chooses."""
        return participation.Participation(
            **{
                kind: participation.build(kind, getattr(self, kind), self.resolved(kind))
                for kind in participation.KINDS
            }
        )

    def _validate_participation(self, errors: list[str]) -> participation.Participation | None:
        """What the participation models refuse for this config (their options together,
        a trace file that is missing or malformed); the models built, None when refused."""
        for kind in participation.KINDS:
            declared = OPTION_OWNERS[kind][getattr(self, kind)].options
            if any(declared[n].error(n, v) for n, v in self.options.items() if n in declared):
                return None  # said by the options' checks
        try:
            built = self.build_participation()
        except (ValueError, OSError) as err:  # OSError: a trace that is no file
            errors.append(str(err))
            return None
        if built.availability is not None and isinstance(self.num_clients, int):
            try:
                built.availability.check(self.num_clients)
            except ValueError as err:
                errors.append(str(err))
        most_steps = self._most_local_steps()
        if hasattr(built.stragglers, "check") and most_steps is not None:
            try:
                built.stragglers.check(most_steps)
            except ValueError as err:
                errors.append(str(err))
        return built

    def _most_local_steps(self) -> int | None:
        """The most local steps the plan gives a client; None when that depends on the
        data (an epochs plan: checked once it is loaded) or the plan is invalid (said by
        its own checks)."""
        try:
            plan = self.resolved_plan()
        except (ValueError, TypeError, KeyError, OverflowError):
            return None
        return None if plan.steps_vary else int(plan.shape(1)[0])

    def _validate_privacy(self, errors: list[str], how: participation.Participation | None) -> None:
        """What the private algorithm refuses for this config (an algorithm that does not
        aggregate by sums, weights, warm starts, an uncovered sampler or accountant)."""
        if self.algorithm not in ALGORITHMS or self.sampler not in sampling.SAMPLERS:
            return  # said by the checks of those fields
        declared = MECHANISMS[self.privacy].options
        if any(declared[n].error(n, v) for n, v in self.options.items() if n in declared):
            return  # said by the options' checks
        if how is None:
            return  # said by the participation checks
        try:
            algorithm = self.build_algorithm(lambda params, batch: 0.0)
            algorithm.check(
                self.num_clients,
                self.resolved_clients_per_round(),
                self.weighting,
                sampling=sampling.SAMPLERS[self.sampler].privacy,
                participation=how,
            )
        except (ValueError, TypeError) as err:
            errors.append(f"privacy = {self.privacy!r}: {err}")

    @staticmethod
    def _check_declared(check: _Checker, name: str, value: Any, declared: Any) -> bool:
        """Checks a hyper-parameter's ``value`` against its declared range; False (with a
        message) when bad."""
        what = "finite and >= 0" if declared.allow_zero else "finite and > 0"
        if declared.maximum is not None:
            what += f" and <= {declared.maximum:g}"
        return check.number(
            name, value, low=0.0, high=declared.maximum, strict=not declared.allow_zero,
            what=what, float32=True,
        )  # fmt: skip

    def _keeps_statistics(self) -> bool:
        """Whether the model, with this config's options, keeps running statistics (its
        registry entry says: resnet18 with BatchNorm, a plugin model that takes
        ``state_policy``)."""
        if self.model not in MODELS:
            return False
        return MODELS[self.model].statistics_with(self.options)

    def _validate_partition(self, check: _Checker, errors: list[str]) -> None:
        # The options' own ranges are their declarations'; here: which partitioner.
        owner = _partition_fields()
        given = {f: v for f, v in self.options.items() if f in owner and v is not None} if (
            isinstance(self.options, Mapping)
        ) else {}  # fmt: skip
        if self.partition is not None:
            check.registered("partition", self.partition, PARTITIONERS)
        elif len({owner[f] for f in given}) > 1:
            fields = ", ".join(f"{f} = {v!r}" for f, v in given.items())
            errors.append(f"{fields} are conflicting partition settings: give one of them.")

    def _validate_plan(self, check: _Checker, errors: list[str]) -> None:
        """The plan's own options are checked with every chosen entry's; here: the plan
        is registered and the options it cannot do without are given."""
        if self.batch_plan is not None and not check.registered(
            "batch_plan", self.batch_plan, PLANS
        ):
            return
        kind = self.resolved_plan_kind()
        options = self.options if isinstance(self.options, Mapping) else {}  # else: said
        declared = {n for _, spec in PLANS.items() for n in spec.options}
        given = {k: v for k, v in options.items() if k in declared and v is not None}
        if self.batch_plan is None and not any(
            set(given) <= set(spec.options) for _, spec in PLANS.items()
        ):
            fields = ", ".join(f"{f} = {v!r}" for f, v in given.items())
            plans = "; ".join(f"{n}: {', '.join(spec.options)}" for n, spec in PLANS.items())
            errors.append(
                f"{fields} are conflicting batch plan settings: give the options of one plan "
                f"({plans}), or batch_plan."
            )
        complete = True
        for name, option in PLANS[kind].options.items():
            if option.default is None and options.get(name) is None:
                errors.append(f"batch_plan = {kind!r} needs {name}.")
                complete = False
        values = self.resolved("batch_plan")
        if complete and all(PLANS[kind].options[n].error(n, v) is None for n, v in values.items()):
            # Each option in its range can still make a plan of too many local steps K
            # (batch_fraction = 1e-9: K = 10**9); the plan says so, here rather than in XLA.
            try:
                self.resolved_plan()
            except ValueError as err:
                given = ", ".join(f"{n} = {v!r}" for n, v in values.items())
                errors.append(f"{given} (batch_plan = {kind!r}): {err}")

    # ------------------------------------------------------------------ resolution
    def resolved_partition_kind(self) -> str:
        """The partitioner: ``partition``, else the one that declares an option that is
        set, else :data:`~scaffold_jax.data.partition.DEFAULT_PARTITIONER`."""
        if self.partition is not None:
            return self.partition
        owner = _partition_fields()
        options = self.options if isinstance(self.options, Mapping) else {}
        return next((owner[f] for f in options if f in owner), DEFAULT_PARTITIONER)

    def resolved_partition(self) -> tuple[str, dict[str, Any]]:
        """``(partitioner name, its split keywords)`` after defaults: each option it
        declares from the config, or its declared default when unset."""
        kind = self.resolved_partition_kind()
        return kind, factory_kwargs(PARTITIONERS[kind].options, self.resolved("partition"))

    def resolved_plan_kind(self) -> str:
        """``batch_plan``, else the plan the given options point to: ``local_steps`` →
        ``fixed`` (with ``batch_size``) or ``full``; ``batch_size`` → ``epochs``; nothing
        given → the algorithm's default plan (SGD: ``full``), else ``fraction``."""
        if self.batch_plan is not None:
            return self.batch_plan
        given = {k for k, v in self.options.items() if v is not None} if isinstance(
            self.options, Mapping
        ) else set()  # fmt: skip
        if "local_steps" in given:
            return "fixed" if "batch_size" in given else "full"
        if "batch_size" in given:
            return "epochs"
        plan_options = {name for _, spec in PLANS.items() for name in spec.options}
        default = ALGORITHMS[self.algorithm].default_plan if self.algorithm in ALGORITHMS else None
        if default in PLANS and not given & plan_options:
            return default  # e.g. the paper's SGD: one gradient on the client's full data
        return "fraction"

    def resolved_plan(self) -> BatchPlan:
        """The :class:`BatchPlan` after defaults (see :meth:`resolved_plan_kind`)."""
        spec = PLANS[self.resolved_plan_kind()]
        return spec.make(**factory_kwargs(spec.options, self.resolved("batch_plan")))

    def resolved_partition_seed(self) -> int:
        """The seed of the data (subsets, split, held-out tests, natural client draw)."""
        return self.seed if self.partition_seed is None else int(self.partition_seed)

    def resolved_clients_per_round(self) -> int:
        if self.clients_per_round is not None:
            return int(self.clients_per_round)
        fraction = 0.2 if self.client_fraction is None else float(self.client_fraction)
        return max(1, min(self.num_clients, round(fraction * self.num_clients)))

    def resolved_hparams(self) -> HParams:
        """The algorithm's declared hyper-parameters: the step sizes, the ``hparams``
        table, and the declared defaults for the rest (names it does not declare left
        out)."""
        # Built with this config's options: they may change what it declares (FedDyn
        # with a server optimizer declares server_lr).
        algorithm = self.build_algorithm(lambda params, batch: 0.0)
        given = {k: v for k, v in self.hparams.items() if k in algorithm.hparams}
        steps = {"client_lr": self.client_lr, "server_lr": self.server_lr}
        if self.privacy is not None:
            given.update(self._private_hparams(given))
        # resolve_hparams drops a default step size the algorithm does not declare.
        return resolve_hparams(algorithm, {**steps, **given})

    def build_algorithm(self, loss_fn) -> Algorithm:
        """The algorithm with this config's options, wrapped by its privacy mechanism
        when it chooses one."""
        algorithm = ALGORITHMS[self.algorithm].build(loss_fn, **self.resolved_options())
        if self.privacy is None:
            return algorithm
        spec = MECHANISMS[self.privacy]
        options = {k: v for k, v in self.resolved("privacy").items()
                   if spec.options[k].argument != "-"}  # fmt: skip
        return spec.wrap(algorithm, **factory_kwargs(spec.options, options))

    def privacy_sampling(self) -> accounting.Sampling:
        """How the accountant sees this config's client sampling (N, S and the kind)."""
        kind = sampling.SAMPLERS[self.sampler].privacy
        if kind is None:
            raise ConfigError(
                f"sampler = {self.sampler!r} is not covered by any privacy accountant: a "
                "private run needs sampler = 'uniform' (S of N without replacement) or "
                "'poisson'."
            )
        return accounting.Sampling(kind, self.num_clients, self.resolved_clients_per_round())

    def _private_hparams(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The privacy hyper-parameters the run-level settings fix: dp_noise_multiplier
        calibrated from dp_epsilon for the planned rounds, adaptive clipping from
        dp_adaptive_quantile."""
        options, out = self.resolved("privacy"), {}
        quantile = options.get("dp_adaptive_quantile")
        if quantile is not None:
            out["dp_target_quantile"] = quantile
            out["dp_clip_lr"] = given.get("dp_clip_lr", ADAPTIVE_CLIP_LR)
        target = options.get("dp_epsilon")
        if target is not None and "dp_noise_multiplier" in given:
            raise ConfigError(
                f"dp_epsilon = {target} and dp_noise_multiplier = "
                f"{given['dp_noise_multiplier']} are both set: give one of them (the noise "
                "multiplier is calibrated from the target epsilon)."
            )
        if target is None and "dp_noise_multiplier" not in given:
            raise ConfigError(
                "a private run needs its noise: give dp_noise_multiplier (--dp-noise-multiplier "
                "Z) or a target dp_epsilon (--dp-epsilon E, calibrated for the planned rounds)."
            )
        plan = self.privacy_sampling()
        try:  # validate() says it too (the private algorithm's check)
            accounting.check_privacy_parameters(
                delta=options.get("dp_delta"), num_clients=plan.num_clients
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if target is not None:
            delta = options.get("dp_delta") or accounting.default_delta(plan.num_clients)
            try:
                out["dp_noise_multiplier"] = accounting.calibrate(
                    plan, self.rounds, target, delta, options.get("dp_accountant")
                )
            except ValueError as err:
                raise ConfigError(str(err)) from None
        return out

    def resolved_options(self) -> dict[str, Any]:
        """The algorithm's factory options (``{config key: value}``, parsed, defaults
        filled in; names it does not declare left out)."""
        return self.resolved("algorithm")


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
        mine = [f"`{n}`" for n, spec in ALGORITHMS.items() if name in getattr(spec, table)]
        mine += [f"privacy `{n}`" for n, spec in MECHANISMS.items() if name in spec.hparams]
        return ", ".join(mine)

    for name, hparam in declared_hparams().items():
        lines.append(
            f"| `{name}` | `--{name.replace('_', '-')}` | {cell(hparam.default)} | "
            f"{owners('hparams', name)} | {text(hparam.help)} |"
        )
    lines += [
        "",
        "## Declared options",
        "",
        "Options the registered algorithms, models, partitioners, datasets, batch plans,",
        "samplers and weightings declare (a variant, a width, a concentration...); in the",
        "`options` table, at the top level (`hidden_sizes = [32]`) or as a flag",
        "(`--hidden-sizes 32`). A numeric option of a model, partitioner, dataset or batch",
        "plan is an axis of `scaffold-jax sweep --grid`. A value",
        "for an option the chosen entries do not declare is an error, unless it is that",
        "option's default. A plugin's entries declare theirs the same way.",
        "",
        "| key | flag | type | default | declared by | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for name, option in declared_options().items():
        meaning = option.help
        if option.choices:
            meaning += ". One of: " + ", ".join(f"`{c}`" for c in option.choices)
        elif getattr(option, "low", None) is not None or getattr(option, "high", None) is not None:
            meaning += f" ({option.describe()})"
        kind = getattr(option, "kind", "str")
        owners = ", ".join(f"`{entry}`" for _, entry in option_owners(name))
        owner_kinds = sorted({kind for kind, _ in option_owners(name)})
        lines.append(
            f"| `{name}` | `--{name.replace('_', '-')}` | {kind} | {cell(option.default)} | "
            f"{' / '.join(owner_kinds)} {owners} | {text(meaning)} |"
        )
    return "\n".join(lines) + "\n"


def _privacy_settings(hparams: Any, options: Any) -> list[str]:
    """The privacy hyper-parameters and options a config sets (any chooses a mechanism)."""
    names = {n for _, spec in MECHANISMS.items() for n in (*spec.hparams, *spec.options)}
    given = [*(hparams if isinstance(hparams, Mapping) else ()),
             *(options if isinstance(options, Mapping) else ())]  # fmt: skip
    return [n for n in given if n in names]


def _partition_fields() -> dict[str, str]:
    """Option -> the first registered partitioner that declares it (read at each call:
    a plugin may have registered partitioners since import)."""
    owner: dict[str, str] = {}
    for name, spec in PARTITIONERS.items():
        for field in spec.options:
            owner.setdefault(field, name)
    return owner


def _route(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` with every declared hyper-parameter and option given by name moved into
    the ``hparams`` / ``options`` tables (an option given as None is unset); plugins
    named in ``values`` are imported first (they may declare those names).

    Raises:
      ConfigError: a table that is not a table, or a key that is neither a field nor a
        declared name (with the closest known one).
    """
    values = dict(values)
    if "plugins" in values and isinstance(values["plugins"], (list, tuple)):
        _load_plugins(values["plugins"])
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
            value = values.pop(name)
            if value is None:
                options.pop(name, None)
            else:
                options[name] = value
    values["hparams"], values["options"] = hparams, options
    known = RunConfig.field_names()
    unknown = [k for k in values if k not in known]
    if unknown:
        names = [*known, *declared_hparams(), *declared_options()]
        lines = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"unknown {where} key {key!r}{hint}")
        raise ConfigError(
            "; ".join(lines) + f". Known keys: {', '.join(known)}, and the hyper-parameters "
            "and options the registered algorithms, models, partitioners and datasets "
            "declare (docs/config.md)."
        )
    return values


def _option_error(errors: list[str], name: str, value: Any, declared: Any) -> bool:
    """Appends why ``value`` is invalid for ``declared``; True when it is valid."""
    error = declared.error(name, value)
    if error is not None:
        errors.append(error)
    return error is None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        if float32 and v != 0 and abs(v) < FLOAT32_TINY:
            # 1e-50 is > 0 here, but 0 (or a subnormal, flushed to 0) once float32.
            least = f"{'' if strict else '0 or '}at least {FLOAT32_TINY:.8g}"
            self.errors.append(
                f"{name} = {value!r} underflows float32 (smallest normal {FLOAT32_TINY:.2g}): "
                "the step sizes and hyper-parameters are float32, where it would become 0; "
                f"it must be {what}, and {least}."
            )
            return False
        return True


_FLOAT32_MAX = float(np.finfo(np.float32).max)


_TABLES = ("hparams", "options")


def _unique_keys(path: Path) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A json ``object_pairs_hook`` that refuses a key given twice in one object."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(
                    f"config file {path} gives the key {key!r} twice ({out[key]!r}, then "
                    f"{value!r}); give each key once."
                )
            out[key] = value
        return out

    return hook


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a TOML (``.toml``) or JSON (``.json``) config file into a flat dict.

    Raises:
      ConfigError: a missing or unparsable file (a key given twice included), a
        directory, an unknown extension, or a non-flat document (only top-level keys are
        fields).
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a .toml or .json file.")
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
            # json keeps the last of two equal keys silently; tomllib refuses them.
            values = json.loads(path.read_text(), object_pairs_hook=_unique_keys(path))
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
