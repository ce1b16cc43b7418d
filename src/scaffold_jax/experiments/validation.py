"""The checks that refuse a bad config: :func:`validate` names every invalid setting of a
:class:`~scaffold_jax.experiments.RunConfig` in one
:class:`~scaffold_jax.registry.ConfigError`, each as ``field = value is invalid: it must be
...`` (:class:`Checker` words them), before anything is built."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from scaffold_jax import compatibility, participation, sampling
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.compression import COMPRESSORS
from scaffold_jax.data import assembly, natural
from scaffold_jax.data.batching import PLANS
from scaffold_jax.data.partition import PARTITIONERS
from scaffold_jax.engine import MAX_ROUNDS, MAX_SEED, ROUNDS_WHY, SEED_WHY
from scaffold_jax.engine.buffered import EXECUTIONS, asynchronous_algorithms, make_execution
from scaffold_jax.experiments import resolve, schema
from scaffold_jax.experiments.schema import ConfigFields
from scaffold_jax.models import MODELS
from scaffold_jax.privacy import MECHANISMS
from scaffold_jax.registry import ConfigError, Registry, did_you_mean, in_one_line
from scaffold_jax.robust import AGGREGATORS, ATTACKS
from scaffold_jax.types import FLOAT32_TINY, STATE_POLICIES, STEP_SIZES, allowed_range
from scaffold_jax.weighting import WEIGHTINGS
from scaffold_jax.wrappers import WRAPPERS, chosen_hparams

MAX_CLIENTS = 2**31 - 1  # client ids are int32
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def validate(config: ConfigFields) -> Any:
    """Checks every field; returns ``config`` so calls chain.

    Raises:
      ConfigError: listing every invalid field as ``field = value is invalid: it
        must be ...``.
    """
    errors: list[str] = []
    check = Checker(errors)
    if check.type("plugins", config.plugins, (list, tuple), "a list of modules or .py files"):
        try:
            schema.import_plugins(config.plugins)
        except ConfigError as err:
            errors.append(str(err))
    if check.registered("algorithm", config.algorithm, ALGORITHMS):
        _check_hparams(config, check, errors)
    _check_options(config, errors)
    for name, value in (("client_lr", config.client_lr), ("server_lr", config.server_lr)):
        check.number(name, value, low=0.0, strict=True, what="finite and > 0", float32=True)
    check.registered("weighting", config.weighting, WEIGHTINGS)
    data_kind = assembly.kind_of(config.dataset)
    if check.type("dataset", config.dataset, str, "a dataset name"):
        if data_kind == "natural":
            _check_natural(config, errors)
        elif data_kind == "synthetic":
            _check_synthetic(config, errors)
        elif data_kind is None:
            check.registered("dataset", config.dataset, schema.DATASETS)
    check.number(
        "local_test_fraction", config.local_test_fraction, low=0.0, high=1.0, strict=True,
        optional=True, what="a fraction in (0, 1)",
    )  # fmt: skip
    if config.local_test_fraction is not None and data_kind == "natural":
        errors.append(
            f"local_test_fraction = {config.local_test_fraction!r} cannot be set with dataset = "
            f"{config.dataset!r}: its clients have their own test splits."
        )
    policy = config.options.get("state_policy") if isinstance(config.options, Mapping) else None
    if policy in STATE_POLICIES and policy != "average" and not _keeps_statistics(config):
        errors.append(
            f"state_policy = {policy!r} applies to a model with running statistics "
            "(resnet18 with resnet_norm = 'batch', or a plugin model that takes "
            f"state_policy); model = {config.model!r} keeps none."
        )
    check.type("data_dir", config.data_dir, str, "a folder path", optional=True)
    check.type("download", config.download, bool, "true or false")
    check.integer("max_train_examples", config.max_train_examples, low=1, optional=True)
    check.integer("max_test_examples", config.max_test_examples, low=1, optional=True)
    _check_partition(config, check, errors)
    check.registered("model", config.model, MODELS)
    check.registered("sampler", config.sampler, sampling.SAMPLERS)
    how = None
    kinds = participation.KINDS.items()
    if all([check.registered(k, getattr(config, k), r) for k, r in kinds]):
        how = _check_participation(config, errors)
    if check.registered("execution", config.execution, EXECUTIONS):
        _check_execution(config, errors)
    said = len(errors)
    if check.integer(
        "num_clients", config.num_clients, low=1, high=MAX_CLIENTS,
        what=f"an integer in [1, {MAX_CLIENTS}] (client ids are int32)",
    ):  # fmt: skip
        check.integer(
            "clients_per_round", config.clients_per_round, low=1, high=config.num_clients,
            optional=True, what=f"an integer in [1, num_clients = {config.num_clients}]",
        )  # fmt: skip
    check.number(
        "client_fraction", config.client_fraction, low=0.0, high=1.0, strict=True,
        optional=True, what="in (0, 1]",
    )  # fmt: skip
    if config.clients_per_round is not None and config.client_fraction is not None:
        errors.append(
            f"clients_per_round = {config.clients_per_round} and client_fraction = "
            f"{config.client_fraction} are both set: give one of them."
        )
    counts_ok = len(errors) == said
    # The private algorithm's own checks need the cohort S: valid client counts first.
    privacy = config.privacy is not None
    if privacy and check.registered("privacy", config.privacy, MECHANISMS) and counts_ok:
        _check_privacy(config, errors, how)
    if check.registered("compression", config.compression, COMPRESSORS):
        if _check_compression_options(config, errors):
            _check_compression(config, errors)
    attack_ok = check.registered("attack", config.attack, ATTACKS)
    if check.registered("aggregator", config.aggregator, AGGREGATORS) and attack_ok:
        _check_robustness(config, errors)
    _check_plan(config, check, errors)
    check.integer(
        "rounds", config.rounds, low=1, high=MAX_ROUNDS,
        what=f"an integer >= 1 and <= {MAX_ROUNDS}{ROUNDS_WHY}",
    )  # fmt: skip
    check.integer("eval_every", config.eval_every, low=1)
    _check_personal_evaluation(config, check, errors, data_kind)
    check.integer("keep_checkpoints", config.keep_checkpoints, low=1)
    check.integer("train_eval_examples", config.train_eval_examples, low=0)
    if check.type("targets", config.targets, (list, tuple), "a list of accuracies"):
        if not all(is_number(t) and 0.0 < t <= 1.0 for t in config.targets):
            errors.append(
                f"targets = {list(config.targets)!r} is invalid: every target must be an "
                "accuracy in (0, 1]."
            )
    for name in ("seed", "partition_seed"):
        check.integer(
            name, getattr(config, name), low=0, high=MAX_SEED,
            optional=name == "partition_seed",
            what=f"an integer >= 0 and <= {MAX_SEED}{SEED_WHY}",
        )  # fmt: skip
    out_given = check.type("out", config.out, str, "a folder path", optional=True)
    if out_given and not config.out.strip():
        errors.append(
            f"out = {config.out!r} is invalid: it must be a folder path (an empty one would "
            "write into the working folder); give a folder, or leave out unset for "
            "results/<algorithm>-<dataset>-<digest>."
        )
    if errors:
        raise ConfigError(in_one_line("invalid config", errors))
    return config


def _check_synthetic(config: ConfigFields, errors: list[str]) -> None:
    """A synthetic family is generated for N clients: nothing to read, split or subset."""
    given = _given(config, "partition", "data_dir", "max_train_examples", "max_test_examples",
                   "local_test_fraction", *schema.partition_fields())  # fmt: skip
    if given:
        errors.append(
            f"{', '.join(given)} cannot be set with dataset = {config.dataset!r}: it is "
            "generated for num_clients clients from the data seed (its own options set "
            "it); remove them."
        )
    default_model = ConfigFields.__dataclass_fields__["model"].default
    if resolve.brings_problem(config) and config.model != default_model:
        errors.append(
            f"model = {config.model!r} cannot be set with dataset = {config.dataset!r}: it "
            "brings its own loss (no model); remove it."
        )


def _check_personal_evaluation(config, check, errors, data_kind) -> None:
    """The personalized evaluation's options; a personalized algorithm or fine-tuning
    needs every client's own test data (a natural dataset's, or local_test_fraction)."""
    check.integer("finetune_steps", config.finetune_steps, low=0)
    check.number("finetune_lr", config.finetune_lr, low=0.0, strict=True, optional=True,
                 what="a step size > 0", float32=True)  # fmt: skip
    check.integer("personal_eval_clients", config.personal_eval_clients, low=1, optional=True)
    wants = [
        f"{name} = {getattr(config, name)!r}"
        for name in ("finetune_steps", "finetune_lr", "personal_eval_clients")
        if getattr(config, name) not in (None, 0)
    ]
    known = isinstance(config.algorithm, str) and config.algorithm in ALGORITHMS
    if known and ALGORITHMS[config.algorithm].personalized:
        wants.append(f"algorithm = {config.algorithm!r} (a model per client)")
    if wants and data_kind != "natural" and config.local_test_fraction is None:
        errors.append(
            f"{', '.join(wants)} evaluates every client's own model on its own test data, "
            f"which dataset = {config.dataset!r} has none of: set local_test_fraction (e.g. 0.2, "
            "each client's held-out fraction)."
        )


def _check_natural(config: ConfigFields, errors: list[str]) -> None:
    """A natural dataset brings its clients: no partition, no example subset."""
    spec = natural.NATURAL_DATASETS[config.dataset]
    if spec.needs_data_dir and config.data_dir is None:
        errors.append(
            f"dataset = {config.dataset!r} needs data_dir (--data-dir): {spec.description}."
        )
    given = _given(config, "partition", *schema.partition_fields())
    if given:
        errors.append(
            f"{', '.join(given)} cannot be set with dataset = {config.dataset!r}: its clients "
            "come with the data; remove them (num_clients picks how many of its clients)."
        )
    if config.max_train_examples is not None:
        errors.append(
            f"max_train_examples = {config.max_train_examples} cannot be set with dataset = "
            f"{config.dataset!r} (a random subset of examples would break its clients); use "
            "num_clients or min_client_examples instead."
        )


def _given(config: ConfigFields, *names: str) -> list[str]:
    """Which of the fields and options ``names`` the config sets, each once."""
    return list(dict.fromkeys(n for n in names if getattr(config, n) is not None))


def _check_hparams(config: ConfigFields, check: Checker, errors: list[str]) -> None:
    """The ``hparams`` table against what the algorithm declares."""
    spec = ALGORITHMS[config.algorithm]
    try:  # as the chosen options declare them (Ditto's base adds FedProx's prox_mu)
        declared_here = dict(spec.hparams_for(resolve.entry_options(config, "algorithm")))
    except (ValueError, TypeError):  # a bad option, which the options' checks name
        declared_here = dict(spec.hparams)
    everywhere = schema.declared_hparams()
    declared_here.update(chosen_hparams(config, strict=False))
    if not check.type("hparams", config.hparams, Mapping, "a table of names and values"):
        return
    for name, value in config.hparams.items():
        if name in STEP_SIZES:
            errors.append(f"hparams.{name} is invalid: set the step size {name} as its own field.")
        elif name in declared_here:
            _check_declared(check, name, value, declared_here[name])
        elif name not in everywhere:
            errors.append(
                f"hparams.{name} is unknown: no registered algorithm declares it "
                f"({config.algorithm} takes {', '.join(declared_here) or 'none'})."
            )
        elif _check_declared(check, name, value, everywhere[name]) and (
            value != everywhere[name].default
        ):
            takes = ", ".join(k for k in declared_here if k not in STEP_SIZES) or "none"
            for _, wrapper in WRAPPERS.items():  # a wrapper kind's (qsgd's bits, cclip's τ)
                owners = [n for n, spec in wrapper.kinds.items() if name in spec.hparams]
                if owners:
                    chosen = getattr(config, wrapper.field)
                    whose, which = " and ".join(owners), f"that {wrapper.field}"
                    if len(owners) > 2:
                        whose, which = ", ".join(owners), "one of those"
                    errors.append(
                        f"{name} = {value!r} does not apply to {wrapper.field} = {chosen!r}: "
                        f"it is {whose}'s; remove it or choose {which}."
                    )
                    break
            else:
                errors.append(
                    f"{name} = {value!r} does not apply to algorithm = {config.algorithm!r}, "
                    f"which takes {takes}; remove it or choose an algorithm that declares it."
                )
            continue


def _check_declared(check: Checker, name: str, value: Any, declared: Any) -> bool:
    """Checks a hyper-parameter's ``value`` against its declared range; False (with a
    message) when bad."""
    what = allowed_range(declared, declared.allow_zero)
    low = 0.0 if declared.minimum is None else declared.minimum
    strict = not declared.allow_zero and declared.minimum is None
    if not check.number(
        name, value, low=low, high=declared.maximum, strict=strict, what=what, float32=True
    ):
        return False
    values = value if isinstance(value, list) else [value]
    if declared.integer and any(float(v) != round(float(v)) for v in values):
        check.errors.append(f"{name} = {value!r} is invalid: it must be {what}.")
        return False
    return True


def _check_options(config: ConfigFields, errors: list[str]) -> None:
    """The ``options`` table against what the chosen entries declare: a chosen entry's
    option is checked against its declaration; another entry's must hold its default
    (an earlier ``config.json`` holds them all); a name nobody declares is unknown."""
    if not isinstance(config.options, Mapping):
        errors.append(
            f"options = {config.options!r} is invalid: it must be a table of names and values."
        )
        return
    entries = resolve.chosen(config)
    chosen = {name: opt for _, _, table in entries for name, opt in table.items()}
    everywhere, hparams = schema.declared_options(), schema.declared_hparams()  # once
    dataset = resolve.canonical_dataset(config)
    # A natural or synthetic dataset's checks say that it takes no partition option.
    unsplit = dataset is not None and assembly.kind_of(dataset) != "pooled"
    for name, value in config.options.items():
        if name in STEP_SIZES or name in hparams:
            errors.append(
                f"options.{name} is invalid: {name} is a hyper-parameter; set it as "
                f"{name} = ... or in the hparams table."
            )
        elif name in chosen:
            _option_error(errors, name, value, chosen[name])
        elif name not in everywhere:
            errors.append(
                f"options.{name} is unknown{did_you_mean(name, everywhere)}: no registered "
                "algorithm, model, partitioner or dataset declares it."
            )
        elif unsplit and name in schema.partition_fields():
            continue
        elif _option_error(errors, name, value, everywhere[name]) and resolve.parsed(
            everywhere[name], value
        ) != resolve.parsed(everywhere[name], everywhere[name].default):
            owner_kind = schema.option_owners(name)[0][0]
            owners = [repr(e) for k, e in schema.option_owners(name) if k == owner_kind]
            refuses = ALGORITHMS[config.algorithm].refuses if config.algorithm in ALGORITHMS else {}
            why = refuses.get(name)
            mine = [f"{k} = {e!r}" for k, e, _ in entries if k == owner_kind]
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


def _option_error(errors: list[str], name: str, value: Any, declared: Any) -> bool:
    """Appends why ``value`` is invalid for ``declared``; True when it is valid."""
    error = declared.error(name, value)
    if error is not None:
        errors.append(error)
    return error is None


def _options_refused(config: ConfigFields, kind: str, name: str) -> bool:
    """Whether an option of the entry ``name`` of ``kind`` holds an invalid value (which
    the options' checks say)."""
    declared = schema.OPTION_OWNERS[kind][name].options
    return any(declared[n].error(n, v) for n, v in config.options.items() if n in declared)


def _check_participation(
    config: ConfigFields, errors: list[str]
) -> participation.Participation | None:
    """What the participation models refuse for the config (their options together, a
    trace file that is missing or malformed); the models built, None when refused."""
    if any(_options_refused(config, kind, getattr(config, kind)) for kind in participation.KINDS):
        return None
    try:
        built = participation.make(
            config.availability,
            config.stragglers,
            config.dropouts,
            config.options,
            profiles=config.profiles,
        )
    except (ValueError, OSError) as err:  # OSError: a trace that is no file
        errors.append(str(err))
        return None
    if built.availability is not None and isinstance(config.num_clients, int):
        try:
            built.availability.check(config.num_clients)
        except ValueError as err:
            errors.append(str(err))
    most_steps = _most_local_steps(config)
    if hasattr(built.stragglers, "check") and most_steps is not None:
        try:
            built.stragglers.check(most_steps)
        except ValueError as err:
            errors.append(str(err))
    if built.profiles is not None:
        _check_clock(config, built.profiles, errors)
    return built


def _check_clock(config: ConfigFields, clock, errors: list[str]) -> None:
    """What the virtual clock refuses of the config: over-selecting more clients than
    there are, and compressed uplinks (their size is a hyper-parameter)."""
    try:
        S = config.resolved_clients_per_round()
    except (ValueError, TypeError, AttributeError):
        S = None  # said by the sampling checks
    if isinstance(S, int) and isinstance(config.num_clients, int):
        sampled = clock.sampled(S)
        if sampled > config.num_clients:
            # An over_selection of 1e300 would print a 301-digit integer.
            shown = f"{sampled}" if sampled < 10**12 else f"{clock.over_selection * S:.3g}"
            errors.append(
                f"over_selection = {clock.over_selection} samples ceil(f * S) = {shown} "
                f"clients a round, more than num_clients N = {config.num_clients}: use a "
                "smaller over_selection or clients_per_round."
            )
    least = _least_examples(config)
    counts_ok = isinstance(config.num_clients, int) and 1 <= config.num_clients <= MAX_CLIENTS
    seed_ok = isinstance(config.seed, int) and 0 <= config.seed <= MAX_SEED
    rounds_ok = isinstance(config.rounds, int) and 1 <= config.rounds <= MAX_ROUNDS
    if least is not None and counts_ok and seed_ok and rounds_ok:
        try:
            clock.check(config.seed, config.num_clients, least, config.rounds)
        except ValueError as err:
            errors.append(str(err))


def _check_execution(config: ConfigFields, errors: list[str]) -> None:
    """What FedBuff refuses of the config's own values (B > M, M > N, no profiles); what
    the simulation cannot run it with is said when it is built (engine checks)."""
    if config.execution == "sync" or _options_refused(config, "execution", config.execution):
        return
    try:
        buff = make_execution(config.execution, config.options)
    except ValueError as err:
        errors.append(str(err))
        return
    if isinstance(config.num_clients, int) and buff.concurrency > config.num_clients:
        errors.append(
            f"concurrency M = {buff.concurrency} exceeds num_clients N = {config.num_clients}: "
            "at most N clients can be in flight; use M <= N."
        )
    if config.profiles == "none":
        errors.append(
            "execution = 'fedbuff' needs device profiles to time its clients: set profiles "
            "= 'lognormal' or 'file' (--profiles)."
        )
    if config.algorithm in ALGORITHMS and not ALGORITHMS[config.algorithm].asynchronous:
        errors.append(
            f"execution = 'fedbuff' has no asynchronous contract for {config.algorithm!r} yet "
            "(what a stale update does to its server state is not written): use algorithm = "
            f"{' | '.join(asynchronous_algorithms())}, or execution = 'sync'."
        )
    # FedBuff draws a new client each time one arrives, M in flight (concurrency) and a
    # step every buffer_size arrivals: a cohort's size S and its sampler mean nothing there.
    cohort = {k: getattr(config, k) for k in ("clients_per_round", "client_fraction")}
    cohort = {k: v for k, v in cohort.items() if v is not None}
    if config.sampler != sampling.DEFAULT_SAMPLER:
        cohort["sampler"] = config.sampler
    if cohort:
        said = ", ".join(f"{k} = {v!r}" for k, v in cohort.items())
        errors.append(
            f"execution = 'fedbuff' does not use {said}: it keeps concurrency M = "
            f"{buff.concurrency} clients in flight (an arrival's replacement drawn uniformly "
            f"among those not in flight) and steps every buffer_size B = {buff.buffer_size} "
            "arrivals; remove "
            f"{'it' if len(cohort) == 1 else 'them'} and set concurrency or buffer_size "
            "(--concurrency, --buffer-size)."
        )
    # What FedBuff composes with: the one compatibility matrix (the engine's checks read it).
    on = [k for k in participation.KINDS if getattr(config, k) != participation.DEFAULTS[k]]
    on += ["over_selection"] if float(config.options.get("over_selection", 1.0)) > 1.0 else []
    on += ["privacy"] if config.privacy is not None else []
    why = compatibility.refusal(config.execution, on)
    if why is not None:
        errors.append(why)


def _least_examples(config: ConfigFields) -> int | None:
    """The fewest examples a client processes in a round (a client of one example; one
    local step where stragglers may cut its steps): a lower bound of its local work for the
    clock's checks. None when the plan is invalid (said by its own checks)."""
    try:
        plan = resolve.plan(config)
    except (ValueError, TypeError, KeyError, OverflowError):
        return None
    one = np.int32(1)
    steps = plan.local_steps(one) if config.stragglers == "none" else one
    return int(plan.examples(one, steps))


def _most_local_steps(config: ConfigFields) -> int | None:
    """The most local steps the plan gives a client; None when that depends on the data
    (an epochs plan: checked once it is loaded) or the plan is invalid (said by its own
    checks)."""
    try:
        plan = resolve.plan(config)
    except (ValueError, TypeError, KeyError, OverflowError):
        return None
    return None if plan.steps_vary else int(plan.shape(1)[0])


def _check_robustness(config: ConfigFields, errors: list[str]) -> None:
    """What an attack or a robust aggregator cannot compose with, said before anything is
    built."""
    # A data-poisoning attack needs classes; a dataset that brings its own problem is a
    # regression (the quadratics).
    if ATTACKS[config.attack].poison is not None and resolve.brings_problem(config):
        errors.append(
            f"attack = {config.attack!r} flips a classifier's labels, and the {config.dataset} "
            "dataset is a regression: use a message attack (signflip, gaussian, alie, ipm)."
        )
    if AGGREGATORS[config.aggregator].aggregate is None:  # the mean: no wrapper
        return
    # (With privacy, building the private algorithm says why: private() refuses it.)
    if config.weighting != "uniform":
        errors.append(
            f"aggregator = {config.aggregator!r} weighs every reporting client the same: use "
            f"weighting = 'uniform', not {config.weighting!r}."
        )


def _check_compression_options(config: ConfigFields, errors: list[str]) -> bool:
    """The compression options that cannot apply, refused as a compressor's
    hyper-parameter given to another is (``compress_bits`` without qsgd): which entries to
    compress or how to store a residual without a compressor, a residual's storage with a
    compressor that keeps none; an empty name in ``compress_entries``. True when none."""
    if not isinstance(config.options, Mapping):
        return False  # said by the options' checks
    spec = COMPRESSORS[config.compression]
    given = {
        k: config.options[k]
        for k in ("compress_entries", "compress_residual_dtype")
        if config.options.get(k) is not None
    }
    said = len(errors)
    residual = [n for n, c in COMPRESSORS.items() if c.compressor and c.compressor.error_feedback]
    for name, value in given.items():
        if name not in spec.options or spec.options[name].error(name, value) is not None:
            continue  # said by the options' checks
        if value == spec.options[name].default:
            continue  # a default means nothing either way (an earlier config.json's)
        if spec.compressor is None:
            errors.append(
                f"{name} = {value!r} does not apply to compression = {config.compression!r}: "
                "it is an option of a compressor; remove it or choose a compression "
                f"({', '.join(n for n, c in COMPRESSORS.items() if c.compressor)})."
            )
        elif name == "compress_residual_dtype" and not spec.compressor.error_feedback:
            errors.append(
                f"compress_residual_dtype = {value!r} does not apply to compression = "
                f"{config.compression!r}, which keeps no error-feedback residual; remove it "
                f"or choose a compression with one ({' or '.join(residual)})."
            )
        elif name == "compress_entries" and isinstance(value, str):
            names = [n.strip() for n in value.split(",")]
            if value.strip() and "" in names:
                errors.append(
                    f"compress_entries = {value!r} holds an empty name (a stray comma): give "
                    "names separated by single commas (e.g. delta_params,delta_control), or "
                    "all."
                )
    return len(errors) == said


def _check_compression(config: ConfigFields, errors: list[str]) -> None:
    """What compression refuses for the config: an entry its algorithm's clients do not
    send, a residual storage it does not know."""
    if config.algorithm not in ALGORITHMS or COMPRESSORS[config.compression].compressor is None:
        return
    if _options_refused(config, "compression", config.compression):
        return
    try:
        # Compression wraps the algorithm before privacy does: checked alone here, the
        # private algorithm (with it) by the privacy checks.
        resolve.make_algorithm(dataclasses.replace(config, privacy=None))
    except (ValueError, TypeError) as err:
        errors.append(f"compression = {config.compression!r}: {err}")


def _check_privacy(
    config: ConfigFields, errors: list[str], how: participation.Participation | None
) -> None:
    """What the private algorithm refuses for the config (an algorithm that does not
    aggregate by sums, weights, warm starts, an uncovered sampler or accountant)."""
    if config.algorithm not in ALGORITHMS or config.sampler not in sampling.SAMPLERS:
        return  # said by the checks of those fields
    if _options_refused(config, "privacy", config.privacy) or how is None:
        return  # said by the options' checks, or the participation checks
    try:
        algorithm = resolve.make_algorithm(config)
        algorithm.check(
            config.num_clients,
            resolve.clients_per_round(config),
            config.weighting,
            sampling=sampling.SAMPLERS[config.sampler].privacy,
            participation=how,
        )
    except (ValueError, TypeError) as err:
        errors.append(f"privacy = {config.privacy!r}: {err}")


def _keeps_statistics(config: ConfigFields) -> bool:
    """Whether the model, with the config's options, keeps running statistics (its
    registry entry says: resnet18 with BatchNorm, a plugin model that takes
    ``state_policy``)."""
    return config.model in MODELS and MODELS[config.model].statistics_with(config.options)


def _check_partition(config: ConfigFields, check: Checker, errors: list[str]) -> None:
    # The options' own ranges are their declarations'; here: which partitioner.
    owner = schema.partition_fields()
    given = {f: v for f, v in config.options.items() if f in owner and v is not None} if (
        isinstance(config.options, Mapping)
    ) else {}  # fmt: skip
    if config.partition is not None:
        check.registered("partition", config.partition, PARTITIONERS)
    elif len({owner[f] for f in given}) > 1:
        fields = ", ".join(f"{f} = {v!r}" for f, v in given.items())
        errors.append(f"{fields} are conflicting partition settings: give one of them.")


def _check_plan(config: ConfigFields, check: Checker, errors: list[str]) -> None:
    """The plan's own options are checked with every chosen entry's; here: the plan is
    registered and the options it cannot do without are given."""
    if config.batch_plan is not None and not check.registered(
        "batch_plan", config.batch_plan, PLANS
    ):
        return
    kind = resolve.plan_kind(config)
    options = config.options if isinstance(config.options, Mapping) else {}  # else: said
    declared = {n for _, spec in PLANS.items() for n in spec.options}
    given = {k: v for k, v in options.items() if k in declared and v is not None}
    if config.batch_plan is None and not any(
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
    values = resolve.entry_options(config, "batch_plan")
    if complete and all(PLANS[kind].options[n].error(n, v) is None for n, v in values.items()):
        # Each option in its range can still make a plan of too many local steps K
        # (batch_fraction = 1e-9: K = 10**9); the plan says so, here rather than in XLA.
        try:
            resolve.plan(config)
        except ValueError as err:
            given = ", ".join(f"{n} = {v!r}" for n, v in values.items())
            errors.append(f"{given} (batch_plan = {kind!r}): {err}")


def _kind_note(kind: str) -> str:
    """What goes with an entry of ``kind`` when a name of it was given for another key."""
    if kind == "execution":
        return f", with algorithm = {' | '.join(asynchronous_algorithms())}"
    return ""


def is_number(value: Any) -> bool:
    """Whether ``value`` is an int or a float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Checker:
    """Collects ``field = value is invalid: it must be ...`` messages."""

    def __init__(self, errors: list[str]):
        self.errors = errors

    def _bad(self, name: str, value: Any, what: str) -> bool:
        self.errors.append(f"{name} = {value!r} is invalid: it must be {what}.")
        return False

    def type(self, name, value, types, what, optional=False) -> bool:
        """``types``: not a number's (a bool is an int): :meth:`integer` and :meth:`number`
        check those."""
        if value is None and optional:
            return False
        return isinstance(value, types) or self._bad(name, value, what)

    def choice(self, name, value, choices) -> bool:
        what = "one of " + ", ".join(repr(c) for c in choices)
        return value in choices or self._bad(name, value, what)

    def registered(self, name: str, value: Any, registry: Registry) -> bool:
        """``value`` must name an entry of ``registry``, as registered when this runs."""
        if value in registry:
            return True
        names = ", ".join(repr(n) for n in registry)
        elsewhere = [k for k, r in schema.OPTION_OWNERS.items() if k != name and value in r]
        if elsewhere:  # the name of another key's entry (--algorithm fedbuff)
            kind = elsewhere[0]
            return self._bad(
                name, value,
                f"one of {names}; {value!r} is a{'n' if kind[0] in 'aeiou' else ''} {kind}, "
                f"not a{'n' if name[0] in 'aeiou' else ''} {name}: set {kind} = {value!r} "
                f"(--{kind.replace('_', '-')} {value}){_kind_note(kind)}",
            )  # fmt: skip
        return self._bad(name, value, f"one of {names}{did_you_mean(value, registry.names())}")

    def integer(self, name, value, low=None, high=None, optional=False, what=None) -> bool:
        if value is None and optional:
            return False
        if what is None:
            what = "an integer" + (f" >= {low}" if low is not None else "")
            what += f" and <= {high}" if high is not None else ""
        wrong = isinstance(value, bool) or not isinstance(value, (int, np.integer))
        if wrong or (low is not None and value < low) or (high is not None and value > high):
            return self._bad(name, value, what)
        return True

    def number(
        self, name, value, low=None, high=None, strict=False, optional=False, what=None,
        float32=False,
    ) -> bool:  # fmt: skip
        """``float32``: the value becomes a float32 array (a hyper-parameter), so it must
        also be finite THERE (1e39 is finite in Python but inf in float32)."""
        if value is None and optional:
            return False
        what = what or "a finite number"
        try:
            v = float(value) if is_number(value) else math.nan
        except OverflowError:  # an int beyond float64
            v = math.nan
        below = low is not None and (v < low or (strict and v == low))
        if not math.isfinite(v) or below or (high is not None and v > high):
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
