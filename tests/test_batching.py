"""Batch plans: positions stay inside a client's data, epochs are permutations, and padded
slots contribute nothing to a gradient."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import assert_trees_close

import scaffold_jax as sj
from scaffold_jax.local import batch_grad


@pytest.mark.parametrize("count", [1, 4, 7, 10])
def test_epochs_plan_visits_every_example_once_per_epoch(count):
    plan = sj.BatchPlan.epochs(batch_size=3, num_epochs=2)
    pos, mask = plan.positions(jr.key(0), jnp.int32(count), max_count=10)
    assert pos.shape == mask.shape == plan.shape(10)
    steps_per_epoch = -(-count // 3)
    seen = np.asarray(pos)[np.asarray(mask) > 0]
    assert len(seen) == 2 * count
    first = seen[:count]
    assert sorted(first.tolist()) == list(range(count))
    assert sorted(seen[count:].tolist()) == list(range(count))
    active_steps = int((np.asarray(mask).sum(1) > 0).sum())
    assert active_steps == 2 * steps_per_epoch


@pytest.mark.parametrize("count", [5, 23, 100])
def test_fraction_plan_cuts_each_epoch_into_equal_batches(count):
    plan = sj.BatchPlan.fraction_of_data(0.2, num_epochs=3)
    pos, mask = plan.positions(jr.key(1), jnp.int32(count), max_count=100)
    assert plan.shape(100) == (15, 20)
    sizes = np.asarray(mask).sum(1)
    assert sizes.sum() == 3 * count
    assert sizes.max() - sizes.min() <= 1  # near-equal batches, 5 per epoch
    pos, mask = np.asarray(pos), np.asarray(mask)
    for epoch in range(3):
        seen = pos[epoch * 5 : (epoch + 1) * 5][mask[epoch * 5 : (epoch + 1) * 5] > 0]
        assert sorted(seen.tolist()) == list(range(count))


def test_fixed_plan_draws_distinct_examples_within_a_step():
    plan = sj.BatchPlan.fixed(batch_size=4, num_steps=50)
    pos, mask = plan.positions(jr.key(2), jnp.int32(9), max_count=12)
    pos, mask = np.asarray(pos), np.asarray(mask)
    assert mask.min() == 1
    assert pos.max() < 9 and pos.min() >= 0
    assert all(len(set(row)) == 4 for row in pos)
    counts = np.bincount(pos.ravel(), minlength=9)
    assert counts.min() > 10  # every example is drawn, roughly uniformly
    # A client smaller than B gets every example once per step and padding beyond.
    pos, mask = plan.positions(jr.key(2), jnp.int32(3), max_count=12)
    assert np.asarray(mask).sum(1).tolist() == [3] * 50


def test_full_plan_is_the_whole_client_every_step():
    plan = sj.BatchPlan.full(num_steps=2)
    pos, mask = plan.positions(jr.key(0), jnp.int32(3), max_count=5)
    np.testing.assert_array_equal(np.asarray(mask), [[1, 1, 1, 0, 0]] * 2)
    np.testing.assert_array_equal(np.asarray(pos)[:, :3], [[0, 1, 2]] * 2)


def test_padded_slots_contribute_nothing_to_the_gradient(small_data, small_problem):
    """The padded full batch of a small client gives the unpadded gradient exactly, even
    when the padding holds another client's (very different) data."""
    client = 0  # 2 examples, padded to 13
    batches, mask = small_data.client_batches(jnp.int32(client), jr.key(0), sj.BatchPlan.full(1))
    batch = jax.tree.map(lambda a: a[0], batches)
    garbage = jax.tree.map(
        lambda a: a.at[2:].set(a[2:] * 0 + 50 if a.dtype != jnp.int32 else a[2:]), batch
    )
    unpadded = small_data.client_examples(client)
    loss_u, grad_u = batch_grad(small_problem.loss_fn, small_problem.params, unpadded, jnp.ones(2))
    for b in (batch, garbage):
        loss_p, grad_p = batch_grad(small_problem.loss_fn, small_problem.params, b, mask[0])
        np.testing.assert_allclose(loss_p, loss_u, rtol=1e-6)
        assert_trees_close(grad_p, grad_u, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: sj.BatchPlan.fixed(0, 3), "batch_size = 0"),
        (lambda: sj.BatchPlan.epochs(4, 0), "num_epochs = 0"),
        (lambda: sj.BatchPlan.fraction_of_data(0.0, 1), "fraction = 0.0"),
        (lambda: sj.BatchPlan.fraction_of_data(1.5, 1), "fraction = 1.5"),
        (lambda: sj.BatchPlan("minibatch"), "kind 'minibatch' is unknown"),
    ],
)
def test_bad_plans_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "plan",
    [
        sj.BatchPlan.epochs(batch_size=4, num_epochs=3),
        sj.BatchPlan.fixed(batch_size=4, num_steps=5),
        sj.BatchPlan.fraction_of_data(0.2, 2),
        sj.BatchPlan.full(3),
    ],
    ids=lambda p: p.kind,
)
def test_local_steps_ends_at_the_last_non_empty_step(plan):
    """``local_steps(n)`` is one past the client's last step holding an example: the local
    loop stops there, so it must never cut a real step off (nor is it ever longer)."""
    max_count = 23
    for count in range(1, max_count + 1):
        _, mask = plan.positions(jr.key(count), count, max_count)
        non_empty = np.flatnonzero(np.asarray(mask).sum(axis=1) > 0)
        assert int(plan.local_steps(count)) == non_empty[-1] + 1, count
    assert plan.steps_vary == (plan.kind == "epochs")
