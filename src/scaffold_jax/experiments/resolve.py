"""Resolution: what a config leaves open, decided from the defaults and the registries
before anything is built: the entries it chooses and their options (:func:`chosen`,
:func:`entry_options`), the partitioner, the batch plan, S, the seed of the data and the
hyper-parameters (:func:`hparams`, privacy's noise calibrated for the planned rounds).
:func:`resolve` does it once for a valid config, into the frozen :class:`ResolvedConfig`
that :func:`~scaffold_jax.experiments.build.build` builds from. Each function reads a
config as it is, valid or not (validation reads them too): an unknown name chooses nothing.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from scaffold_jax import participation, sampling
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.data import assembly, sources, synthetic
from scaffold_jax.data.batching import PLANS, BatchPlan
from scaffold_jax.data.partition import DEFAULT_PARTITIONER, PARTITIONERS
from scaffold_jax.experiments.schema import DATASETS, OPTION_OWNERS, ConfigFields, partition_fields
from scaffold_jax.privacy import ADAPTIVE_CLIP_LR, accounting
from scaffold_jax.registry import ConfigError, factory_kwargs
from scaffold_jax.types import Algorithm, HParams, resolve_hparams
from scaffold_jax.wrappers import WRAPPERS, chosen_hparams, outermost_first


def canonical_dataset(config: ConfigFields) -> str | None:
    """The registered name of the dataset (aliases resolved), None if unknown."""
    if not isinstance(config.dataset, str):
        return None
    if config.dataset in DATASETS:
        return config.dataset
    try:
        return sources.canonical_name(config.dataset)
    except ValueError:
        return None


def brings_problem(config: ConfigFields) -> bool:
    """Whether the dataset brings its own problem (the quadratics: no model)."""
    kind = assembly.kind_of(config.dataset)
    return kind == "synthetic" and synthetic.FAMILIES[config.dataset].brings_problem


def chosen(config: ConfigFields) -> list[tuple[str, str, Mapping[str, Any]]]:
    """``(kind, name, declared options)`` of the entries the config chooses: its
    algorithm, sampler, weighting, wrappers (privacy mechanism, compressor), participation
    models, batch plan, model, dataset and (for a pooled dataset) partitioner; unknown
    names are left out (validation names them), and so is privacy's None."""
    out = []
    named = [(kind, getattr(config, kind)) for kind in ("algorithm", "sampler", "weighting")]
    named += [(spec.field, getattr(config, spec.field)) for spec in outermost_first()]
    named += [(kind, getattr(config, kind)) for kind in participation.KINDS]
    named.append(("execution", config.execution))
    if config.batch_plan is None or config.batch_plan in PLANS:
        named.append(("batch_plan", plan_kind(config)))
    if not brings_problem(config):
        named.append(("model", config.model))
    for kind, name in named:
        if isinstance(name, str) and name in OPTION_OWNERS[kind]:
            out.append((kind, name, OPTION_OWNERS[kind][name].options))
    dataset = canonical_dataset(config)
    if dataset is not None:
        out.append(("dataset", dataset, DATASETS[dataset].options))
        if assembly.kind_of(dataset) == "pooled":
            kind = partition_kind(config)
            if kind in PARTITIONERS:
                out.append(("partition", kind, PARTITIONERS[kind].options))
    return out


def entry_options(config: ConfigFields, kind: str) -> dict[str, Any]:
    """The options of the chosen entry of ``kind`` (``"model"``, ``"partition"``...):
    every one it declares, given or at its default; ``{}`` if it chooses none."""
    for what, _, declared in chosen(config):
        if what == kind:
            return {
                name: parsed(opt, config.options.get(name, opt.default))
                for name, opt in declared.items()
            }
    return {}


def parsed(declared: Any, value: Any) -> Any:
    """A declared option's value in its canonical form (a hyper-parameter's as it is)."""
    try:
        return declared.parse(value) if hasattr(declared, "parse") else value
    except ValueError:
        return value


def partition_kind(config: ConfigFields) -> str:
    """The partitioner: ``partition``, else the one that declares an option that is set,
    else :data:`~scaffold_jax.data.partition.DEFAULT_PARTITIONER`."""
    if config.partition is not None:
        return config.partition
    owner = partition_fields()
    options = config.options if isinstance(config.options, Mapping) else {}
    return next((owner[f] for f in options if f in owner), DEFAULT_PARTITIONER)


def partition(config: ConfigFields) -> tuple[str, dict[str, Any]]:
    """``(partitioner name, its split keywords)`` after defaults: each option it declares
    from the config, or its declared default when unset."""
    kind = partition_kind(config)
    return kind, factory_kwargs(PARTITIONERS[kind].options, entry_options(config, "partition"))


def plan_kind(config: ConfigFields) -> str:
    """``batch_plan``, else the plan the given options point to: ``local_steps`` →
    ``fixed`` (with ``batch_size``) or ``full``; ``batch_size`` → ``epochs``; nothing
    given → the algorithm's default plan (SGD: ``full``), else ``fraction``."""
    if config.batch_plan is not None:
        return config.batch_plan
    given = {k for k, v in config.options.items() if v is not None} if isinstance(
        config.options, Mapping
    ) else set()  # fmt: skip
    if "local_steps" in given:
        return "fixed" if "batch_size" in given else "full"
    if "batch_size" in given:
        return "epochs"
    plan_options = {name for _, spec in PLANS.items() for name in spec.options}
    default = ALGORITHMS[config.algorithm].default_plan if config.algorithm in ALGORITHMS else None
    if default in PLANS and not given & plan_options:
        return default  # e.g. the paper's SGD: one gradient on the client's full data
    return "fraction"


def plan(config: ConfigFields) -> BatchPlan:
    """The batch plan after defaults (see
    :func:`~scaffold_jax.experiments.resolve.plan_kind`)."""
    spec = PLANS[plan_kind(config)]
    return spec.make(**factory_kwargs(spec.options, entry_options(config, "batch_plan")))


def partition_seed(config: ConfigFields) -> int:
    """The seed of the data (subsets, split, held-out tests, natural client draw)."""
    return config.seed if config.partition_seed is None else int(config.partition_seed)


def clients_per_round(config: ConfigFields) -> int:
    """S: ``clients_per_round``, else ``client_fraction`` (default 0.2) of N."""
    if config.clients_per_round is not None:
        return int(config.clients_per_round)
    fraction = 0.2 if config.client_fraction is None else float(config.client_fraction)
    return max(1, min(config.num_clients, round(fraction * config.num_clients)))


def _inspect_only(params: Any, batch: Any) -> Any:
    # The factories only close over the loss: an algorithm built before its problem (to
    # check what its privacy mechanism refuses, to read the hyper-parameters its entry
    # does not declare) is inspected, never run.
    raise RuntimeError("this algorithm was built without its problem's loss: it cannot run")


def make_algorithm(config: ConfigFields, loss_fn: Callable = _inspect_only) -> Algorithm:
    """The algorithm with the config's options for the problem's ``loss_fn``, wrapped by
    each wrapper the config turns on, in :data:`~scaffold_jax.wrappers.WRAPPERS`' order
    (compression inside privacy: each client compresses, then clips what it sends);
    without ``loss_fn`` (before there is a problem), built to be inspected, not run."""
    algorithm = ALGORITHMS[config.algorithm].build(loss_fn, **entry_options(config, "algorithm"))
    for _, spec in WRAPPERS.items():
        kind = getattr(config, spec.field)
        if kind != spec.off:
            algorithm = spec.wrap(algorithm, kind, entry_options(config, spec.field))
    return algorithm


def hparams(config: ConfigFields) -> HParams:
    """The algorithm's declared hyper-parameters: the step sizes, the ``hparams`` table,
    and the declared defaults for the rest (names it does not declare left out); a private
    config's noise and adaptive clipping as its run-level settings fix them. Declared by
    the registry entries (as a function of the entry's options where they change them:
    FedDyn's server optimizer adds ``server_lr``); only a plugin's entry that declares
    none has its algorithm built to read them.

    Raises:
      ConfigError: a private config's noise given twice or not at all, or a target
        epsilon the accountant cannot meet.
      ValueError: an unknown algorithm, a value out of its declared range.
    """
    spec = ALGORITHMS[config.algorithm]
    if spec.declared_hparams is None:  # a plugin that declares none: built to read them
        declared: Any = make_algorithm(config)
    else:
        # The spec stands for the algorithm: resolve_hparams reads its name and hparams.
        table = {**spec.hparams_for(entry_options(config, "algorithm")), **chosen_hparams(config)}
        declared = spec._replace(name=spec.name or config.algorithm, declared_hparams=table)
    given = {k: v for k, v in config.hparams.items() if k in declared.hparams}
    steps = {"client_lr": config.client_lr, "server_lr": config.server_lr}
    if config.privacy is not None:
        given.update(_private_hparams(config, given))
    # resolve_hparams drops a default step size the algorithm does not declare.
    return resolve_hparams(declared, {**steps, **given})


def _private_hparams(config: ConfigFields, given: Mapping[str, Any]) -> dict[str, Any]:
    """The privacy hyper-parameters the run-level settings fix: dp_noise_multiplier
    calibrated from dp_epsilon for the planned rounds, adaptive clipping from
    dp_adaptive_quantile."""
    options, out = entry_options(config, "privacy"), {}
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
    kind = sampling.SAMPLERS[config.sampler].privacy
    if kind is None:
        raise ConfigError(
            f"sampler = {config.sampler!r} is not covered by any privacy accountant: a "
            "private run needs sampler = 'uniform' (S of N without replacement) or "
            "'poisson'."
        )
    plan = accounting.Sampling(kind, config.num_clients, clients_per_round(config))
    try:  # validation says the first too (the private algorithm's check)
        accounting.check_privacy_parameters(
            delta=options.get("dp_delta"), num_clients=plan.num_clients
        )
        if target is not None:
            delta = options.get("dp_delta") or accounting.default_delta(plan.num_clients)
            out["dp_noise_multiplier"] = accounting.calibrate(
                plan, config.rounds, target, delta, options.get("dp_accountant")
            )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return out


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """A valid config with everything it leaves open decided (made by :func:`resolve`):
    a copy of the settings as given (``config``), the dataset's registered name, the
    partitioner (None when the data brings its clients), ``{kind: options}`` of every chosen
    entry with their defaults (:meth:`of` reads one kind's), the batch plan, S, the seed of
    the data, and the hyper-parameters (a private config's noise calibrated)."""

    config: ConfigFields
    dataset: str
    partition: str | None
    options: Mapping[str, Mapping[str, Any]]
    plan: BatchPlan
    clients_per_round: int
    partition_seed: int
    hparams: HParams

    def of(self, kind: str) -> dict[str, Any]:
        """The options of the chosen entry of ``kind``; ``{}`` if the config chooses none."""
        return dict(self.options.get(kind, {}))


def resolve(config: ConfigFields) -> ResolvedConfig:
    """``config``, valid (:meth:`~scaffold_jax.experiments.RunConfig.validate` accepted
    it), resolved once.

    Raises:
      ConfigError: a private config whose noise cannot be fixed (see :func:`hparams`).
    """
    config = copy.deepcopy(config)
    options = {kind: MappingProxyType(entry_options(config, kind)) for kind, _, _ in chosen(config)}
    return ResolvedConfig(
        config=config,
        dataset=canonical_dataset(config),
        partition=partition_kind(config) if "partition" in options else None,
        options=MappingProxyType(options),
        plan=plan(config),
        clients_per_round=clients_per_round(config),
        partition_seed=partition_seed(config),
        hparams=hparams(config),
    )
