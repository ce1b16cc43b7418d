"""What a simulation refuses before anything is compiled or allocated, each with a message
that names the problem and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax import compatibility, resources
from scaffold_jax.engine.state import initial_state
from scaffold_jax.local import takes
from scaffold_jax.sampling import check_sampler, privacy_sampling, takes_availability, uniform
from scaffold_jax.tree import tree_bytes
from scaffold_jax.types import STATE_POLICIES


def check_count(
    name: str, value: Any, minimum: int = 1, maximum: int | None = None, why: str = ""
) -> int:
    """``value`` as an int; ValueError unless it is an integer >= ``minimum`` (and <=
    ``maximum`` when given; ``why`` is appended to that message, e.g. :data:`SEED_WHY`).

    Integral floats (``1e3``) are accepted; ``2.5`` or ``True`` are not: ``int()`` would
    silently truncate them.
    """
    if isinstance(value, bool):
        as_int = None
    elif isinstance(value, (int, np.integer)):
        as_int = int(value)
    elif isinstance(value, (float, np.floating)) and float(value).is_integer():
        as_int = int(value)
    else:
        as_int = None
    if as_int is None:
        raise ValueError(f"{name} = {value!r} is invalid: it must be an integer >= {minimum}.")
    if as_int < minimum:
        raise ValueError(f"{name} = {value} is invalid: it must be >= {minimum}.")
    if maximum is not None and as_int > maximum:
        raise ValueError(f"{name} = {value} is invalid: it must be <= {maximum}{why}.")
    return as_int


MAX_SEED = 2**32 - 1
"""The largest seed: ``jax.random.key(seed)`` keeps only a seed's low 32 bits, so seed
``2**32 + s`` would silently repeat the run of seed ``s``."""

SEED_WHY = " (jax.random.key keeps only the low 32 bits: a larger seed repeats a smaller one)"

MAX_ROUNDS = 10_000_000
"""The most rounds one run may take. The round counter is int32 (2**31 - 1 at most), and
well before that a run stops being practical: its metrics and sampled clients are kept for
every round in memory (:func:`check_rounds_fit` refuses fewer rounds than this when they
do not fit), and the host loop plans its blocks of rounds before compiling (2e9 rounds
hung there, silently)."""

ROUNDS_WHY = (
    " (every round's metrics and sampled clients are kept in memory, and the blocks of "
    "rounds are planned before compiling)"
)


def check_simulation(sim, data) -> None:
    """Raises ValueError naming the problem if ``sim`` cannot run on ``data`` (see
    :meth:`Simulation.check`)."""
    if not all(hasattr(data, a) for a in ("num_clients", "counts", "client_batches")):
        raise TypeError(
            "data must be a federated dataset (a FederatedData, e.g. from "
            "scaffold_jax.from_client_arrays, or a procedural dataset with num_clients, "
            f"counts and client_batches); got {type(data).__name__}."
        )
    num_clients = data.num_clients
    if sim.clients_per_round > num_clients:
        raise ValueError(
            f"clients_per_round (S) = {sim.clients_per_round} exceeds the number of "
            f"clients N = {num_clients}; use S <= N."
        )
    if sim.algorithm.check is not None:
        extra = {}
        if takes(sim.algorithm.check, "sampling"):
            extra["sampling"] = privacy_sampling(sim.sampler)
        if takes(sim.algorithm.check, "participation"):
            extra["participation"] = sim.participation
        sim.algorithm.check(num_clients, sim.clients_per_round, sim.weighting, **extra)
    if sim.sampler is not uniform:
        check_sampler(sim.sampler, num_clients, sim.clients_per_round)
    _check_participation(sim, num_clients)
    _check_model_state(sim)
    _check_memory(sim, data)
    counts = np.asarray(data.counts)
    if counts.min() < 1:
        empty = np.flatnonzero(counts < 1)[:5].tolist()
        raise ValueError(f"clients {empty} have no data; every client needs >= 1 example.")
    test = getattr(data, "test", None)
    leaves = jax.tree.leaves(test)
    if test is not None and leaves and np.ndim(leaves[0]) and np.shape(leaves[0])[0] == 0:
        raise ValueError(
            "the test set is empty (0 examples): give it at least one example, or build "
            "the data with test=None to run without a held-out evaluation."
        )
    _check_problem_fits(sim, data)
    _check_labels(sim, data)
    stragglers = sim.participation.stragglers
    if stragglers is not None and hasattr(stragglers, "check"):
        # The most local steps a client takes (an epochs plan's: its largest client's).
        stragglers.check(int(sim.plan.shape(int(counts.max()))[0]))


def _check_participation(sim, num_clients: int) -> None:
    _check_clock(sim, num_clients)
    _check_execution(sim, num_clients)
    availability = sim.participation.availability
    if availability is None:
        return
    availability.check(num_clients)
    if not takes_availability(sim.sampler):
        raise ValueError(
            f"the availability model {availability.name!r} needs a client sampler that "
            "draws among the available clients (one that takes available=, as 'uniform' "
            "and 'poisson' do); this sampler does not. Add an `available=None` keyword "
            "to it (scaffold_jax.sampling.sample_available draws S of them), or use "
            "availability = 'always'."
        )


def _check_clock(sim, num_clients: int) -> None:
    """Refuses a virtual clock that would over-select more clients than there are."""
    profiles = sim.participation.profiles
    if profiles is None:
        return
    sampled = profiles.sampled(sim.clients_per_round)
    if sampled > num_clients:
        raise ValueError(
            f"over_selection = {profiles.over_selection} samples ceil(f * S) = {sampled} "
            f"clients a round, more than the N = {num_clients} there are: use a smaller "
            "over_selection or S."
        )


def _check_execution(sim, num_clients: int) -> None:
    """Refuses FedBuff (:mod:`scaffold_jax.engine.buffered`) where its contract is not
    written or the simulation cannot run it, each with the reason and the fix."""
    from scaffold_jax.algorithms import ALGORITHMS
    from scaffold_jax.engine.buffered import asynchronous_algorithms

    buff = sim.execution
    if buff is None:
        return
    name = sim.algorithm.name
    if not (name in ALGORITHMS and ALGORITHMS[name].asynchronous):
        raise ValueError(
            f"FedBuff has no asynchronous contract for {name!r} yet (what a stale update "
            f"does to its server state is not written): use one of "
            f"{', '.join(asynchronous_algorithms())}, or synchronous rounds."
        )
    if buff.concurrency > num_clients:
        raise ValueError(
            f"concurrency M = {buff.concurrency} exceeds the N = {num_clients} clients: at "
            "most N clients can be in flight; use M <= N."
        )
    part = sim.participation
    if part.profiles is None:
        raise ValueError(
            "FedBuff needs device profiles to time its clients (profiles = 'lognormal' or "
            "'file'; Python: participation.make(profiles=...))."
        )
    why = compatibility.refusal("fedbuff", compatibility.features_of(sim.algorithm, part,
                                                                     sim.problem))  # fmt: skip
    if why is not None:
        raise ValueError(why)


def _check_model_state(sim) -> None:
    """Refuses a model with running statistics that this simulation cannot carry."""
    problem = sim.problem
    if problem.model_state is None:
        return
    if problem.state_policy not in STATE_POLICIES:
        raise ValueError(
            f"Problem.state_policy={problem.state_policy!r} is unknown; use one of "
            f"{STATE_POLICIES}."
        )
    if problem.update_state is None:
        raise ValueError(
            "the problem has a model_state but no update_state: give "
            "update_state(params, state, batch, mask) -> state, the running statistics "
            "after a training forward pass (models.classification_problem builds it for "
            "a flax module)."
        )
    if not takes(sim.algorithm.client_update, "model_state"):
        raise ValueError(
            f"{sim.algorithm.name}'s client_update has no model_state parameter, so it "
            "cannot train a model with running statistics (BatchNorm's): add "
            "model_state=None to it and pass it to local_update / local_sgd (which "
            "advance it and return it in ClientOutput.model_state), or use a model "
            "without them (GroupNorm, LayerNorm)."
        )


def _check_memory(sim, data) -> None:
    """Refuses, before anything is compiled or allocated, a client table plus one chunk of
    the round's local work larger than the memory available for them (shapes from
    ``jax.eval_shape``: no allocation). A chunk's ``[K, B, ...]`` batches are gathered at
    once, so K = 5,018 steps of 126 examples of 2.1 million features (a fuzzed config)
    ask for 5.3 TB in the first round, not at the build."""
    num_clients = data.num_clients
    like = jax.eval_shape(
        lambda: initial_state(
            sim.algorithm, sim.problem.params, num_clients, sim.problem, sim.participation
        )
    )
    # The message transforms' table (compression's error-feedback residuals) is a second
    # client table beside the algorithm's.
    table = tree_bytes((like.clients, like.messages))
    try:
        chunk = sim.resolve_client_chunk(data) or sim.participation.sampled(sim.clients_per_round)
        work = chunk * sim.client_bytes(data)
    except Exception:  # data that do not fit the plan: reported by the checks below
        chunk, work = 0, 0
    mesh = getattr(sim.layout, "mesh", None)
    devices = list(np.asarray(mesh.devices).flat) if mesh is not None else [jax.devices()[0]]
    local = [d for d in devices if d.process_index == jax.process_index()] or devices
    # CPU "devices" of a process share its host memory; accelerators hold one block each.
    share = len(local) if local[0].platform == "cpu" else 1
    available = resources.available_memory_bytes(local[0])
    per = " per device" if share < len(devices) else ""
    where = f"{per} on {local[0].platform}"
    if table * share // len(devices) > available:
        needed = table * share // len(devices)
        raise ValueError(
            f"the client table of N = {num_clients} clients needs {needed} bytes "
            f"({resources.format_bytes(needed)}){per}, more than the {available} bytes "
            f"({resources.format_bytes(available)}) available{where}; one round's chunk "
            f"of {chunk} clients adds {work} bytes of local work. Use fewer clients N or a "
            "smaller model, or split the table over more devices with a ClientMesh layout "
            "(scaffold_jax.layout)."
        )
    needed = (table + work) * share // len(devices)
    if needed > available:
        who = "one client gathers" if chunk == 1 else f"each chunk of {chunk} clients gathers"
        smaller = "" if chunk == 1 else ", client_chunk=1"
        raise ValueError(
            f"one round's local work needs {needed} bytes ({resources.format_bytes(needed)})"
            f"{per} with the client table, more than the {available} bytes "
            f"({resources.format_bytes(available)}) available{where}: {who} its "
            f"K = {sim.plan.num_steps} local steps' batches at once "
            f"({resources.format_bytes(work)}). Use fewer local steps or a smaller batch "
            f"size{smaller}, or a smaller model."
        )


def _check_labels(sim, data) -> None:
    """Integer labels of materialised data must index the problem's C classes."""
    num_classes = getattr(sim.problem, "num_classes", None)
    if num_classes is None:
        return
    sets = {"the clients' examples": getattr(data, "examples", None)}
    sets["the test set"] = getattr(data, "test", None)
    for where, examples in sets.items():
        if not isinstance(examples, Mapping) or "y" not in examples:
            continue
        if not getattr(examples["y"], "is_fully_addressable", True):
            continue  # spread over processes: each process checks its own input data
        labels = np.asarray(examples["y"])
        if not np.issubdtype(labels.dtype, np.integer) or labels.size == 0:
            continue
        bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
        if bad.size:
            wider = (
                ""
                if labels.min() < 0
                else f", or build the model with num_classes > {labels.max()}"
            )
            raise ValueError(
                f"labels must be class indices in [0, {num_classes}) for this model: "
                f"label {labels[bad[0]]} at index {bad[0]} of {where} ({bad.size} labels "
                f"out of range). Remap the labels to 0..{num_classes - 1}{wider}."
            )


def _check_problem_fits(sim, data) -> None:
    batches, mask = jax.eval_shape(lambda: data.client_batches(jnp.int32(0), jr.key(0), sim.plan))
    batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), batches)
    try:
        out = jax.eval_shape(sim.problem.loss_fn, sim.problem.params, batch)
    except Exception as err:  # flax, optax and jnp each raise their own error types
        shapes = jax.tree.map(lambda s: (tuple(s.shape), str(s.dtype)), batch)
        params = jax.tree.map(lambda a: tuple(jnp.shape(a)), sim.problem.params)
        raise ValueError(
            "the model's params do not fit the data: loss_fn(params, batch) failed for a "
            f"batch with shapes {shapes} and params with shapes {params}. Build the model "
            f"for the data's example shape and number of classes. ({err})"
        ) from err
    if tuple(out.shape) != tuple(mask.shape[1:]):
        raise ValueError(
            f"loss_fn must return one loss per example, shape {tuple(mask.shape[1:])}; it "
            f"returned shape {tuple(out.shape)}. Return per-example losses, not a mean."
        )
    test = getattr(data, "test", None)
    if test is not None:
        # Evaluation runs the loss on the test set too; a set the model cannot read would
        # otherwise fail deep inside the compiled evaluation with a flax or KeyError.
        structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), test)
        try:
            jax.eval_shape(sim.problem.loss_fn, sim.problem.params, structs)
        except Exception as err:
            shapes = jax.tree.map(lambda s: (tuple(s.shape), str(s.dtype)), structs)
            train = jax.tree.map(lambda s: (tuple(s.shape[1:]), str(s.dtype)), batch)
            raise ValueError(
                f"the test set does not fit the model: loss_fn(params, test) failed for a "
                f"test set with shapes {shapes} (training batches: {train}). Give the "
                f"test set the fields and example shape of the training data. ({err})"
            ) from err


def check_rounds_fit(sim, num_rounds: int, configs: int = 1) -> None:
    """Refuses, before anything is compiled, ``num_rounds`` rounds whose per-round metrics
    cannot be kept in memory: a run keeps every round's metrics (the S sampled ids, which
    of them reported, ~16 scalars) of every config, once in the compiled block's buffer and
    once on the host. (Found by the fuzz test: 10 million rounds of S = 200 asked for
    8.4 GB at the end of the block, and the kernel's OOM killer took the process.)"""
    per_round = configs * (4 * sim.clients_per_round * 2 + 64)
    needed = 2 * num_rounds * per_round
    available = resources.available_memory_bytes()
    if needed <= available:
        return
    fits = max(1, available // (2 * per_round))
    raise ValueError(
        f"num_rounds = {num_rounds} with S = {sim.clients_per_round} clients a round"
        f"{f' and {configs} configs' if configs > 1 else ''} keeps {needed} bytes "
        f"({resources.format_bytes(needed)}) of per-round metrics in memory (the sampled ids "
        f"and the round's scalars of every round), more than the {available} bytes "
        f"({resources.format_bytes(available)}) available: use num_rounds <= {fits}, or "
        "fewer clients a round."
    )
