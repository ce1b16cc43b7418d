"""SCAFFOLD: Stochastic Controlled Averaging for Federated Learning.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020. https://arxiv.org/abs/1910.06378
(Algorithm 1).

Every client keeps a control variate c_i across rounds; the server keeps c. A sampled
client starts from y_i = x and takes K steps ``y_i ← y_i − η_l (g − c_i + c)``, then
updates its control:

* Option I:  ``c_i⁺ = ∇f_i(x)`` on all the data the client drew this round (one extra pass;
  with ``BatchPlan.full()`` it is the exact local gradient at x);
* Option II: ``c_i⁺ = c_i − c + (x − y_i) / (K_i η_l)`` (the paper's default), with K_i the
  number of local steps the client ACTUALLY took (counting padded steps here is one of the
  slips behind failed reproductions).

The server applies ``x ← x + η_g Σ_S w_i Δy_i / Σ_S w_i`` and ``c ← c + Σ_S w_i Δc_i / W``
where W is the total weight of all N clients. With the paper's uniform weights (w_i = 1,
W = N) that is ``c ← c + (|S|/N) mean Δc_i``, and ``c = mean_i c_i`` holds after every
round. With ``weighting="num_examples"`` it keeps ``c = Σ_i n_i c_i / Σ_i n_i`` instead, the
consistent counterpart of data-size weighted model averaging. A client sends Δy_i and
``ClientOutput.message = {"delta_control": Δc_i}``. Under differential privacy
(:func:`scaffold_jax.privacy.private`) the pair is clipped jointly and noised, so the
server's c moves by the noised sum and no longer equals the mean of the c_i, which each
client keeps unclipped (it never leaves the client); with Option II ‖Δc_i‖ ≈ ‖Δy_i‖ /
(K η_l) typically dominates the pair's norm (docs/results/privacy.md).

Warm-started controls (``warm_controls=True``, an option; the paper starts every control
at 0). Before round 1 every client sets ``c_i = ∇f_i(x⁰)`` on ALL its local data and the
server ``c = Σ_i w_i c_i / Σ_i w_i`` over all N (the mean under uniform weights), so the
invariant holds from the start; it costs one pass over all clients' data. With zero
controls the first rounds of SCAFFOLD are FedAvg's and depend on the gradient
dissimilarity G (each client drifts towards its own optimum until its control has been set
by a visit); warm controls remove that transient.

Storage of the c_i. With ``control_dtype=jnp.bfloat16`` the client table holds the
bfloat16 values as their ``uint16`` bit patterns, not as bfloat16 arrays: XLA's CPU backend
has no bfloat16 scatter and converted the whole ``[N, P]`` table to float32 and back to
write the S new rows each round (a float32 table of temporaries, 3× the bfloat16 table at
the peak), while a ``uint16`` scatter writes the rows in place. A client decodes its row to
float32 when it starts and encodes its new row (round-to-nearest-even, exactly
``astype(jnp.bfloat16)``) when it ends; the values, and every result, are those of a
bfloat16 table. Read the controls as numbers with :func:`client_controls`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from scaffold_jax.algorithms.common import (
    init_server_optimizer,
    local_update,
    records_options,
    server_model_step,
    server_params,
    transformation,
)
from scaffold_jax.algorithms.registry import SERVER_OPTIMIZER, register
from scaffold_jax.local import batch_grad, flatten_steps
from scaffold_jax.registry import Option
from scaffold_jax.tree import decode_storage, encode_storage, weighted_mean, weighted_sum
from scaffold_jax.types import STEP_SIZES, Algorithm, ClientOutput, FullDataPass, HParams, PyTree


class ScaffoldServerState(NamedTuple):
    """Attributes: params (x), control (c), opt_state (server optimizer, ``()`` if none)."""

    params: PyTree
    control: PyTree
    opt_state: PyTree


class ScaffoldClientState(NamedTuple):
    """Attributes: control (c_i) in its storage form: float32 arrays, or for
    ``control_dtype=jnp.bfloat16`` the ``uint16`` bit patterns of the bfloat16 values.
    Read it as numbers with :func:`client_controls`."""

    control: PyTree


def client_controls(client_state: ScaffoldClientState) -> PyTree:
    """The client control variates c_i as float32 numbers, whatever their storage dtype.

    Works on one client's state and on the whole table (``SimState.clients``, every leaf
    ``[N, ...]``; a sharded table keeps its layout). Use it rather than reading
    ``client_state.control``, which holds ``uint16`` bit patterns when the controls are
    stored in bfloat16. With several processes, read a sharded result with
    :func:`scaffold_jax.layout.gather` first.

    Args:
      client_state: a :class:`ScaffoldClientState` (arrays, jax or numpy).

    Returns:
      The pytree of ``client_state.control`` with float32 leaves.

    Examples:
      >>> import jax.numpy as jnp, scaffold_jax as sj
      >>> from scaffold_jax.algorithms import client_controls
      >>> problem = sj.models.logistic_regression((4,), 3)
      >>> alg = sj.scaffold(problem.loss_fn, control_dtype=jnp.bfloat16)
      >>> state = sj.init_state(alg, problem.params, num_clients=5)
      >>> state.clients.control["linear"]["kernel"].dtype
      dtype('uint16')
      >>> client_controls(state.clients)["linear"]["kernel"].dtype
      dtype('float32')
    """
    return decode_storage(client_state.control)


_OPTIONS = {1: 1, 2: 2, "I": 1, "II": 2, "i": 1, "ii": 2}


def option_name(option: object) -> object:
    """SCAFFOLD's option in its canonical spelling, ``"I"`` or ``"II"`` (other values are
    returned as they are, for the caller to refuse)."""
    try:
        return {1: "I", 2: "II"}.get(_OPTIONS.get(option, option), option)  # type: ignore[arg-type]
    except TypeError:  # unhashable (a list): not an option
        return option


@records_options
def scaffold(
    loss_fn,
    option: int | str = 2,
    control_dtype=jnp.float32,
    server_optimizer: optax.GradientTransformation | str | None = None,
    warm_controls: bool = False,
) -> Algorithm:
    """SCAFFOLD (Algorithm 1 of Karimireddy et al. 2020).

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      option: 2 / "II" (default, no extra gradient) or 1 / "I" (gradient at x).
      control_dtype: storage dtype of the client control variates c_i (``jnp.float32``
        or ``jnp.bfloat16`` to halve the client table); arithmetic is always float32.
        Δc_i is computed from the STORED (rounded) c_i⁺, so the server's c stays exactly the
        mean of the stored table. bfloat16 values are stored as their ``uint16`` bit
        patterns (see the module docstring); read them with :func:`client_controls`.
      server_optimizer: optional optax transformation on −Δx, as for FedAvg.
      warm_controls: start from ``c_i = ∇f_i(x⁰)`` and c = their mean (see the module
        docstring) instead of zeros.

    Raises:
      ValueError: for an unknown option or control dtype.
    """
    if option not in _OPTIONS:
        raise ValueError(
            f"SCAFFOLD option {option!r} is unknown; use 1 (or 'I': control = gradient at x) "
            "or 2 (or 'II': control from the local update, the paper's default)."
        )
    option = _OPTIONS[option]
    server_optimizer = transformation(server_optimizer)
    control_dtype = jnp.dtype(control_dtype)
    if control_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(
            f"control_dtype {control_dtype} is not supported; use float32 or bfloat16."
        )

    def init(params: PyTree):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
        server = ScaffoldServerState(
            params=params,
            control=optax.tree.zeros_like(params),
            opt_state=init_server_optimizer(server_optimizer, params),
        )
        client = ScaffoldClientState(
            control=encode_storage(optax.tree.zeros_like(params), control_dtype)
        )
        return server, client

    def client_update(
        hparams: HParams, server_state, client_state, batches, mask, key, model_state=None
    ):
        x, c = server_state.params, server_state.control
        c_i = decode_storage(client_state.control)

        # Every local gradient is corrected by the same c - c_i.
        offset = optax.tree.sub(c, c_i)
        y, output, info = local_update(
            loss_fn, hparams, x, batches, mask, offset=offset, key=key, model_state=model_state
        )
        if option == 2:
            steps = jnp.maximum(info.num_steps, 1).astype(jnp.float32)
            c_plus = optax.tree.add_scale(
                optax.tree.sub(c_i, c), 1.0 / (steps * hparams.client_lr), optax.tree.sub(x, y)
            )
            # A client that drew no data took no step and learned nothing: keep its control.
            c_plus = optax.tree.where(info.num_steps > 0, c_plus, c_i)
        else:
            flat, flat_mask = flatten_steps(batches, mask)
            _, c_plus = batch_grad(loss_fn, x, flat, flat_mask)
        stored = encode_storage(c_plus, control_dtype)
        delta_control = optax.tree.sub(decode_storage(stored), c_i)
        output = output._replace(message={"delta_control": delta_control})
        return ScaffoldClientState(control=stored), output

    def warm_client(server_state, client_state, batch, mask):
        del client_state
        _, grad = batch_grad(loss_fn, server_state.params, batch, mask)
        stored = encode_storage(grad, control_dtype)
        # The server's c is the mean of the STORED (possibly rounded) controls.
        return ScaffoldClientState(control=stored), decode_storage(stored)

    def warm_server(server_state, mean_control):
        return server_state._replace(control=mean_control)

    def server_update(hparams: HParams, state, outputs: ClientOutput, total_weight):
        delta_x = weighted_mean(outputs.delta_params, outputs.weight)
        params, opt_state = server_model_step(
            server_optimizer, hparams, state.params, state.opt_state, delta_x
        )
        delta_c = weighted_sum(outputs.message["delta_control"], outputs.weight)
        control = optax.tree.add_scale(state.control, 1.0 / total_weight, delta_c)
        return ScaffoldServerState(params=params, control=control, opt_state=opt_state)

    return Algorithm(
        name="scaffold",
        init=init,
        client_update=client_update,
        server_update=server_update,
        server_params=server_params,
        warm_start=FullDataPass(warm_client, warm_server) if warm_controls else None,
        downlink=lambda state: (state.params, state.control),  # x and c; up: Δy_i and Δc_i
        uplink=lambda params: {"delta_control": params},
    )


register(
    "scaffold",
    scaffold,
    "SCAFFOLD",
    options={
        **SERVER_OPTIMIZER,
        "scaffold_option": Option(
            "II",
            "SCAFFOLD control update: II (the paper's default) or I",
            choices=("I", "II"),
            argument="option",
            normalize=option_name,
        ),
        "control_dtype": Option(
            "float32",
            "storage dtype of SCAFFOLD's client controls",
            choices=("float32", "bfloat16"),
        ),
        "warm_controls": Option(
            False,
            "SCAFFOLD: start every c_i at its full-batch gradient at x0 (one pass over all "
            "data) instead of 0",
            "bool",
        ),
    },
    refuses={
        "local_optimizer": "SCAFFOLD's correction c - c_i is defined for plain SGD local "
        "steps; momentum or Adam around the corrected gradient changes what the controls "
        "estimate (a known cause of failed SCAFFOLD reproductions). Use plain SGD, or "
        "fedavg / fedprox with a local optimizer",
    },
    hparams=STEP_SIZES,
    asynchronous=True,  # FedBuff: c sums the arrivals' Δc_i unweighted (c = mean c_i)
)
