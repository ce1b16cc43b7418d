"""The :class:`Simulation`: the compiled programs of one algorithm on one problem."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaffold_jax import resources
from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.engine import communication, evaluation, personal
from scaffold_jax.engine.axes import repeat_rounds
from scaffold_jax.engine.buffered import FedBuff
from scaffold_jax.engine.checks import check_count, check_simulation
from scaffold_jax.engine.context import RoundContext, weights_of
from scaffold_jax.engine.evaluation import DEFAULT_EVALUATORS, TRAIN_EVAL_EXAMPLES
from scaffold_jax.engine.personal import Personalization
from scaffold_jax.engine.phases import full_data_pass
from scaffold_jax.engine.round import SYNCHRONOUS
from scaffold_jax.engine.state import init_program, initial_state
from scaffold_jax.layout import SingleDevice
from scaffold_jax.local import takes
from scaffold_jax.participation import Participation
from scaffold_jax.sampling import Sampler, privacy_sampling, uniform
from scaffold_jax.types import Algorithm, HParams, Problem, PyTree, SimState, resolve_hparams
from scaffold_jax.weighting import WEIGHTINGS
from scaffold_jax.weighting import make as make_weighting


class Simulation:
    """The compiled programs of one algorithm on one problem with a fixed round shape.

    Everything that fixes the SHAPE of the program (the algorithm, the batch plan, S, the
    weighting, the layout) is given here; everything that is data (hyper-parameters,
    state, the dataset, the key) is passed to the compiled functions, so changing a step
    size or the seed never recompiles. The host loop (:func:`scaffold_jax.loop.run`) runs
    them; ``scaffold_jax.Simulation`` (:class:`scaffold_jax.loop.Simulation`) is this class
    with a ``run`` method that calls it (the engine knows nothing of the loop above it).

    Args:
      algorithm: an :class:`~scaffold_jax.types.Algorithm`.
      problem: the :class:`~scaffold_jax.types.Problem` (initial params and loss).
      plan: the :class:`~scaffold_jax.data.batching.BatchPlan` of the local steps.
      clients_per_round: S.
      weighting: a registered weighting (:data:`scaffold_jax.weighting.WEIGHTINGS`):
        ``"uniform"`` (the paper's 1/|S| averaging), ``"num_examples"``, a plugin's.
      weighting_options: its options (given, else their declared defaults).
      eval_batch_size: examples per chunk in the jitted evaluation.
      client_chunk: how many sampled clients run in one vmapped chunk of the round:
        ``"auto"`` (all S on an accelerator or a client mesh, cache-sized chunks on CPU,
        one client at a time for a convolutional or recurrent model on CPU; see
        :meth:`resolve_client_chunk`), None (all S) or a number of clients.
      layout: where the client axis lives: :class:`~scaffold_jax.layout.SingleDevice`
        (default) or a :class:`~scaffold_jax.layout.ClientMesh`.
      evaluators: the evaluation functions ``fn(simulation, params, data) -> {name:
        scalar}`` traced into :meth:`evaluate_fn` (default :data:`DEFAULT_EVALUATORS`:
        test loss and accuracy, training objective).
      train_eval_examples: training examples the training objective (``train_loss``) is
        evaluated on: a fixed uniform subsample of this many (default
        :data:`~scaffold_jax.engine.evaluation.TRAIN_EVAL_EXAMPLES`; an unbiased estimate,
        see :func:`~scaffold_jax.engine.evaluation.train_objective`), or
        None for all of them. The mean loss of the clients' own local steps is in the
        round metrics (``local_loss``) whatever this is.
      sampler: which S clients take part in a round, ``sampler(key, round, N, S) -> ids``
        (:mod:`scaffold_jax.sampling`; default: the paper's uniform sampling without
        replacement; ``sampling.make(name, options)`` builds a registered one).
      participation: the clients' availability, stragglers and dropouts, a
        :class:`~scaffold_jax.participation.Participation` (``participation.make(...)``;
        default: every client always available, finishing its steps, never dropping),
        and their device profiles for a virtual clock
        (:mod:`scaffold_jax.participation.clock`).
      personalization: how each client's own model is evaluated on its own test data
        (:class:`~scaffold_jax.engine.personal.Personalization`: fine-tuning steps, the
        evaluated clients); None: the algorithm's personal models as they are, every
        client.
      execution: None (synchronous rounds) or :class:`~scaffold_jax.engine.buffered.FedBuff`
        (asynchronous buffered aggregation: a "round" is a server step; it needs device
        profiles for the clients' durations).

    Examples:
      >>> import numpy as np, scaffold_jax as sj
      >>> rng = np.random.default_rng(0)
      >>> data = sj.data.from_client_arrays(
      ...     [{"x": rng.normal(size=(n, 4)).astype("float32"), "y": rng.integers(0, 3, n)}
      ...      for n in (5, 8, 6)])
      >>> problem = sj.models.logistic_regression((4,), 3)
      >>> sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem,
      ...                     sj.BatchPlan.fixed(batch_size=4, num_steps=3), clients_per_round=2)
      >>> result = sim.run(data, sj.hparams(client_lr=0.1), num_rounds=4, eval_every=2)
      >>> [r["round"] for r in result.records]
      [0, 2, 4]
    """

    def __init__(
        self,
        algorithm: Algorithm,
        problem: Problem,
        plan: BatchPlan,
        clients_per_round: int,
        weighting: str = "uniform",
        weighting_options: Mapping[str, Any] | None = None,
        eval_batch_size: int = 4096,
        client_chunk: int | str | None = "auto",
        layout: Any = None,
        evaluators: Sequence[Callable[..., Mapping[str, jax.Array]]] = DEFAULT_EVALUATORS,
        train_eval_examples: int | None = TRAIN_EVAL_EXAMPLES,
        sampler: Sampler | None = None,
        participation: Participation | None = None,
        execution: FedBuff | None = None,
        personalization: Personalization | None = None,
    ):
        if not isinstance(plan, BatchPlan):
            raise TypeError(f"plan must be a BatchPlan, got {type(plan).__name__}.")
        if not isinstance(weighting, str) or weighting not in WEIGHTINGS:
            raise ValueError(WEIGHTINGS.unknown_message(str(weighting)))
        self.algorithm = algorithm
        self.problem = problem
        self.plan = plan
        self.clients_per_round = check_count("clients_per_round (S)", clients_per_round)
        self.weighting = weighting
        self.weighting_options = dict(weighting_options or {})
        self._weigh = make_weighting(weighting, self.weighting_options)
        self.equal_weights = WEIGHTINGS[weighting].equal
        self.eval_batch_size = check_count("eval_batch_size", eval_batch_size)
        if not (client_chunk is None or (isinstance(client_chunk, str) and client_chunk == "auto")):
            try:
                client_chunk = check_count("client_chunk", client_chunk)
            except ValueError:
                raise ValueError(
                    f"client_chunk = {client_chunk!r} is invalid: use 'auto', None (all S "
                    "clients in one vmap) or a number of clients per chunk >= 1."
                ) from None
        self.client_chunk = client_chunk
        self.layout = SingleDevice() if layout is None else layout
        self.sampler = uniform if sampler is None else sampler
        if participation is None:
            participation = Participation()
        if not isinstance(participation, Participation):
            raise TypeError(
                "participation must be a scaffold_jax.participation.Participation (from "
                f"participation.make(...)), got {type(participation).__name__}."
            )
        self.participation = participation
        if execution is not None and not isinstance(execution, FedBuff):
            raise TypeError(
                "execution must be None (synchronous rounds) or a scaffold_jax.FedBuff, got "
                f"{type(execution).__name__}."
            )
        self.execution = execution
        # The execution mode, chosen once: its ``step`` is the round.
        self.mode = SYNCHRONOUS if execution is None else execution
        self.evaluators = tuple(evaluators)
        self.train_eval_examples = (
            None
            if train_eval_examples is None
            else check_count("train_eval_examples", train_eval_examples)
        )
        self.round = jax.jit(self.round_fn, donate_argnums=(1,))
        self.run_rounds = jax.jit(
            self.run_rounds_fn, static_argnames=("num_rounds",), donate_argnums=(1,)
        )
        self.evaluate = jax.jit(self.evaluate_fn)
        self.personalization = personalization
        self.evaluate_clients = jax.jit(self.evaluate_clients_fn)

    def replace(self, **changes: Any) -> Simulation:
        """A new simulation with some constructor arguments changed (e.g. ``layout=``)."""
        names = (
            "algorithm", "problem", "plan", "clients_per_round", "weighting",
            "weighting_options", "eval_batch_size", "client_chunk", "layout", "evaluators",
            "train_eval_examples", "sampler", "participation", "execution", "personalization",
        )  # fmt: skip
        return type(self)(**{name: changes.get(name, getattr(self, name)) for name in names})

    # ----------------------------------------------------------------- the pure programs
    def round_fn(
        self,
        hparams: HParams,
        state: SimState,
        data,
        key: jax.Array,
        diverged: jax.Array | None = None,
        configs: int | None = None,
    ):
        """One round (pure; :attr:`round` is its jitted, state-donating version).

        ``configs``: M configs of one seed at once (a sweep's group): ``hparams``,
        ``state.server``, ``state.clients``, ``state.model`` and ``diverged`` carry a
        leading ``[M]`` axis, ``state.round`` and ``state.participation`` are shared. The
        configs share the round's sample, keys and minibatches (as their single runs
        draw them), and each sampled client runs the M configs' local steps side by side
        (client-major ``[S, M, ...]`` rows: the M configs' dots are one wider dot, with
        no per-step transpose); the per-config rest of the round is vmapped over M. The
        metrics gain the leading ``[M]`` axis.

        ``diverged``: for the sweep's freeze policy, this config's carried flag (a bool
        scalar). When given, a round whose new server state or new client rows hold a
        NaN/Inf is NOT applied (nor is any round once ``diverged`` is set): the state keeps
        its previous values, only the round counter advances, and the metrics gain
        ``finite``, whether this round's results were finite (the rows after the
        algorithm's ``client_sync`` step included). The metrics always hold
        ``server_finite``, whether the round's new server state is finite, and the
        metrics of a ``server_update`` that returns a
        :class:`~scaffold_jax.types.ServerOutput`.
        """
        return self.mode.step(self.context(data, configs), hparams, state, data, key, diverged,
                              configs)  # fmt: skip

    def report(self, hparams: Mapping[str, Any], rounds: int, num_clients: int) -> dict:
        """The algorithm's host-side numbers for a record after ``rounds`` rounds with one
        config's ``hparams`` (a private run's ``dp_epsilon``; ``{}`` for most)."""
        if self.algorithm.report is None:
            return {}
        values = {k: float(np.asarray(v)) for k, v in hparams.items()}
        return dict(
            self.algorithm.report(
                values,
                rounds,
                num_clients,
                self.clients_per_round,
                privacy_sampling(self.sampler),
            )
        )

    def client_weights(self, data) -> jax.Array:
        """Every client's weight p_i (float32 ``[N]``) under the simulation's weighting."""
        return self._weigh(data.counts.astype(jnp.float32))

    def weights(self, data, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The aggregation weights of clients ``ids`` and the total weight of all N:
        ``(1, N)`` uniform, ``(n_i, Σ n_j)`` with ``weighting="num_examples"``."""
        return weights_of(None if self.equal_weights else self._weigh, data, ids)

    def warm_start_fn(self, state: SimState, data) -> SimState:
        """The state after the algorithm's ``warm_start`` pass over ALL N clients (the
        state itself when it has none). Clients run in chunks of S (or the round's CPU
        chunk), so the pass holds no more examples at once than a round does."""
        warm = self.algorithm.warm_start
        if warm is None:
            return state
        ids = jnp.arange(data.num_clients, dtype=jnp.int32)
        weights, _ = self.weights(data, ids)
        chunk = self.resolve_client_chunk(data) or min(self.clients_per_round, data.num_clients)
        clients, server = full_data_pass(
            warm, state.server, state.clients, ids, weights, data, chunk
        )
        return state._replace(server=server, clients=clients)

    def resolve_client_chunk(self, data, configs: int = 1) -> int | None:
        """How many sampled clients one vmapped chunk of the round runs (None: all S).

        ``client_chunk="auto"`` picks None on an accelerator or a layout that splits the
        clients over devices, where one kernel over all S clients is fastest, and on CPU
        as many clients as fit :data:`~scaffold_jax.resources.CLIENT_CHUNK_BYTES` of
        working set (their ``[K, B, ...]`` batches, one step's batch in float32 and four
        params-sized buffers), so that a chunk's K steps run in cache instead of streaming
        ``[S, params]`` buffers through memory at every step (measured in
        benchmarks/README.md), except for a model with convolutions or recurrences, which
        runs one client at a time on CPU (:meth:`one_client_at_a_time`). The chunk is
        balanced (the largest divisor of S in
        [chunk/2, chunk] when there is one): ``lax.map`` runs a remainder as one more,
        separately compiled, vmap. Results equal the unchunked round up to the order of
        floating-point sums. ``configs`` configurations vmapped side by side (a sweep's
        block) share the budget: a sweep asks for its chunk here and runs the round of
        ``replace(client_chunk=...)``.
        """
        return resources.client_chunk(
            self.client_chunk, self.participation.sampled(self.clients_per_round),
            not self.layout.allows_client_chunks, self.one_client_at_a_time(data),
            lambda: self.client_bytes(data) * configs,
        )  # fmt: skip

    def one_client_at_a_time(self, data) -> bool:
        """Whether the loss contains a convolution or a loop (a recurrent model), read from
        its jaxpr once. On CPU such models run one client at a time: vmapped clients, each
        with its own kernels, make every convolution a grouped one and every recurrent
        matmul a batched one, which XLA's CPU backend runs several times slower than one
        client's own (benchmarks/README.md, W4 and W5)."""
        if not hasattr(self, "_one_at_a_time"):
            self._one_at_a_time = resources.one_client_at_a_time(self.problem, self.plan, data)
        return self._one_at_a_time

    def configs_one_at_a_time(self, data) -> bool:
        """Whether a sweep runs its seeds, its configs (inside each client's work) and their
        evaluations one after another (``lax.map``) rather than vmapped: on CPU, for a model
        with convolutions or loops (:meth:`one_client_at_a_time`). Vmapped, each with its own
        kernels, they make every convolution a grouped one; on W4's CNN a sweep so vmapped
        took 6-7x the time of its configs run one by one (benchmarks/README.md)."""
        return jax.default_backend() == "cpu" and self.one_client_at_a_time(data)

    def traffic(self):
        """The bytes a participating client receives and sends per round
        (:func:`scaffold_jax.engine.communication.traffic`; a compressor's with its
        declared default bits or fraction)."""
        if not hasattr(self, "_traffic"):
            defaults = {k: h.default for k, h in self.algorithm.hparams.items()
                        if h.default is not None}  # fmt: skip
            self._traffic = communication.traffic(self.algorithm, self.problem.params, defaults)
        return self._traffic

    def context(self, data, configs: int | None = None) -> RoundContext:
        """The round's frozen context for ``data`` (:mod:`scaffold_jax.engine.context`)."""
        return RoundContext(
            self.algorithm, self.problem, self.plan, self.participation, self.sampler,
            self.layout, self.clients_per_round, self.resolve_client_chunk(data),
            bool(configs) and self.configs_one_at_a_time(data), self.traffic(),
            None if self.equal_weights else self._weigh,
        )  # fmt: skip

    def client_bytes(self, data) -> int:
        """The working set of one sampled client's local steps, in bytes (see
        :meth:`resolve_client_chunk`)."""
        return resources.client_bytes(self.problem, self.plan, data)

    def run_rounds_fn(
        self, hparams: HParams, state: SimState, data, key, num_rounds: int, stop=None
    ):
        """``num_rounds`` rounds as one loop; metrics gain a leading ``[R]`` axis.

        ``stop``: when given (an int32 scalar <= ``num_rounds``, traced), only the first
        ``stop`` rounds run and the metrics' rows from ``stop`` on are zeros: one compiled
        program serves every block length up to ``num_rounds`` (the host loop's, whatever
        its evaluation and checkpoint cadence; see :func:`repeat_rounds`).
        """

        def body(state):
            return self.round_fn(hparams, state, data, key)

        return repeat_rounds(body, state, num_rounds, stop)

    def evaluate_fn(self, server_state: PyTree, data, model: PyTree = None) -> dict[str, jax.Array]:
        """Centralised metrics of the server model x: every evaluator's, merged (by default
        ``test_loss`` / ``test_accuracy`` on ``data.test`` and ``train_loss``).

        ``model``: the state's running statistics (``SimState.model``), for a problem that
        keeps them; an evaluator with a ``model`` parameter gets them (the built-in ones
        evaluate in inference mode with them, see :meth:`per_example`), others do not."""
        if model is None and self.problem.model_state is not None:
            raise ValueError(
                "the model keeps running statistics: evaluate it with them, "
                "evaluate(state.server, data, state.model)."
            )
        params = self.algorithm.server_params(server_state)
        out: dict[str, jax.Array] = {}
        for evaluator in self.evaluators:
            extra = {"model": model} if takes(evaluator, "model") else {}
            out.update(evaluator(self, params, data, **extra))
        return out

    def evaluates_clients(self, data) -> bool:
        """Whether runs evaluate every client on its own test data
        (:meth:`evaluate_clients_fn`): the data has some and the problem an accuracy."""
        return getattr(data, "client_test", None) is not None and (
            self.problem.accuracy_fn is not None
        )

    def evaluate_clients_fn(self, hparams: HParams, state: SimState, data, key: jax.Array):
        """Each evaluated client's own model p_i and x on its own test data, in one pass:
        ``(metrics, per_client)`` (:func:`scaffold_jax.engine.personal.client_evaluation`;
        ``key`` is the run's)."""
        return personal.client_evaluation(self, hparams, state, data, key)

    def per_example(
        self,
        fn: Callable,
        params: PyTree,
        examples: PyTree,
        model: PyTree = None,
        owner: jax.Array | None = None,
    ) -> jax.Array:
        """See :func:`scaffold_jax.engine.evaluation.per_example`."""
        return evaluation.per_example(self, fn, params, examples, model, owner)

    def mean_statistics(self, model: PyTree, data) -> PyTree:
        """See :func:`scaffold_jax.engine.evaluation.mean_statistics`."""
        return evaluation.mean_statistics(self, model, data)

    # ----------------------------------------------------------------- the host-side API
    def init(self, data) -> SimState:
        """Checks the set-up against ``data`` and returns the initial :class:`SimState`,
        placed in this simulation's layout."""
        self.check(data)
        # The programs are kept per population size: a notebook calling run() again pays
        # for neither tracing nor compiling them twice.
        programs = self.__dict__.setdefault("_init_programs", {})
        if data.num_clients not in programs:
            build = init_program(self.algorithm, self.problem.params, data.num_clients,
                                 self.layout, self.problem, self.participation,
                                 self.execution)  # fmt: skip
            warm = None
            if self.algorithm.warm_start is not None:
                like = jax.eval_shape(build, self.problem.params)
                shardings = self.layout.state_shardings(like)  # reads only the structure
                warm = jax.jit(self.warm_start_fn, donate_argnums=(0,), out_shardings=shardings)
            programs[data.num_clients] = (build, warm)
        build, warm = programs[data.num_clients]
        state = build(self.problem.params)
        return state if warm is None else warm(state, data)

    def state_like(self, num_clients: int) -> SimState:
        """The state's shapes, dtypes and (in a client mesh) shardings for ``num_clients``:
        what a checkpoint is restored into, already placed."""
        self.layout.check_num_clients(num_clients)
        like = jax.eval_shape(
            lambda: initial_state(
                self.algorithm,
                self.problem.params,
                num_clients,
                self.problem,
                self.participation,
                self.execution,
            )  # fmt: skip
        )
        shardings = self.layout.state_shardings(like)
        if shardings is None:
            return like
        return jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            like,
            shardings,
        )

    def check(self, data) -> None:
        """Raises ValueError naming the problem if the simulation cannot run on ``data``.

        Once ``data`` passed, checking it again is free (a command checks before its
        folder is made, then ``run`` checks as every caller's does)."""
        checked = getattr(self, "_checked", None)
        if checked is not None and checked() is data:
            return
        check_simulation(self, data)
        try:
            self._checked = weakref.ref(data)
        except TypeError:  # data that cannot be referenced weakly: checked every time
            self._checked = None

    def resolve_hparams(self, hparams: HParams | Mapping[str, Any]) -> HParams:
        """``hparams`` completed with the algorithm's declared defaults and checked
        (see :func:`scaffold_jax.types.resolve_hparams`)."""
        return resolve_hparams(self.algorithm, hparams)
