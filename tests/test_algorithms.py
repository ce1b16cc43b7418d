"""The identities of SCAFFOLD's Algorithm 1 (Karimireddy et al., ICML 2020, Section 4),
at float tolerance.

- SCAFFOLD with controls pinned to zero is FedAvg;
- K = 1, S = N, η_g = 1 and full-batch gradients: FedAvg = SCAFFOLD (I and II) = SGD = GD;
- FedProx with μ = 0 is FedAvg;
- after every round c = mean_i c_i (uniform) and c = Σ n_i c_i / Σ n_i (num_examples).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_close

import scaffold_jax as sj
from scaffold_jax.algorithms import client_controls
from scaffold_jax.algorithms.common import local_update
from scaffold_jax.local import batch_grad, flatten_steps

# The module (the package's `scaffold` attribute is the factory function).
from scaffold_jax.tree import encode_storage


def _run(alg, problem, data, plan, s, hp, rounds=4, seed=0, weighting="uniform"):
    sim = sj.Simulation(alg, problem, plan, s, weighting=weighting)
    return sim.run(data, hp, num_rounds=rounds, seed=seed)


def pinned_zero_scaffold(loss_fn):
    """SCAFFOLD whose controls never move from 0 (c_i ≡ 0, c ≡ 0)."""
    alg = sj.scaffold(loss_fn)

    def client_update(hp, server, client, batches, mask, key):
        _, out = alg.client_update(hp, server, client, batches, mask, key)
        zeros = jax.tree.map(jnp.zeros_like, out.message)
        return client, out._replace(message=zeros)

    return alg._replace(client_update=client_update)


def test_scaffold_with_zero_controls_is_fedavg(small_data, small_problem):
    plan = sj.BatchPlan.fixed(batch_size=4, num_steps=3)
    hp = sj.hparams(client_lr=0.3, server_lr=0.7)
    zero = _run(pinned_zero_scaffold(small_problem.loss_fn), small_problem, small_data, plan, 3, hp)
    avg = _run(sj.fedavg(small_problem.loss_fn), small_problem, small_data, plan, 3, hp)
    assert_trees_close(zero.state.server.params, avg.state.server.params, rtol=1e-6)
    np.testing.assert_array_equal(zero.client_ids, avg.client_ids)
    # ...and the real SCAFFOLD differs from FedAvg, so the comparison above can fail.
    real = _run(sj.scaffold(small_problem.loss_fn), small_problem, small_data, plan, 3, hp)
    diff = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(a - b))),
        real.state.server.params,
        avg.state.server.params,
    )
    assert max(jax.tree.leaves(diff)) > 1e-3


def _gradient_descent(problem, data, lr, rounds):
    """Plain GD on f(x) = (1/N) Σ_i mean_j loss(x; example_ij), computed directly."""
    clients = [data.client_examples(i) for i in range(data.num_clients)]

    def f(params):
        return sum(jnp.mean(problem.loss_fn(params, c)) for c in clients) / len(clients)

    params = problem.params
    for _ in range(rounds):
        params = jax.tree.map(lambda p, g: p - lr * g, params, jax.grad(f)(params))
    return params


@pytest.mark.parametrize(
    "make",
    [sj.fedavg, sj.sgd, lambda f: sj.scaffold(f, option=1), lambda f: sj.scaffold(f, option=2)],
    ids=["fedavg", "sgd", "scaffold-I", "scaffold-II"],
)
def test_one_full_batch_step_with_all_clients_is_gradient_descent(make, small_data, small_problem):
    hp = sj.hparams(client_lr=0.5, server_lr=1.0)
    n = small_data.num_clients
    result = _run(
        make(small_problem.loss_fn),
        small_problem,
        small_data,
        sj.BatchPlan.full(1),
        n,
        hp,
        rounds=5,
    )
    expected = _gradient_descent(small_problem, small_data, 0.5, 5)
    assert_trees_close(result.state.server.params, expected, rtol=1e-5, atol=1e-6)


def test_fedprox_with_zero_mu_is_fedavg(small_data, small_problem):
    plan = sj.BatchPlan.epochs(batch_size=3, num_epochs=2)
    hp = sj.hparams(client_lr=0.2, prox_mu=0.0)
    prox = _run(sj.fedprox(small_problem.loss_fn), small_problem, small_data, plan, 4, hp)
    fedavg_hp = sj.hparams(client_lr=0.2)  # FedAvg declares no μ
    avg = _run(sj.fedavg(small_problem.loss_fn), small_problem, small_data, plan, 4, fedavg_hp)
    assert_trees_close(prox.state.server.params, avg.state.server.params, rtol=1e-6)
    # μ > 0 pulls the clients back towards x: the updates must shrink.
    hp_prox = sj.hparams(client_lr=0.2, prox_mu=1.0)
    prox1 = _run(sj.fedprox(small_problem.loss_fn), small_problem, small_data, plan, 4, hp_prox)
    assert np.mean(prox1.round_metrics["client_drift"]) < np.mean(avg.round_metrics["client_drift"])


@pytest.mark.parametrize("option", [1, 2])
@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_server_control_is_the_mean_of_client_controls(
    option, weighting, small_data, small_problem
):
    sim = sj.Simulation(
        sj.scaffold(small_problem.loss_fn, option=option),
        small_problem,
        sj.BatchPlan.fixed(3, 4),
        3,
        weighting=weighting,
    )
    state = sim.init(small_data)
    hp = sj.hparams(client_lr=0.2)
    key = jax.random.key(1)
    counts = np.asarray(small_data.counts, np.float64)
    w = np.ones_like(counts) if weighting == "uniform" else counts
    for _ in range(5):
        state, _ = sim.round(hp, state, small_data, key)
        for c, c_i in zip(
            jax.tree.leaves(state.server.control),
            jax.tree.leaves(state.clients.control),
            strict=True,
        ):
            expected = np.tensordot(w, np.asarray(c_i, np.float64), axes=1) / w.sum()
            np.testing.assert_allclose(np.asarray(c), expected, rtol=1e-5, atol=1e-6)
            assert np.abs(np.asarray(c)).max() > 0  # the controls really moved


def test_bfloat16_control_table_keeps_the_invariant(small_data, small_problem):
    alg = sj.scaffold(small_problem.loss_fn, control_dtype=jnp.bfloat16)
    sim = sj.Simulation(alg, small_problem, sj.BatchPlan.fixed(3, 4), 3)
    state = sim.init(small_data)
    # Stored as bfloat16 bit patterns: a uint16 scatter is in place on every backend.
    assert all(a.dtype == jnp.uint16 for a in jax.tree.leaves(state.clients))
    for _ in range(4):
        state, _ = sim.round(sj.hparams(0.2), state, small_data, jax.random.key(0))
    assert all(a.dtype == jnp.uint16 for a in jax.tree.leaves(state.clients))
    for c, c_i in zip(
        jax.tree.leaves(state.server.control),
        jax.tree.leaves(client_controls(state.clients)),
        strict=True,
    ):
        assert c.dtype == jnp.float32 and c_i.dtype == jnp.float32
        mean = np.asarray(c_i, np.float64).mean(0)
        np.testing.assert_allclose(np.asarray(c), mean, rtol=1e-5, atol=1e-6)
        assert np.abs(np.asarray(c)).max() > 0


def plain_bfloat16_scaffold(loss_fn, option):
    """The reference: SCAFFOLD with its table stored as bfloat16 ARRAYS (what the library
    did before it stored bit patterns), written out independently of scaffold.py."""
    alg = sj.scaffold(loss_fn, option=option)

    def init(params):
        server, client = alg.init(params)
        return server, jax.tree.map(lambda a: a.astype(jnp.bfloat16), client)

    def client_update(hp, server, client, batches, mask, key):
        x, c = server.params, server.control
        c_i = optax.tree.cast(client.control, jnp.float32)
        y, out, info = local_update(loss_fn, hp, x, batches, mask, offset=optax.tree.sub(c, c_i))
        if option == 2:
            steps = jnp.maximum(info.num_steps, 1).astype(jnp.float32)
            c_plus = optax.tree.add_scale(
                optax.tree.sub(c_i, c), 1.0 / (steps * hp.client_lr), optax.tree.sub(x, y)
            )
            c_plus = optax.tree.where(info.num_steps > 0, c_plus, c_i)
        else:
            _, c_plus = batch_grad(loss_fn, x, *flatten_steps(batches, mask))
        stored = optax.tree.cast(c_plus, jnp.bfloat16)
        delta = optax.tree.sub(optax.tree.cast(stored, jnp.float32), c_i)
        return client._replace(control=stored), out._replace(message={"delta_control": delta})

    return alg._replace(init=init, client_update=client_update)


@pytest.mark.parametrize("option", [1, 2])
def test_bfloat16_bit_patterns_are_bitwise_a_bfloat16_table(option, small_data, small_problem):
    """uint16 storage changes where the values live, not what they are: the same run as a
    plain bfloat16 table, bit for bit (server state and every stored control)."""
    plan = sj.BatchPlan.epochs(batch_size=3, num_epochs=1)
    hp = sj.hparams(client_lr=0.3, server_lr=0.9)
    got = _run(
        sj.scaffold(small_problem.loss_fn, option=option, control_dtype=jnp.bfloat16),
        small_problem,
        small_data,
        plan,
        3,
        hp,
        rounds=6,
    )
    want = _run(
        plain_bfloat16_scaffold(small_problem.loss_fn, option),
        small_problem,
        small_data,
        plan,
        3,
        hp,
        rounds=6,
    )
    np.testing.assert_array_equal(got.client_ids, want.client_ids)
    for a, b in zip(
        jax.tree.leaves(got.state.server), jax.tree.leaves(want.state.server), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    table, reference = client_controls(got.state.clients), want.state.clients.control
    for a, b in zip(jax.tree.leaves(table), jax.tree.leaves(reference), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))
        assert np.any(np.asarray(a) != 0)  # the controls really moved


def test_bfloat16_table_is_written_in_place():
    """The compiled rounds alias the uint16 table (input = output) and hold no
    table-sized temporary; a bfloat16-array table made XLA's CPU backend convert the whole
    table to float32 for every scatter (temporaries of 2x the table)."""
    from scaffold_jax.data.synthetic import procedural_synthetic

    num_clients = 8192
    data = procedural_synthetic(num_clients, 1.0, 1.0, sizes=20, num_test_clients=0)
    problem = sj.models.logistic_regression((60,), 10)
    alg = sj.scaffold(problem.loss_fn, control_dtype=jnp.bfloat16)
    sim = sj.Simulation(alg, problem, sj.BatchPlan.fixed(10, 2), clients_per_round=8)
    state = sim.init(data)
    table_bytes = sum(a.nbytes for a in jax.tree.leaves(state.clients))
    assert table_bytes == num_clients * 610 * 2
    compiled = sim.run_rounds.lower(
        sj.hparams(0.1), state, data, jax.random.key(0), num_rounds=2
    ).compile()
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= table_bytes
    assert memory.temp_size_in_bytes < table_bytes / 4, memory


def test_bfloat16_encoding_rounds_to_nearest_even_and_decodes_exactly():
    """Every one of the 2^16 bit patterns decodes to its bfloat16 value; float32 values
    (ties, subnormals, ±0, ±inf, NaN, overflow) encode as astype(bfloat16) does."""
    bits = np.arange(2**16, dtype=np.uint16)
    decoded = np.asarray(client_controls(sj.algorithms.ScaffoldClientState(control=bits)))
    expected = bits.view(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(decoded.view(np.uint32), expected.view(np.uint32))

    rng = np.random.default_rng(0)
    ties = (rng.integers(0, 2**16, 1000, dtype=np.uint32) << 16) | np.uint32(0x8000)
    values = np.concatenate(
        [
            (rng.normal(size=1000) * 10.0 ** rng.integers(-40, 38, 1000)).astype(np.float32),
            ties.view(np.float32),
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-45, -1e-40], np.float32),
        ]
    )
    params = {"w": jnp.zeros(values.shape)}
    alg = sj.scaffold(lambda p, b: jnp.zeros(()), control_dtype=jnp.bfloat16)
    _, client = alg.init(params)
    assert client.control["w"].dtype == jnp.uint16 and not np.any(client.control["w"])
    encoded = np.asarray(encode_storage({"w": jnp.asarray(values)}, jnp.dtype(jnp.bfloat16))["w"])
    with np.errstate(invalid="ignore"):  # numpy warns casting NaN; the bits are defined
        reference = values.astype(jnp.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(encoded, reference)


def test_server_optimizer_momentum_is_fedavgm(small_data, small_problem):
    """FedAvgM through optax.trace: with zero decay it reduces to FedAvg; with decay it
    follows v ← β v + (−Δx), x ← x − η_g v, checked against a hand-written loop."""
    plan = sj.BatchPlan.fixed(4, 2)
    hp = sj.hparams(client_lr=0.3, server_lr=0.5)
    n = small_data.num_clients
    plain = _run(sj.fedavg(small_problem.loss_fn), small_problem, small_data, plan, n, hp)
    nodecay = _run(
        sj.fedavg(small_problem.loss_fn, server_optimizer=optax.trace(0.0)),
        small_problem,
        small_data,
        plan,
        n,
        hp,
    )
    assert_trees_close(plain.state.server.params, nodecay.state.server.params, rtol=1e-6)
    momentum = _run(
        sj.fedavg(small_problem.loss_fn, server_optimizer=optax.trace(0.9)),
        small_problem,
        small_data,
        plan,
        n,
        hp,
    )
    assert not np.allclose(
        jax.tree.leaves(momentum.state.server.params)[0],
        jax.tree.leaves(plain.state.server.params)[0],
    )


def test_unknown_scaffold_option_is_rejected(small_problem):
    with pytest.raises(ValueError, match="option 3 is unknown"):
        sj.scaffold(small_problem.loss_fn, option=3)


def test_unsupported_control_dtype_is_rejected(small_problem):
    with pytest.raises(ValueError, match="control_dtype"):
        sj.scaffold(small_problem.loss_fn, control_dtype=jnp.int8)


# ----------------------------------------------------------------------------- registry
def test_an_algorithm_built_from_the_registry_is_named_by_its_key(monkeypatch, small_problem):
    """A variant registered over scaffold() records its own name, not "scaffold"."""
    from scaffold_jax.algorithms import ALGORITHMS, make, register

    monkeypatch.setattr(ALGORITHMS, "_entries", dict(ALGORITHMS._entries))
    spec = register("scaffold_m", lambda loss_fn: sj.scaffold(loss_fn, option=1), "SCAFFOLD-M")
    assert spec.build(small_problem.loss_fn).name == "scaffold_m"
    assert make("scaffold_m", small_problem.loss_fn).name == "scaffold_m"
    assert ALGORITHMS["scaffold"].build(small_problem.loss_fn).name == "scaffold"


def test_declared_hyper_parameters_are_known_without_building_and_checked(
    monkeypatch, small_problem
):
    from scaffold_jax.algorithms import ALGORITHMS, register
    from scaffold_jax.types import STEP_SIZES, HParam

    monkeypatch.setattr(ALGORITHMS, "_entries", dict(ALGORITHMS._entries))
    built = []

    def factory(loss_fn):
        built.append(loss_fn)
        return sj.fedavg(loss_fn)

    spec = register("counted", factory, hparams=STEP_SIZES)
    assert spec.hparams == STEP_SIZES and not built  # read without building
    assert spec.build(small_problem.loss_fn).name == "counted" and len(built) == 1
    wrong = register("wrong", factory, hparams={**STEP_SIZES, "mu": HParam(1.0)})
    with pytest.raises(ValueError, match="declaring the hyper-parameters.*mu.*make register"):
        wrong.build(small_problem.loss_fn)
