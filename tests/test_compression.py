"""Compression of the uplink (scaffold_jax.compression), against references written here:
QSGD's levels and unbiasedness (a statistical test with a stated false-alarm rate), top-k
and scaled sign with error feedback against a plain per-client numpy loop over several
rounds (clients that sat out or dropped keep their residuals), random-k's scaling, the
bytes each sends, exact resume with residuals, and the refusals."""

import math

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import scaffold_jax as sj
from scaffold_jax.compression import COMPRESSORS, compressed, fraction_count
from scaffold_jax.engine import communication
from scaffold_jax.tree import decode_storage
from tests.conftest import make_classification_clients

PLAN = sj.BatchPlan.fixed(batch_size=4, num_steps=3)
SIZES = [6, 9, 4, 12, 7, 5, 8, 10]


def _setup():
    data = sj.data.from_client_arrays(make_classification_clients(SIZES))
    return data, sj.models.logistic_regression((5,), 3)


def _apply(name, v, key=None, residual=None, **hparams):
    key = jr.key(0) if key is None else key
    compressor = COMPRESSORS[name].compressor
    defaults = {k: h.default for k, h in COMPRESSORS[name].hparams.items()}
    return compressor.apply(jnp.asarray(v, jnp.float32), key, residual, {**defaults, **hparams})


# ----------------------------------------------------------------------------- per leaf
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_sends_levels_of_the_norm_and_is_unbiased(bits):
    """Every sent entry is ‖v‖·sign(v_j)·ℓ/s with ℓ ∈ {⌊s|v_j|/‖v‖⌋, +1}; the mean of n
    draws is within 5.45 standard errors of v in every one of the 16 coordinates: a
    false alarm (two-sided, Bonferroni over 16) has probability below 1e-6 per run."""
    v = np.random.default_rng(3).normal(size=16).astype(np.float32)
    v[4] = 0.0
    s = 2 ** (bits - 1) - 1
    norm = np.linalg.norm(v.astype(np.float64))
    n = 20000
    keys = jr.split(jr.key(7), n)
    sent = np.asarray(jax.vmap(lambda k: _apply("qsgd", v, k, compress_bits=bits)[0])(keys))
    sent = sent.astype(np.float64)
    low = np.floor(s * np.abs(v) / norm)
    levels = np.abs(sent) * s / norm
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)  # whole levels
    assert np.all((np.round(levels) == low) | (np.round(levels) == low + 1))
    assert np.all(sent[:, 4] == 0) and np.all(np.sign(sent) * np.sign(v) >= 0)
    p = s * np.abs(v) / norm - low
    std = norm / s * np.sqrt(p * (1 - p) / n)
    z = np.abs(sent.mean(axis=0) - v) / np.where(std > 0, std, 1.0)
    assert z.max() < 5.45
    assert np.all(sent.mean(axis=0)[std == 0] == pytest.approx(v[std == 0], rel=1e-6))
    np.testing.assert_array_equal(np.asarray(_apply("qsgd", np.zeros(5), compress_bits=bits)[0]), 0)


def test_topk_keeps_the_largest_entries_ties_to_the_lowest_index():
    u = np.array([0.5, -2.0, 2.0, 0.1, -2.0, 1.0], np.float32)
    sent, residual = _apply("topk", u, residual=jnp.zeros(6), compress_fraction=0.5)
    np.testing.assert_array_equal(np.asarray(sent), [0, -2.0, 2.0, 0, -2.0, 0])
    np.testing.assert_array_equal(np.asarray(residual), u - np.asarray(sent))


def test_the_bisection_selects_what_a_stable_sort_selects():
    """keep_largest (32 counting passes, a traced k) against numpy's stable argsort, on
    keys with many ties and with none, for every k."""
    from scaffold_jax.compression.topk import keep_largest

    rng = np.random.default_rng(0)
    select = jax.jit(keep_largest)
    for keys in (rng.integers(0, 4, 23), rng.integers(0, 2**32, 23), np.full(23, 2**32 - 1)):
        keys = keys.astype(np.uint32)
        for k in range(1, 24):
            expected = np.zeros(23, bool)
            expected[np.argsort(-keys.astype(np.int64), kind="stable")[:k]] = True
            np.testing.assert_array_equal(np.asarray(select(jnp.asarray(keys), k)), expected)


def test_the_count_of_a_fraction_is_its_ceiling_without_float_artefacts():
    assert int(fraction_count(0.07, 100)) == 7  # float32(0.07) * 100 = 7.0000005
    assert int(fraction_count(0.075, 100)) == 8
    assert int(fraction_count(1e-6, 10)) == 1 and int(fraction_count(1.0, 10)) == 10
    assert int(fraction_count(0.01, 10**7)) == 10**5
    assert int(fraction_count(jnp.float32(0.07), 100)) == 7  # the same in the program


def _exact_count(fraction: str, size: int) -> int:
    """⌈fraction·size⌉ in [1, size] in integer arithmetic, the fraction as its decimal."""
    from decimal import Decimal
    from fractions import Fraction

    return max(1, min(size, math.ceil(Fraction(Decimal(fraction)) * size)))


def test_the_count_is_exact_at_every_leaf_size_on_the_host_and_in_the_program():
    """k against integer arithmetic at sizes up to 2²⁴ + 1 (and 2³¹ − 1), for fractions of
    1 to 6 significant digits from 1 down to 1e-12: the host's count (the bytes) and the
    program's (a vmapped grid of traced fractions, what topk and randk send) alike. The
    first four are the float32 product's off-by-ones: 0.07 of 139,043 gave 9,733."""
    rng = np.random.default_rng(5)
    sizes = [1, 3, 100, 139_043, 341_337, 972_801, 2**20, 2**24, 2**24 + 1, 2**31 - 1]
    sizes += [int(n) for n in rng.integers(1, 2**24 + 2, 12)]
    fractions = ["0.07", "0.3", "0.01", "1.0", "0.9", "0.99", "0.999", "0.5", "0.1", "0.075"]
    fractions += ["0.123456", "0.999999", "0.100001", "0.000001", "1e-12"]
    fractions += [f"0.{d:03d}" for d in rng.integers(1, 1000, 20)]
    mantissas, exponents = rng.integers(1, 10**6, 20), rng.integers(6, 13, 20)
    fractions += [f"{m}e-{p}" for m, p in zip(mantissas, exponents, strict=True)]
    grid = jnp.asarray([float(f) for f in fractions], jnp.float32)
    for size in sizes:
        program = np.asarray(jax.jit(jax.vmap(lambda f, n=size: fraction_count(f, n)))(grid))
        expected = [_exact_count(f, size) for f in fractions]
        assert [int(fraction_count(float(f), size)) for f in fractions] == expected, size
        assert program.tolist() == expected, size
    assert int(fraction_count(0.07, 139_043)) == 9_734
    assert int(fraction_count(1.0, 2**24 + 1)) == 2**24 + 1  # top-k at 1 is lossless
    # Beyond 6 significant digits the fraction is read to 6 (float32 carries no more).
    assert int(fraction_count(0.1234567, 10**7)) == 1_234_570
    with pytest.raises(ValueError, match="2\\*\\*31"):
        fraction_count(0.5, 2**31)


def test_randk_sends_k_entries_scaled_by_size_over_k_and_is_unbiased():
    v = np.arange(1, 11, dtype=np.float32)
    sent = np.asarray(jax.vmap(lambda k: _apply("randk", v, k, compress_fraction=0.3)[0])(
        jr.split(jr.key(1), 40000)))  # fmt: skip
    sent, kept = sent.astype(np.float64), sent != 0
    assert np.all(kept.sum(axis=1) == 3)
    np.testing.assert_allclose(sent[kept], np.broadcast_to(v * 10 / 3, sent.shape)[kept], rtol=1e-6)
    # Each entry is kept with probability 3/10: the mean's standard error is v·√(7/3/n).
    z = np.abs(sent.mean(axis=0) - v) / (v * np.sqrt(7 / 3 / 40000))
    assert z.max() < 5.3  # false alarm < 1e-6 (two-sided, Bonferroni over 10)


def test_signef_sends_the_mean_magnitude_times_the_sign():
    u = np.array([1.0, -3.0, 0.0, 2.0], np.float32)
    sent, residual = _apply("signef", u, residual=jnp.zeros(4))
    np.testing.assert_allclose(np.asarray(sent), [1.5, -1.5, 0.0, 1.5])
    np.testing.assert_allclose(np.asarray(residual), [-0.5, -1.5, 0.0, 0.5])


# ------------------------------------------------------------------------------- bytes
def test_the_bytes_of_each_compressor_follow_its_cost_formula():
    _, problem = _setup()  # leaves W [5, 3] (15 entries), b [3]
    scaffold = sj.scaffold(problem.loss_fn)

    def up(name, entries="all", **hp):
        algorithm = compressed(scaffold, name, entries)
        return communication.traffic(algorithm, problem.params, hp).entries

    both = {"delta_params": None, "delta_control": None}
    expected = {
        "qsgd": (lambda n: 32 + 4 * n, {"compress_bits": 4}),
        "topk": (
            lambda n: math.ceil(0.2 * n) * (32 + math.ceil(math.log2(n))),
            {"compress_fraction": 0.2},
        ),
        "randk": (lambda n: 32 * math.ceil(0.2 * n) + 64, {"compress_fraction": 0.2}),
        "signef": (lambda n: n + 32, {}),
    }
    for name, (bits, hp) in expected.items():
        per_entry = sum(math.ceil(bits(n) / 8) for n in (15, 3))
        assert up(name, **hp) == dict.fromkeys(both, per_entry)
        assert up(name, "delta_params", **hp) == {
            "delta_params": per_entry,
            "delta_control": 4 * 18,
        }
    assert compressed(scaffold, "none") is scaffold  # bitwise today's run


# ------------------------------------------- error feedback against a per-client loop
def _numpy_topk(u, fraction):
    k = max(1, min(u.size, math.ceil(round(fraction * u.size, 9))))
    sent = np.zeros_like(u)
    top = np.argsort(-np.abs(u), kind="stable")[:k]
    sent[top] = u[top]
    return sent


def _numpy_signef(u, fraction):
    del fraction
    return np.abs(u).sum() / u.size * np.sign(u)


@pytest.mark.parametrize("name, reference", [("topk", _numpy_topk), ("signef", _numpy_signef)])
def test_error_feedback_equals_a_per_client_loop_over_rounds(name, reference):
    """FedAvg with S = 4 of N = 8 and Bernoulli dropouts, compressed with error feedback,
    against a plain loop: each round, each sampled client's Δy_i from the server model
    (its own ``client_update``, one client at a time), u = Δy_i + e_i per leaf, the sent
    m by the numpy compressor, e_i ← u − m only if it reported, and x ← x + mean of the
    reported m. Every residual (sat out, dropped, reported) and x are compared."""
    data, problem = _setup()
    fedavg = sj.fedavg(problem.loss_fn)
    algorithm = compressed(fedavg, name)
    part = sj.participation.make(dropouts="bernoulli", options={"dropout_rate": 0.3})
    plan = sj.BatchPlan.full(num_steps=2)  # full batches: a client's Δy_i needs no key
    sim = sj.Simulation(algorithm, problem, plan, clients_per_round=4, participation=part)
    hp = (
        sj.hparams(client_lr=0.5, compress_fraction=0.25)
        if name == "topk"
        else sj.hparams(client_lr=0.5)
    )
    rounds = 6
    result = sim.run(data, hp, num_rounds=rounds, eval_every=rounds)
    ids, reported = np.asarray(result.client_ids), np.asarray(result.reported)
    assert 0 < reported.sum() < reported.size and len(set(ids.ravel())) < 8 * rounds

    x = jax.tree.map(np.asarray, problem.params)
    leaves, tree = jax.tree.flatten(x)
    residual = {i: [np.zeros(leaf.size, np.float32) for leaf in leaves] for i in range(8)}
    for r in range(rounds):
        sent_sum, count = [np.zeros(leaf.size, np.float64) for leaf in leaves], 0
        for slot, i in enumerate(ids[r]):
            batches, mask = data.client_batches(jnp.int32(i), jr.key(0), plan)
            server = fedavg.init(jax.tree.unflatten(tree, leaves))[0]
            _, out = fedavg.client_update(hp, server, (), batches, mask, jr.key(0))
            for j, delta in enumerate(jax.tree.leaves(out.delta_params)):
                u = np.asarray(delta, np.float32).ravel() + residual[i][j]
                m = reference(u, 0.25)
                if reported[r, slot]:
                    residual[i][j] = u - m
                    sent_sum[j] += m
            count += int(reported[r, slot])
        if count:
            leaves = [
                leaf + (s / count).reshape(leaf.shape)
                for leaf, s in zip(leaves, sent_sum, strict=True)
            ]
    table = [np.asarray(a) for a in jax.tree.leaves(result.state.messages)]
    for i in range(8):
        for j in range(len(leaves)):
            np.testing.assert_allclose(table[j][i].ravel(), residual[i][j], rtol=2e-4, atol=2e-6)
    for a, b in zip(jax.tree.leaves(result.state.server.params), leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4, atol=2e-6)


# -------------------------------------------------------------------- resume, refusals
def test_a_run_with_residuals_resumes_exactly_and_refuses_another_compressor(tmp_path):
    data, problem = _setup()
    algorithm = compressed(sj.scaffold(problem.loss_fn), "topk")
    sim = sj.Simulation(algorithm, problem, PLAN, clients_per_round=3)
    hp = sj.hparams(client_lr=0.1, compress_fraction=0.2)
    whole = sim.run(data, hp, num_rounds=6, eval_every=2)
    sim.run(data, hp, num_rounds=3, eval_every=2, checkpoint_dir=tmp_path, checkpoint_every=3)
    resumed = sim.run(data, hp, num_rounds=6, eval_every=2, checkpoint_dir=tmp_path, resume=True)
    assert resumed.resumed_from == 3
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.any(np.asarray(jax.tree.leaves(whole.state.messages)[0]) != 0)
    other = sim.replace(algorithm=compressed(sj.scaffold(problem.loss_fn), "signef"))
    with pytest.raises(ValueError, match="compression"):
        other.run(
            data, sj.hparams(client_lr=0.1), num_rounds=6, checkpoint_dir=tmp_path, resume=True
        )
    with pytest.raises(ValueError, match="compress_fraction"):
        sim.run(data, sj.hparams(client_lr=0.1, compress_fraction=0.5), num_rounds=6,
                checkpoint_dir=tmp_path, resume=True)  # fmt: skip


def test_a_sweep_varies_the_bits_in_one_program():
    """qsgd's bits and topk's fraction are data: one compiled program for a grid of them,
    each config equal to its single run."""
    from scaffold_jax.sweep import grid, sweep

    data, problem = _setup()
    sim = sj.Simulation(compressed(sj.fedavg(problem.loss_fn), "qsgd"), problem, PLAN, 3)
    hparams, seeds, _ = grid(client_lr=[0.1], compress_bits=[2, 8], seeds=[0])
    result = sweep(sim, data, hparams, seeds, num_rounds=3)
    for i, bits in enumerate(np.asarray(hparams.compress_bits)):
        single = sim.run(data, sj.hparams(client_lr=0.1, compress_bits=float(bits)), num_rounds=3)
        for a, b in zip(jax.tree.leaves(single.state.server),
                        jax.tree.leaves(jax.tree.map(lambda x: x[i], result.server_states)),
                        strict=True):  # fmt: skip
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)


def test_bfloat16_residuals_halve_the_table_and_stay_close():
    data, problem = _setup()
    hp = sj.hparams(client_lr=0.1, compress_fraction=0.2)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        algorithm = compressed(sj.fedavg(problem.loss_fn), "topk", residual_dtype=dtype)
        sim = sj.Simulation(algorithm, problem, PLAN, clients_per_round=4)
        runs[dtype] = sim.run(data, hp, num_rounds=4, eval_every=4)
    table = {k: jax.tree.leaves(r.state.messages)[0] for k, r in runs.items()}
    assert table["bfloat16"].dtype == jnp.uint16 and table["float32"].dtype == jnp.float32
    decoded = decode_storage(table["bfloat16"])
    np.testing.assert_allclose(
        np.asarray(decoded), np.asarray(table["float32"]), rtol=0.05, atol=1e-3
    )


def test_refusals_name_the_problem():
    _, problem = _setup()
    fedavg = sj.fedavg(problem.loss_fn)
    with pytest.raises(ValueError, match="delta_control, which fedavg's clients do not send"):
        compressed(fedavg, "topk", "delta_params,delta_control")
    with pytest.raises(ValueError, match=r"Compress first.*private\(compressed\("):
        compressed(sj.privacy.private(fedavg), "qsgd")
    with pytest.raises(ValueError, match="compress_bits=1 is invalid: every value must be a whole"):
        sj.Simulation(compressed(fedavg, "qsgd"), problem, PLAN, 3).resolve_hparams(
            {"client_lr": 0.1, "compress_bits": 1}
        )


def test_private_compressed_clips_what_is_sent_and_counts_its_compressed_bytes():
    """private(compressed(alg, c)): the bytes are the compressor's (2-bit qsgd: 13 B a
    client for the 15 + 3 entries, not 72 B), in the records too; without noise and with
    C = inf the run is the compressed run bitwise."""
    data, problem = _setup()
    fedavg = sj.fedavg(problem.loss_fn)
    inner = compressed(fedavg, "qsgd")
    outer = sj.privacy.private(inner)
    hp = {"compress_bits": 2}
    plain_bytes = communication.traffic(fedavg, problem.params, {}).entries
    assert plain_bytes == {"delta_params": 72}
    assert communication.traffic(outer, problem.params, hp).entries == {
        "delta_params": math.ceil((32 + 2 * 15) / 8) + math.ceil((32 + 2 * 3) / 8)
    }
    assert communication.traffic(outer, problem.params, hp).entries == (
        communication.traffic(inner, problem.params, hp).entries
    )
    runs = {}
    for name, algorithm, extra in (
        ("compressed", inner, {}),
        ("private", outer, {"dp_noise_multiplier": 0.0, "dp_clip": float("inf")}),
    ):
        sim = sj.Simulation(algorithm, problem, PLAN, clients_per_round=4)
        runs[name] = sim.run(data, {"client_lr": 0.1, **hp, **extra}, num_rounds=3)
    for a, b in zip(jax.tree.leaves(runs["compressed"].state.server.params),
                    jax.tree.leaves(runs["private"].state.server.inner.params),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    last = runs["private"].records[-1]
    assert last["bytes_up_total"] == runs["compressed"].records[-1]["bytes_up_total"]
    assert last["bytes_up_total"] == 3 * 4 * 13


def test_a_private_config_with_a_compressor_builds_private_over_compressed():
    """``--compression qsgd --dp-epsilon 3``: accepted, the private wrapper outside (its
    clip on what the compressor sends), the bytes the compressor's."""
    from scaffold_jax.experiments import RunConfig, resolve

    config = RunConfig(
        dataset="synthetic", num_clients=20, clients_per_round=5, rounds=4,
        compression="qsgd", compress_bits=2, dp_epsilon=3.0,
    )  # fmt: skip
    config.validate()
    _, problem = _setup()
    algorithm = resolve.make_algorithm(config, problem.loss_fn)
    assert "privacy" in algorithm.options and "compression" in algorithm.options
    traffic = communication.traffic(algorithm, problem.params, {"compress_bits": 2})
    assert (
        traffic.entries
        == communication.traffic(
            compressed(sj.scaffold(problem.loss_fn), "qsgd"), problem.params, {"compress_bits": 2}
        ).entries
    )
