"""The vmapped engine against a plain per-client Python reference loop, determinism,
compilation counts, evaluation and input validation."""

import chex
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import (
    assert_trees_close,
    make_classification_clients,
    quadratic_clients,
    reference_grad,
)

import scaffold_jax as sj
from scaffold_jax import resources
from scaffold_jax.sampling import floyd_ids, sample_clients


# --------------------------------------------------------------------------- reference loop
def reference_run(
    name, problem, data, plan, num_sampled, hp, rounds, seed, option=2, weighting="uniform"
):
    """Algorithm 1 of the paper (and its baselines) written out client by client.

    No vmap, no client table: Python lists of per-client controls, one client at a time.
    Only the documented randomness contract is shared with the engine (round key
    fold_in(root, r), split into (sample key, clients key), client key fold_in(clients
    key, id), and the batch plan's positions), so both see the same minibatches.
    """
    n_clients = data.num_clients
    lr, glr, mu = float(hp.client_lr), float(hp.server_lr), float(hp.get("prox_mu", 0.0))
    x = jax.tree.map(lambda a: np.asarray(a, np.float64), problem.params)
    c = jax.tree.map(np.zeros_like, x)
    c_i = [jax.tree.map(np.zeros_like, x) for _ in range(n_clients)]
    counts = np.asarray(data.counts)
    weights = np.ones(n_clients) if weighting == "uniform" else counts.astype(np.float64)
    root = jr.key(seed)

    def grad_at(params, batch, mask):
        return reference_grad(problem.loss_fn, params, batch, mask)

    all_ids = []
    for r in range(rounds):
        round_key = jr.fold_in(root, r)
        sample_key, clients_key = jr.split(round_key)
        ids = np.asarray(sample_clients(sample_key, n_clients, num_sampled))
        all_ids.append(ids)
        dys, dcs, ws = [], [], []
        for i in ids:
            key = jr.fold_in(clients_key, int(i))
            pos, mask = plan.positions(key, counts[i], data.max_count)
            pos, mask = np.asarray(pos), np.asarray(mask)
            examples = data.client_examples(int(i))
            batches = [jax.tree.map(lambda a, k=k: a[pos[k]], examples) for k in range(len(pos))]
            if name == "sgd":
                flat = jax.tree.map(lambda a: a[pos.reshape(-1)], examples)
                g = grad_at(x, flat, mask.reshape(-1))
                dys.append(jax.tree.map(lambda gg: -lr * gg, g))
                ws.append(weights[i])
                continue
            y = jax.tree.map(np.copy, x)
            steps = 0
            for k, batch in enumerate(batches):
                if mask[k].sum() == 0:
                    continue
                g = grad_at(y, batch, mask[k])
                if name == "scaffold":
                    g = jax.tree.map(lambda gg, ci, cc: gg - ci + cc, g, c_i[i], c)
                if name == "fedprox":
                    g = jax.tree.map(lambda gg, yy, xx: gg + mu * (yy - xx), g, y, x)
                y = jax.tree.map(lambda yy, gg: yy - lr * gg, y, g)
                steps += 1
            if name == "scaffold":
                if option == 2:
                    new = jax.tree.map(
                        lambda ci, cc, xx, yy: ci - cc + (xx - yy) / (steps * lr), c_i[i], c, x, y
                    )
                else:
                    flat = jax.tree.map(lambda a: a[pos.reshape(-1)], examples)
                    new = grad_at(x, flat, mask.reshape(-1))
                dcs.append((weights[i], jax.tree.map(lambda a, b: a - b, new, c_i[i])))
                c_i[i] = new
            dys.append(jax.tree.map(lambda yy, xx: yy - xx, y, x))
            ws.append(weights[i])
        total = sum(ws)
        dx = jax.tree.map(lambda *d: sum(w * v for w, v in zip(ws, d, strict=True)) / total, *dys)
        x = jax.tree.map(lambda xx, d: xx + glr * d, x, dx)
        for w, dc in dcs:
            c = jax.tree.map(lambda cc, d, w=w: cc + w * d / weights.sum(), c, dc)
    return x, c, c_i, np.stack(all_ids)


# (algorithm, SCAFFOLD option, weighting, client_chunk): chunk 2 of S = 3 runs one chunk
# of 2 clients and a remainder of 1 through lax.map.
CASES = [
    ("fedavg", 2, "uniform", None),
    ("fedprox", 2, "uniform", 2),
    ("sgd", 2, "uniform", 2),
    ("scaffold", 1, "uniform", None),
    ("scaffold", 1, "uniform", 2),
    ("scaffold", 2, "uniform", None),
    ("scaffold", 2, "num_examples", 2),
]


@pytest.mark.parametrize(
    ("name", "option", "weighting", "chunk"),
    CASES,
    ids=[f"{n}-{o}-{w}-chunk{c}" for n, o, w, c in CASES],
)
def test_engine_matches_per_client_reference_loop(
    name, option, weighting, chunk, small_data, small_problem
):
    # epochs plan: clients of 2..13 examples take 1..5 steps of a batch of 3, padded slots.
    plan = sj.BatchPlan.epochs(batch_size=3, num_epochs=1)
    mu = {"prox_mu": 0.5} if name == "fedprox" else {}
    hp = sj.hparams(client_lr=0.4, server_lr=0.8, **mu)
    options = {"option": option} if name == "scaffold" else {}
    alg = sj.algorithms.make(name, small_problem.loss_fn, **options)
    sim = sj.Simulation(
        alg, small_problem, plan, clients_per_round=3, weighting=weighting, client_chunk=chunk
    )
    assert sim.resolve_client_chunk(small_data) == chunk
    result = sim.run(small_data, hp, num_rounds=4, seed=7)
    x, c, c_i, ids = reference_run(
        name, small_problem, small_data, plan, 3, hp, 4, 7, option=option, weighting=weighting
    )
    np.testing.assert_array_equal(result.client_ids, ids)
    assert_trees_close(result.state.server.params, x, rtol=1e-5, atol=1e-6)
    if name == "scaffold":
        assert_trees_close(result.state.server.control, c, rtol=1e-5, atol=1e-6)
        table = jax.tree.map(lambda *rows: np.stack(rows), *c_i)
        assert_trees_close(result.state.clients.control, table, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- convergence
def test_scaffold_reaches_the_optimum_where_fedavg_stalls():
    """Heterogeneous quadratics, full-batch, K = 10: FedAvg converges to a biased point
    (client drift) and stays there; SCAFFOLD converges to x*."""
    data, problem, x_star = quadratic_clients(num_clients=4, dim=3)
    plan = sj.BatchPlan.full(num_steps=10)
    hp = sj.hparams(client_lr=0.1)

    def distance_after(alg, rounds):
        sim = sj.Simulation(alg, problem, plan, clients_per_round=4)
        state = sim.run(data, hp, num_rounds=rounds).state
        return float(np.linalg.norm(np.asarray(state.server.params["x"]) - x_star))

    scaffold_err = distance_after(sj.scaffold(problem.loss_fn), 300)
    fedavg_err = distance_after(sj.fedavg(problem.loss_fn), 300)
    fedavg_err_later = distance_after(sj.fedavg(problem.loss_fn), 600)
    assert scaffold_err < 1e-4
    assert fedavg_err > 0.05  # the drift bias
    assert abs(fedavg_err_later - fedavg_err) < 1e-3 * fedavg_err  # ...and it is a fixed point


# --------------------------------------------------------------------------- determinism
def test_client_chunks_equal_one_vmap_over_all_sampled_clients(monkeypatch):
    """Chunked rounds (even, uneven and the automatic CPU chunk) give the unchunked run's
    state and metrics: the same clients, batches and updates, summed in another order."""

    data = sj.from_client_arrays(make_classification_clients(list(range(3, 43)), seed=3))
    problem = sj.models.logistic_regression((5,), 3)
    plan = sj.BatchPlan.fixed(batch_size=4, num_steps=3)
    hp = sj.hparams(client_lr=0.3)
    # One client's working set: batches 288 B + one step in float32 96 B + 4 x params 288 B.
    # A budget of 5 clients makes the automatic rule chunk: 5 -> 4, a divisor of S = 16.
    monkeypatch.setattr(resources, "CLIENT_CHUNK_BYTES", 5 * 672)
    runs, chunks = {}, {}
    for chunk in (None, 4, 7, "auto"):
        sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, plan, 16, client_chunk=chunk)
        chunks[chunk] = sim.resolve_client_chunk(data)
        runs[chunk] = sim.run(data, hp, num_rounds=3, seed=1)
    assert chunks == {None: None, 4: 4, 7: 7, "auto": 4}
    for chunk in (4, 7, "auto"):
        np.testing.assert_array_equal(runs[chunk].client_ids, runs[None].client_ids)
        assert_trees_close(runs[chunk].state, runs[None].state, rtol=1e-6, atol=1e-7)


def test_automatic_client_chunk_follows_the_memory_budget(monkeypatch, small_data, small_problem):

    plan = sj.BatchPlan.fixed(batch_size=3, num_steps=2)
    sim = sj.Simulation(sj.fedavg(small_problem.loss_fn), small_problem, plan, 6)
    assert sim.resolve_client_chunk(small_data) is None  # all 6 fit 16 MiB
    monkeypatch.setattr(resources, "CLIENT_CHUNK_BYTES", 1)
    assert sim.resolve_client_chunk(small_data) == 1
    monkeypatch.setattr(resources, "CLIENT_CHUNK_BYTES", 3 * 10**9)
    assert sim.resolve_client_chunk(small_data) is None
    assert [resources.balanced_chunk(1000, c) for c in (64, 50, 7)] == [50, 50, 5]
    assert resources.balanced_chunk(97, 10) == 10  # prime: 9 chunks of 10 and one of 7
    assert resources.balanced_chunk(8, 8) is None


@pytest.mark.parametrize("chunk", ["fast", 0, 2.5, True])
def test_bad_client_chunk_is_rejected(chunk, small_problem):
    with pytest.raises(ValueError, match="client_chunk"):
        sj.Simulation(
            sj.fedavg(small_problem.loss_fn),
            small_problem,
            sj.BatchPlan.fixed(3, 2),
            2,
            client_chunk=chunk,
        )


def test_same_seed_gives_bitwise_identical_results(small_data, small_problem):
    def run(seed):
        sim = sj.Simulation(
            sj.scaffold(small_problem.loss_fn), small_problem, sj.BatchPlan.fixed(4, 3), 3
        )
        return sim.run(small_data, sj.hparams(0.3), num_rounds=5, eval_every=2, seed=seed)

    a, b, other = run(0), run(0), run(1)
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(a.client_ids, b.client_ids)
    assert not np.array_equal(a.client_ids, other.client_ids)


def test_client_ids_are_distinct_and_auditable(small_data, small_problem):
    sim = sj.Simulation(
        sj.fedavg(small_problem.loss_fn),
        small_problem,
        sj.BatchPlan.fixed(2, 1),
        clients_per_round=4,
    )
    result = sim.run(small_data, sj.hparams(0.1), num_rounds=30, eval_every=10, seed=3)
    assert result.client_ids.shape == (30, 4)
    for row in result.client_ids:
        assert len(set(row.tolist())) == 4 and row.min() >= 0 and row.max() < 7
    # Replay: round r's ids follow from the root key alone.
    for r in (0, 17, 29):
        sample_key = jr.split(jr.fold_in(jr.key(3), r))[0]
        expected = sample_clients(sample_key, 7, 4)
        np.testing.assert_array_equal(result.client_ids[r], np.asarray(expected))
    # Uniform sampling: every client is drawn, with frequency near S/N = 4/7.
    freq = np.bincount(result.client_ids.ravel(), minlength=7) / 30
    assert np.all(np.abs(freq - 4 / 7) < 0.3)


def test_resuming_from_a_state_continues_the_same_run(small_data, small_problem):
    def sim():
        return sj.Simulation(
            sj.scaffold(small_problem.loss_fn), small_problem, sj.BatchPlan.fixed(4, 3), 3
        )

    full = sim().run(small_data, sj.hparams(0.3), num_rounds=6, seed=5)
    half = sim().run(small_data, sj.hparams(0.3), num_rounds=3, seed=5)
    rest = sim().run(small_data, sj.hparams(0.3), num_rounds=3, seed=5, state=half.state)
    assert int(rest.state.round) == 6
    assert_trees_close(rest.state, full.state, rtol=0, atol=0)


# --------------------------------------------------------------------------- compilation
def test_no_recompilation_in_round_two_nor_for_a_new_learning_rate(small_data, small_problem):
    traces = []

    def counting_loss(params, batch):
        traces.append(1)  # runs only while tracing
        return small_problem.loss_fn(params, batch)

    problem = small_problem._replace(loss_fn=counting_loss)
    sim = sj.Simulation(sj.scaffold(counting_loss), problem, sj.BatchPlan.fixed(3, 2), 3)
    state = sim.init(small_data)
    key = jr.key(0)
    state, _ = sim.run_rounds(sj.hparams(0.1), state, small_data, key, num_rounds=2)
    first = len(traces)
    assert first > 0
    state, _ = sim.run_rounds(sj.hparams(0.1), state, small_data, key, num_rounds=2)
    state, _ = sim.run_rounds(sj.hparams(0.05, server_lr=0.5), state, small_data, key, num_rounds=2)
    assert len(traces) == first
    assert sim.run_rounds._cache_size() == 1


def test_the_round_traces_once_and_keeps_the_client_axis(small_data, small_problem):
    """chex's trace counter and shape-prefix check (equinox/optax test habits): a round
    with other hyper-parameters, another state and another key reuses the one trace, and
    every leaf of the table keeps its leading [N] client axis."""
    sim = sj.Simulation(
        sj.scaffold(small_problem.loss_fn), small_problem, sj.BatchPlan.fixed(3, 2), 3
    )
    round_fn = jax.jit(chex.assert_max_traces(sim.round_fn, n=1), donate_argnums=(1,))
    state = sim.init(small_data)
    chex.assert_tree_shape_prefix(state.clients, (small_data.num_clients,))
    for r, hp in enumerate([sj.hparams(0.1), sj.hparams(0.05, server_lr=0.5), sj.hparams(0.2)]):
        state, metrics = round_fn(hp, state, small_data, jr.key(r))
    chex.assert_tree_shape_prefix(state.clients, (small_data.num_clients,))
    chex.assert_shape(metrics["client_ids"], (3,))
    assert int(state.round) == 3


def _loops_whose_trip_count_is_data(sim, data) -> int:
    state = sim.init(data)
    hp = sj.types.resolve_hparams(sim.algorithm, sj.hparams(0.1))
    text = sim.run_rounds.lower(hp, state, data, jr.key(0), num_rounds=2).compile().as_text()
    return sum(" while(" in line and "known_trip_count" not in line for line in text.splitlines())


@pytest.mark.parametrize(
    ("plan", "expected"),
    [(sj.BatchPlan.fixed(3, 4), 0), (sj.BatchPlan.full(2), 0), (sj.BatchPlan.epochs(4, 1), 1)],
)
def test_the_round_reads_no_loop_condition_back_where_no_client_stops_early(
    small_data, small_problem, plan, expected
):
    """Where every client takes all K steps (a fixed or full plan, no stragglers) the
    round has no loop whose trip count is data, which an accelerator would read back to
    the host after every trip: the sampler's and the local steps' loops have counts the
    compiler knows. An epochs plan keeps its local loop data-bounded (a chunk stops with
    its longest client)."""
    sim = sj.Simulation(sj.scaffold(small_problem.loss_fn), small_problem, plan, 3)
    assert _loops_whose_trip_count_is_data(sim, small_data) == expected


@pytest.mark.parametrize("algorithm", ["scaffold", "apfl"])
def test_all_k_steps_equal_stopping_after_the_last_non_empty_one(
    small_data, small_problem, algorithm, monkeypatch
):
    """The known-count loop the engine uses where no client stops early gives the same
    bits as the data-bounded loop (empty steps are no-ops), for local_sgd (SCAFFOLD) and
    the personalized algorithms' masked loop (APFL), with short batches: a client of 2
    examples under fixed(3, 4)."""
    from scaffold_jax import local
    from scaffold_jax.algorithms import apfl
    from scaffold_jax.engine import phases

    def run():
        build = sj.scaffold if algorithm == "scaffold" else apfl
        sim = sj.Simulation(
            build(small_problem.loss_fn), small_problem, sj.BatchPlan.fixed(3, 4), 4
        )
        return sim.run(small_data, sj.hparams(0.2), num_rounds=3, seed=4)

    static = run()
    monkeypatch.setattr(phases, "every_step_runs", lambda yes: local.every_step_runs(False))
    bounded = run()
    for a, b in zip(jax.tree.leaves(static.state), jax.tree.leaves(bounded.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(
        static.round_metrics["local_loss"], bounded.round_metrics["local_loss"]
    )


def test_client_table_is_donated(small_data, small_problem):
    sim = sj.Simulation(
        sj.scaffold(small_problem.loss_fn), small_problem, sj.BatchPlan.fixed(3, 2), 3
    )
    state = sim.init(small_data)
    table = state.clients.control["linear"]["kernel"]
    sim.round(sj.hparams(0.1), state, small_data, jr.key(0))
    assert table.is_deleted()  # the buffer was handed to XLA and reused in place


# --------------------------------------------------------------------------- evaluation
def test_evaluation_matches_a_direct_computation(small_data, small_problem):
    sim = sj.Simulation(
        sj.fedavg(small_problem.loss_fn),
        small_problem,
        sj.BatchPlan.fixed(3, 1),
        2,
        eval_batch_size=8,
    )  # 60 train / 40 test examples: ragged chunks
    server, _ = sim.algorithm.init(small_problem.params)
    out = jax.device_get(sim.evaluate(server, small_data))
    params = small_problem.params
    test = small_data.test
    np.testing.assert_allclose(
        out["test_loss"], np.mean(small_problem.loss_fn(params, test)), rtol=1e-6
    )
    np.testing.assert_allclose(
        out["test_accuracy"], np.mean(small_problem.accuracy_fn(params, test)), rtol=1e-6
    )
    per_client = [
        np.mean(small_problem.loss_fn(params, small_data.client_examples(i)))
        for i in range(small_data.num_clients)
    ]
    np.testing.assert_allclose(out["train_loss"], np.mean(per_client), rtol=1e-5)


@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_train_loss_on_a_subsample_estimates_the_objective(weighting):
    """``train_eval_examples = m``: the objective over ALL examples with None (and with
    m >= n), and an unbiased estimate on m of them: its error over many different clients
    is within the sampling error, and it is the same subsample at every evaluation."""
    sizes = [3 + (7 * i) % 40 for i in range(60)]  # 60 clients of 3..42 examples
    data = sj.from_client_arrays(make_classification_clients(sizes, seed=4))
    problem = sj.models.logistic_regression((5,), 3, zero_init=False, key=jax.random.key(1))
    server, _ = sj.fedavg(problem.loss_fn).init(problem.params)
    all_losses = np.asarray(problem.loss_fn(problem.params, data.examples), np.float64)
    losses = np.split(all_losses, np.cumsum(sizes)[:-1])  # the clients' rows, in order
    exact = (
        np.mean(all_losses)
        if weighting == "num_examples"
        else np.mean([np.mean(ell) for ell in losses])
    )

    def train_loss(m):
        sim = sj.Simulation(
            sj.fedavg(problem.loss_fn), problem, sj.BatchPlan.fixed(3, 1), 2,
            weighting=weighting, train_eval_examples=m,
        )  # fmt: skip
        return float(sim.evaluate(server, data)["train_loss"])

    n = data.num_examples
    np.testing.assert_allclose(train_loss(None), exact, rtol=1e-5)
    np.testing.assert_allclose(train_loss(n), exact, rtol=1e-5)
    estimate = train_loss(n // 4)
    assert estimate != pytest.approx(exact, rel=1e-6)  # a subsample, not the full pass
    # Standard error of a mean of n/4 weighted losses (without replacement), generously.
    assert abs(estimate - exact) < 4 * np.std(all_losses) * np.sqrt(3 / n) * 3
    assert train_loss(n // 4) == estimate  # a fixed subsample


def test_one_program_runs_every_block_of_a_run(small_data, small_problem):
    """An evaluation period that does not divide the rounds, and checkpoints between
    evaluations, still compile ONE round program, and the run equals one evaluated every
    round; records carry the clients' own mean local loss since the last evaluation, and
    the evaluation time is reported apart from the rounds'."""

    def run(eval_every, **kwargs):
        sim = sj.Simulation(
            sj.scaffold(small_problem.loss_fn), small_problem, sj.BatchPlan.fixed(3, 2), 3
        )
        # A second program (another block length) would trace the rounds a second time.
        chex.clear_trace_counter()
        traced_once = chex.assert_max_traces(sim.run_rounds_fn, n=1)
        sim.run_rounds = jax.jit(traced_once, static_argnames="num_rounds", donate_argnums=1)
        hp = sj.hparams(0.1)
        return sim.run(small_data, hp, num_rounds=10, eval_every=eval_every, **kwargs)

    result = run(3)  # blocks of 3, 3, 3, 1 rounds
    assert [r["round"] for r in result.records] == [0, 3, 6, 9, 10]
    every = run(1)
    assert_trees_close(result.state, every.state, rtol=0, atol=0)
    local = result.round_metrics["local_loss"]
    assert "local_loss" not in result.records[0]  # no round has run yet
    np.testing.assert_allclose(
        [r["local_loss"] for r in result.records[1:]],
        [local[0:3].mean(), local[3:6].mean(), local[6:9].mean(), local[9]],
        rtol=1e-6,
    )
    assert 0 < result.eval_seconds < result.run_seconds
    assert result.round_seconds == pytest.approx(result.run_seconds - result.eval_seconds)


def test_learning_on_separable_data_improves_accuracy():
    clients = make_classification_clients([30] * 10, dim=6, num_classes=4, seed=2)
    test = make_classification_clients([200], dim=6, num_classes=4, seed=2, skew=False)[0]
    data = sj.from_client_arrays(clients, test=test)
    problem = sj.models.mlp((6,), 4, hidden_sizes=(16,))
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, sj.BatchPlan.fixed(10, 5), 5)
    result = sim.run(data, sj.hparams(0.1), num_rounds=40, eval_every=20)
    assert result.records[0]["test_accuracy"] < 0.5
    assert result.records[-1]["test_accuracy"] > 0.8
    assert result.records[-1]["train_loss"] < result.records[0]["train_loss"]


# --------------------------------------------------------------------------- bad input
def _sim(problem, s=2, plan=None, **kw):
    return sj.Simulation(
        sj.scaffold(problem.loss_fn), problem, plan or sj.BatchPlan.fixed(2, 2), s, **kw
    )


def test_more_sampled_clients_than_clients_is_rejected(small_data, small_problem):
    with pytest.raises(ValueError, match=r"clients_per_round \(S\) = 8 exceeds .* N = 7"):
        _sim(small_problem, s=8).run(small_data, sj.hparams(0.1), num_rounds=1)


def test_zero_sampled_clients_is_rejected(small_problem):
    with pytest.raises(ValueError, match=r"clients_per_round \(S\) = 0 is invalid"):
        _sim(small_problem, s=0)


@pytest.mark.parametrize(
    "make_plan", [lambda: sj.BatchPlan.fixed(2, 0), lambda: sj.BatchPlan.full(0)]
)
def test_zero_local_steps_is_rejected(make_plan):
    with pytest.raises(ValueError, match=r"num_local_steps \(K\) = 0 is invalid"):
        make_plan()


@pytest.mark.parametrize("lr", [0.0, -0.1, float("nan"), float("inf")])
def test_bad_client_step_size_is_rejected(lr):
    with pytest.raises(ValueError, match="client_lr=.* is invalid"):
        sj.hparams(client_lr=lr)


@pytest.mark.parametrize("lr", [0.0, float("nan")])
def test_bad_server_step_size_is_rejected(lr):
    with pytest.raises(ValueError, match="server_lr=.* is invalid"):
        sj.hparams(client_lr=0.1, server_lr=lr)


def test_bad_step_size_smuggled_into_run_is_rejected(small_data, small_problem):
    hp = sj.HParams(client_lr=-1.0, server_lr=1.0)
    with pytest.raises(ValueError, match="client_lr"):
        _sim(small_problem).run(small_data, hp, num_rounds=1)


def test_params_that_do_not_fit_the_data_are_rejected(small_data):
    wrong = sj.models.logistic_regression((7,), 3)  # data has 5 features
    with pytest.raises(ValueError, match="params do not fit the data"):
        _sim(wrong).run(small_data, sj.hparams(0.1), num_rounds=1)


def test_a_loss_that_returns_a_mean_is_rejected(small_data, small_problem):
    mean_loss = small_problem._replace(loss_fn=lambda p, b: jnp.mean(small_problem.loss_fn(p, b)))
    with pytest.raises(ValueError, match="one loss per example"):
        _sim(mean_loss).run(small_data, sj.hparams(0.1), num_rounds=1)


def test_a_client_with_no_data_is_rejected():
    clients = make_classification_clients([3, 4])
    clients.append({"x": np.zeros((0, 5), np.float32), "y": np.zeros((0,), np.int32)})
    with pytest.raises(ValueError, match="client 2 has no data"):
        sj.from_client_arrays(clients)


def test_unknown_weighting_is_rejected(small_problem):
    with pytest.raises(ValueError, match="weighting 'size' is unknown"):
        _sim(small_problem, weighting="size")


@pytest.mark.parametrize(("n", "s"), [(6, 2), (6, 5), (6, 6), (200, 3)])
def test_client_sampling_is_uniform_over_subsets(n, s):
    """Every client is drawn with probability S/N and every pair with S(S−1)/(N(N−1)),
    for both samplers (Floyd's for S << N, a permutation otherwise)."""
    draws = 4000
    ids = np.asarray(jax.vmap(lambda k: sample_clients(k, n, s))(jr.split(jr.key(0), draws)))
    assert all(len(set(row)) == s for row in ids) and ids.min() >= 0 and ids.max() < n
    freq = np.bincount(ids.ravel(), minlength=n) / draws
    tol = 5 * np.sqrt(s / n * (1 - s / n) / draws) + 1e-9
    assert np.all(np.abs(freq - s / n) <= tol)
    if n <= 6 and 1 < s < n:
        hits = np.zeros((n, n))
        for row in ids:
            hits[np.ix_(row, row)] += 1
        pair = hits[~np.eye(n, dtype=bool)] / draws
        p = s * (s - 1) / (n * (n - 1))
        assert np.all(np.abs(pair - p) <= 5 * np.sqrt(p * (1 - p) / draws))


def _floyd_sequential(draws, n):
    chosen = []
    for i, j in enumerate(draws):
        t = n - len(draws) + i
        chosen.append(t if int(j) in chosen else int(j))
    return chosen


@pytest.mark.parametrize(("n", "s"), [(7, 2), (10, 3), (50, 20), (200, 60), (1000, 100)])
def test_the_parallel_sampler_is_floyds_sequential_algorithm_bit_for_bit(n, s):
    """sample_clients (S draws at once, collisions settled by pointer doubling) against
    Floyd's algorithm written as the plain loop of S dependent steps over the same draws
    (step i's j_i from the i-th key of ``split(key, S)``): the same ids for 200 keys, so
    every seed samples what it always did. The sizes reach chains of collisions (S = 60
    of 200). The draws are made per key, eagerly, for the first key."""

    def draws(key):
        last = jnp.arange(n - s, n, dtype=jnp.int32)
        return jax.vmap(lambda k, t: jr.randint(k, (), 0, t + 1, dtype=jnp.int32))(
            jr.split(key, s), last
        )

    keys = jr.split(jr.key(n + s), 200)
    first = [int(jr.randint(k, (), 0, n - s + i + 1, dtype=jnp.int32))
             for i, k in enumerate(jr.split(keys[0], s))]  # fmt: skip
    assert np.asarray(draws(keys[0])).tolist() == first
    all_draws = np.asarray(jax.jit(jax.vmap(draws))(keys))
    sampled = np.asarray(jax.jit(jax.vmap(lambda k: sample_clients(k, n, s)))(keys))
    for j, ids in zip(all_draws, sampled, strict=True):
        assert ids.tolist() == _floyd_sequential(j, n)


@pytest.mark.parametrize(("n", "s"), [(5, 1), (9, 8), (12, 9), (40, 33), (300, 257)])
def test_floyd_ids_settle_the_longest_chains_of_collisions(n, s):
    """floyd_ids against the sequential loop on draws no key is likely to give: a chain in
    which every step collides because the one before it did (j_0 = j_1 = 0, then
    j_i = t_{i-1}: S − 1 links, the most ⌈log2 S⌉ doubling passes must settle), and 300
    draw vectors crowded into the t range (N − S small), where chains are long."""
    offset = n - s
    chain = [0] + [0] * (s > 1) + [offset + i - 1 for i in range(2, s)]
    rng = np.random.default_rng(s)
    crowded = [[int(rng.integers(max(0, offset + i - 4), offset + i + 1)) for i in range(s)]
               for _ in range(300)]  # fmt: skip
    draws = np.asarray([chain, *crowded], np.int32)
    got = np.asarray(jax.jit(jax.vmap(lambda d: floyd_ids(d, n)))(draws))
    for row, ids in zip(draws, got, strict=True):
        assert ids.tolist() == _floyd_sequential(row, n)
    if s > 2:  # the chain really is one: every step after the first collided
        assert _floyd_sequential(chain, n)[1:] == list(range(offset + 1, n))


@pytest.mark.slow
def test_skewed_clients_sorted_into_chunks_equal_the_padded_round():
    """Clients of 1..60 examples under an epochs plan take 1..30 steps: sorted by step
    count into chunks, each chunk looping only as long as its longest client, the rounds
    equal the per-client reference loop over all K padded steps and the unchunked round."""
    sizes = [1, 60, 2, 3, 45, 5, 13, 34, 4]
    data = sj.from_client_arrays(make_classification_clients(sizes, seed=5))
    problem = sj.models.logistic_regression((5,), 3)
    plan = sj.BatchPlan.epochs(batch_size=4, num_epochs=2)
    hp = sj.hparams(client_lr=0.2, server_lr=0.9)
    x, c, c_i, ids = reference_run("scaffold", problem, data, plan, 7, hp, 2, 2, option=2)
    # 1: one client at a time (no vmap); 3: two sorted chunks of 3 and a remainder of 1.
    # (All S in one vmap under an epochs plan: test_engine_matches_per_client_reference_loop.)
    for chunk in (1, 3):
        sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, plan, 7, client_chunk=chunk)
        result = sim.run(data, hp, num_rounds=2, seed=2)
        np.testing.assert_array_equal(result.client_ids, ids)
        assert_trees_close(result.state.server.params, x, rtol=1e-5, atol=1e-6)
        assert_trees_close(result.state.server.control, c, rtol=1e-5, atol=1e-6)
        table = jax.tree.map(lambda *rows: np.stack(rows), *c_i)
        assert_trees_close(result.state.clients.control, table, rtol=1e-5, atol=1e-6)


def test_init_builds_its_program_once_per_simulation(small_data, small_problem):
    """Simulation.init keeps its jitted programs (the state's, a warm start's): a second
    call, as a notebook's second run() makes, traces nothing again; the states are equal
    and independent (the first is not donated by the second)."""
    traces = []
    base = sj.scaffold(small_problem.loss_fn, warm_controls=True)

    def counting_init(params):
        traces.append(1)
        return base.init(params)

    plan = sj.BatchPlan.fixed(batch_size=4, num_steps=3)
    sim = sj.Simulation(base._replace(init=counting_init), small_problem, plan, 3)
    first = sim.init(small_data)
    traced = len(traces)
    second = sim.init(small_data)
    assert len(traces) == traced
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
