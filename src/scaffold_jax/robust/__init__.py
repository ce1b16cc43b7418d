"""Byzantine clients and robust aggregation: two wrappers any algorithm takes.

:func:`attacked` makes a fraction f of the clients malicious (``byzantine_fraction``, a
set fixed for the run: :mod:`~scaffold_jax.robust.malicious`) and changes what they SEND,
every uplink entry by the same rule (:mod:`~scaffold_jax.robust.attacks`), their local
work and their own state staying honest; or, label flipping, the labels they train on.
:func:`robustly_aggregated` replaces the server's mean of the reporting clients' messages
by a robust aggregate (:mod:`~scaffold_jax.robust.aggregators`), optionally over the
means of random buckets of clients; centered clipping keeps its centre in the server
state (:mod:`~scaffold_jax.robust.centred`). Both are message transforms
(:mod:`scaffold_jax.messages`): the attack runs first, then compression (an attacker's
message goes through the channel like any other), then the aggregator. A pre-round pass's
message (Mime's full-batch gradient) goes through both as well (its ``transform``).

The aggregator writes its aggregate into every reporting row, so the algorithm's own
server update, a weighted mean of the rows, moves x by η_g · agg(Δy) and SCAFFOLD's c by
(n/N) · agg(Δc) (uniform weights: a robust aggregator needs ``weighting = "uniform"``).
A config chooses each by one field (``attack = "alie"``, ``aggregator = "median"``) from
:data:`ATTACKS` and :data:`AGGREGATORS`, whose entries declare their options and
hyper-parameters like every other registry's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.local import takes
from scaffold_jax.messages import MessageContext, chain, stateless
from scaffold_jax.registry import Option, Registry, factory_kwargs
from scaffold_jax.robust import aggregators, attacks, malicious
from scaffold_jax.robust.centred import CentredServerState, with_centre
from scaffold_jax.types import Algorithm, ClientOutput, FullDataPass, HParam

_ATTACK_STREAM = 0x617474  # "att": the attack's randomness, from the server's round key
_BUCKET_STREAM = 0x627563  # "buc": the buckets' permutation
_PASS_STREAM = 0x707265  # "pre": a pre-round pass's attack and buckets

#: The malicious fraction every attack reads.
FRACTION = {
    "byzantine_fraction": HParam(
        0.1, "fraction f of the N clients that are malicious, in [0, 0.5) (a fixed set "
        "drawn from the seed)", allow_zero=True, maximum=0.4999999,
        tradeoff=True,  # a condition of the study, never "tuned": one row per value
    ),
}  # fmt: skip


class AttackSpec(NamedTuple):
    """A registered attack: ``attack(u, malicious, benign, key, **params)`` on one uplink
    entry flattened to ``[S, D]`` (None: no message attack), the hyper-parameters it reads
    (``params``: its keyword → the hyper-parameter's name), one line of help, its options,
    and ``poison(batches, malicious, num_classes) -> batches``, a data-poisoning attack on
    what a malicious client trains on (None: none)."""

    attack: Callable[..., jax.Array] | None
    hparams: Mapping[str, HParam]
    help: str = ""
    params: Mapping[str, str] = {}
    options: Mapping[str, Option] = {}
    poison: Callable[..., Mapping[str, Any]] | None = None


ATTACKS: Registry[AttackSpec] = Registry("attack")
ATTACKS.register("none", AttackSpec(None, {}, "no attack"))
ATTACKS.register(
    "signflip",
    AttackSpec(
        attacks.signflip,
        {
            **FRACTION,
            "attack_scale": HParam(
                1.0, "signflip: a malicious client sends −s·u (s)", allow_zero=True
            ),
        },
        "malicious clients send their honest message times −s",
        {"scale": "attack_scale"},
    ),
)
ATTACKS.register(
    "gaussian",
    AttackSpec(
        attacks.gaussian,
        {
            **FRACTION,
            "attack_sigma": HParam(
                1.0, "gaussian: a malicious client sends N(0, σ² I) (σ)", allow_zero=True
            ),
        },
        "malicious clients send Gaussian noise",
        {"sigma": "attack_sigma"},
    ),
)
ATTACKS.register(
    "alie",
    AttackSpec(
        attacks.alie,
        {**FRACTION},
        "A Little Is Enough: μ − z·σ of the benign messages (z from n and m)",
        options={
            "alie_z": Option(None, "alie: z instead of Φ⁻¹((n − s)/n)", "float", argument="z")
        },
    ),
)
ATTACKS.register("labelflip", AttackSpec(
    None, {**FRACTION}, "malicious clients train on labels y → C − 1 − y (classifiers)",
    poison=attacks.labelflip))  # fmt: skip
ATTACKS.register("ipm", AttackSpec(
    attacks.ipm, {**FRACTION, "attack_epsilon": HParam(
        0.1, "ipm: a malicious client sends −ε · the benign mean (ε)", allow_zero=True)},
    "inner-product manipulation: −ε times the benign clients' mean",
    {"epsilon": "attack_epsilon"}))  # fmt: skip


def _flat(tree, rows: int) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((rows, 0), jnp.float32)
    return jnp.concatenate([a.reshape(rows, -1).astype(jnp.float32) for a in leaves], axis=1)


def _unflat(flat: jax.Array, like) -> Any:
    leaves, tree = jax.tree.flatten(like)
    out, start = [], 0
    for a in leaves:
        size = a[0].size
        out.append(flat[:, start : start + size].reshape(a.shape).astype(a.dtype))
        start += size
    return jax.tree.unflatten(tree, out)


def _entries(outputs: ClientOutput) -> dict[str, Any]:
    return {"delta_params": outputs.delta_params, **dict(outputs.message or {})}


def _with_entries(outputs: ClientOutput, entries: Mapping[str, Any]) -> ClientOutput:
    message = outputs.message
    if message is not None:
        message = type(message)(**{k: entries[k] for k in message}) if isinstance(
            message, dict) else {k: entries[k] for k in message}  # fmt: skip
    return outputs._replace(delta_params=entries["delta_params"], message=message)


def malicious_rows(context: MessageContext) -> jax.Array:
    """Which of the round's rows belong to malicious clients (``[S]`` bool; empty slots
    never): 0 when the run declares no ``byzantine_fraction``."""
    if "byzantine_fraction" not in context.hparams or context.run_key is None:
        return jnp.zeros(context.ids.shape, bool)
    fraction = context.hparams["byzantine_fraction"]
    ids = jnp.maximum(context.ids, 0)
    mask = malicious.is_malicious(context.run_key, context.num_clients, fraction, ids)
    return mask & (context.ids >= 0)


def _refuse_warm_start(algorithm: Algorithm, what: str) -> None:
    """SCAFFOLD's warm controls are every client's full-batch gradient sent once before
    round 1, outside the rounds (no hyper-parameter, so no byzantine_fraction, reaches
    it): an attack or a defence of the rounds alone would be a silent half."""
    if algorithm.warm_start is not None:
        raise ValueError(
            f"{what} with {algorithm.name}'s warm controls is refused: every client sends its "
            "full-batch gradient once before round 1, outside the rounds the attacks and "
            "robust aggregators act on; turn them off (warm_controls=False)."
        )


def _on_pass(full_pass: FullDataPass | None, apply: Callable) -> FullDataPass | None:
    """``full_pass`` (Mime's pre-round gradient) whose clients' messages also go through
    ``apply(outputs, context) -> (outputs, released)`` as the ``delta_params`` of
    :class:`ClientOutput` rows, after its transform so far, with a key of its own."""
    if full_pass is None:
        return None
    inner = full_pass.transform

    def transform(messages, weights, context):
        released = {}
        if inner is not None:
            messages, released = inner(messages, weights, context)
        context = context._replace(key=jr.fold_in(context.key, _PASS_STREAM))
        outputs, out = apply(ClientOutput(messages, weights, {}), context)
        return outputs.delta_params, {**released, **out}

    return full_pass._replace(transform=transform)


def attacked(algorithm: Algorithm, attack: str, **options) -> Algorithm:
    """``algorithm`` whose malicious clients send the registered ``attack``'s messages
    (see the module docstring; ``options``: the attack's declared options by their
    argument, ALIE's ``z``); ``"none"`` returns it unchanged."""
    spec = ATTACKS[attack]
    if spec.attack is None and spec.poison is None:
        return algorithm
    if "attack" in algorithm.options:
        raise ValueError(f"{algorithm.name} is attacked already: wrap an algorithm once.")
    _refuse_warm_start(algorithm, f"attack = {attack!r}")
    if "privacy" in algorithm.options or "compression" in algorithm.options:
        raise ValueError(
            f"attacked({algorithm.name}) must wrap the plain algorithm: the attack comes "
            "first, then compression and privacy (the command line builds it so)."
        )

    def apply(outputs: ClientOutput, context: MessageContext):
        bad = malicious_rows(context)
        reporting = outputs.weight > 0
        sent, benign = bad & reporting, reporting & ~bad
        metrics = {
            "malicious_sampled": jnp.sum(bad.astype(jnp.float32)),
            "malicious_reported": jnp.sum(sent.astype(jnp.float32)),
        }
        if spec.attack is None:  # a data-poisoning attack: what is sent is left alone
            return outputs, {"metrics": metrics}
        params = {**options, **{k: context.hparams[name] for k, name in spec.params.items()}}
        key = jr.fold_in(context.key, _ATTACK_STREAM)
        rows = bad.shape[0]
        entries = {
            name: _unflat(
                spec.attack(_flat(tree, rows), sent, benign, jr.fold_in(key, i), **params), tree
            )  # fmt: skip
            for i, (name, tree) in enumerate(_entries(outputs).items())
        }
        return _with_entries(outputs, entries), {"metrics": metrics}

    update, pre_round = algorithm.client_update, _on_pass(algorithm.pre_round, apply)
    if spec.poison is not None:
        update = _poisoned(update, spec.poison)
        if pre_round is not None:
            pre_round = pre_round._replace(client=_poisoned(pre_round.client, spec.poison, True))
    return algorithm._replace(
        client_update=update,
        pre_round=pre_round,
        messages=chain(algorithm.messages, stateless(apply)),
        hparams={**algorithm.hparams, **spec.hparams},
        options={**algorithm.options, "attack": {"attack": attack, **options}},
    )


def _poisoned(fn: Callable, poison: Callable, full_pass: bool = False) -> Callable:
    """``fn``, a client update (or with ``full_pass`` a pre-round pass's client function),
    on the batches a malicious client is given by ``poison``. The engine passes the
    client's id and the run's constants (and a pass's client the config's ``hparams=``)
    where the function takes them."""
    data = 2 if full_pass else 3  # the batches' position: after the states (and hparams)

    def poisoned(*args, client_id, run, **extra):
        if run.get("num_classes") is None:
            raise ValueError(
                "attack = 'labelflip' flips a classifier's labels: this problem declares no "
                "num_classes (a regression, or a plugin's model without it); use a message "
                "attack (signflip, gaussian, alie, ipm)."
            )
        hparams = extra.pop("hparams") if full_pass else args[0]
        fraction = hparams["byzantine_fraction"]
        bad = malicious.is_malicious(run["run_key"], run["num_clients"], fraction, client_id)
        args = [*args[:data], poison(args[data], bad, run["num_classes"]), *args[data + 1 :]]
        return fn(*args, **extra)

    # The inner function's own keywords (draw=, model_state=, ...) stay visible to the engine.
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    tail = [p for p in params if p.kind is p.VAR_KEYWORD]
    names = ("hparams", "client_id", "run") if full_pass else ("client_id", "run")
    added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]
    head = [p for p in params if p.kind is not p.VAR_KEYWORD]
    poisoned.__signature__ = signature.replace(parameters=[*head, *added, *tail])
    return poisoned


class AggregatorSpec(NamedTuple):
    """A registered aggregator: ``aggregate(rows, mask, hparams, options, context, centre)
    -> (agg [D], selected [S] bool or None)`` over the reporting rows (None: the mean, no
    wrapper), the hyper-parameters and options it reads, one line of help."""

    aggregate: Callable[..., tuple[jax.Array, jax.Array | None]] | None
    hparams: Mapping[str, HParam]
    help: str = ""
    options: Mapping[str, Option] = {}
    centred: bool = False  # reads ``centre``, the previous round's aggregate (else None)


#: The hyper-parameter every robust aggregator takes: a sweep over it is one program.
BUCKETING = {
    "bucket_size": HParam(1.0, "bucketing before the aggregator: the mean of random buckets "
                          "of s reporting clients (1: none)", minimum=1, integer=True),
}  # fmt: skip


def _assumed_byzantine(hparams, options, cohort_size: int) -> jax.Array:
    """Krum's F: the option, or ⌊f·S⌋ of the attack's fraction (0 without one), S the
    round's rows."""
    if options.get("robust_f") is not None:
        return jnp.float32(options["robust_f"])
    if "byzantine_fraction" not in hparams:
        return jnp.float32(0)
    return malicious.count(hparams["byzantine_fraction"], cohort_size).astype(jnp.float32)


def _krum(rows, mask, hparams, options, context, centre):
    return aggregators.krum(rows, mask, _assumed_byzantine(hparams, options, context.ids.shape[0]))


def _multikrum(rows, mask, hparams, options, context, centre):
    f = _assumed_byzantine(hparams, options, context.ids.shape[0])
    n = jnp.sum(mask.astype(jnp.float32))
    m = n - f if options.get("krum_m") is None else jnp.float32(options["krum_m"])
    return aggregators.multikrum(rows, mask, f, m)


_KRUM_OPTIONS = {
    "robust_f": Option(None, "krum, multikrum: the assumed number F of Byzantine messages "
                       "(default ⌊f·S⌋ of byzantine_fraction)", "int", low=0, high=10**9),
}  # fmt: skip

AGGREGATORS: Registry[AggregatorSpec] = Registry("aggregator")
AGGREGATORS.register("mean", AggregatorSpec(None, {}, "the weighted mean (no wrapper)"))
AGGREGATORS.register(
    "median",
    AggregatorSpec(
        lambda rows, mask, hp, opt, ctx, centre: (aggregators.median(rows, mask), None),
        {**BUCKETING},
        "coordinate-wise median",
    ),
)
AGGREGATORS.register(
    "trimmed_mean",
    AggregatorSpec(
        lambda rows, mask, hp, opt, ctx, centre: (
            aggregators.trimmed_mean(rows, mask, hp.trim_fraction),
            None,
        ),
        {
            "trim_fraction": HParam(
                0.1,
                "trimmed_mean: fraction β of each end dropped per coordinate, in [0, 0.5)",
                allow_zero=True,
                maximum=0.4999999,
            ),
            **BUCKETING,
        },
        "coordinate-wise trimmed mean",
    ),
)
AGGREGATORS.register(
    "krum",
    AggregatorSpec(
        _krum,
        {**BUCKETING},
        "Krum: the message closest to its n − F − 2 nearest",
        {**_KRUM_OPTIONS},
    ),
)
AGGREGATORS.register(
    "multikrum",
    AggregatorSpec(
        _multikrum,
        {**BUCKETING},
        "Multi-Krum: the mean of the m best Krum scores",
        {
            **_KRUM_OPTIONS,
            "krum_m": Option(
                None,
                "multikrum: how many messages are averaged (default n − F)",
                "int",
                low=1,
                high=10**9,
            ),
        },
    ),
)
AGGREGATORS.register("geomed", AggregatorSpec(
    lambda rows, mask, hp, opt, ctx, centre: (aggregators.geomed(
        rows, mask, opt.get("geomed_iters", 8)), None), {**BUCKETING},
    "geometric median (RFA, smoothed Weiszfeld)", {"geomed_iters": Option(
        8, "geomed: Weiszfeld iterations T", "int", low=1, high=10_000)}))  # fmt: skip
AGGREGATORS.register("cclip", AggregatorSpec(
    lambda rows, mask, hp, opt, ctx, centre: (aggregators.cclip(
        rows, mask, centre, hp.clip_radius, opt.get("cclip_iters", 1)), None),
    {"clip_radius": HParam(1.0, "cclip: radius τ of the clipping around the previous "
                           "aggregate (inf: the mean)", allow_inf=True), **BUCKETING},
    "centered clipping around the previous round's aggregate", {"cclip_iters":
    Option(1, "cclip: iterations L", "int", low=1, high=10_000)}, centred=True))  # fmt: skip


def robustly_aggregated(algorithm: Algorithm, aggregator: str, **options) -> Algorithm:
    """``algorithm`` whose server aggregates the reporting messages with the registered
    ``aggregator`` (see the module docstring); ``"mean"`` returns it unchanged."""
    spec = AGGREGATORS[aggregator]
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        hparams = [n for n in unknown if any(n in o.hparams for _, o in AGGREGATORS.items())]
        hint = "."
        if hparams:
            hint = (f"; {', '.join(hparams)} is a hyper-parameter of the robust aggregators: "
                    "give it with the others (sj.hparams(...)).")  # fmt: skip
        raise ValueError(
            f"aggregator = {aggregator!r} takes no option {', '.join(map(repr, unknown))} "
            f"(its options: {', '.join(spec.options) or 'none'}){hint}"
        )
    if spec.aggregate is None:
        return algorithm
    if "privacy" in algorithm.options:
        raise ValueError(
            f"aggregator = {aggregator!r} with differential privacy is refused: the noise is "
            "calibrated to the clipped SUM of the messages, which a robust aggregator does "
            "not release; use aggregator = 'mean' with privacy."
        )
    if not algorithm.linear_aggregate:
        raise ValueError(
            f"{algorithm.name} reads each client's output on its own (not only their mean), "
            f"so aggregator = {aggregator!r} cannot stand in for its mean: use fedavg, "
            "fedprox, scaffold or feddyn."
        )
    _refuse_warm_start(algorithm, f"aggregator = {aggregator!r}")

    def apply(outputs: ClientOutput, context: MessageContext, centre=None):
        reporting = outputs.weight > 0
        entries = _entries(outputs)
        n = reporting.shape[0]
        messages = _flat(entries, n)
        key = jr.fold_in(context.key, _BUCKET_STREAM)
        size = context.hparams["bucket_size"]
        # s = 1 runs the aggregator on the rows themselves (no permutation: bitwise the
        # aggregator alone); a sweep over s runs both branches, one program.
        alone = jnp.where(reporting, jnp.arange(n, dtype=jnp.int32), -1)  # each row its own
        rows, mask, of = jax.lax.cond(
            size > 1,
            lambda rows: aggregators.bucket(rows, reporting, key, size),
            lambda rows: (rows, reporting, alone),
            messages,
        )
        agg, selected = spec.aggregate(rows, mask, context.hparams, options, context, centre)
        flat = jnp.where(reporting[:, None], jnp.broadcast_to(agg, (n, agg.shape[0])), messages)
        metrics = {}
        if selected is not None:  # the malicious clients inside the selected rows (buckets)
            bad = selected[jnp.maximum(of, 0)] & (of >= 0) & malicious_rows(context)
            metrics["aggregator_selected_malicious"] = jnp.sum(bad.astype(jnp.float32))
        # (cclip returns its centre when nobody reported: the centre then stays.)
        released = {"metrics": metrics, **({"robust_centre": agg} if spec.centred else {})}
        return _with_entries(outputs, _unflat(flat, entries)), released

    def check(num_clients, clients_per_round, weighting, participation=None):
        inner = algorithm.check
        if inner is not None:
            extra = {"participation": participation} if takes(inner, "participation") else {}
            inner(num_clients, clients_per_round, weighting, **extra)
        if weighting != "uniform":
            raise ValueError(
                f"aggregator = {aggregator!r} weighs every reporting client the same: use "
                f"weighting = 'uniform', not {weighting!r}."
            )

    def on_pass(outputs, context):  # a pre-round pass's centre is its own
        return apply(outputs, context, context.server.pass_centre if spec.centred else None)

    changes = {
        "pre_round": _on_pass(algorithm.pre_round, on_pass),
        "hparams": {**algorithm.hparams, **spec.hparams},
        "check": check,
        "options": {**algorithm.options, "aggregator": {"aggregator": aggregator, **options}},
    }
    if spec.centred:  # the centre is server state, checkpointed with it
        return with_centre(algorithm, apply, **changes)
    return algorithm._replace(messages=chain(algorithm.messages, stateless(apply)), **changes)


def wrap_attack(algorithm: Algorithm, attack: str, options: Mapping[str, Any]) -> Algorithm:
    """:func:`attacked` for the wrappers' table (:data:`scaffold_jax.wrappers.WRAPPERS`)."""
    return attacked(algorithm, attack, **factory_kwargs(ATTACKS[attack].options, options))


def wrap_aggregator(algorithm: Algorithm, aggregator: str, options: Mapping[str, Any]) -> Algorithm:
    """:func:`robustly_aggregated` with a config's options by their keys."""
    declared = AGGREGATORS[aggregator].options
    return robustly_aggregated(algorithm, aggregator, **factory_kwargs(declared, options))


__all__ = [
    "AGGREGATORS",
    "ATTACKS",
    "AggregatorSpec",
    "AttackSpec",
    "CentredServerState",
    "attacked",
    "malicious_rows",
    "robustly_aggregated",
    "wrap_aggregator",
    "wrap_attack",
]
