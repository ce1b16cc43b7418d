"""The message pipeline (scaffold_jax.messages): a new transform is one file, written here
in the tests without touching the package, with a per-client state that lives in the
simulation state's table beside the algorithm's, is written back only for the clients that
report, and resumes from a checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scaffold_jax as sj
from scaffold_jax.messages import MessageTransform, chain
from tests.conftest import make_classification_clients

PLAN = sj.BatchPlan.fixed(batch_size=4, num_steps=3)


def scale_messages(factor: float) -> MessageTransform:
    """Every array a client sends scaled by ``factor``; each client counts its sends."""

    def init(params):
        del params
        return {"sent": jnp.zeros((), jnp.int32)}

    def apply(outputs, states, context):
        del context
        scale = lambda tree: jax.tree.map(lambda a: a * factor, tree)  # noqa: E731
        sent = states["sent"] + (outputs.weight > 0).astype(jnp.int32)
        scaled = outputs._replace(delta_params=scale(outputs.delta_params),
                                  message=scale(outputs.message))  # fmt: skip
        return scaled, {"sent": sent}, {}

    return MessageTransform(init, apply)


def _setup():
    data = sj.data.from_client_arrays(make_classification_clients([6, 9, 4, 12, 7, 5, 8, 10]))
    problem = sj.models.logistic_regression((5,), 3)
    return data, problem


def test_a_transform_scaling_by_two_is_fedavg_with_twice_the_server_step():
    """Scaling every Δy_i by 2 (exact in floating point) before FedAvg's mean is η_g = 2,
    bit for bit, round after round; the transform's state counts each client's sends."""
    data, problem = _setup()
    fedavg = sj.fedavg(problem.loss_fn)
    scaled = fedavg._replace(messages=scale_messages(2.0))
    rounds = 5
    runs = {}
    for name, algorithm, server_lr in (("scaled", scaled, 1.0), ("plain", fedavg, 2.0)):
        sim = sj.Simulation(algorithm, problem, PLAN, clients_per_round=3)
        runs[name] = sim.run(data, sj.hparams(client_lr=0.1, server_lr=server_lr),
                             num_rounds=rounds, eval_every=rounds)  # fmt: skip
    for a, b in zip(jax.tree.leaves(runs["scaled"].state.server),
                    jax.tree.leaves(runs["plain"].state.server), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert runs["plain"].state.messages is None  # no transform, nothing added to the state
    counts = np.bincount(np.asarray(runs["scaled"].client_ids).ravel(), minlength=8)
    np.testing.assert_array_equal(np.asarray(runs["scaled"].state.messages["sent"]), counts)
    assert counts.sum() == rounds * 3


def test_a_client_that_does_not_report_keeps_its_transform_state():
    """Under dropouts the dropped clients' rows are masked: their counters do not move."""
    data, problem = _setup()
    algorithm = sj.fedavg(problem.loss_fn)._replace(messages=chain(scale_messages(1.0)))
    sim = sj.Simulation(
        algorithm, problem, PLAN, clients_per_round=4,
        participation=sj.participation.make(dropouts="bernoulli", options={"dropout_rate": 0.5}),
    )  # fmt: skip
    result = sim.run(data, sj.hparams(client_lr=0.1), num_rounds=6, eval_every=6)
    ids, reported = np.asarray(result.client_ids), np.asarray(result.reported)
    assert 0 < reported.sum() < reported.size  # some dropped, some reported
    expected = np.bincount(ids[reported], minlength=8)
    np.testing.assert_array_equal(np.asarray(result.state.messages["sent"]), expected)


def test_the_transform_state_resumes_from_a_checkpoint(tmp_path):
    data, problem = _setup()
    algorithm = sj.fedavg(problem.loss_fn)._replace(messages=scale_messages(0.5))
    sim = sj.Simulation(algorithm, problem, PLAN, clients_per_round=3)
    hp = sj.hparams(client_lr=0.1)
    whole = sim.run(data, hp, num_rounds=6, eval_every=2)
    sim.run(data, hp, num_rounds=4, eval_every=2, checkpoint_dir=tmp_path, checkpoint_every=2)
    resumed = sim.run(data, hp, num_rounds=6, eval_every=2, checkpoint_dir=tmp_path, resume=True)
    assert resumed.resumed_from == 4
    np.testing.assert_array_equal(
        np.asarray(resumed.state.messages["sent"]), np.asarray(whole.state.messages["sent"])
    )
    for a, b in zip(jax.tree.leaves(resumed.state.server), jax.tree.leaves(whole.state.server),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_more_rounds_than_their_metrics_fit_in_memory_are_refused_up_front(monkeypatch):
    """10 million rounds of S = 200 asked for 8.4 GB of per-round metrics at the end of
    their block (the fuzz test's find); now refused before anything is compiled, with the
    number of rounds that fits (2 x rounds x (8 S + 64) bytes)."""
    from scaffold_jax import resources

    data, problem = _setup()
    sim = sj.Simulation(sj.fedavg(problem.loss_fn), problem, PLAN, clients_per_round=3)
    monkeypatch.setattr(resources, "available_memory_bytes", lambda device=None: 10**6)
    fits = 10**6 // (2 * (8 * 3 + 64))
    with pytest.raises(
        ValueError, match=rf"num_rounds = {fits + 1} with S = 3 .* num_rounds <= {fits}"
    ):
        sim.run(data, sj.hparams(client_lr=0.1), num_rounds=fits + 1)
    assert sim.run(data, sj.hparams(client_lr=0.1), num_rounds=2).state.round == 2


def test_a_sweep_carries_the_transform_states_per_config():
    """The transforms' table has the sweep's leading configs axis like the client table:
    each config of a grid equals its single run (up to the order of float sums)."""
    from scaffold_jax.sweep import grid, sweep

    data, problem = _setup()
    algorithm = sj.fedavg(problem.loss_fn)._replace(messages=scale_messages(0.5))
    sim = sj.Simulation(algorithm, problem, PLAN, clients_per_round=3)
    hparams, seeds, _ = grid(client_lr=[0.05, 0.2], seeds=[0, 1])
    result = sweep(sim, data, hparams, seeds, num_rounds=4)
    for i, (lr, seed) in enumerate(zip(np.asarray(hparams.client_lr), seeds, strict=True)):
        single = sim.run(data, sj.hparams(client_lr=float(lr)), num_rounds=4, seed=int(seed))
        for a, b in zip(jax.tree.leaves(single.state.server),
                        jax.tree.leaves(jax.tree.map(lambda x: x[i], result.server_states)),
                        strict=True):  # fmt: skip
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
