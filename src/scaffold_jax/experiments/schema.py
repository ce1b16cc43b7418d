"""The settings of a run: the fields of :class:`~scaffold_jax.experiments.RunConfig`
(:class:`ConfigFields`, with what the command line and the key reference read about each),
the hyper-parameters and options the registries declare (:func:`declared_hparams`,
:func:`declared_options`), and how a key given by name goes into the ``hparams`` or
``options`` table."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from scaffold_jax import compatibility, participation, sampling
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.data import natural, sources, synthetic
from scaffold_jax.data.batching import PLANS
from scaffold_jax.data.partition import PARTITIONERS
from scaffold_jax.engine.buffered import EXECUTIONS
from scaffold_jax.models import MODELS
from scaffold_jax.privacy import MECHANISMS
from scaffold_jax.registry import ConfigError, Registry, RegistryUnion, load_plugins
from scaffold_jax.types import STEP_SIZES, HParam
from scaffold_jax.weighting import WEIGHTINGS
from scaffold_jax.wrappers import WRAPPERS, outermost_first

#: The privacy mechanism a config that sets any ``dp_*`` value without naming one gets.
DEFAULT_MECHANISM = "gaussian"

#: The tables of a config; every other key is a top-level field.
TABLES = ("hparams", "options")


def declared_hparams() -> dict[str, HParam]:
    """Every hyper-parameter beyond the step sizes that a registered algorithm or a kind of
    wrapper (privacy mechanism, compressor) declares (the first declaration of a name
    wins), read at each call: plugins may add some."""
    out: dict[str, HParam] = {}
    kinds = [entry for wrapper in outermost_first() for entry in wrapper.kinds.items()]
    for _, spec in [*ALGORITHMS.items(), *kinds]:
        for name, hparam in spec.hparams.items():
            if name not in STEP_SIZES:
                out.setdefault(name, hparam)
    return out


#: Every dataset a config may name: the pooled ones (split over clients by a partitioner)
#: and the naturally federated ones (their clients come with the data).
DATASETS = RegistryUnion("dataset", sources.DATASETS, natural.NATURAL_DATASETS, synthetic.FAMILIES)

#: The registries whose entries declare options, by the config key that names the entry.
OPTION_OWNERS: dict[str, Registry] = {
    "algorithm": ALGORITHMS, "model": MODELS, "partition": PARTITIONERS, "dataset": DATASETS,
    "sampler": sampling.SAMPLERS, "batch_plan": PLANS, "weighting": WEIGHTINGS,
    **{wrapper.field: wrapper.kinds for wrapper in outermost_first()}, **participation.KINDS,
    "execution": EXECUTIONS,
}  # fmt: skip


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


def partition_fields() -> dict[str, str]:
    """Option -> the first registered partitioner that declares it (read at each call:
    a plugin may have registered partitioners since import)."""
    owner: dict[str, str] = {}
    for name, spec in PARTITIONERS.items():
        for field in spec.options:
            owner.setdefault(field, name)
    return owner


def _opt(
    default: Any,
    help: str,
    kind: str,
    choices: Registry | None = None,
    builds: bool = False,
):
    """A config field with CLI metadata: ``kind`` is int, float, str, bool, floats, ints;
    ``builds``: the field shapes the data or the model (what ``diagnose`` measures).

    The :class:`~scaffold_jax.registry.Registry` of ``choices`` is kept as it is, not
    copied: whoever reads the choices (the command line, when it builds its parser) sees
    the entries registered by then, plugins' included.
    """
    meta = {"help": help, "kind": kind, "choices": choices, "builds": builds}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _wrapper_field(name: str):
    """The config field that chooses the wrapper ``name`` (:data:`~scaffold_jax.wrappers.WRAPPERS`):
    off by default, its help and kinds the table's."""
    spec = WRAPPERS[name]
    return _opt(spec.off, spec.help, "str", spec.kinds)


@dataclasses.dataclass
class ConfigFields:
    """The fields of a :class:`~scaffold_jax.experiments.RunConfig` (its docstring says
    what they hold), its construction from given keys and its declared options read as
    attributes."""

    # fmt: off
    algorithm: str = _opt("scaffold", "federated algorithm", "str", ALGORITHMS)
    plugins: list[str] = _opt(
        [], "modules or .py files to import first (they register algorithms, models...)", "strs")
    client_lr: float = _opt(0.1, "client (local) step size eta_l", "float")
    server_lr: float = _opt(1.0, "server (global) step size eta_g", "float")
    hparams: dict[str, float] = _opt(
        {}, "the algorithm's other declared hyper-parameters, e.g. {prox_mu = 1.0}", "table")
    options: dict[str, Any] = _opt(
        {}, "the options the chosen algorithm, model, partitioner and dataset declare, e.g. "
        "{scaffold_option = 'I', hidden_sizes = [32]}", "table")
    weighting: str = _opt("uniform", "server aggregation weights", "str", WEIGHTINGS)
    dataset: str = _opt(
        "fashion_mnist",
        "dataset: a pooled one split over clients by the partition, a naturally "
        "federated one (shakespeare, femnist) that brings its clients, or a synthetic "
        "family generated for N clients (quadratic, synthetic, procedural_synthetic)",
        "str", DATASETS, builds=True)
    data_dir: str | None = _opt(
        None,
        "where the dataset is: a folder of IDX files; Shakespeare: Gutenberg's raw_data.txt "
        "(default: the `shakespeare` package's texts); FEMNIST: LEAF JSON or TFF HDF5 files",
        "str", builds=True)
    local_test_fraction: float | None = _opt(
        None,
        "hold out this fraction of every client's examples as its own test set, for the "
        "per-client metrics (natural datasets use each client's own test split)",
        "float", builds=True)
    download: bool = _opt(
        False, "let TFDS download the dataset (needs internet)", "bool", builds=True)
    max_train_examples: int | None = _opt(
        None, "use a random subset of this many training examples", "int", builds=True)
    max_test_examples: int | None = _opt(
        None, "use a random subset of this many test examples", "int", builds=True)
    partition: str | None = _opt(
        None, "how examples are split over clients", "str", PARTITIONERS, builds=True)
    model: str = _opt("logreg", "model", "str", MODELS, builds=True)
    num_clients: int = _opt(
        100,
        "number of clients N (a natural dataset: N of its clients, drawn with the partition seed)",
        "int", builds=True)
    clients_per_round: int | None = _opt(None, "clients sampled per round S", "int")
    sampler: str = _opt(
        sampling.DEFAULT_SAMPLER,
        "which S clients take part in a round (uniform: S of N; poisson: each client with "
        "probability S/N)",
        "str", sampling.SAMPLERS)
    privacy: str | None = _wrapper_field("privacy")
    compression: str = _wrapper_field("compression")
    attack: str = _wrapper_field("attack")
    aggregator: str = _wrapper_field("aggregator")
    availability: str = _opt(
        participation.DEFAULTS["availability"],
        "which clients can be sampled in a round: always, cyclic (G groups in turn, "
        "Semi-Cyclic SGD), markov (on/off spells), trace (a recorded log)",
        "str", participation.AVAILABILITY)
    stragglers: str = _opt(
        participation.DEFAULTS["stragglers"],
        "how many of its local steps a client completes: none (all), uniform (K_i uniform "
        "in [k_min, K]), speed (a fixed device speed times a per-round load)",
        "str", participation.STRAGGLERS)
    dropouts: str = _opt(
        participation.DEFAULTS["dropouts"],
        "whose updates are lost after training: none, bernoulli (each with dropout_rate)",
        "str", participation.DROPOUTS)
    profiles: str = _opt(
        participation.DEFAULTS["profiles"],
        "the clients' devices, for a virtual clock: none (rounds only), lognormal (seconds "
        "per example and bandwidths drawn per client), file (a CSV, profile_file); with "
        "round_deadline and over_selection",
        "str", participation.PROFILES)
    execution: str = _opt(
        "sync",
        "how rounds run: sync (the paper's synchronous rounds) or fedbuff (asynchronous "
        "buffered aggregation, Nguyen et al. 2022: concurrency, buffer_size, staleness; "
        "a round is a server step; needs profiles; "
        + compatibility.summary("fedbuff") + ")",
        "str", EXECUTIONS)
    client_fraction: float | None = _opt(
        None, "fraction of clients sampled per round (default 0.2)", "float")
    batch_plan: str | None = _opt(
        None,
        "local batch plan (default: inferred from the plan options given; fraction, or "
        "the algorithm's own, e.g. SGD's full)",
        "str", PLANS)
    rounds: int = _opt(100, "communication rounds", "int")
    eval_every: int = _opt(5, "evaluate every this many rounds", "int")
    finetune_steps: int = _opt(
        0,
        "evaluate every client's model after this many plain SGD steps on its own training "
        "data (fine-tuning evaluation; never stored; needs client test data)", "int")
    finetune_lr: float | None = _opt(
        None, "the fine-tuning steps' step size (default: client_lr)", "float")
    personal_eval_clients: int | None = _opt(
        None,
        "evaluate this many clients on their own test data, a fixed sample drawn once from "
        "the seed (default: all)", "int")
    train_eval_examples: int = _opt(
        4096,
        "training examples train_loss is evaluated on: a fixed uniform subsample, an "
        "unbiased estimate (0: all of them, the exact objective)",
        "int")
    targets: list[float] = _opt([0.5, 0.6, 0.7, 0.8], "target test accuracies", "floats")
    seed: int = _opt(
        0,
        "seed of the model's initial params and of the root key of client sampling and "
        "minibatches; also of the data (subsets, partition) unless partition_seed is set",
        "int", builds=True)
    partition_seed: int | None = _opt(
        None,
        "seed of the data alone: the example subsets (max_train/test_examples), the split "
        "over clients, the held-out client tests and a natural dataset's draw of clients "
        "(default: seed)",
        "int", builds=True)
    out: str | None = _opt(
        None, "output folder (default results/<algorithm>-<dataset>-<digest of the settings>)",
        "str")
    keep_checkpoints: int = _opt(
        1,
        "checkpoints a finished run (each cell of a sweep) leaves in <out>/checkpoints: 1, "
        "its final state, is all that --resume with more rounds needs; more keep earlier "
        "rounds too, each the size of the whole state (see the how-to: resuming)",
        "int")
    # fmt: on

    def __init__(self, **values: Any):
        values = route(values, "RunConfig")
        for field in dataclasses.fields(self):
            factory = field.default_factory
            default = field.default if factory is dataclasses.MISSING else factory()
            setattr(self, field.name, values.get(field.name, default))
        # Any privacy hyper-parameter or option chooses a mechanism.
        private = {n for _, spec in MECHANISMS.items() for n in (*spec.hparams, *spec.options)}
        if self.privacy is None and private & {*self.hparams, *self.options}:
            self.privacy = DEFAULT_MECHANISM

    def __getattr__(self, name: str) -> Any:
        # A declared option reads as an attribute: its given value, None when unset.
        options = self.__dict__.get("options")
        if not name.startswith("_") and isinstance(options, Mapping) and name in declared_options():
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
    def from_dict(cls, values: Mapping[str, Any], where: str = "config", strict: bool = True):
        """Builds a config from a mapping; unknown keys are errors (with a suggestion).

        Args:
          values: fields, tables and declared names.
          where: what holds them, for messages.
          strict: refuse a declared name given two values (at the top level and in its
            table); False: the top level's wins (a command's own ``config.json``, which
            lays the values it was given over the first cell's).

        Raises:
          ConfigError: unknown keys, or (``strict``) a name given two values.
        """
        return cls(**route(values, where, strict=strict))

    def replace(self, **changes: Any):
        """A copy with ``changes`` (fields, or declared hyper-parameters and options by
        name, which replace the tables' values; an option set to None is unset)."""
        if isinstance(changes.get("plugins"), (list, tuple)):
            import_plugins(changes["plugins"])  # they may declare the names changed
        values = self.to_dict()
        hparams, options = declared_hparams(), declared_options()
        for name, value in changes.items():
            table = "hparams" if name in hparams else "options" if name in options else None
            if name in TABLES or table is None:
                values[name] = value
            elif value is None:
                values[table].pop(name, None)
            else:
                values[table][name] = value
        return type(self)(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def route(
    values: Mapping[str, Any], where: str, strict: bool = True, source: str | None = None
) -> dict[str, Any]:
    """``values`` with every declared hyper-parameter and option given by name moved into
    the ``hparams`` / ``options`` tables (an option given as None is unset); plugins
    named in ``values`` are imported first (they may declare those names).

    Raises:
      ConfigError: a table that is not a table, a key that is neither a field nor a
        declared name (with the closest known one), or (``strict``) a name given by name
        and in its table with two values (which one was meant cannot be known; the
        message names ``source``, default ``where``).
    """
    values = dict(values)
    if "plugins" in values and isinstance(values["plugins"], (list, tuple)):
        import_plugins(values["plugins"])
    tables = {}
    for table in TABLES:
        given = values.pop(table, None)
        if given is not None and not isinstance(given, Mapping):
            raise ConfigError(
                f"{table} = {given!r} is invalid: it must be a table of names and values."
            )
        tables[table] = dict(given or {})
    twice = []
    for table, declared in (("hparams", declared_hparams()), ("options", declared_options())):
        inside = tables[table]
        for name in [n for n in declared if n in values]:
            value = values.pop(name)
            if (
                strict
                and inside.get(name) is not None
                and value is not None
                and (not same_value(inside[name], value))
            ):
                twice.append(f"{name} = {value!r} and {table}.{name} = {inside[name]!r}")
            inside[name] = value
            if value is None and table == "options":  # an option given as None is unset
                del inside[name]
    if twice:
        raise ConfigError(
            f"{source or where} gives {'; '.join(twice)}: a setting with two values; give it "
            "once, by name or in its table."
        )
    values.update(tables)
    known = ConfigFields.field_names()
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


def same_value(a: Any, b: Any) -> bool:
    """Whether two given values of one setting are the same (8 and 8.0 are; a tuple and
    a list of the same values are)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # an array's comparison: different enough to say so
        return False


def import_plugins(specs: Sequence[str]) -> None:
    """Imports the plugins ``specs`` names (they register their entries); a ConfigError
    names one that cannot be imported."""
    try:
        load_plugins(specs)
    except ValueError as err:
        raise ConfigError(f"plugins = {list(specs)!r} is invalid: {err}") from err
