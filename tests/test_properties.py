"""Property-based tests (hypothesis) of the engine's invariants and of masking.

Compilation dominates the cost of a round on CPU, so the engine properties draw their
round SHAPE (N, S, the batch plan K x B, the weighting) from a few fixed configurations,
each compiled once and cached, and draw everything that is data at random: client sizes,
example values, seeds, step sizes and the number of rounds. Client data use a "gapped"
flat layout: client i's n_i examples sit at the start of its own block of 2 M rows and the
rest of the block is filler, so the array shapes do not depend on the sizes (no
recompilation) and any read outside a client's examples lands on filler. With NaN filler,
a padded slot that is gathered and then masked by multiplication poisons the result; the
mask must keep every such read out.
"""

import functools

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scaffold_jax as sj

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_COUNT = 5  # M: the most examples a client holds (the static padded width)
DIM = 3

# name -> (N, S, plan, weighting): N = 1; S < N; S = N with data-size weighting; K = 2 or 3
# local steps; batches wider than some clients. (The full-batch plan is covered below.)
CONFIGS = {
    "N1-S1-epochs": (1, 1, sj.BatchPlan.epochs(batch_size=2, num_epochs=1), "uniform"),
    "N5-S2-fixed": (5, 2, sj.BatchPlan.fixed(batch_size=3, num_steps=2), "uniform"),
    "N6-S6-fraction": (6, 6, sj.BatchPlan.fraction_of_data(0.5, 1), "num_examples"),
}


def loss_fn(params, batch):
    return 0.5 * (batch["x"] @ params["w"] - batch["y"]) ** 2


PROBLEM = sj.Problem(params={"w": jnp.zeros(DIM, jnp.float32)}, loss_fn=loss_fn)


@functools.cache
def simulation(name):
    """One Simulation per configuration; its jitted round compiles once per shape."""
    num_clients, num_sampled, plan, weighting = CONFIGS[name]
    return sj.Simulation(
        sj.scaffold(loss_fn), PROBLEM, plan, clients_per_round=num_sampled, weighting=weighting
    )


def gapped_data(sizes, values_seed, filler):
    """Client i's examples at rows [2 M i, 2 M i + n_i); every other row is ``filler``.

    ``x[:, 0]`` holds the owner's id and ``x[:, 1]`` the example's index within its
    client, so a gathered example tells where it came from.
    """
    rng = np.random.default_rng(values_seed)
    num_clients, block = len(sizes), 2 * MAX_COUNT
    x = np.full((num_clients * block, DIM), filler, np.float32)
    y = np.full((num_clients * block,), filler, np.float32)
    for i, n in enumerate(sizes):
        rows = slice(i * block, i * block + n)
        x[rows] = rng.normal(size=(n, DIM))
        x[rows, 0] = i
        x[rows, 1] = np.arange(n)
        y[rows] = rng.normal(size=n)
    return sj.FederatedData(
        examples={"x": jnp.asarray(x), "y": jnp.asarray(y)},
        offsets=jnp.arange(num_clients, dtype=jnp.int32) * block,
        counts=jnp.asarray(sizes, jnp.int32),
        test=None,
        num_clients=num_clients,
        max_count=MAX_COUNT,
    )


@st.composite
def runs(draw, names=tuple(CONFIGS)):
    name = draw(st.sampled_from(names))
    num_clients = CONFIGS[name][0]
    sizes = draw(st.lists(st.integers(1, MAX_COUNT), min_size=num_clients, max_size=num_clients))
    return {
        "name": name,
        "sizes": sizes,
        "values_seed": draw(st.integers(0, 2**31 - 1)),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "client_lr": draw(st.floats(0.01, 0.2)),
        "num_rounds": draw(st.integers(1, 3)),
    }


def run_rounds(run, filler):
    """Yields (ids, table before, state after, metrics) for every round of ``run``."""
    sim = simulation(run["name"])
    data = gapped_data(run["sizes"], run["values_seed"], filler)
    hp = sj.hparams(client_lr=run["client_lr"])
    state = sim.init(data)
    key = jr.key(run["seed"])
    for _ in range(run["num_rounds"]):
        before = np.asarray(state.clients.control["w"])  # host copy: the state is donated
        state, metrics = sim.round(hp, state, data, key)
        yield np.asarray(metrics["client_ids"]), before, state, metrics


# --------------------------------------------------------------------------- the engine
@SETTINGS
@given(run=runs())
def test_round_invariants(run):
    """Exactly S distinct clients per round; only their rows change; SCAFFOLD's
    c = Σ w_i c_i / Σ w_i holds after every round; everything stays finite."""
    num_clients, num_sampled, _, weighting = CONFIGS[run["name"]]
    weights = np.ones(num_clients) if weighting == "uniform" else np.asarray(run["sizes"], float)
    for ids, before, state, metrics in run_rounds(run, filler=1e3):
        assert ids.shape == (num_sampled,)
        assert len(set(ids.tolist())) == num_sampled
        assert ids.min() >= 0 and ids.max() < num_clients
        table = np.asarray(state.clients.control["w"])
        untouched = np.setdiff1d(np.arange(num_clients), ids)
        np.testing.assert_array_equal(table[untouched], before[untouched])
        c = np.asarray(state.server.control["w"])
        expected = weights @ table.astype(np.float64) / weights.sum()
        scale = max(1.0, float(np.abs(table).max()))
        np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-5 * scale)
        assert np.all(np.isfinite(np.asarray(state.server.params["w"])))
        assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values())


@pytest.mark.parametrize("name", list(CONFIGS))
@SETTINGS
@given(data=st.data())
def test_padded_slots_never_reach_the_result(name, data):
    """With NaN in every row no client owns, the result is still finite."""
    run = data.draw(runs(names=(name,)))
    for _, _, state, metrics in run_rounds(run, filler=np.nan):
        assert np.all(np.isfinite(np.asarray(state.server.params["w"])))
        assert np.all(np.isfinite(np.asarray(state.clients.control["w"])))
        assert np.isfinite(float(metrics["local_loss"]))


# --------------------------------------------------------------------------- batch plans
@st.composite
def plans(draw):
    kind = draw(st.sampled_from(["fixed", "epochs", "fraction", "full"]))
    if kind == "fixed":
        return sj.BatchPlan.fixed(draw(st.integers(1, 6)), draw(st.integers(1, 3)))
    if kind == "epochs":
        return sj.BatchPlan.epochs(draw(st.integers(1, 6)), draw(st.integers(1, 3)))
    if kind == "fraction":
        fraction = draw(st.sampled_from([0.2, 0.25, 0.5, 1.0]))
        return sj.BatchPlan.fraction_of_data(fraction, draw(st.integers(1, 2)))
    return sj.BatchPlan.full(draw(st.integers(1, 3)))


@settings(max_examples=8, deadline=None)
@given(plan=plans(), max_count=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_batch_plan_positions_stay_inside_the_client(plan, max_count, seed):
    # Every client size 1..max_count at once: one compiled program per draw.
    counts = jnp.arange(1, max_count + 1, dtype=jnp.int32)
    keys = jr.split(jr.key(seed), max_count)
    all_pos, all_mask = jax.jit(jax.vmap(lambda k, n: plan.positions(k, n, max_count)))(
        keys, counts
    )
    for count, pos, mask in zip(range(1, max_count + 1), all_pos, all_mask, strict=True):
        check_positions(plan, count, np.asarray(pos), np.asarray(mask), max_count)


def check_positions(plan, count, pos, mask, max_count):
    assert pos.shape == mask.shape == plan.shape(max_count)
    assert set(np.unique(mask).tolist()) <= {0.0, 1.0}
    live = mask == 1
    assert np.all((pos[live] >= 0) & (pos[live] < count))
    for k in range(pos.shape[0]):  # no example twice in one step
        assert len(set(pos[k][live[k]].tolist())) == int(live[k].sum())
    if plan.kind in ("epochs", "fraction"):  # every epoch sees every example exactly once
        if plan.kind == "epochs":  # ceil(n_i / B) steps per epoch, then padded steps
            per_epoch = -(-count // plan.batch_size)
        else:
            per_epoch = plan.steps_per_epoch_fraction
        for e in range(plan.num_epochs):
            steps = slice(e * per_epoch, (e + 1) * per_epoch)
            assert sorted(pos[steps][live[steps]].tolist()) == list(range(count))
        assert not live[plan.num_epochs * per_epoch :].any()
    elif plan.kind == "full":
        assert np.all(live.sum(axis=1) == count)
    else:
        assert np.all(live.sum(axis=1) == min(plan.batch_size, count))
    if plan.kind != "fixed":
        assert np.all((pos >= 0) & (pos < count))  # masked slots too (see the test below)


def test_fixed_plan_masked_slots_stay_inside_the_client():
    pos, mask = sj.BatchPlan.fixed(batch_size=4, num_steps=2).positions(jr.key(0), 2, 6)
    assert np.all(np.asarray(pos) < 2)


# A few plans of every kind, with batches wider and narrower than the clients.
PLANS = [
    sj.BatchPlan.fixed(batch_size=2, num_steps=2),
    sj.BatchPlan.fixed(batch_size=MAX_COUNT + 1, num_steps=1),
    sj.BatchPlan.epochs(batch_size=2, num_epochs=2),
    sj.BatchPlan.fraction_of_data(0.5, num_epochs=1),
    sj.BatchPlan.full(num_steps=1),
]


@functools.partial(jax.jit, static_argnums=3)
def all_client_batches(data, ids, keys, plan):
    """Every client's batches at once, as the engine draws them (vmap over clients)."""
    return jax.vmap(lambda i, k: data.client_batches(i, k, plan))(ids, keys)


@SETTINGS
@given(
    sizes=st.lists(st.integers(1, MAX_COUNT), min_size=5, max_size=5),
    plan=st.sampled_from(PLANS),
    seed=st.integers(0, 2**31 - 1),
)
def test_client_batches_hold_only_the_clients_own_examples(sizes, plan, seed):
    data = gapped_data(sizes, 0, filler=np.nan)
    ids = jnp.arange(len(sizes), dtype=jnp.int32)
    keys = jax.vmap(lambda i: jr.fold_in(jr.key(seed), i))(ids)
    batches, mask = all_client_batches(data, ids, keys, plan)
    x, live = np.asarray(batches["x"]), np.asarray(mask) == 1
    for client in range(len(sizes)):
        mine = x[client][live[client]]
        assert np.all(mine[:, 0] == client)  # the owner's id: never a neighbour's row
        assert np.all(np.isfinite(mine))
        assert np.all(mine[:, 1] < sizes[client])


# ----------------------------------------------------------------------- config validation
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**31, max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e39, -1e39, 1e308, 5e-324, -0.0, 2**32, 2**63, 2**64, 10**400, -(10**400)])
    | st.text(max_size=8)
    | st.sampled_from(["", " ", "scaffold", "fedprox", "I", "II", "bfloat16", "full", "mlp"])
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.text(max_size=6) | st.sampled_from(["prox_mu", "x"]), children, max_size=3
        )
    ),
    max_leaves=6,
)
# Scalars and flat lists drawn often (most fields take one of those), nesting less often.
JSON_FIELD_VALUES = st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=3), JSON_VALUES)


def _config_keys():
    from scaffold_jax.experiments import RunConfig, declared_hparams, declared_options

    return sorted({*RunConfig.field_names(), *declared_hparams(), *declared_options()})


def _validate(values):
    from scaffold_jax.experiments import ConfigError, RunConfig

    plugins = values.get("plugins")
    if isinstance(plugins, list) and any(isinstance(p, (str, list, dict)) for p in plugins):
        del values["plugins"]  # names would be imported: only non-names are drawn
    try:
        RunConfig.from_dict(values).validate()
    except ConfigError:
        pass


@pytest.mark.parametrize("key", _config_keys())
@settings(max_examples=60, deadline=None)
@given(
    value=JSON_FIELD_VALUES,
    algorithm=st.sampled_from(["scaffold", "fedavg", "fedprox", "sgd"]),
)
def test_every_config_field_refuses_any_json_value_with_a_config_error(key, value, algorithm):
    """Any JSON value for any field (or declared name): the config is valid or refused with
    a ConfigError, never another exception (a TypeError or OverflowError from inside the
    checks)."""
    _validate({"algorithm": algorithm, key: value} if key != "algorithm" else {key: value})


@settings(max_examples=150, deadline=None)
@given(values=st.dictionaries(st.sampled_from(_config_keys()), JSON_FIELD_VALUES, max_size=5))
def test_config_validation_raises_only_config_errors(values):
    """Several fields at once (their cross-checks: partition, plan, sampling)."""
    _validate(values)
