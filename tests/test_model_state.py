"""Models with running statistics (BatchNorm): the local steps update them, the engine keeps
them averaged or per client (FedBN's statistics), evaluation reads them.

The reference here is written with flax directly: per client, a Python loop of training
steps on the REAL examples of each step only (boolean indexing, no mask), the statistics
from flax's ``mutable=["batch_stats"]``, then the plain mean over the sampled clients.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import scaffold_jax as sj
from scaffold_jax.data.federated import with_client_tests
from scaffold_jax.engine import client_keys, round_key_and_ids
from tests.conftest import assert_trees_close

SIZES = (3, 7, 5, 9)  # under and over B: masked slots in most steps
PLAN = sj.BatchPlan.fixed(batch_size=4, num_steps=3)
LR = 0.2


class BNNet(nn.Module):
    num_classes: int = 3
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train, mask=None):
        h = nn.Dense(6)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.8)(
            h, mask=None if mask is None else mask[:, None]
        )
        h = nn.relu(h)
        if self.dropout:
            h = nn.Dropout(self.dropout, deterministic=not train)(h)
        return nn.Dense(self.num_classes)(h)


def make_data(sizes=SIZES, seed=0, dim=4):
    rng = np.random.default_rng(seed)
    clients = [
        {
            # Each client's features have their own offset and scale: its statistics differ.
            "x": (rng.normal(size=(n, dim)) * (1 + i) + 2 * i).astype(np.float32),
            "y": rng.integers(0, 3, n).astype(np.int32),
        }
        for i, n in enumerate(sizes)
    ]
    test = {"x": rng.normal(size=(10, dim)).astype(np.float32), "y": rng.integers(0, 3, 10)}
    return clients, sj.data.from_client_arrays(clients, test=test)


def make_problem(policy="average", module=None):
    return sj.models.classification_problem(
        module or BNNet(), (4,), jr.key(1), train_arg="train", mask_arg="mask",
        state_policy=policy,
    )  # fmt: skip


def reference_client(module, params, stats, batches, mask, lr):
    """K plain SGD steps on the real examples of each step, with flax's BatchNorm."""
    y = params
    for k in range(mask.shape[0]):
        real = np.asarray(mask[k]) > 0
        if not real.any():
            continue
        x, labels = np.asarray(batches["x"][k])[real], np.asarray(batches["y"][k])[real]

        def loss(p, stats=stats, x=x, labels=labels):
            logits, new = module.apply(
                {"params": p, **stats}, x, train=True, mutable=["batch_stats"]
            )
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return jnp.mean(ce), new

        (_, new), grad = jax.value_and_grad(loss, has_aux=True)(y)
        y = jax.tree.map(lambda a, g: a - lr * g, y, grad)
        stats = dict(new)
    return y, stats


def one_round_by_hand(problem, data, state, key):
    ids_key, ids = round_key_and_ids(key, 0, data.num_clients, 2)
    keys = client_keys(ids_key, ids)
    x = state.server.params
    outs = []
    for i, k in zip(np.asarray(ids), keys, strict=True):
        batches, mask = data.client_batches(jnp.int32(i), k, PLAN)
        start = (
            state.model["server"]
            if "server" in state.model
            else jax.tree.map(lambda a, i=i: a[i], state.model["clients"])
        )
        outs.append((int(i), *reference_client(BNNet(), x, start, batches, mask, LR)))
    return outs


@pytest.mark.parametrize("policy", ["average", "local"])
def test_a_fedavg_round_equals_the_per_client_reference_loop(policy):
    _, data = make_data()
    problem = make_problem(policy)
    sim = sj.Simulation(sj.fedavg(problem.loss_fn), problem, PLAN, clients_per_round=2)
    state = sim.init(data)
    before = jax.device_get(state)
    expected = one_round_by_hand(problem, data, before, jr.key(3))
    after, metrics = sim.round(sj.hparams(client_lr=LR), state, data, jr.key(3))
    assert sorted(np.asarray(metrics["client_ids"]).tolist()) == sorted(e[0] for e in expected)

    mean_params = jax.tree.map(lambda *a: sum(a) / len(a), *[e[1] for e in expected])
    assert_trees_close(after.server.params, mean_params, rtol=1e-5, atol=1e-6)
    if policy == "average":
        mean_stats = jax.tree.map(lambda *a: sum(a) / len(a), *[e[2] for e in expected])
        assert_trees_close(after.model["server"], mean_stats, rtol=1e-5, atol=1e-6)
        # The statistics moved: the test is not comparing the initial ones.
        moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                             after.model["server"], before.model["server"])  # fmt: skip
        assert max(jax.tree.leaves(moved)) > 0.1
    else:
        table = after.model["clients"]
        for i, _, stats in expected:
            assert_trees_close(jax.tree.map(lambda a, i=i: a[i], table), stats, 1e-5, 1e-6)
        sampled = {e[0] for e in expected}
        for i in set(range(data.num_clients)) - sampled:  # unsampled rows as they were
            jax.tree.map(lambda a, b, i=i: np.testing.assert_array_equal(a[i], b[i]),
                         table, before.model["clients"])  # fmt: skip
        # Two sampled clients of different data now hold different statistics.
        a, b = sorted(sampled)
        mean = table["batch_stats"]["BatchNorm_0"]["mean"]
        assert float(jnp.max(jnp.abs(mean[a] - mean[b]))) > 0.1


def test_an_nnx_batchnorm_model_runs_the_round_of_the_same_linen_model():
    """The same network as BNNet written in NNX, from the same initial values: one round
    gives the same params and statistics (each policy's state layout alike)."""
    from flax import nnx

    class NNXNet(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 6, rngs=rngs)
            self.bn = nnx.BatchNorm(6, momentum=0.8, rngs=rngs)
            self.out = nnx.Linear(6, 3, rngs=rngs)

        def __call__(self, x, mask=None):
            h = self.bn(self.lin(x), mask=None if mask is None else mask[:, None])
            return self.out(nnx.relu(h))

    _, data = make_data()
    linen = make_problem("local")
    model = NNXNet(nnx.Rngs(0))
    p = linen.params
    for layer, name in ((model.lin, "Dense_0"), (model.out, "Dense_1")):
        layer.kernel[...], layer.bias[...] = p[name]["kernel"], p[name]["bias"]
    model.bn.scale[...], model.bn.bias[...] = p["BatchNorm_0"]["scale"], p["BatchNorm_0"]["bias"]
    ours = sj.models.nnx_classification_problem(model, 3, mask_arg="mask", state_policy="local")
    out = {}
    for name, problem in (("linen", linen), ("nnx", ours)):
        sim = sj.Simulation(sj.fedavg(problem.loss_fn), problem, PLAN, clients_per_round=2)
        state, _ = sim.round(sj.hparams(client_lr=LR), sim.init(data), data, jr.key(3))
        out[name] = state
    lin, nx = out["linen"], out["nnx"]
    bn = lin.model["clients"]["batch_stats"]["BatchNorm_0"]
    pairs = [
        (nx.server.params["lin"]["kernel"], lin.server.params["Dense_0"]["kernel"]),
        (nx.server.params["bn"]["scale"], lin.server.params["BatchNorm_0"]["scale"]),
        (nx.model["clients"]["bn"]["mean"], bn["mean"]),
        (nx.model["clients"]["bn"]["var"], bn["var"]),
    ]
    for got, want in pairs:
        np.testing.assert_allclose(got[...], want, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(bn["mean"]))) > 0.1  # the statistics moved


def test_padded_slots_stay_out_of_the_statistics():
    """A module given no mask computes its statistics over the padded slots too: the round
    then differs from the reference, which the masked module matches (test above)."""

    class Unmasked(BNNet):
        @nn.compact
        def __call__(self, x, train):
            return BNNet(name="net")(x, train)

    _, data = make_data()
    masked = make_problem()
    unmasked = sj.models.classification_problem(Unmasked(), (4,), jr.key(1), train_arg="train")
    out = {}
    for name, problem in (("masked", masked), ("unmasked", unmasked)):
        sim = sj.Simulation(sj.fedavg(problem.loss_fn), problem, PLAN, clients_per_round=2)
        state, _ = sim.round(sj.hparams(client_lr=LR), sim.init(data), data, jr.key(3))
        out[name] = jax.tree.leaves(state.model["server"])
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*out.values(), strict=True)) > 1e-3


@pytest.mark.parametrize("policy", ["average", "local"])
def test_evaluation_uses_the_running_statistics_in_inference_mode(policy):
    clients, data = make_data()
    data = with_client_tests(data, clients)  # each client's test: its own data
    problem = make_problem(policy)
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, PLAN, clients_per_round=2)
    result = sim.run(data, sj.hparams(client_lr=LR), num_rounds=3, eval_every=3)
    state = result.state
    params = state.server.params
    module = BNNet()

    def stats_of(i):
        if policy == "average":
            return state.model["server"]
        return jax.tree.map(lambda a: a[i], state.model["clients"])

    def accuracy(stats, x, y):
        logits = module.apply({"params": params, **stats}, x, train=False)
        return np.asarray(jnp.argmax(logits, -1) == y, np.float32)

    per_client = [accuracy(stats_of(i), c["x"], c["y"]).mean() for i, c in enumerate(clients)]
    record = result.records[-1]
    np.testing.assert_allclose(record["local_accuracy_mean"], np.mean(per_client), atol=1e-6)
    held = stats_of(0) if policy == "average" else jax.tree.map(
        lambda a: jnp.mean(a, 0), state.model["clients"]
    )  # fmt: skip
    test = data.test
    expected = accuracy(held, test["x"], test["y"]).mean()
    np.testing.assert_allclose(record["test_accuracy"], expected, atol=1e-6)
    # The training objective: every example with its own client's statistics (local) or
    # the server's, in inference mode, averaged client by client.
    losses = []
    for i, c in enumerate(clients):
        stats = stats_of(i)
        logits = module.apply({"params": params, **stats}, c["x"], train=False)
        losses.append(optax.softmax_cross_entropy_with_integer_labels(logits, c["y"]).mean())
    np.testing.assert_allclose(record["train_loss"], np.mean(losses), rtol=1e-5)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("algorithm", "policy"),
    [
        ("fedavg", "local"),
        ("scaffold", "average"),
        ("mime", "local"),
        ("feddyn", "average"),
        pytest.param("scaffold", "local", marks=SLOW),
        pytest.param("fedprox", "average", marks=SLOW),
        pytest.param("fednova", "local", marks=SLOW),
        pytest.param("sgd", "average", marks=SLOW),
    ],
)
def test_batchnorm_and_dropout_models_train(algorithm, policy):
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 4)) * 3

    def client(n, bias):
        y = rng.integers(0, 3, n)
        x = centers[y] + rng.normal(size=(n, 4)) + bias  # a client-specific shift
        return {"x": x.astype(np.float32), "y": y.astype(np.int32)}

    clients = [client(n, i) for i, n in enumerate((20, 30, 25, 35))]
    data = with_client_tests(sj.data.from_client_arrays(clients), clients)
    problem = make_problem(policy, BNNet(dropout=0.2))
    factory = sj.algorithms.ALGORITHMS[algorithm].factory
    hp = {"client_lr": 0.1, **({"prox_mu": 0.01} if algorithm == "fedprox" else {})}
    sim = sj.Simulation(factory(problem.loss_fn), problem, sj.BatchPlan.fixed(8, 5), 2)
    result = sim.run(data, hp, num_rounds=20, eval_every=20)
    first, last = result.records[0], result.records[-1]
    assert last["train_loss"] < 0.7 * first["train_loss"]
    assert last["local_accuracy_mean"] > 0.75


def test_an_algorithm_without_a_model_state_parameter_is_refused_naming_the_fix():
    _, data = make_data()
    problem = make_problem()
    base = sj.fedavg(problem.loss_fn)

    def client_update(hparams, server_state, client_state, batches, mask, key):
        return base.client_update(hparams, server_state, client_state, batches, mask, key)

    sim = sj.Simulation(base._replace(client_update=client_update), problem, PLAN, 2)
    with pytest.raises(ValueError, match="client_update has no model_state parameter.*local_sgd"):
        sim.init(data)

    def drops_it(hparams, server_state, client_state, batches, mask, key, model_state=None):
        return base.client_update(hparams, server_state, client_state, batches, mask, key)

    sim = sj.Simulation(base._replace(client_update=drops_it), problem, PLAN, 2)
    with pytest.raises(ValueError, match="returned no ClientOutput.model_state"):
        sim.round(sj.hparams(client_lr=LR), sim.init(data), data, jr.key(0))
    sim = sj.Simulation(base, problem, PLAN, 2)
    state = sim.init(data)
    with pytest.raises(ValueError, match=r"evaluate\(state.server, data, state.model\)"):
        sim.evaluate(state.server, data)


def test_a_sweep_carries_each_configs_statistics_like_its_single_run():
    _, data = make_data()
    problem = make_problem()
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, PLAN, clients_per_round=2)
    lrs = [0.05, 0.3]
    grid, seeds, _ = sj.sweep.grid(client_lr=lrs)
    swept = sj.sweep.sweep(sim, data, grid, seeds, num_rounds=4)
    for j, lr in enumerate(lrs):
        single = sim.run(data, sj.hparams(client_lr=lr), num_rounds=4, eval_every=4)
        np.testing.assert_allclose(
            swept.records[j][-1]["test_loss"], single.records[-1]["test_loss"], rtol=1e-5
        )
        mine = jax.tree.map(lambda a, j=j: a[j], swept.model_states)
        assert_trees_close(mine, jax.device_get(single.state.model), rtol=1e-5, atol=1e-6)
    # The two step sizes led to different statistics: the comparison is not vacuous.
    mean = swept.model_states["server"]["batch_stats"]["BatchNorm_0"]["mean"]
    assert float(np.max(np.abs(mean[0] - mean[1]))) > 1e-3


def test_resume_restores_the_statistics(tmp_path):
    _, data = make_data()
    problem = make_problem("local")
    sim = sj.Simulation(sj.fedavg(problem.loss_fn), problem, PLAN, clients_per_round=2)
    hp = sj.hparams(client_lr=LR)
    whole = sim.run(data, hp, num_rounds=4, eval_every=2)
    sim.run(data, hp, num_rounds=2, eval_every=2, checkpoint_dir=tmp_path)
    resumed = sim.run(data, hp, num_rounds=4, eval_every=2, checkpoint_dir=tmp_path, resume=True)
    assert resumed.resumed_from == 2
    jax.tree.map(np.testing.assert_array_equal, resumed.state.model, whole.state.model)
    assert resumed.records[-1]["test_loss"] == whole.records[-1]["test_loss"]


def test_averaged_statistics_with_dropouts_average_the_reporting_clients_only():
    """Under ``state_policy="average"`` with dropouts, the server's statistics after a round
    are the mean of the REPORTING clients' (a dropped client's weigh 0), and stay as they
    were in a round where nobody reported."""
    _, data = make_data(sizes=(3, 7, 5, 9, 4, 6))
    problem = make_problem("average")
    part = sj.participation.make(dropouts="bernoulli", options={"dropout_rate": 0.6})
    sim = sj.Simulation(sj.fedavg(problem.loss_fn), problem, PLAN, 3, participation=part)
    hparams, key = sim.resolve_hparams(sj.hparams(client_lr=LR)), jr.key(2)
    state, seen = sim.init(data), set()
    for _ in range(12):
        before = jax.device_get(state.model["server"])
        state, metrics = sim.round(hparams, state, data, key)
        after = jax.device_get(state.model["server"])
        reported = int(np.sum(metrics["reported"]))
        seen.add(reported)
        flat = lambda t: np.concatenate([np.ravel(a) for a in jax.tree.leaves(t)])  # noqa: E731
        assert np.all(np.isfinite(flat(after)))
        if reported == 0:
            np.testing.assert_array_equal(flat(after), flat(before))
        else:
            assert not np.array_equal(flat(after), flat(before))
    assert 0 in seen and len(seen) > 1  # both kinds of round happened
