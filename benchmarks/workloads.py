"""The benchmark workloads W1-W3 (dense models) and the programs that time them.

Workloads (synthetic data with the real shapes: 28×28 uint8 images, int32 labels; the cost
of a round does not depend on pixel values):

====== ==================================== ===== =========================== =========
name   clients × examples                   S     local steps                 model
====== ==================================== ===== =========================== =========
W1     1,000 × 60, 10 classes               100   K = 5, B = 12 (fixed)       logreg
W2     100 × 1,128, 47 classes              20    5 epochs at 0.2 (K = 25)    logreg
W2-mlp as W2                                20    as W2                       MLP 256²
W3     10,000 × 50, 10 classes              1,000 K = 10, B = 10 (fixed)      logreg
W6     200 clients, 60,000 examples split   20    2 epochs of B = 32          logreg
       Dirichlet α = 0.1 (1..~2,200 each)         (1..~140 steps, mean ~20)
====== ==================================== ===== =========================== =========

(1,128 examples per client is EMNIST-balanced's 112,800 training images over 100 clients.
W6 is the skewed-size case: Fashion-MNIST's 60,000 images split by Dirichlet label skew,
each client a different size, so that an epochs plan gives each a different step count.)

Every workload runs for SCAFFOLD (option II and I), FedAvg, FedProx, SGD, FedDyn, FedNova,
Mime and MimeLite. For each,
three programs do the same gradient work, and are timed in ONE process, interleaved, so
that their ratios survive a noisy shared machine:

* ``engine``: :meth:`Simulation.run_rounds` — R rounds as one compiled ``lax.scan``:
  sampling, batch drawing and gathering, the vmapped local solver, aggregation, the client
  table scatter, metrics.
* ``bare``: the floor of this formulation — the smallest JAX program doing the same
  per-client gradient work on PRE-GATHERED batches ``[S, K, B, ...]``: ``vmap`` over the S
  clients of a K-step ``lax.scan`` of ``x ← x − η ∇ mean loss`` with the same flax loss,
  no sampling, no masks, no client table; the only "aggregation" is ``x ← mean_S y``, which
  keeps XLA from hoisting the round out of the loop. SGD's bare program is one gradient
  over the K·B examples per client; SCAFFOLD option I's adds that gradient to the K steps;
  MimeLite's starts with one gradient over the client's n_i examples (its full-data pass),
  Mime's also takes two gradients per step (at y and at x, on the same batch).
  ``bare`` takes the gradient of the same model with flax's ``nn.Dense`` kernels
  (``[in, out]``, :func:`flax_layout_problem`), all S clients in one vmap;
  ``bare_tuned`` does the same work with the package's models (kernels ``[out, in]``,
  :class:`scaffold_jax.models.Dense`) in the engine's client chunks, the fastest
  formulation of the local step we found.
* ``loop``: the per-client loop — a jitted client function (batch drawing + K steps) called
  from Python once per sampled client, then a jitted server update (how most simulators
  run; :func:`loop_program`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from common import peak_rss_mib, ratio_rows

import scaffold_jax as sj
from scaffold_jax.engine import client_keys, round_key_and_ids
from scaffold_jax.tree import take_rows
from scaffold_jax.types import resolve_hparams

IMAGE_SHAPE = (28, 28)
ALGORITHMS = (
    "scaffold", "scaffold-I", "fedavg", "fedprox", "sgd", "feddyn", "fednova", "mime", "mimelite",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Workload:
    """A benchmark workload (all static)."""

    name: str
    num_clients: int
    per_client: int
    num_classes: int
    clients_per_round: int
    plan: sj.BatchPlan
    model: str = "logreg"  # or "mlp"
    hidden_sizes: tuple[int, ...] = (256, 256)
    rounds: int = 10  # rounds per compiled engine program (timing)
    # Dirichlet label skew of the num_clients × per_client examples (unequal client sizes),
    # None: every client holds per_client examples
    alpha: float | None = None
    loop_rounds: int = 2  # rounds of the per-client loop (timing)

    @property
    def steps_and_batch(self) -> tuple[int, int]:
        return self.plan.shape(self.per_client)

    def describe(self) -> str:
        k, b = self.steps_and_batch
        return (
            f"{self.name}: N={self.num_clients}×{self.per_client}, d=784, "
            f"{self.num_classes} classes, {self.model}, S={self.clients_per_round}, K={k}, "
            f"B={b} ({self.plan.kind})"
        )


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", 1000, 60, 10, 100, sj.BatchPlan.fixed(12, 5), rounds=20, loop_rounds=3),
    "W2": Workload(
        "W2", 100, 1128, 47, 20, sj.BatchPlan.fraction_of_data(0.2, 5), rounds=2, loop_rounds=1
    ),
    "W2-mlp": Workload(
        "W2-mlp",
        100,
        1128,
        47,
        20,
        sj.BatchPlan.fraction_of_data(0.2, 5),
        model="mlp",
        rounds=1,
        loop_rounds=1,
    ),
    "W3": Workload("W3", 10_000, 50, 10, 1000, sj.BatchPlan.fixed(10, 10), rounds=3, loop_rounds=1),
    "W6": Workload(
        "W6", 200, 300, 10, 20, sj.BatchPlan.epochs(32, 2), alpha=0.1, rounds=5, loop_rounds=2
    ),
}

# --quick: the same shapes per client, fewer clients and examples (a smoke test of the
# scripts, e.g. in CI; the numbers mean little).
QUICK: dict[str, Workload] = {
    "W1": dataclasses.replace(WORKLOADS["W1"], num_clients=200, clients_per_round=20, rounds=3),
    "W2": dataclasses.replace(WORKLOADS["W2"], num_clients=10, per_client=120, clients_per_round=4),
    "W2-mlp": dataclasses.replace(
        WORKLOADS["W2-mlp"],
        num_clients=10,
        per_client=120,
        clients_per_round=4,
        hidden_sizes=(32, 32),
    ),
    "W3": dataclasses.replace(WORKLOADS["W3"], num_clients=400, clients_per_round=40, rounds=2),
    "W6": dataclasses.replace(WORKLOADS["W6"], num_clients=40, per_client=100, clients_per_round=8),
}


def get_workload(name: str, quick: bool = False) -> Workload:
    table = QUICK if quick else WORKLOADS
    if name not in table:
        raise ValueError(f"workload {name!r} is unknown; use one of {sorted(table)}.")
    return table[name]


# ----------------------------------------------------------------------------- the problem
def make_data(w: Workload, seed: int = 0) -> sj.FederatedData:
    """Synthetic uint8 images and int32 labels, each client's rows contiguous: client i at
    ``[i n, (i + 1) n)``, or, with ``w.alpha``, clients of the sizes of a Dirichlet label
    split (:func:`scaffold_jax.data.partition.dirichlet_split`) of balanced labels.

    Built directly as a :class:`FederatedData` (no concatenation), so the host holds one
    copy of the examples while they are moved to the device.
    """
    rng = np.random.default_rng(seed)
    n = w.num_clients * w.per_client
    x = rng.integers(0, 256, (n, *IMAGE_SHAPE), dtype=np.uint8)
    y = rng.integers(0, w.num_classes, n).astype(np.int32)
    counts = np.full(w.num_clients, w.per_client, np.int32)
    if w.alpha is not None:
        y = np.arange(n, dtype=np.int32) % w.num_classes
        parts = sj.data.partition.dirichlet_split(y, w.num_clients, w.alpha, seed)
        y = y[np.concatenate(parts)]
        counts = np.array([len(p) for p in parts], np.int32)
    test = {"x": jnp.asarray(x[:1000]), "y": jnp.asarray(y[:1000])}
    examples = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    del x, y
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return sj.FederatedData(
        examples=examples,
        offsets=jnp.asarray(offsets, jnp.int32),
        counts=jnp.asarray(counts),
        test=test,
        num_clients=w.num_clients,
        max_count=int(counts.max()),
    )


def useful_step_fraction(sim: sj.Simulation, data, client_ids: np.ndarray) -> dict[str, float]:
    """The fraction of the local steps run that are a client's own (not padding), for the
    sampled ``client_ids`` ``[R, S]``: the engine now (clients sorted by step count into
    its chunks, each chunk as long as its longest client) and a round that pads every
    client to the K of the largest client (the engine before)."""
    steps = np.asarray(sim.plan.local_steps(np.asarray(data.counts)))[client_ids]  # [R, S]
    padded = sim.plan.shape(data.max_count)[0]
    chunk = sim.resolve_client_chunk(data) or steps.shape[1]
    ordered = -np.sort(-steps, axis=1)
    run = sum(
        part.shape[1] * part.max(axis=1)
        for part in np.array_split(ordered, range(chunk, steps.shape[1], chunk), axis=1)
    )
    return {
        "useful_steps": float(steps.sum() / np.sum(run)),
        "useful_steps_padded": float(steps.mean() / padded),
        "mean_steps": float(steps.mean()),
        "padded_steps": padded,
    }


def make_problem(w: Workload) -> sj.Problem:
    if w.model == "logreg":
        return sj.models.logistic_regression(IMAGE_SHAPE, w.num_classes)
    return sj.models.mlp(IMAGE_SHAPE, w.num_classes, hidden_sizes=w.hidden_sizes)


class _FlaxLayoutNet(nn.Module):
    """The workload's model with flax's own ``nn.Dense`` (kernels stored ``[in, out]``)."""

    hidden_sizes: tuple[int, ...]
    num_classes: int

    @nn.compact
    def __call__(self, x):
        h = x.astype(jnp.float32).reshape((x.shape[0], -1)) * (1.0 / 255.0)
        for width in self.hidden_sizes:
            h = nn.relu(nn.Dense(width)(h))
        return nn.Dense(self.num_classes)(h)


def flax_layout_problem(w: Workload) -> sj.Problem:
    """:func:`make_problem`'s model with kernels stored ``[in, out]``, as flax's
    ``nn.Dense`` stores them: the layout before the models took ``[out, in]``
    (:class:`scaffold_jax.models.Dense`). The ``bare`` floor and the ablation's "stored
    layout" stage use it."""
    hidden = tuple(w.hidden_sizes) if w.model == "mlp" else ()
    module = _FlaxLayoutNet(hidden, w.num_classes)
    problem = sj.models.classification_problem(module, IMAGE_SHAPE, jr.key(0))
    if w.model == "logreg":  # zero-initialised, as logistic_regression is
        problem = problem._replace(params=jax.tree.map(jnp.zeros_like, problem.params))
    return problem


def make_algorithm(name: str, loss_fn) -> sj.Algorithm:
    if name == "scaffold":
        return sj.scaffold(loss_fn, option=2)
    if name == "scaffold-I":
        return sj.scaffold(loss_fn, option=1)
    if name == "apfl":  # adaptive: what FedJAX's APFL always is
        return sj.algorithms.make("apfl", loss_fn, adaptive=True)
    return sj.algorithms.make(name, loss_fn)


def make_hparams(name: str, algorithm: sj.Algorithm | None = None) -> sj.HParams:
    """η_l = 0.05 (FedProx μ = 0.01), the algorithm's declared defaults for the rest."""
    hp = sj.hparams(client_lr=0.05, **({"prox_mu": 0.01} if name == "fedprox" else {}))
    return hp if algorithm is None else resolve_hparams(algorithm, hp)


def gradient_kind(name: str) -> str:
    """The per-client gradient work of an algorithm: "steps" (K minibatch gradients),
    "grad" (one over the drawn data), "steps+grad" (both), "full+steps" (one over the
    client's whole data, then K: MimeLite), "full+2steps" (Mime: two gradients a step)."""
    return {
        "sgd": "grad",
        "scaffold-I": "steps+grad",
        "mimelite": "full+steps",
        "mime": "full+2steps",
    }.get(name, "steps")


# ----------------------------------------------------------------------------- FLOPs
def layer_dims(w: Workload) -> list[tuple[int, int]]:
    d = math.prod(IMAGE_SHAPE)
    sizes = [d, *(w.hidden_sizes if w.model == "mlp" else ()), w.num_classes]
    return list(zip(sizes[:-1], sizes[1:], strict=True))


def flops_per_example_gradient(w: Workload) -> int:
    """Matmul FLOPs of one example's forward and backward pass (2 per multiply-add):
    forward, weight gradients, and input gradients of every layer but the first."""
    dims = layer_dims(w)
    macs = sum(i * o for i, o in dims)
    return 2 * macs + 2 * macs + 2 * sum(i * o for i, o in dims[1:])


def examples_per_client_round(w: Workload, name: str) -> int:
    """Examples whose gradient one client computes in a round (real ones, not padding)."""
    k, b = w.steps_and_batch
    drawn = w.plan.num_epochs * w.per_client if w.plan.kind in ("fraction", "epochs") else k * b
    full = w.per_client
    return {
        "steps": drawn,
        "grad": drawn,
        "steps+grad": 2 * drawn,
        "full+steps": full + drawn,
        "full+2steps": full + 2 * drawn,
    }[gradient_kind(name)]


def flops_per_round(w: Workload, name: str) -> int:
    return w.clients_per_round * examples_per_client_round(w, name) * flops_per_example_gradient(w)


# ----------------------------------------------------------------------------- programs
def engine_program(w: Workload, name: str, data, problem, client_chunk="auto"):
    """``(sim, run, state, compile_s, memory)``: the compiled ``run_rounds`` program."""
    alg = make_algorithm(name, problem.loss_fn)
    sim = sj.Simulation(alg, problem, w.plan, w.clients_per_round, client_chunk=client_chunk)
    hp = make_hparams(name, alg)
    state = sim.init(data)
    key = jr.key(0)
    start, cpu_start = time.perf_counter(), cpu_seconds()
    compiled = sim.run_rounds.lower(hp, state, data, key, num_rounds=w.rounds).compile()
    compile_s = (time.perf_counter() - start, cpu_seconds() - cpu_start)
    memory = memory_stats(compiled)

    def run(state):
        return compiled(hp, state, data, key)[0]

    return sim, run, state, compile_s, memory


def memory_stats(compiled) -> dict[str, int] | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return {
        k: int(getattr(stats, k))
        for k in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
        )
    }


def bare_program(
    w: Workload, name: str, problem, tuned: bool, chunk: int | None = None, seed: int = 1
):
    """``(run, x0)``: R rounds of the bare per-client gradient work (module docstring).

    ``tuned``: ``problem`` as given (the models' ``[out, in]`` kernels) and the S clients
    run ``chunk`` at a time (the engine's
    :meth:`~scaffold_jax.Simulation.resolve_client_chunk`; None: all S); otherwise the
    same model with flax's ``[in, out]`` kernels (:func:`flax_layout_problem`), all S in
    one vmap.
    """
    k, b = w.steps_and_batch
    s = w.clients_per_round
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.integers(0, 256, (s, k, b, *IMAGE_SHAPE), dtype=np.uint8))
    ys = jnp.asarray(rng.integers(0, w.num_classes, (s, k, b)).astype(np.int32))
    lr = 0.05
    kind = gradient_kind(name)
    if not tuned:
        problem = flax_layout_problem(w)
    params = jax.tree.map(jnp.asarray, problem.params)

    def grad(p, x, y):
        return jax.grad(lambda q: jnp.mean(problem.loss_fn(q, {"x": x, "y": y})))(p)

    def client(p, cx, cy):  # cx [K, B, ...]
        out = p
        if kind.startswith("full"):  # the client's whole data once (the first n_i drawn)
            n = min(w.per_client, k * b)
            g_full = grad(p, cx.reshape(-1, *cx.shape[2:])[:n], cy.reshape(-1)[:n])
            p = jax.tree.map(lambda a, gg: a - 0.0 * gg, p, g_full)  # keeps it computed
        if kind in ("steps", "steps+grad", "full+steps", "full+2steps"):

            def step(q, batch):
                g = grad(q, *batch)
                if kind == "full+2steps":  # Mime: the same batch's gradient at x
                    g = jax.tree.map(jnp.subtract, g, grad(p, *batch))
                return jax.tree.map(lambda a, gg: a - lr * gg, q, g), None

            out, _ = jax.lax.scan(step, p, (cx, cy))
        if kind in ("grad", "steps+grad"):
            flat_x = cx.reshape(-1, *cx.shape[2:])
            g = grad(p, flat_x, cy.reshape(-1))
            out = jax.tree.map(lambda a, gg: a - lr * gg, out, g)
        return out

    rounds = w.rounds
    chunk = chunk if tuned else None

    @jax.jit
    def run(x):
        def one(p, _):
            # The barrier ties the batches to the round, so that XLA cannot hoist work on
            # them (the uint8 -> float32 conversion) out of the round loop.
            p, bx, by = jax.lax.optimization_barrier((p, xs, ys))
            if chunk is None:
                y = jax.vmap(client, in_axes=(None, 0, 0))(p, bx, by)
            else:
                y = jax.lax.map(lambda a: client(p, *a), (bx, by), batch_size=chunk)
            return jax.tree.map(lambda a: jnp.mean(a, axis=0), y), None

        p, _ = jax.lax.scan(one, x, None, length=rounds)
        return p

    return run, params


def loop_program(sim, data, hp):
    """One round of the per-client loop: Python iterates over the sampled clients."""
    alg, plan, w_s = sim.algorithm, sim.plan, sim.clients_per_round

    @jax.jit
    def client(hp, server, row, client_id, key):
        batches, mask = data.client_batches(client_id, key, plan)
        return alg.client_update(hp, server, row, batches, mask, key)

    @jax.jit
    def server_step(hp, server, outputs):
        return alg.server_update(hp, server, outputs, jnp.float32(data.num_clients))

    sample = jax.jit(lambda key, r: round_key_and_ids(key, r, data.num_clients, w_s))
    key = jr.key(0)
    full_pass = alg.pre_round

    @jax.jit
    def pre_client(server, row, client_id):
        batches, mask = data.client_batches(client_id, key, sj.BatchPlan.full(1))
        return full_pass.client(server, row, jax.tree.map(lambda a: a[0], batches), mask[0])

    @jax.jit
    def pre_server(server, messages):
        return full_pass.server(server, jax.tree.map(lambda m: jnp.mean(m, axis=0), messages))

    def one_round(state):
        round_key, ids = sample(key, state.round)
        keys = client_keys(round_key, ids)
        server = state.server
        if full_pass is not None:  # Mime: every sampled client's full-batch gradient first
            messages = [pre_client(server, take_rows(state.clients, ids[s]), ids[s])[1]
                        for s in range(w_s)]  # fmt: skip
            server = pre_server(server, jax.tree.map(lambda *xs: jnp.stack(xs), *messages))
        rows_out, outs = [], []
        for s in range(w_s):
            row = take_rows(state.clients, ids[s])
            new_row, out = client(hp, server, row, ids[s], keys[s])
            rows_out.append(new_row)
            outs.append(out)
        outputs = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
        server = server_step(hp, server, outputs)
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *rows_out)
        clients = jax.tree.map(lambda a, v: a.at[ids].set(v), state.clients, stacked)
        return sj.SimState(server, clients, state.round + 1)

    return one_round


# ----------------------------------------------------------------------------- measuring


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(fn, arg, cpu: list | None = None):
    """``(fn(arg), wall seconds)``; appends the CPU seconds to ``cpu`` when given."""
    cpu_start = cpu_seconds()
    start = time.perf_counter()
    out = fn(arg)
    jax.block_until_ready(out)
    wall = time.perf_counter() - start
    if cpu is not None:
        cpu.append(cpu_seconds() - cpu_start)
    return out, wall


def tree_bytes(tree) -> int:
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree)))


def _interleaved(
    programs: dict, repeats: int, rounds: dict, stateless=("bare", "bare_tuned")
) -> tuple[dict, dict, dict]:
    """Runs every ``(fn, arg)`` of ``programs`` once per repeat, in turn. A program's
    output is its next argument (the engine's state, donated), except for the
    ``stateless`` ones (the bare programs restart from the same params). Returns
    per-round wall and CPU seconds (lists) and the final arguments."""
    args = {k: a for k, (_, a) in programs.items()}
    wall = {k: [] for k in programs}
    cpu = {k: [] for k in programs}
    for repeat in range(repeats + 1):  # repeat 0 is the warm-up
        for k, (fn, _) in programs.items():
            c: list[float] = []
            out, t = _timed(fn, args[k], c)
            if k not in stateless:
                args[k] = out
            if repeat:
                wall[k].append(t / rounds[k])
                cpu[k].append(c[0] / rounds[k])
    return wall, cpu, args


def measure(
    w: Workload,
    name: str,
    data,
    problem,
    repeats: int = 5,
    loop: bool = True,
    unchunked: bool = True,
) -> dict[str, Any]:
    """Times engine, unchunked (the engine with ``client_chunk=None``, where the engine
    chunks), bare and bare_tuned (interleaved, min of ``repeats``), then the per-client
    loop. Everything in ms per round.

    Memory: ``engine_rss_mib`` is the process's peak RSS after the engine alone has been
    compiled and run (data + client table + the round's working set + XLA itself; in a
    fresh process, as ``run_all.py`` runs each algorithm, it is the engine's own peak,
    unless building the data peaked higher); ``current_rss_*`` are resident sizes (not
    peaks) just before and after the engine; ``peak_rss_mib`` is the peak after everything
    (bare programs, loop) ran.
    """
    rss_before, current_before = peak_rss_mib(), current_rss_mib()
    sim, engine, state, compile_s, memory = engine_program(w, name, data, problem)
    state, _ = _timed(engine, state)
    state, _ = _timed(engine, state)
    engine_rss, current_engine = peak_rss_mib(), current_rss_mib()
    programs = {"engine": (engine, state)}
    rounds = {"engine": w.rounds}
    chunk = sim.resolve_client_chunk(data)
    if unchunked and chunk is not None:
        _, run, ustate, ucompile, umemory = engine_program(w, name, data, problem, None)
        programs["unchunked"] = (run, ustate)
        rounds["unchunked"] = w.rounds
    for tuned, key in ((False, "bare"), (True, "bare_tuned")):
        fn, x0 = bare_program(w, name, problem, tuned=tuned, chunk=chunk)
        programs[key] = (fn, x0)
        rounds[key] = w.rounds
    start = time.perf_counter()
    jax.block_until_ready(programs["bare"][0](programs["bare"][1]))
    bare_compile_s = time.perf_counter() - start
    wall, cpu, args = _interleaved(programs, repeats, rounds)
    best = {k: min(v) for k, v in wall.items()}
    best_cpu = {k: min(v) for k, v in cpu.items()}
    state = args["engine"]
    row: dict[str, Any] = {
        "workload": w.name,
        "algorithm": name,
        "rounds_per_program": w.rounds,
        "repeats": repeats,
        "compile_s": compile_s[0],
        "compile_cpu_s": compile_s[1],
        "bare_compile_s": bare_compile_s,
        "engine_ms": best["engine"] * 1e3,
        "bare_ms": best["bare"] * 1e3,
        "bare_tuned_ms": best["bare_tuned"] * 1e3,
        "engine_over_bare": best["engine"] / best["bare"],
        "engine_over_bare_tuned": best["engine"] / best["bare_tuned"],
        # the ratio per repeat (the two measured back to back), median
        "engine_over_bare_median": float(np.median(np.divide(wall["engine"], wall["bare"]))),
        # CPU time (all threads) per round: insensitive to being descheduled by neighbours
        "cpu_ms": {k: v * 1e3 for k, v in best_cpu.items()},
        "all_ms": {k: [t * 1e3 for t in v] for k, v in wall.items()},
        "flops_per_round": flops_per_round(w, name),
        "memory_analysis": memory,
        "client_table_bytes": tree_bytes(state.clients),
        "data_bytes": tree_bytes(data.examples),
        "client_chunk": chunk,
        "rss_before_engine_mib": rss_before,
        "engine_rss_mib": engine_rss,
        # resident now (not peak): before the engine (data on device, host copy freed) and
        # after it ran; the difference is the engine's table, program and working set
        "current_rss_before_engine_mib": current_before,
        "current_rss_engine_mib": current_engine,
    }
    if "unchunked" in best:
        row["unchunked_ms"] = best["unchunked"] * 1e3
        row["unchunked_over_engine"] = best["unchunked"] / best["engine"]
        row["unchunked_compile_s"] = ucompile[0]
        row["unchunked_memory_analysis"] = umemory
    row["engine_gflops"] = row["flops_per_round"] / best["engine"] / 1e9
    row["best_gflops"] = row["engine_gflops"]
    row["bare_gflops"] = row["flops_per_round"] / best["bare"] / 1e9
    row["bare_tuned_gflops"] = row["flops_per_round"] / best["bare_tuned"] / 1e9
    if memory is not None and row["client_table_bytes"]:
        # A hidden per-round copy of the [N, ...] table would show up as temp space of at
        # least its size; the donated table is aliased to the output instead.
        row["temp_over_table"] = memory["temp_size_in_bytes"] / row["client_table_bytes"]
        row["alias_over_table"] = memory["alias_size_in_bytes"] / row["client_table_bytes"]
    if loop:
        one_round = loop_program(sim, data, make_hparams(name, sim.algorithm))
        lstate = sim.init(data)
        lstate, _ = _timed(one_round, lstate)  # compile
        loop_times = []
        for _ in range(w.loop_rounds):
            lstate, t = _timed(one_round, lstate)
            loop_times.append(t)
        row["loop_ms"] = min(loop_times) * 1e3
        row["loop_over_engine"] = row["loop_ms"] / row["engine_ms"]
    row["peak_rss_mib"] = peak_rss_mib()
    return row


# ----------------------------------------------------------------------------- ablation
def _argsort_permutations(key, count, max_count, num, width=None):
    """The sampler before the top_k change (a full stable argsort per step)."""
    u = jr.uniform(key, (num, max_count))
    u = jnp.where(jnp.arange(max_count) < count, u, 2.0)
    perms = jnp.argsort(u, axis=-1).astype(jnp.int32)
    return perms if width is None else perms[:, :width]


class _patched:
    """Temporarily replaces module attributes while a program is traced."""

    def __init__(self, patches):
        self.patches = patches
        self.saved = []

    def __enter__(self):
        for module, attr, value in self.patches:
            self.saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)

    def __exit__(self, *exc):
        for module, attr, value in reversed(self.saved):
            setattr(module, attr, value)


def ablation(w: Workload, name: str, data, problem, repeats: int = 5) -> list[dict]:
    """ms/round of the engine with each optimisation undone or added, in one process.

    Stages (cumulative): ``before`` (argsort sampler, kernels in their stored layout, all
    S clients in one vmap), ``+top_k sampler``, ``+compute layout``, ``+client chunks``
    (= the engine now, where it chunks); and, apart, the engine now with ONE round per
    compiled call (no multi-round scan), with that and no donation, and with float32
    instead of uint8 images.
    """
    import scaffold_jax.data.batching as batching

    sorted_sampler = (batching, "_permutations", _argsort_permutations)
    flax_problem = flax_layout_problem(w)
    programs, rounds, compile_s = {}, {}, {}

    def add(label, patches=(), w_=w, data_=data, donate=True, client_chunk="auto", problem=problem):
        with _patched(patches):
            alg = make_algorithm(name, problem.loss_fn)
            sim = sj.Simulation(
                alg, problem, w_.plan, w_.clients_per_round, client_chunk=client_chunk
            )
            hp, key, state = make_hparams(name, sim.algorithm), jr.key(0), sim.init(data_)
            fn = jax.jit(
                sim.run_rounds_fn,
                static_argnames=("num_rounds",),
                donate_argnums=(1,) if donate else (),
            )
            start = time.perf_counter()
            compiled = fn.lower(hp, state, data_, key, num_rounds=w_.rounds).compile()
            compile_s[label] = time.perf_counter() - start
        programs[label] = (lambda st, c=compiled, d=data_: c(hp, st, d, key)[0], state)
        rounds[label] = w_.rounds

    alg = make_algorithm(name, problem.loss_fn)
    chunk = sj.Simulation(alg, problem, w.plan, w.clients_per_round).resolve_client_chunk(data)
    add(
        "ablation: before (argsort sampler, stored layout, one vmap)",
        (sorted_sampler,),
        client_chunk=None,
        problem=flax_problem,
    )
    add("ablation: + top_k sampler", client_chunk=None, problem=flax_problem)
    if chunk is None:
        add("ablation: + compute layout (engine now)")
    else:
        add("ablation: + compute layout", client_chunk=None)
        add(f"ablation: + client chunks of {chunk} (engine now)")
    one = dataclasses.replace(w, rounds=1)
    add("ablation: engine now, 1 round per call", w_=one)
    add("ablation: engine now, 1 round per call, no donation", w_=one, donate=False)
    float_data = data.replace(
        examples={**data.examples, "x": data.examples["x"].astype(jnp.float32) / 255.0}
    )
    add("ablation: engine now, float32 images", data_=float_data)
    wall, cpu, _ = _interleaved(programs, repeats, rounds)
    return [
        {
            "workload": w.name,
            "algorithm": name,
            "variant": label.removeprefix("ablation: "),
            "ms": min(wall[label]) * 1e3,
            "cpu_ms": min(cpu[label]) * 1e3,
            "median_ms": float(np.median(wall[label])) * 1e3,
            "compile_s": compile_s[label],
        }
        for label in programs
    ]


def compiled_rounds(sim, hparams, state, data, key, num_rounds: int):
    """``(run, compile_s, temp_bytes)``: ``sim``'s block of ``num_rounds`` rounds compiled
    once (timed), ``run(state)`` calling it, and XLA's temp memory for it."""
    start = time.perf_counter()
    compiled = sim.run_rounds.lower(hparams, state, data, key, num_rounds=num_rounds).compile()
    compile_s = time.perf_counter() - start
    memory = memory_stats(compiled) or {}

    def run(state):
        return compiled(hparams, state, data, key)[0]

    return run, compile_s, memory.get("temp_size_in_bytes")


def variant_rows(algorithms, labels, repeats: int, rounds: int, build, base="plain") -> list[dict]:
    """For each algorithm, every variant's program (``build(algorithm, label) -> (run,
    state, compile_s, temp_bytes)``) timed interleaved (``repeats`` calls of ``rounds``
    rounds each) and compared with the ``base`` variant's (:func:`ratio_rows`)."""
    rows = []
    for name in algorithms:
        programs, counts, info = {}, {}, {}
        for label in labels:
            run, state, compile_s, temp = build(name, label)
            programs[label], counts[label] = (run, state), rounds
            info[label] = {"compile_s": compile_s, "temp_bytes": temp}
        wall, _, _ = _interleaved(programs, repeats, counts, stateless=())
        rows += ratio_rows(name, wall, info, base=base)
    return rows
