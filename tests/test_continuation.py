"""The records' running totals (bytes, virtual time) belong to the state: a run that
continues a state in memory (``Simulation.run(state=...)``) carries them on as a resumed
checkpoint does, the first record of a run carries them (0 for a fresh one), and a FedBuff
run's first record names the M clients it started at time 0."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import scaffold_jax as sj
from scaffold_jax import participation
from tests.conftest import binary_clients

TOTALS = ("bytes_down_total", "bytes_up_total", "virtual_time")
HP = sj.hparams(client_lr=0.5)


@pytest.fixture(scope="module")
def data():
    sizes = [4, 4, 8, 4, 8, 4, 12, 4, 8, 4]
    return binary_clients(sizes, seed=3)


@pytest.fixture(scope="module")
def problem():
    return sj.models.logistic_regression((3,), 2)


def _sync(problem):
    """Rounds whose counts and durations vary: log-normal devices and dropouts."""
    part = participation.make(
        profiles="lognormal", dropouts="bernoulli", options={"dropout_rate": 0.3}
    )
    return sj.Simulation(sj.scaffold(problem.loss_fn), problem, sj.BatchPlan.full(2), 3,
                         participation=part)  # fmt: skip


def _fedbuff(problem, concurrency=4, size=2):
    part = participation.make(profiles="lognormal")
    return sj.Simulation(sj.scaffold(problem.loss_fn), problem, sj.BatchPlan.full(2), size,
                         participation=part, execution=sj.FedBuff(concurrency, size))  # fmt: skip


def _totals(records):
    return {r["round"]: tuple(r.get(k) for k in TOTALS) for r in records}


def _continued(sim, data, calls, rounds, eval_every=None):
    """``calls`` runs of ``rounds`` rounds, each continuing the state of the one before."""
    state, out = None, []
    for _ in range(calls):
        result = sim.run(data, HP, num_rounds=rounds, eval_every=eval_every, state=state)
        state = result.state
        out.append(result)
    return out


@pytest.mark.parametrize("make", [_sync, _fedbuff], ids=["sync", "fedbuff"])
def test_runs_continuing_a_state_carry_its_totals_on(make, data, problem):
    """Three 2-round calls continuing one state report the 6-round run's totals, their
    first records included (each the previous call's last), and the same state."""
    sim = make(problem)
    whole = sim.run(data, HP, num_rounds=6, eval_every=2)
    want = _totals(whole.records)
    assert len(set(want.values())) == 4 and all(v is not None for v in want[6])
    parts = _continued(sim, data, calls=3, rounds=2)
    for start, result in zip((0, 2, 4), parts, strict=True):
        got = _totals(result.records)
        assert sorted(got) == [start, start + 2]
        assert got == {r: want[r] for r in got}  # exact: the same float64 sums
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(parts[-1].state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_continued_fedbuff_run_reads_the_clock_of_its_state(data, problem):
    """The records' virtual_time is the state's clock, in a continued run too."""
    sim = _fedbuff(problem)
    state = None
    for _ in range(3):
        result = sim.run(data, HP, num_rounds=2, state=state)
        state = result.state  # donated to the next call: its clock is read now
        now = float(state.inflight.now)
        assert result.records[-1]["virtual_time"] == pytest.approx(now, rel=1e-6)
    assert result.records[-1]["round"] == 6 and now > 0


def test_a_fedbuff_state_a_run_did_not_return_says_its_totals_itself(data, problem):
    """Steps run outside a run (sim.round): FedBuff's counts follow from the steps (M, then
    B a step) and its clock is in the state."""
    sim = _fedbuff(problem)
    whole = sim.run(data, HP, num_rounds=6, eval_every=2)
    hparams, key = sim.resolve_hparams(HP), jax.random.key(0)
    state = sim.init(data)
    for _ in range(4):
        state, _ = sim.round(hparams, state, data, key)
    continued = sim.run(data, HP, num_rounds=2, state=state)
    want = {r["round"]: r for r in whole.records}
    for record in continued.records:
        for name in ("bytes_down_total", "bytes_up_total"):
            assert record[name] == want[record["round"]][name]
        assert record["virtual_time"] == pytest.approx(
            want[record["round"]]["virtual_time"], rel=1e-6
        )


def test_the_first_record_carries_the_totals(data, problem):
    """Round 0: no byte sent and no second passed yet, in a single run and a sweep; a run
    without a clock has no virtual_time in any record."""
    records = _sync(problem).run(data, HP, num_rounds=2).records
    assert {k: records[0][k] for k in TOTALS} == {k: 0 for k in TOTALS}
    assert isinstance(records[0]["bytes_up_total"], int)
    plain = sj.Simulation(sj.fedavg(problem.loss_fn), problem, sj.BatchPlan.full(2), 3)
    records = plain.run(data, HP, num_rounds=2).records
    assert (records[0]["bytes_down_total"], records[0]["bytes_up_total"]) == (0, 0)
    assert all("virtual_time" not in r for r in records)
    grid, seeds, _ = sj.sweep.grid([0.1, 0.5], seeds=[0, 1])
    sim = _sync(problem)
    swept = sj.sweep.sweep(sim, data, grid, seeds, num_rounds=2)
    for config, records in zip(swept.configs, swept.records, strict=True):
        assert {k: records[0][k] for k in TOTALS} == {k: 0 for k in TOTALS}
        single = sim.run(data, sj.hparams(client_lr=config["client_lr"]), num_rounds=2,
                         seed=config["seed"]).records  # fmt: skip
        assert _totals(records) == _totals(single)


def test_a_fedbuff_run_names_the_clients_it_started_at_time_0(data, problem):
    """The round-0 record's started_ids are the M distinct clients in flight at time 0:
    with the steps' own arrived and started ids they replay who trained when."""
    concurrency, size = 5, 2
    sim = _fedbuff(problem, concurrency, size)
    result = sim.run(data, HP, num_rounds=8, eval_every=4)
    first = result.records[0]["started_ids"]
    assert len(set(first)) == concurrency
    assert all("started_ids" not in r for r in result.records[1:])
    flying = list(first)
    metrics = result.round_metrics
    for arrived, started in zip(metrics["arrived_ids"], metrics["started_ids"], strict=True):
        for i in arrived.tolist():
            flying.remove(int(i))  # every arrival is a client in flight
        flying += started.tolist()
        assert len(set(flying)) == concurrency
    # A continued run's first record is a step's, not the start: no started_ids.
    assert "started_ids" not in sim.run(data, HP, 2, state=result.state).records[0]
