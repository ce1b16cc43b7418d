"""User-level differential privacy as a wrapper any algorithm takes: :func:`private`.

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018 (DP-FedAvg), for every algorithm whose server reads its clients only
through sums (:attr:`~scaffold_jax.types.Algorithm.linear_aggregate`), inside the one
compiled round:

1. A client's message is EVERY array it sends the server in the round: Δy_i and its
   ``ClientOutput.message`` (SCAFFOLD's Δc_i, FedDyn's and the others' nothing more; Mime
   and MimeLite also send ∇f_i(x) in their ``pre_round`` pass). It is clipped jointly,
   over all its arrays: ``m_i ← m_i · min(1, C / ‖m_i‖₂)`` (untouched at or below C).
   Mime's two messages of one round are clipped to C/√2 each, so the pair has norm <= C:
   two Gaussian releases of sensitivities s₁, s₂ and the same noise are exactly one of
   sensitivity √(s₁² + s₂²) = C.
2. The server adds N(0, (z_Δ C)²) to the SUM of the clipped messages, every coordinate of
   every array, and divides by the FIXED expected cohort size S (never by the realised
   count, which would leak it). The algorithm's own ``server_update`` then reads these
   noised means: its rows are rewritten so that every weighted mean it takes is the
   noised mean and every weighted sum is S times it (SCAFFOLD's ``c ← c + Σ Δc_i / N``,
   FedDyn's h), with its own code unchanged. Steps 1 and 2 are a message transform
   (:mod:`scaffold_jax.messages`, ``Algorithm.messages``) that the engine applies between
   the clients' work and ``server_update``; Mime's pre-round messages go through the same
   clipping and noise in its pre-round pass.
3. Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021), on when
   ``dp_clip_lr`` > 0: the server also releases the noised count of clients whose norm
   was at most C, b̄ = (Σ 1[‖m_i‖ <= C] + N(0, σ_b²)) / S, and moves C geometrically
   towards the ``dp_target_quantile`` γ of the norms: ``C ← C · exp(−η_C (b̄ − γ))``.
   σ_b = ``count_noise`` · S (Andrew et al.'s S/20). The two releases are one Gaussian of
   multiplier z with z⁻² = z_Δ⁻² + (2σ_b)⁻², so the accountant accounts z and the update
   noise uses z_Δ (:func:`~scaffold_jax.privacy.accounting.update_noise_multiplier`).

Every round reports ``dp_clip_norm`` (the C it clipped to) and ``dp_clipped_fraction`` (the
share of its clients above C: the simulator's diagnostic, not a released value), and
every record their means since the previous one.

The noise multiplier z, the clip norm C, γ and η_C are hyper-parameters (data), so a
sweep over them is one vmapped program and the accountant runs per config
(:attr:`~scaffold_jax.types.Algorithm.report` puts ``dp_epsilon`` in every record).
Clients' own states are never clipped (SCAFFOLD's c_i stays the client's own; only what
it SENDS is), and the round's diagnostics (``local_loss``, ``client_drift``) are the
simulator's, not released values. Privacy needs equal weights (``weighting="uniform"``):
weights of n_i would make the sensitivity unbounded and reveal the sizes.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.local import takes
from scaffold_jax.messages import MessageContext, MessageTransform
from scaffold_jax.privacy import accounting
from scaffold_jax.tree import sq_norm, weighted_mean
from scaffold_jax.types import Algorithm, ClientOutput, FullDataPass, HParam, ServerOutput

#: The hyper-parameters :func:`private` adds to its algorithm's.
HPARAMS: dict[str, HParam] = {
    "dp_clip": HParam(
        1.0,
        "DP clip norm C of a client's whole message (adaptive clipping: its first value)",
        allow_inf=True,
    ),
    "dp_noise_multiplier": HParam(
        None,
        "DP noise multiplier z: the noise std on the sum is z C",
        allow_zero=True,
        tradeoff=True,
    ),
    "dp_target_quantile": HParam(
        0.5,
        "adaptive clipping's target quantile gamma of the clients' message norms",
        allow_zero=True,
        maximum=1.0,
    ),
    "dp_clip_lr": HParam(
        0.0, "adaptive clipping's geometric step eta_C (0: a fixed clip norm)", allow_zero=True
    ),
}

#: Andrew et al.'s noise on the count of unclipped clients: S/20.
DEFAULT_COUNT_NOISE = 0.05


class PrivateServerState(NamedTuple):
    """Attributes: inner (the algorithm's server state), clip_scale (C_t / dp_clip, the
    adaptive clip norm's factor; 1 with a fixed clip norm)."""

    inner: Any
    clip_scale: jax.Array


def clip_rows(rows: Any, clip: jax.Array) -> tuple[Any, jax.Array]:
    """Every row (leading axis) of the pytree ``rows`` scaled to norm <= ``clip``, over
    all its leaves jointly; rows at or below it are untouched (scaled by exactly 1).
    Returns the clipped rows and the rows' norms before clipping."""
    norms = jnp.sqrt(jax.vmap(sq_norm)(rows))
    factor = jnp.where(norms > clip, clip / jnp.where(norms > 0, norms, 1.0), 1.0)
    return _scale_rows(rows, factor), norms


def _scale_rows(rows: Any, factor: jax.Array) -> Any:
    return jax.tree.map(lambda a: a * factor.reshape((-1,) + (1,) * (a.ndim - 1)), rows)


def gaussian_noise(key: jax.Array, like: Any, std: jax.Array) -> Any:
    """N(0, std²) for every coordinate of ``like``'s leaves (one row's shapes); exactly 0
    when std is 0, even for an infinite clip norm."""
    leaves, treedef = jax.tree.flatten(like)
    keys = jr.split(key, max(len(leaves), 1))
    noise = [
        jnp.where(std > 0, std * jr.normal(k, a.shape, jnp.float32), 0.0)
        for k, a in zip(keys, leaves, strict=False)
    ]
    return jax.tree.unflatten(treedef, noise)


def noised_rows(rows: Any, weights: jax.Array, clip, std, cohort_size, key):
    """The rows and weights under which a weighted mean is the noised mean
    ``(Σ clip(m_i) + ξ) / S`` and a weighted sum is ``Σ clip(m_i) + ξ``, ξ ~ N(0, std²).

    ``weights`` are 1 for a client that takes part and 0 for a masked-out row (a Poisson
    round's padding); k of them are 1. Each present row becomes ``(k/S) clip(m_i) + ξ/S``
    with weight S/k; with k = 0 the first row carries ξ/S alone with weight S. With k = S
    (fixed-size sampling), z = 0 and C = ∞ the rows and weights are exactly the inputs'.
    Returns ``(rows, weights, norms)``.
    """
    present = weights > 0
    count = jnp.sum(present.astype(jnp.float32))
    empty = count == 0
    first = (jnp.arange(weights.shape[0]) == 0) & empty
    held = jnp.maximum(count, 1.0)
    clipped, norms = clip_rows(rows, clip)
    scaled = _scale_rows(clipped, jnp.where(present, held / cohort_size, 0.0))
    noise = gaussian_noise(key, jax.tree.map(lambda a: a[0], rows), std)
    out = jax.tree.map(lambda a, n: a + (n / cohort_size)[None], scaled, noise)
    new_weights = jnp.where(present | first, cohort_size / held, 0.0)
    return out, new_weights, norms


def _keys(key: jax.Array) -> jax.Array:
    """The server's round key split three ways: the update's noise, the count's noise and
    the ``pre_round`` pass's noise."""
    return jr.split(key, 3)


def private(
    algorithm: Algorithm,
    *,
    delta: float | None = None,
    accountant: str | None = None,
    count_noise: float = DEFAULT_COUNT_NOISE,
) -> Algorithm:
    """``algorithm`` with user-level differential privacy (see the module docstring).

    Args:
      algorithm: any :class:`~scaffold_jax.types.Algorithm` whose server reads its
        clients through sums (``linear_aggregate``).
      delta: the δ its ε is reported at (default N^-1.1, below 1/N).
      accountant: ``"pld"`` or ``"rdp"`` (default: PLD for Poisson sampling, RDP for
        fixed-size sampling, the only one dp-accounting covers for it).
      count_noise: adaptive clipping's noise on the count of unclipped clients, as a
        fraction of the expected cohort S (σ_b = count_noise · S).

    Returns:
      An Algorithm of the same name, with the hyper-parameters :data:`HPARAMS` added
      (``dp_noise_multiplier`` has no default: give it, or calibrate it from a target ε
      with :func:`~scaffold_jax.privacy.accounting.calibrate`) and ``report`` giving
      ``dp_epsilon`` (and ``dp_delta``) for every record.

    Raises:
      ValueError: an algorithm whose server does not aggregate by sums, one already
        private, or a bad option.

    Examples:
      >>> import scaffold_jax as sj
      >>> problem = sj.models.logistic_regression((4,), 3)
      >>> alg = sj.privacy.private(sj.scaffold(problem.loss_fn))
      >>> sorted(n for n in alg.hparams if n.startswith("dp_"))
      ['dp_clip', 'dp_clip_lr', 'dp_noise_multiplier', 'dp_target_quantile']
    """
    if not algorithm.linear_aggregate:
        raise ValueError(
            f"{algorithm.name} cannot be made differentially private here: its server reads "
            "each client's output on its own (FedNova divides each Δy_i by its own step "
            "count, FedExP reads each ‖Δy_i‖²), not only their sum, which is all a noised "
            "aggregate releases. Use fedavg, fedprox, scaffold, feddyn, mime or mimelite."
        )
    if any(name in algorithm.hparams for name in HPARAMS):
        raise ValueError(f"{algorithm.name} is private already: wrap an algorithm once.")
    if "aggregator" in algorithm.options:
        raise ValueError(
            f"aggregator = {algorithm.options['aggregator']['aggregator']!r} with differential "
            "privacy is refused: the noise is calibrated to the clipped SUM of the messages, "
            "which a robust aggregator does not release; use aggregator = 'mean' with privacy."
        )
    accounting.check_privacy_parameters(delta=delta)
    if accountant is not None and accountant not in accounting.ACCOUNTANTS:
        raise ValueError(
            f"accountant = {accountant!r} is unknown: use one of {accounting.ACCOUNTANTS}."
        )
    if not (math.isfinite(count_noise) and count_noise > 0):
        raise ValueError(f"count_noise = {count_noise} is invalid: it must be finite and > 0.")
    inner = algorithm
    # Mime's two messages of a round share C: C/√2 each keeps the pair within C.
    share = math.sqrt(0.5) if inner.pre_round is not None else 1.0

    def clip_norm(hparams, state) -> jax.Array:
        return hparams.dp_clip * state.clip_scale * share

    def update_std(hparams, cohort_size, clip) -> jax.Array:
        z = hparams.dp_noise_multiplier
        sigma_b = count_noise * cohort_size
        # z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2) when the count is released too (Andrew et al.).
        z_update = jnp.where(
            (hparams.dp_clip_lr > 0) & (z > 0),
            jax.lax.rsqrt(jnp.maximum(z**-2 - (2 * sigma_b) ** -2, 0.0)),
            z,
        )
        return z_update * clip

    def init(params):
        server, client = inner.init(params)
        return PrivateServerState(server, jnp.ones((), jnp.float32)), client

    @functools.wraps(inner.client_update)
    def client_update(hparams, server_state, client_state, batches, mask, key, **extra):
        return inner.client_update(
            hparams, server_state.inner, client_state, batches, mask, key, **extra
        )

    def clip_and_noise(outputs: ClientOutput, states, context: MessageContext):
        # The message transform (the engine applies it between the clients' work and
        # server_update): every client's message clipped, the noise of the released sum.
        released = {}
        if inner.messages is not None:
            inner_context = context._replace(server=context.server.inner)
            outputs, states, released = inner.messages.apply(outputs, states, inner_context)
        hparams, cohort_size = context.hparams, context.cohort_size
        clip = clip_norm(hparams, context.server)
        update_key, _, _ = _keys(context.key)
        message = (outputs.delta_params, outputs.message)
        (delta, sent), weights, norms = noised_rows(
            message,
            outputs.weight,
            clip,
            update_std(hparams, cohort_size, clip),
            cohort_size,
            update_key,
        )
        # Each client's norm before clipping and whether it reported, from which the
        # server side counts the clients at or under C (adaptive clipping's noised count).
        released = {**released, "dp_norms": norms, "dp_reported": outputs.weight > 0}
        return outputs._replace(delta_params=delta, message=sent, weight=weights), states, released

    def server_update(hparams, state, outputs, total_weight, cohort_size, key, released):
        # `outputs` are the clipped, noised rows of clip_and_noise; what is left here is
        # the server-side part: the algorithm's own update, and the clip norm's step.
        _, count_key, _ = _keys(key)
        extra = {"released": released} if takes(inner.server_update, "released") else {}
        result = inner.server_update(hparams, state.inner, outputs, total_weight, **extra)
        new_inner, metrics = result if isinstance(result, ServerOutput) else (result, {})
        # The noised fraction of clients at or under C, and C's geometric step towards γ.
        clip = clip_norm(hparams, state)
        present, norms = released["dp_reported"], released["dp_norms"]
        taking_part = jnp.sum(present.astype(jnp.float32))
        below = jnp.sum((present & (norms <= clip)).astype(jnp.float32))
        noisy_below = below + count_noise * cohort_size * jr.normal(count_key, (), jnp.float32)
        fraction = noisy_below / cohort_size
        adaptive = hparams.dp_clip_lr > 0
        scale = state.clip_scale * jnp.where(
            adaptive, jnp.exp(-hparams.dp_clip_lr * (fraction - hparams.dp_target_quantile)), 1.0
        )
        metrics = {
            **metrics,
            "dp_clip_norm": hparams.dp_clip * state.clip_scale,
            "dp_clipped_fraction": (taking_part - below) / jnp.maximum(taking_part, 1.0),
        }
        return ServerOutput(PrivateServerState(new_inner, scale), metrics)

    pre_round = None
    if inner.pre_round is not None:

        @functools.wraps(inner.pre_round.client)  # its keywords (client_id=, ...) stay visible
        def pass_client(server_state, client_state, batch, mask, **extra):
            return inner.pre_round.client(server_state.inner, client_state, batch, mask, **extra)

        def pass_server(server_state, mean, messages, weights, cohort_size, key, hparams):
            del mean  # the engine's plain mean; the private one is made here
            clip = clip_norm(hparams, server_state)
            rows, new_weights, _ = noised_rows(
                messages,
                weights,
                clip,
                update_std(hparams, cohort_size, clip),
                cohort_size,
                _keys(key)[2],
            )
            received = inner.pre_round.server(server_state.inner, weighted_mean(rows, new_weights))
            return server_state._replace(inner=received)

        # An attack on the pass (the transform) acts before the clipping, as on the round's.
        pre_round = FullDataPass(pass_client, pass_server, transform=inner.pre_round.transform)

    warm_start = None
    if inner.warm_start is not None:
        # A pass over ALL clients before round 1 (SCAFFOLD's warm controls) would release
        # every client's gradient: a private run refuses it (see check below).
        warm_start = inner.warm_start

    def client_sync(hparams, server_before, server_after, client_state, output):
        return inner.client_sync(
            hparams, server_before.inner, server_after.inner, client_state, output
        )

    def check(num_clients, clients_per_round, weighting, sampling=None, participation=None):
        if delta is not None:  # a delta of 1/N or more is no privacy
            accounting.check_privacy_parameters(delta=delta, num_clients=num_clients)
        if inner.check is not None:
            extra = {"participation": participation} if takes(inner.check, "participation") else {}
            inner.check(num_clients, clients_per_round, weighting, **extra)
        if participation is not None and participation.partial:
            raise ValueError(
                "differential privacy's accounting assumes every sampled client is drawn by "
                "the sampler alone and reaches the server; with "
                f"{' and '.join(participation.describe())} who takes part changes in a way no "
                "accountant here covers: use availability = 'always' and dropouts = 'none' "
                "for a private run (stragglers are fine: clipping bounds any update)."
            )
        if weighting != "uniform":
            raise ValueError(
                f"differential privacy needs weighting = 'uniform', not {weighting!r}: weights "
                "of n_i make one client's share of the sum unbounded and reveal its size."
            )
        if inner.warm_start is not None:
            raise ValueError(
                f"{inner.name}'s warm start sends every client's full gradient before round 1, "
                "outside any private aggregate: turn it off (warm_controls=False) for a "
                "private run."
            )
        if sampling is None:
            raise ValueError(
                "differential privacy needs a client sampler an accountant covers: 'uniform' "
                "(fixed-size, without replacement) or 'poisson'; this one declares neither "
                "(SamplerSpec.privacy)."
            )
        accounting.check(
            accounting.Sampling(sampling, num_clients, clients_per_round),
            accountant
            or accounting.default_accountant(
                accounting.Sampling(sampling, num_clients, clients_per_round)
            ),
        )

    def report(hparams, rounds, num_clients, clients_per_round, sampling):
        # Checked here, at the first record (round 0, before any round has run): the
        # update's share of the noise needs 2σ_b > z when the count is released too.
        if hparams["dp_clip_lr"] > 0:
            z, sigma_b = hparams["dp_noise_multiplier"], count_noise * clients_per_round
            if not 2 * sigma_b > z:  # said in the settings' names (the accountant's says z)
                raise ValueError(
                    f"dp_count_noise = {count_noise:g} is too small for dp_noise_multiplier = "
                    f"{z:g} with adaptive clipping (dp_clip_lr = {hparams['dp_clip_lr']:g}): "
                    f"the count of unclipped clients gets noise sigma_b = dp_count_noise x S "
                    f"= {sigma_b:g} (S = {clients_per_round}), and adaptive clipping needs "
                    f"2 sigma_b > dp_noise_multiplier. Use dp_count_noise > "
                    f"{z / (2 * clients_per_round):.3g}, a lower dp_noise_multiplier, or "
                    "dp_clip_lr = 0 (a fixed clip norm)."
                )
            accounting.update_noise_multiplier(z, sigma_b)
        plan = accounting.Sampling(sampling, num_clients, clients_per_round)
        run_delta = accounting.default_delta(num_clients) if delta is None else delta
        return {
            "dp_epsilon": accounting.epsilon(
                plan, float(hparams["dp_noise_multiplier"]), int(rounds), run_delta, accountant
            ),
            "dp_delta": run_delta,
        }

    def server_params(state):
        return inner.server_params(state.inner)

    def personal(hparams, state, client_state, adapt):  # never sent: not made private
        return inner.personal(hparams, state.inner, client_state, adapt)

    personal.global_model = getattr(inner.personal, "global_model", True)

    return Algorithm(
        name=inner.name,
        init=init,
        client_update=client_update,
        server_update=server_update,
        server_params=server_params,
        hparams={**inner.hparams, **HPARAMS},
        pre_round=pre_round,
        warm_start=warm_start,
        client_sync=None if inner.client_sync is None else client_sync,
        check=check,
        options={
            **inner.options,
            "privacy": {"delta": delta, "accountant": accountant, "count_noise": count_noise},
        },
        linear_aggregate=True,
        report=report,
        # Clipping scales what the inner transforms send (a compressor's message), so the
        # bytes sent are theirs.
        messages=MessageTransform(
            (lambda params: None) if inner.messages is None else inner.messages.init,
            clip_and_noise,
            None if inner.messages is None else inner.messages.sizes,
        ),
        # What the algorithm's clients receive, and the clip norm's factor they clip with.
        downlink=lambda state: (
            (inner.downlink or inner.server_params)(state.inner),
            state.clip_scale,
        ),
        uplink=inner.uplink,
        personal=None if inner.personal is None else personal,
        delta=inner.delta,
    )
