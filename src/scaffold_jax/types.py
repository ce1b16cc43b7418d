"""The shared types of scaffold_jax.

An algorithm is written for ONE client (equinox's "write for one example, vmap at the
edge"); only :mod:`scaffold_jax.engine` (and :mod:`scaffold_jax.layout`) know the client axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
Array = jax.Array
Batch = Any  # a pytree of arrays with a leading example axis, e.g. {"x": [B, ...], "y": [B]}


class HParam(NamedTuple):
    """A hyper-parameter an algorithm declares: its default and its allowed range.

    Attributes:
      default: the value used when none is given; None: the caller must give one.
      help: one line for ``--help`` and the docs.
      allow_zero: whether 0 is allowed (every value must be finite and >= 0; without it,
        > 0).
      maximum: the largest value allowed (Scaffnew's probability ``comm_prob`` <= 1), or
        None for no bound.
      allow_inf: whether +inf is allowed (a clip norm of inf: no clipping).
      minimum: the smallest value allowed (QSGD's ``compress_bits`` >= 2), or None.
      integer: whether only whole numbers are allowed (a number of bits).
      tradeoff: whether the value is a cost the user trades against accuracy (privacy's
        noise, compression's bits or fraction) rather than a knob tuned for it: a sweep
        reports one row per value of such an axis (the frontier) and picks its best only
        over the other axes, since less noise or compression is always "better".
    """

    default: float | None
    help: str = ""
    allow_zero: bool = False
    maximum: float | None = None
    allow_inf: bool = False
    minimum: float | None = None
    integer: bool = False
    tradeoff: bool = False


#: The step sizes every algorithm takes: η_l (no default) and η_g (1.0 in all of the
#: paper's experiments). An algorithm declares these plus its own (FedProx adds μ).
STEP_SIZES: dict[str, HParam] = {
    "client_lr": HParam(None, "client (local) step size eta_l"),
    "server_lr": HParam(1.0, "server (global) step size eta_g"),
}


@jax.tree_util.register_pytree_with_keys_class
class HParams(Mapping):
    """Hyper-parameters by name, passed to the compiled round as DATA (float32 arrays).

    Because they are arrays and not Python floats closed over by the program, changing a
    step size never recompiles, and a sweep can ``vmap`` over a leading config axis. The
    names are open: each algorithm declares the ones it reads (:attr:`Algorithm.hparams`),
    and :func:`resolve_hparams` fills in its defaults. Values read as attributes
    (``hp.client_lr``) or items (``hp["client_lr"]``).

    Args:
      values: ``{name: value}``; values are converted to float32 arrays.

    Raises:
      ValueError: a concrete value that is finite but beyond float32's range (1e39), which
        the conversion would silently turn into inf, or nonzero but below its smallest
        normal number (1e-50), which it would turn into 0 or a subnormal.
    """

    def __init__(self, values: Mapping[str, Any] | None = None, /, **named: Any):
        values = {**dict(values or {}), **named}
        for k, v in values.items():
            _check_float32_range(str(k), v)
        self._values = {str(k): jnp.asarray(v, jnp.float32) for k, v in values.items()}

    def __getitem__(self, name: str) -> Array:
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str) -> Array:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(
                f"these hyper-parameters have no {name!r} (they hold {', '.join(self._values)})"
            ) from None

    def __repr__(self) -> str:
        return f"HParams({format_hparams(self)})"

    def _asdict(self) -> dict[str, Array]:
        return dict(self._values)

    def replace(self, **changes: Any) -> HParams:
        return HParams({**self._values, **changes})

    _replace = replace  # the NamedTuple spelling, which HParams had before it was open

    def tree_flatten_with_keys(self):
        names = tuple(self._values)
        return [(jax.tree_util.DictKey(k), self._values[k]) for k in names], names

    @classmethod
    def tree_unflatten(cls, names, leaves):
        out = object.__new__(cls)
        # Leaves may be tracers, ShapeDtypeStructs or None inside jax transformations: keep
        # them as they are.
        out._values = dict(zip(names, leaves, strict=True))
        return out


def hparams(client_lr: Any, server_lr: Any = 1.0, **others: Any) -> HParams:
    """Builds :class:`HParams` of float32 arrays, checking the values when concrete.

    Any value may be an array (e.g. ``[C]`` for a sweep over C configs). Names other than
    the step sizes (``prox_mu=1.0`` for FedProx, ...) are taken as given; the simulation
    checks them against its algorithm's declared hyper-parameters.

    Raises:
      ValueError: a step size that is not finite and > 0, or another value that is not
        finite and >= 0; or a nonzero value that underflows float32 (below 1.2e-38).

    Examples:
      >>> hp = hparams(client_lr=0.1)
      >>> float(hp.server_lr)
      1.0
    """
    hp = HParams(client_lr=client_lr, server_lr=server_lr, **others)
    check_hparams(hp)
    return hp


def format_hparams(values: Mapping[str, Any]) -> str:
    """``client_lr=0.1, ...`` with float32 values printed as float32 (0.1, not 0.100000001)."""

    def show(v):
        if isinstance(v, jax.core.Tracer) or v is None:
            return "<traced>"
        a = np.asarray(v, np.float32)
        return str(a[()]) if a.ndim == 0 else str(a.tolist())

    return ", ".join(f"{k}={show(v)}" for k, v in values.items())


_FLOAT32_MAX = float(np.finfo(np.float32).max)
#: The smallest normal float32. A nonzero value below it becomes 0 or a subnormal in
#: float32 (which accelerators flush to 0): a step size of 1e-50 would silently be 0.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def _check_float32_range(name: str, value: Any) -> None:
    """ValueError when a concrete value is finite as given but inf once float32, or
    nonzero as given but below the smallest normal float32 (0 or a subnormal once
    converted), the conversion :class:`HParams` makes; the message shows the value as
    given."""
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        return  # already an array of its own dtype (or traced): nothing is converted here
    try:
        wide = np.asarray(value, np.float64)
    except (TypeError, ValueError, OverflowError):
        return  # not numbers: jnp.asarray names the problem
    with np.errstate(invalid="ignore"):
        over = np.isfinite(wide) & (np.abs(wide) > _FLOAT32_MAX)
        under = (wide != 0) & (np.abs(wide) < FLOAT32_TINY)
    if not (np.any(over) or np.any(under)):
        return
    shown = ", ".join(f"{v:.7g}" for v in wide.ravel().tolist())
    shown = shown if wide.ndim == 0 else f"[{shown}]"
    if np.any(over):
        raise ValueError(
            f"{name}={shown} is invalid: hyper-parameters are float32, where it would become "
            f"inf; every value must be finite and at most {_FLOAT32_MAX:.8g} in magnitude."
        )
    raise ValueError(_underflow_message(name, shown))


def _underflow_message(name: str, shown: str) -> str:
    return (
        f"{name}={shown} underflows float32 (smallest normal {FLOAT32_TINY:.2g}): "
        "hyper-parameters are float32, where it would become 0 or a subnormal; every "
        f"nonzero value must be at least {FLOAT32_TINY:.8g} in magnitude."
    )


def allowed_range(spec: HParam | None, allow_zero: bool) -> str:
    """What a hyper-parameter's values must be, in words, for error messages."""
    allowed = "finite and >= 0" if allow_zero else "finite and > 0"
    if spec is not None and spec.minimum is not None:
        allowed = f"finite and >= {spec.minimum:g}"
    if spec is not None and spec.integer:
        allowed = allowed.replace("finite and", "a whole number")
    if spec is not None and spec.maximum is not None:
        allowed += f" and <= {spec.maximum:g}"
    return allowed


def check_hparams(hp: HParams, declared: Mapping[str, HParam] | None = None) -> None:
    """Raises ValueError for values outside their range (concrete values only).

    Without ``declared`` the step sizes must be finite and > 0 and any other value finite
    and >= 0; with it, each declared value's own range applies (and its ``maximum``). (A
    value finite as given but beyond float32's range, 1e39, is refused where
    :class:`HParams` converts it, with the value as given.)
    """
    if not isinstance(hp, HParams):
        raise TypeError(
            f"hparams must be an HParams (use scaffold_jax.hparams(...)), got {type(hp).__name__}."
        )
    for name, value in hp.items():
        if isinstance(value, jax.core.Tracer):
            continue
        spec = (declared or STEP_SIZES).get(name)
        allow_zero = (name not in STEP_SIZES) if spec is None else spec.allow_zero
        maximum = None if spec is None else spec.maximum
        value = np.asarray(value, dtype=np.float32)
        finite = np.isfinite(value) | (spec is not None and spec.allow_inf) & (value == np.inf)
        bad = ~finite | (value < 0) | ((value == 0) & (not allow_zero))
        if maximum is not None:
            bad |= value > np.float32(maximum)
        if spec is not None and spec.minimum is not None:
            bad |= value < np.float32(spec.minimum)
        if spec is not None and spec.integer:
            bad |= np.isfinite(value) & (value != np.round(value))
        # float32 digits (0.1, not 0.10000000149011612).
        shown = ", ".join(f"{v:.7g}" for v in value.ravel().tolist())
        shown = shown if value.ndim == 0 else f"[{shown}]"
        if np.any(bad):
            raise ValueError(
                f"{name}={shown} is invalid: every value must be {allowed_range(spec, allow_zero)}."
            )
        # A subnormal given as a float32 array (the accelerators flush it to 0).
        if np.any((value != 0) & (np.abs(value) < np.float32(FLOAT32_TINY))):
            raise ValueError(_underflow_message(name, shown))


def resolve_hparams(algorithm: Algorithm, given: HParams | Mapping[str, Any]) -> HParams:
    """``given`` completed with ``algorithm``'s declared defaults, in declaration order.

    A step size the algorithm does not declare is ignored when it holds its default
    (``server_lr = 1`` for an algorithm without a server step size).

    Raises:
      TypeError: ``given`` is not a mapping of hyper-parameters.
      ValueError: a name the algorithm does not declare, a declared one without a default
        that is missing, or a value outside its range.
    """
    if not isinstance(given, HParams):
        if not isinstance(given, Mapping):
            raise TypeError(
                "hparams must be an HParams (use scaffold_jax.hparams(...)), got "
                f"{type(given).__name__}."
            )
        given = HParams(given)
    declared = algorithm.hparams
    # A step size the algorithm does not declare (FedDyn has no η_g) is dropped when it
    # holds its default, which `hparams()` and `sweep.grid` always fill in.
    given = HParams(
        {
            k: v
            for k, v in given.items()
            if k in declared
            or k not in STEP_SIZES
            or isinstance(v, jax.core.Tracer)
            or not np.all(np.asarray(v, np.float32) == np.float32(STEP_SIZES[k].default or 0))
        }
    )
    unknown = [k for k in given if k not in declared]
    if unknown:
        raise ValueError(
            f"{algorithm.name} does not take the hyper-parameter(s) {', '.join(unknown)}; it "
            f"takes {', '.join(declared)}. Remove them, or use an algorithm that declares them."
        )
    values = {}
    for name, spec in declared.items():
        if name in given:
            values[name] = given[name]
        elif spec.default is None:
            raise ValueError(
                f"{algorithm.name} needs the hyper-parameter {name} ({spec.help}); give it, "
                f"e.g. scaffold_jax.hparams({name}=...)."
            )
        else:
            values[name] = spec.default
    hp = HParams(values)
    check_hparams(hp, declared)
    return hp


class ClientOutput(NamedTuple):
    """What one client sends to the server after its local work.

    Attributes:
      delta_params: Δy_i = y_i − x (same pytree as the params).
      weight: aggregation weight, a float32 scalar. Clients report 1; the engine replaces
        it by the client's number of examples when ``weighting="num_examples"``.
      metrics: float32 scalars averaged over the sampled clients by the engine, for the
        round records.
      message: every array other than ``delta_params`` the client sends the server this
        round, by name: what the algorithm's ``server_update`` reads beside Δy_i
        (SCAFFOLD's ``{"delta_control": Δc_i}``, FedNova's ``{"local_steps": τ_i}``);
        empty for an algorithm that sends Δy_i alone. Each algorithm's module docstring
        says what it sends. Together with ``delta_params`` it is the client's whole
        message, e.g. what a differential-privacy wrapper clips.
      model_state: the :class:`ModelState` after the local steps, for a problem with
        running statistics (the one ``client_update`` was given, advanced by the steps
        taken); None for a stateless problem.
    """

    delta_params: PyTree
    weight: Array
    metrics: dict[str, Array]
    message: dict[str, PyTree] = {}  # one shared empty dict: outputs are never mutated
    model_state: ModelState | None = None


class ServerOutput(NamedTuple):
    """A ``server_update`` result with round metrics (it may also return the state alone).

    Attributes:
      state: the new server state.
      metrics: float32 scalars of the round, added to the round metrics by name (FedExP's
        server step size ``fedexp_server_lr``); a name the engine or the clients' metrics
        already use is refused.
    """

    state: PyTree
    metrics: dict[str, Array]


class FullDataPass(NamedTuple):
    """A pass over clients' WHOLE local data at the server model, outside the local steps.

    Mime sends every sampled client's full-batch gradient at x before the local steps of
    the same round; SCAFFOLD's warm start sets every client's control to its full-batch
    gradient at x⁰ before round 1. The engine gives each client of the pass all its
    examples as one batch (``[n_max, ...]`` with a mask ``[n_max]``, whatever the batch
    plan), averages the messages with the round's weights (uniform, or n_i), and hands the
    mean to the server.

    Attributes:
      client: ``client(server_state, client_state, batch, mask) -> (client_state,
        message)`` for ONE client; ``message`` is a pytree of float32 arrays. In a
        ``pre_round`` pass the engine also passes ``hparams=`` (the config's), ``client_id=``
        and ``run=`` (the run's constants, as to ``client_update``) to a client function
        that takes them (label flipping's malicious clients compute on flipped labels).
      server: ``server(server_state, mean_message) -> server_state``; it gets
        ``released=`` (what ``transform`` released) when it takes it.
      sends: ``sends(params) -> pytree``, the structure (shapes, dtypes) of the message,
        for communication accounting; None: a float32 array per parameter (a gradient).
      transform: optional, for a ``pre_round`` pass: ``transform(messages, weights,
        context) -> (messages, released)`` on the clients' ``[S, ...]`` messages before the
        server's mean, with the round's :class:`~scaffold_jax.messages.MessageContext`
        (a Byzantine attack and a robust aggregator, :mod:`scaffold_jax.robust`).
    """

    client: Callable[..., tuple[PyTree, PyTree]]
    server: Callable[..., PyTree]
    sends: Callable[[PyTree], PyTree] | None = None
    transform: Callable[..., tuple[PyTree, dict]] | None = None


class Algorithm(NamedTuple):
    """A federated algorithm as pure functions written for ONE client.

    Attributes:
      name: a short name for records ("scaffold", "fedavg", ...).
      init: ``init(params) -> (server_state, client_state)``; ``client_state`` is for a
        single client (the engine broadcasts it to ``[N, ...]``).
      client_update: ``client_update(hparams, server_state, client_state, batches, mask,
        key) -> (client_state, ClientOutput)`` with ``batches`` ``[K, B, ...]`` and ``mask``
        ``[K, B]`` (1.0 for a real example, 0.0 for padding). For a problem with running
        statistics the engine also passes ``model_state=`` (a :class:`ModelState`), which
        the algorithm hands to its local steps and returns, advanced, in
        ``ClientOutput.model_state``; an algorithm whose ``client_update`` has no
        ``model_state`` parameter cannot train such a model (the simulation says so). One
        with a ``round_key`` parameter also gets ``round_key=``, a key that every client
        of the round shares (Scaffnew's coin), independent of ``key``, of the client
        sampling and of every other round's. One with a ``draw`` parameter also gets ``draw=``,
        ``draw(stream) -> (batches, mask)``: more batches of the client's data as the
        run's plan draws them (same shapes, a straggler's steps cut alike), from a key of
        their own for each int ``stream`` (Ditto's personal steps, Per-FedAvg's second
        batch), independent of ``batches`` and of every other stream.
      server_update: ``server_update(hparams, server_state, outputs, total_weight) ->
        server_state`` (or a :class:`ServerOutput` of it and round metrics) where
        ``outputs`` carry a leading ``[S]`` axis and ``total_weight`` is the sum of the
        weights of ALL N clients (N under uniform weighting), which is what keeps
        SCAFFOLD's ``c = Σ w_i c_i / Σ w_i`` invariant exact. One with a ``cohort_size``
        parameter also gets the round's expected cohort S (float32), and one with a
        ``key`` parameter the round's server key (:func:`scaffold_jax.engine.server_key`):
        differential privacy's wrapper takes both; one with a ``released`` parameter gets
        what the message transforms released beside the rows (see ``messages``).
      server_params: ``server_params(server_state) -> params``, the model x to evaluate.
      hparams: the hyper-parameters it reads from ``hparams``, ``{name: HParam}`` (default:
        the step sizes, :data:`STEP_SIZES`). Sweeps, configs, the command line and the
        run identity cover exactly these.
      pre_round: a :class:`FullDataPass` the sampled clients make every round BEFORE their
        local work (Mime); its server function's result is the server state the clients
        and ``server_update`` see. None: no such pass.
      warm_start: a :class:`FullDataPass` ALL N clients make once, before round 1, from the
        initial state (SCAFFOLD's warm-started controls). None: none.
      client_sync: a step of every sampled client AFTER the server update, in the same
        round: ``client_sync(hparams, server_before, server_after, client_state, output)
        -> client_state``, given the server state the client worked from (after
        ``pre_round``), the new one, the client's state as ``client_update`` returned it
        and its own :class:`ClientOutput` (with the engine's weight). Scaffnew's control
        update reads the averaged model there. None: no such step.
      options: what the factory was built with, JSON-able (``{"option": 2, ...}``; filled
        by :func:`scaffold_jax.algorithms.common.records_options`): part of a run's
        identity, so a resume with another variant is refused.
      check: ``check(num_clients, clients_per_round, weighting)`` raising ValueError,
        naming the fix, for a round shape the algorithm does not support (Scaffnew needs
        S = N); :meth:`Simulation.check <scaffold_jax.engine.Simulation.check>` calls it
        (with ``sampling=``, how a privacy accountant sees the sampler, when it takes it).
        None: every shape is fine.
      linear_aggregate: whether ``server_update`` (and a ``pre_round`` pass's server)
        reads the clients' outputs only through weighted sums and means of their rows, so
        that a clipped, noised sum can stand for them (:mod:`scaffold_jax.privacy`).
        False for FedNova (each Δy_i divided by its own τ_i) and FedExP (each client's
        ‖Δy_i‖²).
      report: host-side numbers every evaluation record carries, ``report(hparams,
        rounds, num_clients, clients_per_round, sampling) -> {name: float}`` with plain
        float ``hparams`` (one config's) and ``rounds`` the rounds run so far (a private
        run's ε). None: none.
      messages: the chain of message transforms the clients' outputs pass through between
        their local work and ``server_update``
        (:class:`~scaffold_jax.messages.MessageTransform`, e.g. differential
        privacy's clipping and noise); ``server_update`` aggregates what it makes. None:
        the outputs as the clients made them.
      downlink: what a participating client receives of the server state to do its
        work, ``downlink(server_state) -> pytree`` (SCAFFOLD's ``(x, c)``), counted at its
        stored dtypes (:mod:`scaffold_jax.engine.communication`). None: the model x,
        ``server_params(server_state)``.
      uplink: what a client sends besides Δy_i, ``uplink(params) -> {name: pytree}``: the
        structure (shapes, dtypes; not values) of its ``ClientOutput.message``, e.g.
        SCAFFOLD's ``{"delta_control": params}``; the round checks the messages made
        against it. None: no message (``{}``). With ``delta_params`` (and a ``pre_round``
        pass's message) it is what the accounting counts and compression compresses.
      personal: a personalized algorithm's model for ONE client, ``personal(hparams,
        server_state, client_state, adapt) -> params`` (Ditto's v_i, APFL's
        α_i v_i + (1 − α_i) x), evaluated on the client's own test data
        (:mod:`scaffold_jax.engine.personal`); ``adapt(params, steps, lr) -> params`` takes
        ``steps`` (a Python int) plain SGD steps on the client's training data, batches as
        the run's plan, from the evaluation's key (Per-FedAvg's one adaptation step).
        None: the algorithm trains one global model, and a client's model is x.
      delta: what a client's Δy_i (``ClientOutput.delta_params``) covers, ``delta(params)
        -> pytree`` of some of the params' leaves (FedRep's and FedPer's body φ, as
        ``{path: leaf}``): the structure its ``delta_params`` has, which the accounting
        counts, compression compresses and differential privacy clips (float32, as the
        local steps compute it). None: every parameter (Δy_i has the params' structure).
    """

    name: str
    init: Callable[[PyTree], tuple[PyTree, PyTree]]
    client_update: Callable[..., tuple[PyTree, ClientOutput]]
    server_update: Callable[..., PyTree]
    server_params: Callable[[PyTree], PyTree]
    hparams: Mapping[str, HParam] = STEP_SIZES
    pre_round: FullDataPass | None = None
    warm_start: FullDataPass | None = None
    client_sync: Callable[..., PyTree] | None = None
    check: Callable[[int, int, str], None] | None = None
    options: Mapping[str, Any] = {}
    linear_aggregate: bool = True
    report: Callable[..., Mapping[str, float]] | None = None
    messages: Any = None
    downlink: Callable[[PyTree], PyTree] | None = None
    uplink: Callable[[PyTree], Mapping[str, PyTree]] | None = None
    personal: Callable[..., PyTree] | None = None
    delta: Callable[[PyTree], PyTree] | None = None


class PersonalState(NamedTuple):
    """A personalized algorithm's client state: what follows the participation contract
    and what stays on the client.

    Attributes:
      shared: the state that follows the participation contract (SCAFFOLD's c_i under
        Ditto): written back only for a client that reports; a client that trains and
        then drops keeps its old one.
      own: the client's personal state (Ditto's v_i, APFL's v_i and α_i), which never
        leaves it: written back for every client that trained, one whose upload is then
        lost included.
    """

    shared: PyTree
    own: PyTree


class SimState(NamedTuple):
    """The whole simulation state, one pytree.

    Attributes:
      server: the algorithm's server state (unbatched).
      clients: the client table; every leaf has a leading ``[N, ...]`` client axis.
      round: int32 scalar, the number of rounds completed.
      model: the model's running statistics (:attr:`Problem.model_state`), kept by the
        engine beside the algorithm's state: ``{"server": state}`` under the ``"average"``
        policy, ``{"clients": table}`` (every leaf ``[N, ...]``) under ``"local"``; None
        for a stateless problem.
      participation: the availability model's state (a Markov chain's ``[N]`` on/off
        states; :mod:`scaffold_jax.participation`), None without one. It depends on the
        root key and the round only: a sweep keeps one per seed.
      messages: the message transforms' per-client states
        (:mod:`scaffold_jax.messages`), a table with a leading ``[N, ...]`` client
        axis like ``clients``; None when no transform keeps any.
      inflight: FedBuff's in-flight table (:class:`scaffold_jax.engine.inflight.InFlight`,
        ``[M, ...]``); None in synchronous rounds.
    """

    server: PyTree
    clients: PyTree
    round: Array
    model: PyTree = None
    participation: PyTree = None
    messages: PyTree = None
    inflight: PyTree = None


#: How the running statistics of a model (BatchNorm's) are kept across clients: averaged
#: over the sampled clients like the params (what FedAvg over every model buffer does), or
#: kept by each client as its own (FedBN's statistics; Li et al., ICLR 2021).
STATE_POLICIES = ("average", "local")


@dataclasses.dataclass(frozen=True)
class ModelState:
    """A model's running statistics as they travel through one client's local steps.

    A pytree whose leaves are ``value``'s; ``update`` is static (part of the structure).

    Attributes:
      value: the statistics, e.g. flax's ``{"batch_stats": ...}``.
      update: ``update(params, value, batch, mask[, key]) -> value``: the statistics after
        one training step's forward pass at ``params`` on ``batch`` (the real examples of
        ``mask``; ``key`` the step's dropout key, for an update that takes one), i.e.
        :attr:`Problem.update_state`.
    """

    value: PyTree
    update: Callable[..., PyTree]

    def advance(self, params: PyTree, batch: Batch, mask: Array, key=None) -> ModelState:
        extra = {} if key is None else {"key": key}
        return dataclasses.replace(
            self, value=self.update(params, self.value, batch, mask, **extra)
        )


jax.tree_util.register_dataclass(ModelState, data_fields=["value"], meta_fields=["update"])


class Problem(NamedTuple):
    """A learning problem: initial params and per-example functions.

    The functions return one value PER EXAMPLE (shape ``[B]``) rather than a mean, so that
    the engine can mask padded slots exactly (a padded slot contributes nothing to a
    gradient or a mean). The engine never sees flax modules.

    Attributes:
      params: the initial model parameters (a pytree of float32 arrays).
      loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
      accuracy_fn: ``accuracy_fn(params, batch) -> [B]`` per-example correctness in
        {0, 1}, or ``None`` where accuracy has no meaning (e.g. quadratics).
      num_classes: for a classifier of integer labels ``batch["y"]``, the number of
        classes C; the simulation then refuses data whose labels fall outside [0, C)
        (the cross-entropy would silently read outside the logits). None: not checked.
      model_state: the initial running statistics of a model that keeps them (flax's
        ``{"batch_stats": ...}`` of a BatchNorm model), or None for a stateless one. Such
        a problem's ``loss_fn`` is the TRAINING-mode loss (batch statistics), called with
        ``mask=`` (the real examples, so padded slots stay out of the statistics) where
        it has that parameter; ``loss_fn`` and ``accuracy_fn`` called with ``state=`` are
        the evaluation-mode ones (running statistics).
      update_state: ``update_state(params, state, batch, mask, key=None) -> state``: the
        running statistics after one training forward pass (None for a stateless
        problem). The local solver applies it at every step taken, at the params and with
        the dropout key the step's gradient is taken with.
      state_policy: how the statistics are kept across clients (:data:`STATE_POLICIES`):
        ``"average"`` (every sampled client starts from the server's statistics, which
        become the weighted mean of theirs after the round) or ``"local"`` (each client
        keeps its own, FedBN's statistics; the BatchNorm scale and bias are params and
        are still aggregated by the algorithm).
    """

    params: PyTree
    loss_fn: Callable[[PyTree, Batch], Array]
    accuracy_fn: Callable[[PyTree, Batch], Array] | None = None
    num_classes: int | None = None
    model_state: PyTree = None
    update_state: Callable[..., PyTree] | None = None
    state_policy: str = "average"
