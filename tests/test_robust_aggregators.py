"""The robust aggregators (scaffold_jax.robust.aggregators) against plain numpy float64
references written separately here: loops over clients, np.median, sorted lists, explicit
Weiszfeld and centered-clipping loops, explicit pairwise distances for Krum. Inputs hold
masked rows of huge garbage (1e30, which must be ignored exactly), n = 0, 1, 2, odd and
even n, ties; parameters are traced (jit) and vmapped; the contract's identities hold."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaffold_jax.robust.aggregators import (
    bucket,
    cclip,
    geomed,
    krum,
    median,
    multikrum,
    trimmed_mean,
)

S, D = 7, 5
GARBAGE = 1e30
TOL = {"rtol": 1e-5, "atol": 1e-5}

j_median = jax.jit(median)
j_trimmed = jax.jit(trimmed_mean)
j_krum = jax.jit(krum)
j_multikrum = jax.jit(multikrum)
j_geomed = jax.jit(geomed, static_argnames="iterations")
j_cclip = jax.jit(cclip, static_argnames="iterations")
j_bucket = jax.jit(bucket)

# Masks over S = 7 rows: n = 0, 1, 2, 3 (odd), 4 (even), 6 and 7, reporters scattered.
MASKS = [
    [0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 1, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 1],
    [0, 1, 0, 1, 0, 1, 0],
    [1, 1, 0, 0, 1, 0, 1],
    [1, 1, 1, 0, 1, 1, 1],
    [1, 1, 1, 1, 1, 1, 1],
]


def case(mask, seed=0, ties=False):
    """(rows float32 [S, D] with garbage in the masked rows, mask bool [S])."""
    rng = np.random.default_rng(seed)
    mask = np.asarray(mask, bool)
    if ties:
        rows = rng.integers(-2, 3, size=(len(mask), D)).astype(np.float32)
    else:
        rows = rng.normal(size=(len(mask), D)).astype(np.float32)
    sign = np.where(np.arange(len(mask)) % 2 == 0, 1.0, -1.0).astype(np.float32)
    garbage = GARBAGE * sign[:, None] * np.ones((1, D), np.float32)
    return np.where(mask[:, None], rows, garbage).astype(np.float32), mask


def reporting(rows, mask):
    return [np.asarray(rows[i], np.float64) for i in range(len(mask)) if mask[i]]


def ref_mean(rows, mask):
    u = reporting(rows, mask)
    return sum(u) / len(u) if u else np.zeros(rows.shape[1])


def ref_median(rows, mask):
    u = reporting(rows, mask)
    return np.median(np.stack(u), axis=0) if u else np.zeros(rows.shape[1])


def ref_trimmed(rows, mask, beta):
    u = reporting(rows, mask)
    n = len(u)
    if n == 0:
        return np.zeros(rows.shape[1])
    k = math.floor(beta * n)
    out = []
    for c in range(rows.shape[1]):
        values = sorted(v[c] for v in u)
        kept = values[k : n - k]
        out.append(sum(kept) / len(kept))
    return np.array(out)


def ref_krum_scores(rows, mask, f):
    """{row index: score} over the reporting rows, from explicit pairwise distances."""
    idx = [i for i in range(len(mask)) if mask[i]]
    n = len(idx)
    q = max(1, n - f - 2)
    scores = {}
    for i in idx:
        dists = []
        for j in idx:
            if j != i:
                diff = np.asarray(rows[i], np.float64) - np.asarray(rows[j], np.float64)
                dists.append(float(diff @ diff))
        scores[i] = sum(sorted(dists)[:q])
    return scores


def ref_multikrum(rows, mask, f, m):
    """(aggregate, selected indices): the mean of the m lowest scores, ties by index."""
    scores = ref_krum_scores(rows, mask, f)
    if not scores:
        return np.zeros(rows.shape[1]), []
    m = min(max(m, 1), len(scores))
    chosen = sorted(scores, key=lambda i: (scores[i], i))[:m]
    return sum(np.asarray(rows[i], np.float64) for i in chosen) / m, sorted(chosen)


def ref_geomed(rows, mask, iterations=8, nu=1e-6):
    u = reporting(rows, mask)
    if not u:
        return np.zeros(rows.shape[1])
    z = sum(u) / len(u)
    for _ in range(iterations):
        weights = [1.0 / max(nu, float(np.linalg.norm(v - z))) for v in u]
        z = sum(w * v for w, v in zip(weights, u, strict=True)) / sum(weights)
    return z


def ref_cclip(rows, mask, centre, tau, iterations=1):
    u = reporting(rows, mask)
    v = np.asarray(centre, np.float64)
    if not u:
        return v
    for _ in range(iterations):
        step = np.zeros_like(v)
        for x in u:
            norm = float(np.linalg.norm(x - v))
            step += (x - v) * (1.0 if norm == 0 else min(1.0, tau / norm))
        v = v + step / len(u)
    return v


def selected_indices(selected):
    return [i for i, s in enumerate(np.asarray(selected)) if s]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("mask", MASKS)
def test_median_and_trimmed_mean_match_the_references(mask, ties):
    rows, mask = case(mask, seed=sum(mask), ties=ties)
    np.testing.assert_allclose(j_median(rows, mask), ref_median(rows, mask), **TOL)
    for beta in (0.0, 0.2, 0.25, 0.34, 0.49):
        got = j_trimmed(rows, mask, jnp.float32(beta))
        np.testing.assert_allclose(got, ref_trimmed(rows, mask, beta), **TOL)


def test_median_of_at_most_two_rows_and_trim_zero_are_the_mean():
    for mask in MASKS[:3] + MASKS[4:]:
        rows, mask = case(mask, seed=3)
        mean = ref_mean(rows, mask)
        np.testing.assert_allclose(j_trimmed(rows, mask, 0.0), mean, **TOL)
        if mask.sum() <= 2:
            np.testing.assert_allclose(j_median(rows, mask), mean, **TOL)


def test_trimmed_mean_vmapped_over_betas():
    rows, mask = case(MASKS[5], seed=4)  # n = 6: k = 0, 1, 2
    betas = jnp.array([0.0, 0.2, 0.4], jnp.float32)
    got = jax.jit(jax.vmap(trimmed_mean, in_axes=(None, None, 0)))(rows, mask, betas)
    for b, beta in enumerate((0.0, 0.2, 0.4)):
        np.testing.assert_allclose(got[b], ref_trimmed(rows, mask, beta), **TOL)
    assert not np.allclose(got[0], got[2])  # the trim changes something


def test_trimmed_mean_k_is_the_float32_floor_as_documented():
    # float32(0.42) * 150 = 62.99999...: k = 62 (the documented float32 floor), not 63.
    rows = (np.arange(150, dtype=np.float32) ** 2)[:, None]
    mask = np.ones(150, bool)
    want = np.mean(np.arange(62, 88, dtype=np.float64) ** 2)
    np.testing.assert_allclose(trimmed_mean(rows, mask, np.float32(0.42)), [want], rtol=1e-6)
    np.testing.assert_allclose(
        trimmed_mean(rows, mask, np.float32(0.41)), ref_trimmed(rows, mask, 0.41), rtol=1e-6
    )


def test_median_vmapped_over_masks():
    rows, _ = case(MASKS[6], seed=5)
    masks = np.array(MASKS, bool)
    got = jax.vmap(median, in_axes=(None, 0))(rows, masks)
    for b, mask in enumerate(masks):
        np.testing.assert_allclose(got[b], ref_median(np.where(mask[:, None], rows, 7e29), mask))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mask=st.lists(st.booleans(), min_size=S, max_size=S),
    values=st.lists(st.integers(-3, 3), min_size=S * D, max_size=S * D),
    beta=st.sampled_from([0.0, 0.15, 0.3, 0.45]),
)
def test_median_and_trimmed_mean_property(mask, values, beta):
    mask = np.array(mask, bool)
    rows = np.array(values, np.float32).reshape(S, D) * np.float32(0.5)
    rows = np.where(mask[:, None], rows, np.float32(-GARBAGE)).astype(np.float32)
    np.testing.assert_allclose(j_median(rows, mask), ref_median(rows, mask), **TOL)
    np.testing.assert_allclose(j_trimmed(rows, mask, beta), ref_trimmed(rows, mask, beta), **TOL)


@pytest.mark.parametrize("mask", MASKS)
def test_krum_and_multikrum_match_the_reference(mask):
    rows, mask = case(mask, seed=10 + sum(mask))
    n = int(mask.sum())
    for f in (0, 1, 2):
        agg, sel = j_krum(rows, mask, f)
        want, chosen = ref_multikrum(rows, mask, f, 1)
        np.testing.assert_allclose(agg, want, **TOL)
        assert selected_indices(sel) == chosen
        for m in (1, 2, 3, n, n + 2):
            agg, sel = j_multikrum(rows, mask, f, m)
            want, chosen = ref_multikrum(rows, mask, f, m)
            np.testing.assert_allclose(agg, want, **TOL)
            assert selected_indices(sel) == chosen
    assert np.all(np.isfinite(np.asarray(agg)))


def test_krum_uses_q_equal_n_minus_f_minus_2():
    # Five reporting points on a line (and two masked garbage rows): 0, 0.5, 1, 8, 9, f = 1.
    # q = n - f - 2 = 2 picks 0.5 (two close neighbours); q = 3 or q = n - f = 4 pick 1.
    mask = np.array([1, 0, 1, 1, 0, 1, 1], bool)
    line = np.array([0.0, GARBAGE, 0.5, 1.0, -GARBAGE, 8.0, 9.0], np.float32)
    rows = (line[:, None] * np.ones((1, D), np.float32)).astype(np.float32)
    scores = {q: {} for q in (2, 3, 4)}
    for i in np.flatnonzero(mask):
        d = sorted(D * (line[i] - line[j]) ** 2 for j in np.flatnonzero(mask) if j != i)
        for q in scores:
            scores[q][i] = sum(d[:q])
    assert min(scores[2], key=scores[2].get) == 2
    assert min(scores[4], key=scores[4].get) == min(scores[3], key=scores[3].get) == 3
    agg, sel = j_krum(rows, mask, 1)
    assert selected_indices(sel) == [2]
    np.testing.assert_array_equal(agg, rows[2])


def test_krum_ties_go_to_the_earliest_reporting_row():
    rng = np.random.default_rng(20)
    rows = rng.normal(size=(S, D)).astype(np.float32) * 3
    rows[[1, 3, 5]] = 0.25  # three identical rows; row 1 does not report
    mask = np.array([1, 0, 1, 1, 1, 1, 1], bool)
    agg, sel = j_krum(rows, mask, 1)
    assert selected_indices(sel) == [3]
    assert selected_indices(j_multikrum(rows, mask, 1, 2)[1]) == [3, 5]
    want, chosen = ref_multikrum(rows, mask, 1, 2)
    assert chosen == [3, 5]
    np.testing.assert_allclose(j_multikrum(rows, mask, 1, 2)[0], want, **TOL)


def test_krum_with_overflowing_reporting_distances_selects_a_reporting_row():
    # Rows 2 and 4 report, row 4 sends 1e30: float32 distances overflow (both scores +inf,
    # a tie: the earliest reporting row), never a masked row.
    rows, mask = case([0, 0, 1, 0, 1, 0, 0], seed=22)
    rows[4] = GARBAGE
    agg, sel = j_krum(rows, mask, 0)
    assert selected_indices(sel) == [2] == ref_multikrum(rows, mask, 0, 1)[1]
    np.testing.assert_array_equal(agg, rows[2])
    rows, mask = case([1, 0, 1, 1, 1, 0, 0], seed=23)
    rows[2] = -GARBAGE  # one huge attacker among four: never selected by multikrum m = 3
    agg, sel = j_multikrum(rows, mask, 1, 3)
    assert selected_indices(sel) == [0, 3, 4] == ref_multikrum(rows, mask, 1, 3)[1]
    np.testing.assert_allclose(agg, ref_multikrum(rows, mask, 1, 3)[0], **TOL)


def test_krum_vmapped_over_f_and_m_and_multikrum_m_n_is_the_mean():
    rows, mask = case(MASKS[6], seed=21)
    fs = jnp.array([0, 2, 4], jnp.int32)
    ms = jnp.array([1, 3, 7], jnp.int32)
    aggs, sels = jax.jit(jax.vmap(multikrum, in_axes=(None, None, 0, 0)))(rows, mask, fs, ms)
    for b in range(3):
        want, chosen = ref_multikrum(rows, mask, int(fs[b]), int(ms[b]))
        np.testing.assert_allclose(aggs[b], want, **TOL)
        assert selected_indices(sels[b]) == chosen
    np.testing.assert_allclose(aggs[2], ref_mean(rows, mask), **TOL)
    kaggs, _ = jax.vmap(krum, in_axes=(None, None, 0))(rows, mask, fs)
    for b in range(3):
        np.testing.assert_allclose(kaggs[b], ref_multikrum(rows, mask, int(fs[b]), 1)[0], **TOL)


@pytest.mark.parametrize("mask", MASKS)
def test_geomed_matches_weiszfeld(mask):
    rows, mask = case(mask, seed=30 + sum(mask))
    rows[2] = np.where(mask[2], rows[2] * 20, rows[2])  # an outlier when row 2 reports
    np.testing.assert_allclose(j_geomed(rows, mask), ref_geomed(rows, mask), **TOL)
    got = j_geomed(rows, mask, iterations=3, nu=jnp.float32(0.5))
    np.testing.assert_allclose(got, ref_geomed(rows, mask, 3, 0.5), **TOL)


def test_geomed_vmapped_over_nu_and_robust_to_an_outlier():
    rows, mask = case(MASKS[6], seed=31)
    rows[0] = 1e4
    nus = jnp.array([1e-6, 1e-1, 1e5], jnp.float32)
    got = jax.vmap(geomed, in_axes=(None, None, None, 0))(rows, mask, 8, nus)
    for b, nu in enumerate((1e-6, 1e-1, 1e5)):
        np.testing.assert_allclose(got[b], ref_geomed(rows, mask, 8, nu), rtol=1e-5, atol=1e-4)
    # ν above every distance: plain means throughout; far below: the outlier barely counts.
    np.testing.assert_allclose(got[2], ref_mean(rows, mask), rtol=1e-5)
    assert np.abs(np.asarray(got[0])).max() < 100


@pytest.mark.parametrize("mask", MASKS)
def test_cclip_matches_the_reference(mask):
    rows, mask = case(mask, seed=40 + sum(mask))
    centre = np.random.default_rng(41).normal(size=D).astype(np.float32) * 0.3
    for tau, iterations in ((0.5, 1), (1.5, 3), (0.0, 2), (math.inf, 1), (math.inf, 2)):
        got = j_cclip(rows, mask, centre, jnp.float32(tau), iterations=iterations)
        np.testing.assert_allclose(got, ref_cclip(rows, mask, centre, tau, iterations), **TOL)
    mean = ref_mean(rows, mask) if mask.any() else centre
    np.testing.assert_allclose(j_cclip(rows, mask, centre, math.inf), mean, **TOL)


def test_cclip_zero_distance_and_vmap_over_tau():
    rows, mask = case(MASKS[4], seed=42)
    centre = rows[0].copy()  # row 0 reports and sits at the centre: factor 1
    taus = jnp.array([0.0, 0.3, 1.0, jnp.inf], jnp.float32)
    got = jax.jit(jax.vmap(cclip, in_axes=(None, None, None, 0)))(rows, mask, centre, taus)
    for b, tau in enumerate((0.0, 0.3, 1.0, math.inf)):
        np.testing.assert_allclose(got[b], ref_cclip(rows, mask, centre, tau), **TOL)
    np.testing.assert_allclose(got[0], centre)
    assert np.all(np.isfinite(np.asarray(got)))


@pytest.mark.parametrize("mask", MASKS)
def test_bucketing_partitions_the_reporting_rows(mask):
    rows, mask = case(mask, seed=50 + sum(mask))
    n = int(mask.sum())
    sizes = jnp.array([1, 2, 3, 8], jnp.int32)
    key = jax.random.key(5)
    means, bmask, of = jax.jit(jax.vmap(bucket, in_axes=(None, None, None, 0)))(
        rows, mask, key, sizes
    )
    for b, size in enumerate((1, 2, 3, 8)):
        of_b = np.asarray(of[b])
        assert np.all(of_b[~mask] == -1)
        buckets = -(-n // size)
        np.testing.assert_array_equal(bmask[b], np.arange(S) < buckets)
        counts = [int(np.sum(of_b == k)) for k in range(buckets)]
        assert counts == [size] * (buckets - 1) + ([n - size * (buckets - 1)] if n else [])
        for k in range(S):
            members = [np.asarray(rows[i], np.float64) for i in range(S) if of_b[i] == k]
            want = sum(members) / len(members) if members else np.zeros(D)
            np.testing.assert_allclose(means[b, k], want, **TOL)
        # s = 1: the bucket means are the reporting rows, so their mean is the mean.
        if size == 1:
            np.testing.assert_allclose(
                ref_mean(np.asarray(means[b]), np.asarray(bmask[b])), ref_mean(rows, mask), **TOL
            )


def test_bucketing_is_a_random_permutation_from_the_key():
    rows, mask = case(MASKS[6], seed=60)
    draws = {tuple(np.asarray(j_bucket(rows, mask, jax.random.key(k), 1)[2])) for k in range(8)}
    assert all(sorted(d) == list(range(S)) for d in draws)
    assert len(draws) > 4  # 7! orders: eight keys give (nearly) eight
    same = j_bucket(rows, mask, jax.random.key(3), 2)[2]
    np.testing.assert_array_equal(same, j_bucket(rows, mask, jax.random.key(3), 2)[2])


def test_no_reporting_row_gives_zeros_and_nothing_selected():
    rows, mask = case(MASKS[0], seed=70)
    centre = np.full(D, 0.7, np.float32)
    for got in (
        j_median(rows, mask),
        j_trimmed(rows, mask, 0.3),
        j_krum(rows, mask, 1)[0],
        j_multikrum(rows, mask, 1, 3)[0],
        j_geomed(rows, mask),
    ):
        np.testing.assert_array_equal(got, np.zeros(D, np.float32))
    np.testing.assert_array_equal(j_cclip(rows, mask, centre, 1.0, iterations=2), centre)
    assert not np.any(j_krum(rows, mask, 1)[1]) and not np.any(j_multikrum(rows, mask, 0, 2)[1])
    means, bmask, of = j_bucket(rows, mask, jax.random.key(0), 2)
    np.testing.assert_array_equal(means, np.zeros((S, D), np.float32))
    assert not np.any(bmask) and np.all(np.asarray(of) == -1)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13, 100])
def test_the_sorting_network_sorts_each_column_as_jnp_sort(count):
    """The median's and trimmed mean's sort (a bitonic min/max network): the very values
    of ``jnp.sort(x, axis=0)``, ties, ±inf and padding to a power of two included."""
    from scaffold_jax.robust.aggregators.sorting import sort_rows

    rng = np.random.default_rng(count)
    x = rng.integers(-3, 4, size=(count, 7)).astype(np.float32)  # many ties
    x[rng.random(x.shape) < 0.1] = np.inf
    x[rng.random(x.shape) < 0.1] = -np.inf
    got = np.asarray(jax.jit(sort_rows)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.sort(x, axis=0))
