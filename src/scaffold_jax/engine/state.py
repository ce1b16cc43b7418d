"""The simulation state: built as a pure function, and placed in a layout by one program."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaffold_jax.engine.inflight import initial_inflight
from scaffold_jax.layout import SingleDevice
from scaffold_jax.participation import Participation
from scaffold_jax.types import Algorithm, Problem, PyTree, SimState


def initial_state(
    algorithm: Algorithm,
    params: PyTree,
    num_clients: int,
    problem: Problem | None = None,
    participation: Participation | None = None,
    execution: Any = None,
) -> SimState:
    """The initial :class:`SimState` as a pure (traceable) function: server state from
    ``params``, the single-client state broadcast to a ``[N, ...]`` table, round 0, the
    running statistics of ``problem``'s model (when it keeps any) as its
    ``state_policy`` says: the server's, or one copy per client, the initial state of
    ``participation``'s availability model (when it has one), and the message transforms'
    per-client states (when they keep any) as a table like the clients', and an
    ``execution``'s empty in-flight table (FedBuff's, :mod:`scaffold_jax.engine.buffered`)."""

    def table(tree):
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (num_clients, *jnp.shape(a))), tree)

    server, client = algorithm.init(params)
    model = stats = None
    if problem is not None and problem.model_state is not None:
        stats = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), problem.model_state)
        model = (
            {"server": stats} if problem.state_policy == "average" else {"clients": table(stats)}
        )
    availability = None if participation is None else participation.availability
    messages = None if algorithm.messages is None else algorithm.messages.init(params)
    inflight = None
    if execution is not None:
        inflight = initial_inflight(algorithm, params, client, execution.concurrency, stats)
    return SimState(
        server=jax.tree.map(jnp.asarray, server),
        clients=table(client),
        round=jnp.zeros((), jnp.int32),
        model=model,
        participation=None if availability is None else availability.init(num_clients),
        messages=None if messages is None else table(messages),
        inflight=inflight,
    )


def init_state(
    algorithm: Algorithm,
    params: PyTree,
    num_clients: int,
    layout: Any = None,
    problem: Problem | None = None,
    participation: Participation | None = None,
    execution: Any = None,
) -> SimState:
    """:func:`initial_state`, built by one jitted program directly in ``layout``.

    The table is allocated once (on a :class:`~scaffold_jax.layout.ClientMesh`, each
    device only its own block); no host copy of it is made, and the result never aliases
    ``params`` (donating the state leaves the caller's params alive).

    Raises:
      ValueError: the layout cannot hold ``num_clients`` rows (not a multiple of its
        devices).
    """
    program = init_program(
        algorithm, params, num_clients, layout, problem, participation, execution
    )
    return program(params)


def init_program(
    algorithm: Algorithm,
    params: PyTree,
    num_clients: int,
    layout: Any = None,
    problem: Problem | None = None,
    participation: Participation | None = None,
    execution: Any = None,
) -> Callable[[PyTree], SimState]:
    """The jitted ``program(params) -> SimState`` of :func:`init_state` (``params`` of the
    structure given; in several processes, these params themselves, baked in), to keep and
    call again: a caller that wraps a new closure every time compiles it every time."""
    layout = SingleDevice() if layout is None else layout
    layout.check_num_clients(num_clients)

    def build(params):
        return initial_state(algorithm, params, num_clients, problem, participation, execution)

    shardings = layout.state_shardings(jax.eval_shape(build, params))
    if jax.process_count() == 1:
        return jax.jit(build, out_shardings=shardings)
    # Several processes: the params are numpy constants closed over, so the program has no
    # inputs to place and every process runs it alike on the global mesh.
    constants = jax.tree.map(np.asarray, params)
    program = jax.jit(lambda: build(constants), out_shardings=shardings)
    return lambda params: program()
