"""Ditto: a personal model per client, beside a base algorithm's global one.

Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021. https://arxiv.org/abs/2012.04221 (Algorithm 1).

A wrapper around a base algorithm (FedAvg, FedProx or SCAFFOLD; option ``ditto_base``).
A sampled client does the base's local work unchanged and then, from its personal model
v_i (v_i⁰ = x⁰), K_p steps on ``f_i(v) + (λ/2)‖v − x‖²``, x the model it received:
``v ← v − η_p (∇f_i(v; b) + λ (v − x))``, with batches b of its data drawn from a key of
their own (``client_update``'s ``draw(0)``); step k runs iff k < K_p. Everything the
server sees (downlink, uplink, server update, SCAFFOLD's warm start) is the base's, so
the global trajectory (x, and SCAFFOLD's c and c_i) is the base's bitwise for any λ.
v_i never leaves the client: its bytes are the base's, and under differential privacy
only the upload is private. The client state is a :class:`PersonalState`: ``shared`` the
base's (SCAFFOLD's c_i, kept at its old value by a client that drops), ``own`` v_i (kept
at its new value by a client that trains, then drops). The personal model p_i is v_i.

Hyper-parameters, besides the base's: ``ditto_lambda`` λ ≥ 0 (default 0.1: the value the
paper's λ grids {0.05, 0.1, 0.2} and {0.1, 1, 2} share and its fixed λ for clients with
little validation data); ``personal_lr`` η_p, where 0 (the default) means η_l, so that a
sweep over client_lr moves both; ``personal_steps`` K_p, a whole number, default 2^24,
more than any plan's K: all the K steps of the run's plan (any K_p ≥ K is the same). Not
asynchronous (FedBuff refuses it); a model with running statistics (BatchNorm) is refused,
since v_i would need statistics of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import scaffold_jax.algorithms.fedavg  # noqa: F401  (their modules register the bases)
import scaffold_jax.algorithms.fedprox  # noqa: F401
import scaffold_jax.algorithms.scaffold  # noqa: F401
from scaffold_jax.algorithms.registry import ALGORITHMS, register
from scaffold_jax.local import local_sgd
from scaffold_jax.registry import Option
from scaffold_jax.types import Algorithm, HParam, PersonalState

#: The base algorithms Ditto wraps (registry names).
BASES = ("fedavg", "fedprox", "scaffold")

#: The stream of the client's key the personal steps' dropout keys come from.
PERSONAL_KEY = (1 << 30) - 1

#: K_p's default: every step of the run's plan. A whole number (json, a config, a sweep's
#: grid and float32 all hold it exactly; inf would not pass the configs' checks).
ALL_STEPS = 2**24

HPARAMS = {
    "ditto_lambda": HParam(0.1, "Ditto: weight lambda of the personal model's pull to x",
                           allow_zero=True),
    "personal_lr": HParam(0.0, "Ditto: personal step size eta_p (0: client_lr)", allow_zero=True),
    "personal_steps": HParam(ALL_STEPS, "Ditto: personal steps K_p per round (default: all K)",
                             allow_zero=True, integer=True),
}  # fmt: skip


def _base_spec(base: str):
    if base not in BASES:
        raise ValueError(f"Ditto's base {base!r} is not supported; use one of {', '.join(BASES)}.")
    return ALGORITHMS[base]


def _base_arguments(base: str, options: dict) -> dict:
    """The factory options meant for ``base``; another base's option is dropped at its
    default and refused otherwise (scaffold_option = 'I' with base fedavg)."""
    spec, out = _base_spec(base), {}
    arguments = {o.argument or n: n for n, o in spec.options.items()}
    for argument, value in options.items():
        if argument in arguments:
            out[argument] = value
            continue
        owners = [(b, n, o) for b in BASES for n, o in ALGORITHMS[b].options.items()
                  if (o.argument or n) == argument]  # fmt: skip
        if not owners:
            raise TypeError(f"ditto() got an unexpected option {argument!r}.")
        b, name, option = owners[0]
        if value is not None and option.parse(value) != option.parse(option.default):
            why = spec.refuses.get(name, f"it is {b}'s; set ditto_base = {b!r} or remove it")
            raise ValueError(f"{name} = {value!r} does not apply to ditto_base = {base!r}: {why}.")
    return out


def declared_hparams(base: str = "fedavg", **options) -> dict[str, HParam]:
    """The hyper-parameters of ``ditto(loss_fn, base, **options)``: the base's, then λ,
    η_p and K_p."""
    arguments = _base_arguments(base, options)
    names = {o.argument or n: n for n, o in _base_spec(base).options.items()}
    return {**_base_spec(base).hparams_for({names[a]: v for a, v in arguments.items()}),
            **HPARAMS}  # fmt: skip


def ditto(loss_fn, base: str = "fedavg", **options) -> Algorithm:
    """Ditto around the registered algorithm ``base`` built with ``options`` (its factory's
    keyword arguments; another allowed base's option is refused unless at its default).

    Raises:
      ValueError: a base other than fedavg, fedprox or scaffold, or an option it refuses.
    """
    arguments = _base_arguments(base, options)
    inner = ALGORITHMS[base].factory(loss_fn, **arguments)
    # None of the allowed bases has a pre_round pass or a client_sync step.
    assert inner.pre_round is None and inner.client_sync is None

    def init(params):
        server, client = inner.init(params)
        return server, PersonalState(client, inner.server_params(server))

    def personal_steps(hparams, x, v, batches, mask, key):
        steps = jnp.arange(mask.shape[0], dtype=jnp.float32) < hparams.personal_steps
        mask = mask * steps.reshape(steps.shape + (1,) * (mask.ndim - 1)).astype(mask.dtype)
        lr = jnp.where(hparams.personal_lr > 0, hparams.personal_lr, hparams.client_lr)

        def pull(y, batch, batch_mask, step_key):
            del batch, batch_mask, step_key
            return optax.tree.scale(hparams.ditto_lambda, optax.tree.sub(y, x))

        # A dropout loss's keys: a stream of the client key of its own, above the base's
        # steps (fold_in(key, k), k < K) and below the engine's extra batches (2^30 + s).
        key = jax.random.fold_in(key, PERSONAL_KEY)
        v, _ = local_sgd(loss_fn, v, batches, mask, lr, pull, key=key)
        return v

    def client_update(hparams, server_state, client_state, batches, mask, key, draw=None):
        if draw is None:
            raise TypeError("Ditto's client_update needs draw= (the engine passes it).")
        shared, output = inner.client_update(
            hparams, server_state, client_state.shared, batches, mask, key
        )
        x = inner.server_params(server_state)
        own = personal_steps(hparams, x, client_state.own, *draw(0), key)
        return PersonalState(shared, own), output

    warm_start = inner.warm_start
    if warm_start is not None:  # SCAFFOLD's warm controls: the shared state only

        def warm_client(server_state, client_state, batch, mask):
            shared, message = inner.warm_start.client(server_state, client_state.shared,
                                                      batch, mask)  # fmt: skip
            return PersonalState(shared, client_state.own), message

        warm_start = warm_start._replace(client=warm_client)
    options = {"base": base, **inner.options}
    return inner._replace(
        name="ditto", init=init, client_update=client_update, warm_start=warm_start,
        hparams={**inner.hparams, **HPARAMS}, options=options,
        personal=lambda hparams, server_state, client_state, adapt: client_state.own,
    )  # fmt: skip


def _base_options() -> dict[str, Option]:
    out: dict[str, Option] = {}
    for base in BASES:
        for name, option in ALGORITHMS[base].options.items():
            out.setdefault(name, option)
    return out


register(
    "ditto",
    ditto,
    "Ditto",
    options={
        "ditto_base": Option(
            "fedavg", "Ditto: the base algorithm that trains x", choices=BASES, argument="base"
        ),
        **_base_options(),
    },  # fmt: skip
    hparams=declared_hparams,
    personalized=True,
)
