"""Communication accounting (scaffold_jax.engine.communication): the bytes of every
algorithm against a table written here from NETWORK.md §1 (P float32 parameters), and the
records' counts against a plain reference recount of who took part and who reported."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scaffold_jax as sj
from scaffold_jax.algorithms.registry import ALGORITHMS
from scaffold_jax.engine import communication
from tests.conftest import make_classification_clients

PLAN = sj.BatchPlan.fixed(batch_size=4, num_steps=3)
P = 5 * 3 + 3  # logistic regression on 5 features, 3 classes: W [5, 3] and b [3]

#: Per participant, in units of 4 bytes: (down, up with the update, pre-round upload).
EXPECTED = {
    "fedavg": (P, P, 0),
    "fedprox": (P, P, 0),
    "sgd": (P, P, 0),
    "feddyn": (P, P, 0),
    "fedexp": (P, P, 0),
    "scaffnew": (P, P, 0),
    "fednova": (P, P + 1, 0),  # τ_i, one float32
    "scaffold": (2 * P, 2 * P, 0),  # x and c down; Δy_i and Δc_i up
    "mimelite": (2 * P, P, P),  # x and momentum's s down; ∇f_i(x) before, Δy_i after
    "mime": (3 * P, P, P),  # and c, the round's mean full-batch gradient, down
}


def _setup():
    data = sj.data.from_client_arrays(make_classification_clients([6, 9, 4, 12, 7, 5, 8, 10]))
    return data, sj.models.logistic_regression((5,), 3)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_bytes_of_every_algorithm_follow_from_its_shapes(name):
    _, problem = _setup()
    algorithm = ALGORITHMS[name].build(problem.loss_fn)
    traffic = communication.traffic(algorithm, problem.params)
    down, up, pre = EXPECTED[name]
    assert (traffic.down, traffic.up, traffic.pre_round) == (4 * down, 4 * up, 4 * pre)
    # A server optimizer's state stays on the server (for those that take one: Scaffnew's
    # factory refuses any).
    if "server_optimizer" in ALGORITHMS[name].options:
        try:
            adam = ALGORITHMS[name].build(problem.loss_fn, server_optimizer="adam")
        except ValueError:
            return
        assert communication.traffic(adam, problem.params) == traffic


def test_a_private_client_also_receives_the_clip_norm():
    _, problem = _setup()
    private = sj.privacy.private(sj.scaffold(problem.loss_fn))
    traffic = communication.traffic(private, problem.params)
    assert (traffic.down, traffic.up) == (4 * 2 * P + 4, 4 * 2 * P)


def test_bfloat16_controls_are_stored_at_the_clients_not_sent_narrower():
    # c_i is stored in bfloat16 by each client; x, c, Δy_i and Δc_i travel in float32.
    _, problem = _setup()
    algorithm = sj.scaffold(problem.loss_fn, control_dtype=jnp.bfloat16)
    traffic = communication.traffic(algorithm, problem.params)
    assert (traffic.down, traffic.up) == (8 * P, 8 * P)


def _reference_bytes(result, traffic):
    """Per round: bytes down (every client that took part, a dropped one too) and up
    (those that reported), recounted from the run's own ids and reported flags."""
    ids, reported = np.asarray(result.client_ids), np.asarray(result.reported)
    took_part = (ids >= 0).sum(axis=1)
    return took_part * traffic.down, reported.sum(
        axis=1
    ) * traffic.up + took_part * traffic.pre_round


@pytest.mark.parametrize("name", ["fedavg", "mimelite"])
def test_records_carry_the_bytes_of_who_took_part_and_who_reported(name):
    """Dropped clients downloaded (and sent MimeLite's pre-round gradient) but their
    update never arrived; records hold per-round means since the previous record and
    exact cumulative totals."""
    data, problem = _setup()
    algorithm = ALGORITHMS[name].build(problem.loss_fn)
    part = sj.participation.make(dropouts="bernoulli", options={"dropout_rate": 0.4})
    sim = sj.Simulation(algorithm, problem, PLAN, clients_per_round=4, participation=part)
    result = sim.run(data, sj.hparams(client_lr=0.1), num_rounds=9, eval_every=3)
    traffic = communication.traffic(algorithm, problem.params)
    down, up = _reference_bytes(result, traffic)
    assert up.min() < 4 * traffic.up + 4 * traffic.pre_round  # some dropped
    records = {r["round"]: r for r in result.records}
    assert "bytes_down" not in records[0]  # no round ran yet
    for r in (3, 6, 9):
        assert records[r]["bytes_down_total"] == down[:r].sum()
        assert records[r]["bytes_up_total"] == up[:r].sum()
        assert isinstance(records[r]["bytes_up_total"], int)
        np.testing.assert_allclose(records[r]["bytes_down"], down[r - 3 : r].mean(), rtol=1e-6)
        np.testing.assert_allclose(records[r]["bytes_up"], up[r - 3 : r].mean(), rtol=1e-6)


def test_a_resumed_run_continues_the_totals_exactly(tmp_path):
    data, problem = _setup()
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, PLAN, clients_per_round=3)
    hp = sj.hparams(client_lr=0.1)
    whole = sim.run(data, hp, num_rounds=6, eval_every=2)
    # Stopped at round 3, between two evaluations of the resumed schedule (0, 2, 4, 6).
    sim.run(data, hp, num_rounds=3, eval_every=2, checkpoint_dir=tmp_path, checkpoint_every=3)
    resumed = sim.run(data, hp, num_rounds=6, eval_every=2, checkpoint_dir=tmp_path, resume=True)
    assert resumed.resumed_from == 3
    totals = ("bytes_down_total", "bytes_up_total")
    after = {r["round"]: r for r in resumed.records}
    for record in whole.records:
        assert {k: record.get(k) for k in totals} == {
            k: after[record["round"]].get(k) for k in totals
        }
    assert whole.records[-1]["bytes_up_total"] == 6 * 3 * 8 * P


def test_a_message_that_is_not_the_stated_uplink_is_refused():
    data, problem = _setup()
    fedavg = sj.fedavg(problem.loss_fn)

    def client_update(hparams, server, client, batches, mask, key):
        client, output = fedavg.client_update(hparams, server, client, batches, mask, key)
        return client, output._replace(message={"extra": jnp.zeros(3)})

    sim = sj.Simulation(fedavg._replace(client_update=client_update), problem, PLAN, 3)
    with pytest.raises(ValueError, match=r"states uplink = \{\}: set Algorithm.uplink"):
        sim.run(data, sj.hparams(client_lr=0.1), num_rounds=1)


def test_summary_reports_the_bytes_to_each_target():
    from scaffold_jax.results import series_summary

    records = [
        {"round": 0, "test_accuracy": 0.1},
        {"round": 2, "test_accuracy": 0.55, "bytes_up_total": 800, "bytes_down_total": 900},
        {"round": 4, "test_accuracy": 0.65, "bytes_up_total": 1600, "bytes_down_total": 1800},
    ]
    summary = series_summary(records, targets=(0.5, 0.6, 0.9))
    assert summary["rounds_to_target"] == {"0.5": 2, "0.6": 4, "0.9": None}
    assert summary["bytes_up_to_target"] == {"0.5": 800, "0.6": 1600, "0.9": None}
    assert summary["bytes_down_to_target"] == {"0.5": 900, "0.6": 1800, "0.9": None}
    assert jax.tree.leaves(summary)  # JSON-able numbers
