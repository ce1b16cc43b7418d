"""Byzantine attacks (scaffold_jax.robust.attacks) and the malicious set
(scaffold_jax.robust.malicious), against plain numpy float64 references written here: one
loop over the rows per attack, Φ⁻¹ from statistics.NormalDist, np.std with ddof 0; rows of
clients that did not report hold garbage (±1e30, NaN) that must not reach μ or σ; honest
rows come back bit for bit; swept parameters are traced (jit, vmap). The malicious count
is checked against Python's ⌊round(f·N, 9)⌋ and exact decimal arithmetic."""

import math
import statistics
from fractions import Fraction

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from scaffold_jax.robust import malicious as mal
from scaffold_jax.robust.attacks import alie, gaussian, ipm, signflip
from scaffold_jax.robust.attacks.alie import alie_z

BENIGN, MALICIOUS, ABSENT = "b", "m", "."
GARBAGE = [1e30, -1e30, np.nan]


# ---------------------------------------------------------------- references (float64)


def _ref_alie_sz(n, m):
    s = max(1, math.floor(n / 2 + 1) - m)
    p = (n - s) / n
    z = -math.inf if p <= 0 else statistics.NormalDist().inv_cdf(p)
    return s, z


def _ref_attack(name, u, roles, **params):
    """The attacked matrix, row by row, in float64."""
    u = np.asarray(u, np.float64)
    benign = [u[i] for i, r in enumerate(roles) if r == BENIGN]
    out = u.copy()
    for i, role in enumerate(roles):
        if role != MALICIOUS:
            continue
        if name == "signflip":
            out[i] = -params.get("scale", 1.0) * u[i]
        elif not benign:
            out[i] = u[i]
        elif name == "ipm":
            out[i] = -params.get("epsilon", 0.1) * np.mean(benign, axis=0)
        elif name == "alie":
            n, m = len(benign) + roles.count(MALICIOUS), roles.count(MALICIOUS)
            z = params.get("z")
            if z is None or math.isnan(z):
                z = _ref_alie_sz(n, m)[1]
            out[i] = np.mean(benign, axis=0) - z * np.std(benign, axis=0, ddof=0)
    return out


# ---------------------------------------------------------------- inputs


def _inputs(roles, dim, seed):
    """u [S, D] float32 with garbage in the absent rows, and the two masks."""
    rng = np.random.default_rng(seed)
    u = (rng.normal(size=(len(roles), dim)) * rng.uniform(0.1, 3.0, size=dim)).astype(np.float32)
    u += rng.normal(size=dim).astype(np.float32)  # a common offset: μ is not ~0
    for i, r in enumerate(roles):
        if r == ABSENT:
            u[i] = GARBAGE[i % len(GARBAGE)]
    roles = list(roles)
    mask = lambda r: jnp.asarray([x == r for x in roles])
    return jnp.asarray(u), mask(MALICIOUS), mask(BENIGN), roles


ROLES = [
    "bbbbmm.",  # a typical round
    "b.m.b.mbbbm..b",  # absent rows in between
    "mm..m",  # no benign client reported: u unchanged
    "bbb..b",  # m = 0: nothing changes
    "bm",  # one benign: σ = 0
    "m",
    "....",
    "mbbbbbbbbbbbbbbbbbbm",
    "bmbmbmbmbm.",
]
ATTACKS = {
    "signflip": (signflip, {"scale": 2.5}),
    "ipm": (ipm, {"epsilon": 0.3}),
    "alie": (alie, {}),
}


def _bits(x):
    return np.asarray(x).view(np.uint32)


def _check(name, out, u, roles, **params):
    out, u = np.asarray(out), np.asarray(u)
    ref = _ref_attack(name, u, roles, **params)
    hit = np.array([r == MALICIOUS for r in roles])
    # Every row that is not malicious is returned bit for bit (garbage and NaN included).
    np.testing.assert_array_equal(_bits(out[~hit]), _bits(u[~hit]))
    np.testing.assert_allclose(out[hit], ref[hit], rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(out[hit]))


# ---------------------------------------------------------------- message attacks


@pytest.mark.parametrize("name", sorted(ATTACKS))
@pytest.mark.parametrize("case", range(len(ROLES)))
def test_attack_matches_reference(name, case):
    fn, params = ATTACKS[name]
    u, m, b, roles = _inputs(ROLES[case], 37, seed=case)
    _check(name, fn(u, m, b, jr.key(0), **params), u, roles, **params)


def test_attacks_change_what_they_should():
    """The references are not vacuous: each attack moves the malicious rows it must."""
    u, m, b, roles = _inputs("bbbbmm.", 16, seed=1)
    for name, (fn, params) in ATTACKS.items():
        out = np.asarray(fn(u, m, b, jr.key(0), **params))
        assert not np.allclose(out[4:6], np.asarray(u)[4:6]), name
    # ALIE with this n and m: s = max(1, 4 - 2) = 2, z = Φ⁻¹(4/6); all malicious rows agree.
    out = np.asarray(alie(u, m, b, jr.key(0)))
    benign = np.asarray(u, np.float64)[:4]
    z = statistics.NormalDist().inv_cdf(4 / 6)
    np.testing.assert_allclose(out[4], benign.mean(0) - z * benign.std(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[4], out[5])


def test_garbage_rows_do_not_reach_the_statistics():
    """Absent rows hold ±1e30 or NaN; the same round with those rows zeroed gives the
    same malicious messages exactly."""
    u, m, b, roles = _inputs("b.m.b.mbbbm..b", 21, seed=7)
    clean = jnp.where((m | b)[:, None], u, 0.0)
    for name, (fn, params) in ATTACKS.items():
        hit = np.asarray(m)
        got = np.asarray(fn(u, m, b, jr.key(0), **params))[hit]
        want = np.asarray(fn(clean, m, b, jr.key(0), **params))[hit]
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize(
    "name,param,values",
    [
        ("signflip", "scale", [0.0, 1.0, -0.5, 4.0]),
        ("ipm", "epsilon", [0.0, 0.1, 0.5, 2.0]),
        ("alie", "z", [np.nan, 0.0, 0.75, -1.5]),
    ],
)
def test_traced_parameters_under_jit_and_vmap(name, param, values):
    fn = {"signflip": signflip, "ipm": ipm, "alie": alie}[name]
    u, m, b, roles = _inputs("bbmbb.mb", 11, seed=3)
    run = jax.jit(jax.vmap(lambda v: fn(u, m, b, jr.key(0), **{param: v})))
    out = run(jnp.asarray(values, jnp.float32))
    assert out.shape == (len(values), *u.shape)
    for i, v in enumerate(values):
        _check(name, out[i], u, roles, **{param: float(v)})
        # The traced value gives what the same value given on the host gives.
        host = fn(u, m, b, jr.key(0), **{param: float(v)})
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(host), rtol=1e-6, atol=1e-6)


def test_alie_z_override():
    u, m, b, roles = _inputs("bbbbbmm..", 9, seed=5)
    computed = np.asarray(alie(u, m, b, jr.key(0)))
    np.testing.assert_array_equal(np.asarray(alie(u, m, b, jr.key(0), z=np.nan)), computed)
    np.testing.assert_array_equal(
        np.asarray(alie(u, m, b, jr.key(0), z=jnp.float32(np.nan))), computed
    )
    given = np.asarray(alie(u, m, b, jr.key(0), z=1.25))
    _check("alie", given, u, roles, z=1.25)
    assert not np.allclose(given[5], computed[5])
    # z = 0: the malicious rows send the benign mean.
    mean = np.asarray(u, np.float64)[:5].mean(0)
    np.testing.assert_allclose(np.asarray(alie(u, m, b, jr.key(0), z=0.0))[5], mean, rtol=1e-6)


def test_alie_s_and_z_against_the_reference():
    for n in range(1, 13):
        for m in range(n + 1):
            s, z = alie_z(n, m)
            ref_s, ref_z = _ref_alie_sz(n, m)
            assert int(s) == ref_s, (n, m)
            if math.isinf(ref_z):
                assert float(z) == ref_z, (n, m)
            else:
                np.testing.assert_allclose(float(z), ref_z, rtol=1e-5, atol=1e-6, err_msg=(n, m))
    # With both a malicious and a benign client (the only case used), z is finite, >= 0.
    for n in range(2, 13):
        for m in range(1, n):
            assert 0.0 <= float(alie_z(n, m)[1]) < math.inf
    # Traced n and m (vmapped), and n = 0 gives no NaN.
    ns = jnp.arange(0, 13, dtype=jnp.int32)
    s, z = jax.jit(jax.vmap(alie_z))(ns, ns // 3)
    for n, si, zi in zip(range(13), np.asarray(s), np.asarray(z), strict=True):
        if n == 0:
            assert (si, zi) == (1, 0.0)
        else:
            ref_s, ref_z = _ref_alie_sz(n, n // 3)
            assert si == ref_s
            np.testing.assert_allclose(zi, ref_z, rtol=1e-5, atol=1e-6)


def test_gaussian():
    roles = "bmb.m.mb"
    u, m, b, _ = _inputs(roles, 40_000, seed=2)
    key = jr.key(11)
    out = np.asarray(gaussian(u, m, b, key, sigma=2.5))
    hit = np.asarray(m)
    np.testing.assert_array_equal(_bits(out[~hit]), _bits(np.asarray(u)[~hit]))
    rows = out[hit].astype(np.float64)
    # Mean within 6 standard errors of 0; std within ~6 of its standard errors of σ.
    assert np.all(np.abs(rows.mean(1)) < 6 * 2.5 / math.sqrt(rows.shape[1]))
    assert np.all(np.abs(rows.std(1) / 2.5 - 1) < 6 / math.sqrt(2 * rows.shape[1]))
    assert not np.array_equal(rows[0], rows[1]) and not np.array_equal(rows[1], rows[2])
    # Row i is σ·N(0, I) from split(key, S)[i]; the same key gives the same noise.
    keys = jr.split(key, len(roles))
    for i in np.flatnonzero(hit):
        want = 2.5 * np.asarray(jr.normal(keys[i], (u.shape[1],), jnp.float32))
        np.testing.assert_allclose(out[i], want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(gaussian(u, m, b, key, sigma=2.5)), out)
    other = np.asarray(gaussian(u, m, b, jr.key(12), sigma=2.5))
    assert not np.array_equal(other[hit], out[hit])
    # σ traced and vmapped: the same draws scaled.
    sig = jnp.asarray([0.0, 1.0, 3.0], jnp.float32)
    many = np.asarray(jax.jit(jax.vmap(lambda s: gaussian(u, m, b, key, sigma=s)))(sig))
    np.testing.assert_array_equal(many[0][hit], 0.0)
    np.testing.assert_allclose(many[2][hit], 3.0 * many[1][hit], rtol=1e-6)
    np.testing.assert_allclose(many[1][hit] * 2.5, out[hit], rtol=1e-6)


# ---------------------------------------------------------------- the malicious set

FRACTIONS = [0.0, 0.1, 0.2, 0.25, 0.3, 0.45, 0.49]
SIZES = [1, 7, 10, 100, 1000, 12345, 10**6]


@pytest.mark.parametrize("n", SIZES)
def test_count_is_exact(n):
    want = [math.floor(round(f * n, 9)) for f in FRACTIONS]
    traced = jax.jit(jax.vmap(mal.count, (0, None)), static_argnums=1)
    got = traced(jnp.asarray(FRACTIONS, jnp.float32), n)
    assert got.dtype == jnp.int32
    assert np.asarray(got).tolist() == want
    assert [int(mal.count(f, n)) for f in FRACTIONS] == want  # host fractions
    assert [int(mal.count(jnp.float32(f), n)) for f in FRACTIONS[:3]] == want[:3]


def test_count_is_exact_where_float32_is_not():
    """Large N and fractions of up to 6 significant digits, where float32's f·N is off by
    more than the distance to the next integer (⌊f·N·(1 + 2⁻²⁰)⌋ fails most of these)."""
    sizes = [9_999_999, 10**7, 2**24 + 1, 123_456_789, 2**31 - 1]
    fractions = [0.1, 0.3, 0.49, 0.07, 0.333333, 0.123457, 0.499999, 1e-7, 0.45]
    traced = jax.jit(jax.vmap(mal.count, (0, None)), static_argnums=1)
    for n in sizes:
        want = [math.floor(Fraction(str(f)) * n) for f in fractions]
        assert want == [math.floor(round(f * n, 9)) for f in fractions]
        assert np.asarray(traced(jnp.asarray(fractions, jnp.float32), n)).tolist() == want, n
        assert [int(mal.count(f, n)) for f in fractions] == want, n
    naive = [
        int(np.floor(np.float32(f) * np.float32(9_999_999) * np.float32(1 + 2**-20)))
        for f in fractions
    ]
    assert naive != [math.floor(Fraction(str(f)) * 9_999_999) for f in fractions]


def test_ranks_are_a_deterministic_permutation():
    key = jr.key(3)
    r = np.asarray(mal.ranks(key, 1000))
    assert r.dtype == np.int32
    assert sorted(r.tolist()) == list(range(1000))
    assert not np.array_equal(r, np.arange(1000))
    np.testing.assert_array_equal(np.asarray(mal.ranks(jr.key(3), 1000)), r)
    assert not np.array_equal(np.asarray(mal.ranks(jr.key(4), 1000)), r)
    # The permutation is the one of fold_in(key, MALICIOUS_STREAM): ranks invert it.
    perm = np.asarray(jr.permutation(jr.fold_in(key, mal.MALICIOUS_STREAM), 1000))
    np.testing.assert_array_equal(r[perm], np.arange(1000))
    # A raw uint32 key works as well.
    raw = np.asarray(mal.ranks(jax.random.PRNGKey(3), 50))
    assert sorted(raw.tolist()) == list(range(50))


def test_malicious_set_is_nested_and_sized():
    n, key = 1000, jr.key(9)
    ids = jnp.arange(n)
    fs = jnp.asarray(FRACTIONS, jnp.float32)
    sets = np.asarray(jax.jit(jax.vmap(lambda f: mal.is_malicious(key, n, f, ids)))(fs))
    assert sets.shape == (len(FRACTIONS), n) and sets.dtype == bool
    assert sets.sum(1).tolist() == [math.floor(round(f * n, 9)) for f in FRACTIONS]
    assert not sets[0].any()  # f = 0: nobody
    for small, big in zip(sets[:-1], sets[1:], strict=True):
        assert not np.any(small & ~big)  # f₁ < f₂: M(f₁) ⊂ M(f₂)
    # The set is the lowest ranks, and a subset of ids gets the same answer.
    r = np.asarray(mal.ranks(key, n))
    np.testing.assert_array_equal(sets[4], r < 300)
    some = jnp.asarray([5, 999, 0, 5, 421])
    np.testing.assert_array_equal(
        np.asarray(mal.is_malicious(key, n, 0.3, some)), sets[4][np.asarray(some)]
    )
    other = np.asarray(mal.is_malicious(jr.key(10), n, 0.3, ids))
    assert other.sum() == 300 and not np.array_equal(other, sets[4])
