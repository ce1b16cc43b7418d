"""Sweeps: every config equals the same config run alone, divergence stays in its config,
one compilation per grid, chunking, the chunk rule, the step-size summary and the plots.

Compilation dominates the cost on CPU, so one module-scoped sweep of SCAFFOLD (8 configs)
is shared and the other sweeps reuse its program wherever the shapes allow.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, quadratic_clients

import scaffold_jax as sj
from scaffold_jax import results
from scaffold_jax.resources import available_memory_bytes, choose_chunk_size, chunk_shape
from scaffold_jax.results import (
    format_summary,
    plot_best_curves,
    plot_rounds_to_target,
    rounds_to_target,
    summarize,
)
from scaffold_jax.sweep import Sweep, SweepResult, config_bytes, grid, sweep

ROUNDS, EVERY = 4, 2
METRICS = ("test_loss", "test_accuracy", "train_loss")


@pytest.fixture(scope="module")
def setup(small_data, small_problem):
    """A SCAFFOLD simulation whose loss counts its traces, and its (cached) Sweep."""
    traces = []

    def counting_loss(params, batch):
        traces.append(1)  # runs only while tracing
        return small_problem.loss_fn(params, batch)

    problem = small_problem._replace(loss_fn=counting_loss)
    sim = sj.Simulation(sj.scaffold(counting_loss), problem, sj.BatchPlan.fixed(4, 3), 3)
    return sim, Sweep.of(sim), traces


@pytest.fixture(scope="module")
def base(setup, small_data):
    """8 configs: η_l × η_g × seeds, unchunked, with the client tables kept."""
    sim, program, traces = setup
    hp, seeds, configs = grid(client_lr=[0.1, 0.4], server_lr=[1.0, 0.7], seeds=[0, 3])
    result = sweep(sim, small_data, hp, seeds, ROUNDS, EVERY, keep_client_states=True)
    return hp, seeds, configs, result, len(traces)


def _config(result, j):
    return jax.tree.map(lambda a: a[j], result.server_states)


# ------------------------------------------------------------------------ the grid helper
def test_grid_is_the_cartesian_product_with_seeds_fastest():
    hp, seeds, configs = grid(client_lr=[0.1, 0.3], prox_mu=[0.0, 1.0], seeds=[4, 5, 6])
    assert hp.client_lr.shape == hp.server_lr.shape == hp.prox_mu.shape == (12,)
    assert hp.client_lr.dtype == jnp.float32
    assert seeds.tolist() == [4, 5, 6] * 4
    assert configs[0] == {"client_lr": 0.1, "server_lr": 1.0, "prox_mu": 0.0, "seed": 4}
    assert configs[-1] == {"client_lr": 0.3, "server_lr": 1.0, "prox_mu": 1.0, "seed": 6}
    np.testing.assert_allclose(hp.prox_mu, [c["prox_mu"] for c in configs])


# ------------------------------------------------------------------------ equivalence
def test_each_config_equals_the_same_config_run_alone(setup, base, small_data):
    sim, _, _ = setup
    hp, seeds, configs, result, _ = base
    assert result.num_configs == 8 and result.num_chunks == 1
    assert not result.diverged.any()
    for j, config in enumerate(configs):
        alone = sim.run(
            small_data,
            sj.hparams(config["client_lr"], config["server_lr"]),
            ROUNDS,
            EVERY,
            seed=config["seed"],
        )
        np.testing.assert_array_equal(result.client_ids[j], alone.client_ids)
        assert_trees_close(_config(result, j), alone.state.server, rtol=1e-5, atol=1e-6)
        table = jax.tree.map(lambda a, j=j: a[j], result.client_states)
        assert_trees_close(table, alone.state.clients, rtol=1e-5, atol=1e-6)
        assert [r["round"] for r in result.records[j]] == [r["round"] for r in alone.records]
        for mine, theirs in zip(result.records[j], alone.records, strict=True):
            assert mine["status"] == "ok" and mine["config"] == config
            for name in METRICS:
                np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-5, atol=1e-6)
        for name, values in alone.round_metrics.items():
            np.testing.assert_allclose(result.round_metrics[name][j], values, rtol=1e-5, atol=1e-6)
    # Seeds matter: two seeds of one step size sample different clients.
    assert not np.array_equal(result.client_ids[0], result.client_ids[1])


def test_records_index_no_device_array_one_value_at_a_time(setup, base, small_data, monkeypatch):
    """A sweep's records (one per config per evaluation: Figure 3 makes ~165k) are built
    from host copies, one transfer per block: no JAX indexing per value (which made
    `reproduce fig3` 3.5x slower), and they equal the base sweep's records."""
    from jax._src import array

    from scaffold_jax.loop import sweeps

    sim, _, _ = setup
    hp, seeds, _, expected, _ = base
    indexed, inside = [], [False]
    original_getitem, original_records = array.ArrayImpl.__getitem__, sweeps._Chunk.records

    def getitem(self, index):
        if inside[0]:
            indexed.append(index)
        return original_getitem(self, index)

    def records(self, *args):
        inside[0] = True
        try:
            return original_records(self, *args)
        finally:
            inside[0] = False

    monkeypatch.setattr(array.ArrayImpl, "__getitem__", getitem)
    monkeypatch.setattr(sweeps._Chunk, "records", records)
    result = sweep(sim, small_data, hp, seeds, ROUNDS, EVERY)
    assert indexed == []
    strip = lambda runs: [
        [{k: v for k, v in r.items() if k != "seconds"} for r in rs] for rs in runs
    ]
    assert strip(result.records) == strip(expected.records)


def test_one_compilation_for_the_whole_grid(setup, base, small_data):
    sim, program, traces = setup
    _, _, _, result, traces_after_base = base
    assert program.run_rounds._cache_size() == 1
    assert program.evaluate._cache_size() == 1
    # A new grid of the same shape (other step sizes, other seeds) traces nothing new.
    before = len(traces)
    hp, seeds, _ = grid(client_lr=[0.05, 0.2, 0.3, 0.5], server_lr=[0.9], seeds=[1, 2])
    again = sweep(sim, small_data, hp, seeds, ROUNDS, EVERY)
    assert len(traces) == before
    assert program.run_rounds._cache_size() == 1
    assert again.compile_seconds < result.compile_seconds


@pytest.mark.slow  # a CNN's sweep and single runs: ~19 s
def test_a_cnn_sweep_equals_its_single_runs_and_evaluates_without_grouped_convolutions():
    """A model with convolutions on CPU: its configs' local steps and evaluations run
    config by config (vmapped configs would make each convolution a grouped one), with
    the same results as the configs run alone."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(36, 8, 8), dtype=np.uint8)
    y = rng.integers(0, 3, size=36).astype(np.int32)
    test = {"x": x[:12], "y": y[:12]}
    data = sj.from_partition({"x": x, "y": y}, list(np.arange(36).reshape(6, 6)), test=test)
    problem = sj.models.build("cnn", (8, 8), 3, key=jax.random.key(1))
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, sj.BatchPlan.fixed(3, 2), 2)
    assert sim.one_client_at_a_time(data)
    hp, seeds, configs = grid(client_lr=[0.01, 0.05], seeds=[0, 1])
    result = sweep(sim, data, hp, seeds, 2, 1)
    assert result.num_chunks == 1
    for j, config in enumerate(configs):
        alone = sim.run(data, sj.hparams(config["client_lr"]), 2, 1, seed=config["seed"])
        assert_trees_close(_config(result, j), alone.state.server, rtol=1e-4, atol=1e-6)
        for mine, theirs in zip(result.records[j], alone.records, strict=True):
            for name in METRICS:
                np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-5, atol=1e-6)
    program = Sweep.of(sim)
    carry = program.init(data, 2, 2)
    hlo = program.evaluate.lower(carry.state.server, data, carry.state.model).as_text()
    two_by_two = jax.tree.map(lambda a: a[:4].reshape(2, 2), program.resolve_grid(hp, 4))
    keys = jax.vmap(jax.random.key)(jnp.arange(2))
    hlo += program.run_rounds.lower(two_by_two, carry, data, keys, num_rounds=1).as_text()
    groups = re.findall(r"feature_group_count = (\d+)", hlo)
    assert groups and set(groups) == {"1"}  # convolutions, none of them grouped


# ------------------------------------------------------------------------ divergence
def test_a_diverging_config_is_frozen_and_leaves_the_others_untouched(setup, base, small_data):
    sim, program, _ = setup
    hp, seeds, configs, result, _ = base
    # Config 1 gets a step size that overflows in round 1; everything else is as in base.
    huge = hp._replace(client_lr=hp.client_lr.at[1].set(3e38))
    poisoned = sweep(sim, small_data, huge, seeds, ROUNDS, EVERY, keep_client_states=True)
    assert program.run_rounds._cache_size() == 1  # same shapes: same program
    assert poisoned.diverged.tolist() == [False, True] + [False] * 6
    assert poisoned.diverged_round.tolist() == [-1, 1] + [-1] * 6
    for j in (0, *range(2, 8)):  # bit for bit what they were without the NaN next door
        assert_trees_close(_config(poisoned, j), _config(result, j), rtol=0, atol=0)
        np.testing.assert_array_equal(poisoned.client_ids[j], result.client_ids[j])
        assert poisoned.records[j][1:] == [
            {**r, "seconds": p["seconds"]}
            for r, p in zip(result.records[j][1:], poisoned.records[j][1:], strict=True)
        ]
    # The diverged config kept its last finite state: the initial one.
    server, _ = sim.algorithm.init(sim.problem.params)
    assert_trees_close(_config(poisoned, 1), server, rtol=0, atol=0)
    assert not np.any(poisoned.client_states.control["linear"]["kernel"][1])
    assert [r["status"] for r in poisoned.records[1]] == ["ok", "diverged", "diverged"]
    assert all(np.isnan(r["test_loss"]) for r in poisoned.records[1][1:])
    assert np.all(poisoned.client_ids[1] == -1)
    assert np.all(np.isnan(poisoned.round_metrics["local_loss"][1]))
    # reached at round 0, before diverging
    assert results.rounds_to_target(poisoned.records[1], 0.0) == 0


def test_divergence_mid_run_freezes_the_state_of_the_round_before():
    """Quadratics with η_l = 100 grow ~1e10× per round: finite for a few rounds, then
    Inf. The frozen state is exactly the state the same config had one round before."""
    data, problem, _ = quadratic_clients(num_clients=4, dim=3)
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, sj.BatchPlan.full(5), 2)
    hp, seeds, _ = grid(client_lr=[0.1, 100.0], seeds=[0])
    result = sweep(sim, data, hp, seeds, num_rounds=6, eval_every=1, keep_client_states=True)
    assert result.diverged.tolist() == [False, True]
    last_ok = int(result.diverged_round[1]) - 1
    assert 1 <= last_ok < 5
    # The same grid stopped before the divergence (the same compiled program).
    before = sweep(sim, data, hp, seeds, num_rounds=last_ok, eval_every=1, keep_client_states=True)
    assert not before.diverged.any()
    assert_trees_close(_config(result, 1), _config(before, 1), rtol=0, atol=0)
    table = jax.tree.map(lambda a: a[1], result.client_states)
    assert_trees_close(table, jax.tree.map(lambda a: a[1], before.client_states), rtol=0, atol=0)
    statuses = [r["status"] for r in result.records[1]]
    assert statuses == ["ok"] * (last_ok + 1) + ["diverged"] * (6 - last_ok)
    assert np.all(np.isnan(result.round_metrics["local_loss"][1, last_ok:]))
    assert np.all(np.isfinite(result.round_metrics["local_loss"][0]))
    assert Sweep.of(sim).run_rounds._cache_size() == 1


# ------------------------------------------------------------------------ chunking
def test_chunked_sweep_equals_the_unchunked_one_and_compiles_once(setup, base, small_data):
    sim, program, traces = setup
    hp, seeds, configs, result, _ = base
    # 5 configs: seed 0 has configs 0, 2, 4 and seed 3 has 1, 3 (padded to 3). A budget
    # of 2.5 configs gives chunks of 1 seed × 2 configs (4 chunks, two of them padded) and
    # ONE new program for the new chunk shape.
    per_config = config_bytes(sim, small_data)
    sub = jax.tree.map(lambda a: a[:5], hp)
    chunked = sweep(
        sim,
        small_data,
        sub,
        seeds[:5],
        ROUNDS,
        EVERY,
        memory_budget_bytes=int(2.5 * per_config),
        keep_client_states=True,
    )
    assert (chunked.chunk_shape, chunked.num_chunks) == ((1, 2), 4)
    assert chunked.bytes_per_config == per_config
    assert program.run_rounds._cache_size() == 2
    assert chunked.configs == configs[:5]
    for j in range(5):
        assert_trees_close(_config(chunked, j), _config(result, j), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(chunked.client_ids[j], result.client_ids[j])
        for mine, theirs in zip(chunked.records[j], result.records[j], strict=True):
            for name in METRICS:
                np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-5, atol=1e-6)
    table = jax.tree.map(lambda a: a[:5], result.client_states)
    assert_trees_close(chunked.client_states, table, rtol=1e-5, atol=1e-6)


def test_config_bytes_counts_the_state_and_the_round_working_set(setup, small_data):
    sim, _, _ = setup
    n, s = small_data.num_clients, sim.clients_per_round
    params = 4 * (5 * 3 + 3)  # float32 kernel [5, 3] and bias [3]
    state = 2 * params + n * params + 4  # server x and c, client controls, round counter
    batches = 3 * 4 * (5 * 4 + 4)  # K=3 × B=4 × (5 float32 features + an int32 label)
    assert config_bytes(sim, small_data) == 2 * state + s * (8 * params + batches)


@pytest.mark.parametrize(
    ("configs", "budget", "cap", "expected"),
    [
        (10, 450, None, 4),  # 4.5 configs fit
        (10, 10**6, None, 10),  # everything fits
        (10, 50, None, 1),  # not even one fits: one at a time
        (5, 10**6, 4, 4),  # the caller's cap
    ],
)
def test_choose_chunk_size(configs, budget, cap, expected):
    assert choose_chunk_size(configs, 100, budget, cap) == expected


@pytest.mark.parametrize(
    ("seeds", "per_seed", "cap", "expected"),
    [
        (4, 8, 32, (4, 8)),  # the whole grid
        (4, 8, 20, (2, 8)),  # whole seed groups first: 2 chunks of 2 seeds
        (4, 8, 5, (1, 4)),  # part of a group: 4 + 4 rather than 5 + 3
        (3, 8, 16, (2, 8)),  # 2 + 1 (padded) seeds
        (1, 5, 2, (1, 2)),  # 2 + 2 + 1 (padded)
    ],
)
def test_chunk_shape(seeds, per_seed, cap, expected):
    assert chunk_shape(seeds, per_seed, cap) == expected


def test_available_memory_is_read(tmp_path):
    from scaffold_jax.resources import _meminfo_available

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  2048 kB\nMemAvailable:  1024 kB\n")
    assert _meminfo_available(str(meminfo)) == 1024 * 1024
    assert _meminfo_available(str(tmp_path / "missing")) is None
    assert available_memory_bytes() > 0


def test_available_memory_is_what_an_address_space_limit_leaves(tmp_path, monkeypatch):
    """Under ulimit -v / prlimit --as, MemAvailable says nothing of the limit: what the
    limit leaves of the address space (the limit minus VmSize) is what can be allocated."""
    resource = pytest.importorskip("resource")
    from scaffold_jax import resources

    status = tmp_path / "status"
    status.write_text("Name: python\nVmPeak:  3000 kB\nVmSize:  2048 kB\n")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (10 * 2**20, resource.RLIM_INFINITY))
    assert resources._address_space_left(str(status)) == 10 * 2**20 - 2048 * 1024
    assert resources.available_memory_bytes(jax.devices("cpu")[0]) < 10 * 2**20
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert resources._address_space_left(str(status)) is None


# ------------------------------------------------------------------------ summary
def _fake(configs, accuracies, losses, diverged=()):
    """A SweepResult from per-config accuracy curves (evaluated at rounds 0, 10, 20...)."""
    records = []
    for j, (curve, loss) in enumerate(zip(accuracies, losses, strict=True)):
        status = "diverged" if j in diverged else "ok"
        records.append(
            [
                {
                    "round": 10 * i,
                    "test_accuracy": a,
                    "train_loss": loss,
                    "seconds": 0.0,
                    "status": status if i else "ok",
                    "config": configs[j],
                }
                for i, a in enumerate(curve)
            ]
        )
    rounds = np.full(len(configs), -1)
    rounds[list(diverged)] = 5
    return SweepResult("fedavg", list(configs), records, rounds)


def test_summary_picks_fewest_rounds_then_lowest_loss():
    cfg = [
        {"client_lr": lr, "server_lr": 1.0, "prox_mu": 0.0, "seed": s}
        for lr in (0.01, 0.1, 1.0, 10.0)
        for s in (0, 1)
    ]
    accuracies = [
        [0.1, 0.3, 0.6],
        [0.1, 0.6, 0.7],  # η=0.01: rounds 20 and 10 → 15 ± 5
        [0.1, 0.6, 0.7],
        [0.1, 0.6, 0.7],  # η=0.1: 10 and 10, loss 0.5
        [0.1, 0.6, 0.7],
        [0.1, 0.6, 0.7],  # η=1: 10 and 10, loss 0.3 ← best (tie → loss)
        [0.9, 0.9, 0.9],
        [0.1, 0.2, 0.2],  # η=10: seed 1 never reaches; seed 0 diverges
    ]
    losses = [0.4, 0.4, 0.5, 0.5, 0.3, 0.3, 0.1, 0.1]
    result = _fake(cfg, accuracies, losses, diverged=(6,))
    assert rounds_to_target(result.records[6], 0.5) == 0  # before it diverged
    summary = summarize({"fedavg": result}, target=0.5)
    best = summary["fedavg"]["best"]
    assert best["hparams"] == {"client_lr": 1.0, "server_lr": 1.0, "prox_mu": 0.0}
    assert (best["rounds_mean"], best["rounds_std"], best["reached"]) == (10.0, 0.0, 2)
    groups = {g["hparams"]["client_lr"]: g for g in summary["fedavg"]["groups"]}
    assert (groups[0.01]["rounds_mean"], groups[0.01]["rounds_std"]) == (15.0, 5.0)
    assert groups[0.01]["rounds_to_target"] == [20, 10]
    assert groups[10.0]["rounds_mean"] is None and groups[10.0]["num_diverged"] == 1
    assert groups[10.0]["final_loss_mean"] == float("inf")
    np.testing.assert_allclose(groups[0.01]["final_value_mean"], 0.65)
    table = format_summary(summary)
    assert "| fedavg | client_lr=1" in table and "10.0 ± 0.0" in table


def test_summary_of_a_real_sweep_and_its_plots(base, tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    backend = matplotlib.get_backend()
    _, _, _, result, _ = base
    target = 0.5
    summary = summarize(result, target)
    best = summary["scaffold"]["best"]
    assert len(best["seeds"]) == 2 and len(summary["scaffold"]["groups"]) == 4
    rows = results.sweep_rows(result, target)
    assert rows[0]["status"] == "ok" and target in rows[0]["rounds_to_target"]
    for make in (plot_rounds_to_target, plot_best_curves):
        fig = make({"scaffold": result}, target)
        assert isinstance(fig, Figure) and matplotlib.get_backend() == backend
        fig.savefig(tmp_path / f"{make.__name__}.png")
        assert (tmp_path / f"{make.__name__}.png").stat().st_size > 0


# ------------------------------------------------------------------------ bad input
def test_bad_sweeps_are_rejected(setup, small_data):
    sim, _, _ = setup
    hp, seeds, _ = grid(client_lr=[0.1, 0.2], seeds=[0])
    with pytest.raises(ValueError, match=r"seeds must be one integer per config, shape \[1\]"):
        Sweep.of(sim).run(small_data, hp, [[0, 1]], 2)
    with pytest.raises(ValueError, match=r"grid.client_lr has shape \(2,\).*shape \(3,\)"):
        sweep(sim, small_data, hp, [0, 1, 2], 2)
    with pytest.raises(ValueError, match="non-negative integers"):
        sweep(sim, small_data, hp, [0, -1], 2)
    with pytest.raises(ValueError, match=r"grid.client_lr has shape \(3,\)"):
        sweep(sim, small_data, hp._replace(client_lr=jnp.ones(3)), seeds, 2)
    with pytest.raises(ValueError, match="client_lr=.* is invalid"):
        sweep(sim, small_data, hp._replace(client_lr=jnp.array([0.1, -1.0])), seeds, 2)
    with pytest.raises(ValueError, match="num_rounds = 0 is invalid"):
        sweep(sim, small_data, hp, seeds, 0)
    with pytest.raises(ValueError, match="the grid axis seed is empty"):
        grid(client_lr=[0.1], seeds=[])
    with pytest.raises(TypeError, match="grid must be an HParams"):
        sweep(sim, small_data, {"client_lr": [0.1]}, [0], 2)
