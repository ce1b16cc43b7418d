"""User-level differential privacy (scaffold_jax.privacy): clipping, the noise's law, the
non-private limit, what SCAFFOLD's server sees against a per-client reference loop,
Poisson sampling and its padding, sweeps, resume and the accountant in the records.

Statistical tests state their false-alarm rate; each is at most 1e-6 per test.
"""

import csv
import json
import math
import re
import sys

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import assert_trees_close, make_classification_clients
from scipy import stats

import scaffold_jax as sj
from scaffold_jax import sampling
from scaffold_jax.cli import main
from scaffold_jax.engine import client_keys, round_key_and_ids
from scaffold_jax.experiments import ConfigError, RunConfig
from scaffold_jax.privacy import accounting, private
from scaffold_jax.privacy.mechanism import clip_rows
from scaffold_jax.sweep import grid, sweep
from scaffold_jax.tree import sq_norm

FALSE_ALARM = 1e-6
PLAN = sj.BatchPlan.fixed(batch_size=4, num_steps=3)


@pytest.fixture(scope="module")
def data():
    """20 clients of unequal sizes, 6 features, 4 classes, label skew."""
    rng = np.random.default_rng(0)
    clients = make_classification_clients(rng.integers(3, 12, 20).tolist(), dim=6, num_classes=4)
    test = make_classification_clients([60], dim=6, num_classes=4, seed=1, skew=False)[0]
    return sj.from_client_arrays(clients, test=test)


@pytest.fixture(scope="module")
def problem():
    return sj.models.logistic_regression((6,), 4, zero_init=False, key=jr.key(3))


def _hp(name, **extra):
    values = {"client_lr": 0.1, **extra}
    if name == "feddyn":
        values["alpha"] = 0.1
    return values


# ------------------------------------------------------------------------ clipping
def test_clipping_is_exact_joint_and_leaves_small_messages_untouched():
    rng = np.random.default_rng(1)
    rows = {
        "a": jnp.asarray(rng.normal(size=(50, 7)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(50, 3, 2)), jnp.float32) * 3,
    }
    norms_before = np.sqrt(np.asarray(jax.vmap(sq_norm)(rows)))
    clip = jnp.float32(np.median(norms_before))
    clipped, norms = clip_rows(rows, clip)
    np.testing.assert_allclose(norms, norms_before, rtol=1e-6)
    after = np.sqrt(np.asarray(jax.vmap(sq_norm)(clipped)))
    assert np.all(after <= float(clip) * (1 + 1e-6))
    below = norms_before <= float(clip)
    assert 0 < below.sum() < 50
    for leaf, original in zip(jax.tree.leaves(clipped), jax.tree.leaves(rows), strict=True):
        # At or under C: bit for bit the message; above: scaled onto the sphere of radius C,
        # every array by the same factor (the message is clipped jointly).
        np.testing.assert_array_equal(np.asarray(leaf)[below], np.asarray(original)[below])
    np.testing.assert_allclose(after[~below], float(clip), rtol=1e-5)
    ratio_a = np.asarray(clipped["a"])[~below, 0] / np.asarray(rows["a"])[~below, 0]
    ratio_b = np.asarray(clipped["b"])[~below, 0, 0] / np.asarray(rows["b"])[~below, 0, 0]
    np.testing.assert_allclose(ratio_a, ratio_b, rtol=1e-5)


# ------------------------------------------------------------------------ the non-private limit
@pytest.mark.parametrize(
    "name",  # FedAvg, SCAFFOLD and Mime's pre-round pass quick; the others ~2.5 s each
    ["scaffold", "fedavg", "mime"]
    + [pytest.param(n, marks=pytest.mark.slow) for n in ("fedprox", "feddyn", "mimelite")],
)
def test_no_noise_and_no_clipping_is_the_plain_run_bit_for_bit(name, data, problem):
    base = getattr(sj, name)(problem.loss_fn)
    plain = sj.Simulation(base, problem, PLAN, clients_per_round=5)
    dp = sj.Simulation(private(base), problem, PLAN, clients_per_round=5)
    hp = _hp(name)
    a = plain.run(data, hp, num_rounds=4, eval_every=2)
    b = dp.run(data, {**hp, "dp_noise_multiplier": 0.0, "dp_clip": math.inf}, 4, 2)
    for x, y in zip(
        jax.tree.leaves((plain.algorithm.server_params(a.state.server), a.state.clients)),
        jax.tree.leaves((dp.algorithm.server_params(b.state.server), b.state.clients)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert [r["test_loss"] for r in a.records] == [r["test_loss"] for r in b.records]
    assert all(r["dp_epsilon"] == math.inf for r in b.records[1:])


# ------------------------------------------------------------------------ SCAFFOLD's server
def test_scaffold_server_sees_the_clipped_sum_of_the_reference_loop(data, problem):
    """One private round (z = 0, C small enough to clip) against a plain loop over the
    sampled clients: each client's (Δy_i, Δc_i) clipped jointly, x += Σ Δy_i / S,
    c += Σ Δc_i / N; the clients keep their own unclipped c_i⁺."""
    num_sampled, clip = 5, 0.05
    inner = sj.scaffold(problem.loss_fn)
    sim = sj.Simulation(private(inner), problem, PLAN, clients_per_round=num_sampled)
    hp = sim.resolve_hparams(_hp("scaffold", dp_noise_multiplier=0.0, dp_clip=clip))
    key = jr.key(7)
    state, metrics = sim.round(hp, sim.init(data), data, key)

    server, client = inner.init(problem.params)
    round_key, ids = round_key_and_ids(key, 0, data.num_clients, num_sampled)
    keys = client_keys(round_key, ids)
    sum_dy = jax.tree.map(jnp.zeros_like, server.params)
    sum_dc = jax.tree.map(jnp.zeros_like, server.params)
    controls, clipped = [], 0
    for i, client_id in enumerate(np.asarray(ids)):
        batches, mask = data.client_batches(jnp.int32(client_id), keys[i], PLAN)
        new, out = inner.client_update(hp, server, client, batches, mask, keys[i])
        dy, dc = out.delta_params, out.message["delta_control"]
        norm = float(jnp.sqrt(sq_norm(dy) + sq_norm(dc)))
        factor = min(1.0, clip / norm)
        clipped += norm > clip
        sum_dy = jax.tree.map(lambda s, d, f=factor: s + f * d, sum_dy, dy)
        sum_dc = jax.tree.map(lambda s, d, f=factor: s + f * d, sum_dc, dc)
        controls.append(new.control)
    assert clipped >= 3  # the test exercises clipping
    x = jax.tree.map(lambda p, s: p + s / num_sampled, server.params, sum_dy)
    c = jax.tree.map(lambda p, s: p + s / data.num_clients, server.control, sum_dc)
    assert_trees_close(state.server.inner.params, x, rtol=1e-5, atol=1e-7)
    assert_trees_close(state.server.inner.control, c, rtol=1e-5, atol=1e-7)
    rows = jax.tree.map(lambda a: a[ids], state.clients.control)
    assert_trees_close(rows, jax.tree.map(lambda *r: jnp.stack(r), *controls), rtol=1e-5)
    assert float(metrics["dp_clipped_fraction"]) == pytest.approx(clipped / num_sampled)
    assert float(metrics["dp_clip_norm"]) == pytest.approx(clip)


# ------------------------------------------------------------------------ the noise
NOISE_Z, NOISE_CLIP, NOISE_S = 2.0, 0.5, 4


def _noise(make, read) -> np.ndarray:
    """``read(server)`` after one round at z = NOISE_Z less the same round at z = 0 (same
    key, state and data), over 30 keys, flattened: the noise that reached it alone."""
    wide = sj.models.logistic_regression((30,), 10, zero_init=False, key=jr.key(0))
    rng = np.random.default_rng(0)
    clients = [
        {"x": rng.normal(size=(8, 30)).astype(np.float32), "y": rng.integers(0, 10, 8)}
        for _ in range(12)
    ]
    data = sj.from_client_arrays(clients)
    sim = sj.Simulation(private(make(wide.loss_fn)), wide, PLAN, NOISE_S)
    quiet = sim.resolve_hparams(
        {"client_lr": 0.1, "dp_noise_multiplier": 0.0, "dp_clip": NOISE_CLIP}
    )
    noisy = quiet.replace(dp_noise_multiplier=jnp.float32(NOISE_Z))
    diffs = []
    for draw in range(30):
        key = jr.key(draw)
        a, _ = sim.round(quiet, sim.init(data), data, key)
        b, _ = sim.round(noisy, sim.init(data), data, key)
        for x, y in zip(*map(jax.tree.leaves, (read(a.server), read(b.server))), strict=True):
            diffs.append(np.ravel(np.asarray(y, np.float64) - np.asarray(x, np.float64)))
    return np.concatenate(diffs)


def _assert_normal_with_std(diffs: np.ndarray, sigma: float) -> None:
    """Σ (d/σ)² ~ χ²(n) for n independent N(0, σ²): rejected outside the two-sided
    quantiles of a 1e-6 false alarm; and the mean by a z-test at 1e-6."""
    n = diffs.size
    statistic = float(np.sum((diffs / sigma) ** 2))
    low, high = stats.chi2.ppf(FALSE_ALARM / 2, n), stats.chi2.isf(FALSE_ALARM / 2, n)
    assert low < statistic < high, (statistic / n, n)
    assert abs(diffs.mean()) * math.sqrt(n) / sigma < stats.norm.isf(FALSE_ALARM / 2)


def test_the_noise_on_the_mean_has_std_z_c_over_s():
    """x(z) − x(0) over the same round is ξ/S, ξ ~ N(0, (zC)²) per coordinate."""
    diffs = _noise(sj.fedavg, lambda server: server.inner)
    _assert_normal_with_std(diffs, NOISE_Z * NOISE_CLIP / NOISE_S)


def test_mimes_first_message_is_clipped_to_c_over_root_2_and_noised():
    """Mime's pre-round mean gradient c (what its clients and the server's base optimizer
    read) is noised as its own release: c(z) − c(0) is ξ/S with ξ ~ N(0, (z C/√2)²) per
    coordinate (the pair's share of C)."""
    diffs = _noise(sj.mime, lambda server: server.inner.control)
    _assert_normal_with_std(diffs, NOISE_Z * NOISE_CLIP / math.sqrt(2) / NOISE_S)


# ------------------------------------------------------------------------ Poisson sampling
def test_poisson_sampler_draws_each_client_with_probability_q_and_drops_none():
    """Over R rounds: every present id distinct and in range; the cohort is exactly the
    Binomial(N, q) count drawn from the same key (padding never drops a sampled client);
    each client's inclusion count is Binomial(R, q) (max z-score against the Bonferroni
    bound of a 1e-6 false alarm)."""
    num_clients, expected, rounds = 60, 6, 3000
    sampler = sampling.make("poisson")
    width = sampling.poisson_bound(num_clients, expected)
    keys = jr.split(jr.key(0), rounds)
    ids, present = jax.jit(jax.vmap(lambda k: sampler(k, 0, num_clients, expected)))(keys)
    ids, present = np.asarray(ids), np.asarray(present)
    assert ids.shape == present.shape == (rounds, width)
    drawn = jax.vmap(
        lambda k: jr.binomial(jr.split(k, 3)[0], float(num_clients), expected / num_clients)
    )(keys)
    np.testing.assert_array_equal(present.sum(1), np.asarray(drawn).astype(int))
    for row in ids:
        assert len(set(row.tolist())) == width and row.min() >= 0 and row.max() < num_clients
    counts = np.bincount(ids[present], minlength=num_clients)
    q = expected / num_clients
    score = np.abs(counts - rounds * q) / math.sqrt(rounds * q * (1 - q))
    assert score.max() < stats.norm.isf(FALSE_ALARM / (2 * num_clients))


def test_poisson_bound_refuses_a_bound_that_would_drop_clients():
    assert sampling.poisson_bound(1000, 10) > 10
    assert sampling.poisson_overflow(1000, 10, sampling.poisson_bound(1000, 10)) <= 1e-12
    with pytest.raises(ValueError, match=r"poisson_bound = 12 is too small.*Use poisson_bound >="):
        sampling.poisson_bound(1000, 10, 12)


def test_a_poisson_round_leaves_the_clients_not_drawn_untouched(data, problem):
    sim = sj.Simulation(
        private(sj.scaffold(problem.loss_fn)), problem, PLAN, 5, sampler=sampling.make("poisson")
    )
    hp = sim.resolve_hparams(_hp("scaffold", dp_noise_multiplier=1.0, dp_clip=1.0))
    state, metrics = sim.round(hp, sim.init(data), data, jr.key(2))
    ids = np.asarray(metrics["client_ids"])
    taking_part = ids[ids >= 0]
    assert metrics["participants"] == taking_part.size > 0
    changed = np.any(np.asarray(state.clients.control["linear"]["kernel"]) != 0, axis=(1, 2))
    np.testing.assert_array_equal(np.flatnonzero(changed), np.sort(taking_part))


@pytest.mark.parametrize("chunk", [1, 3])
def test_skipping_the_padding_chunks_changes_nothing(data, problem, chunk):
    """On CPU a round runs its clients in chunks and skips the chunks of a Poisson round
    that hold only padding; every result equals the round that runs all its rows."""
    alg = sj.scaffold(problem.loss_fn)
    poisson = sampling.make("poisson")
    runs = {}
    for name, client_chunk in (("all", None), ("chunked", chunk)):
        sim = sj.Simulation(alg, problem, PLAN, 3, sampler=poisson, client_chunk=client_chunk)
        runs[name] = sim.run(data, _hp("scaffold"), 6, 3)
    width = sampling.poisson_bound(data.num_clients, 3)
    assert runs["all"].round_metrics["participants"].max() + 2 * chunk <= width  # skipped some
    assert_trees_close(runs["chunked"].state, runs["all"].state, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(runs["chunked"].client_ids, runs["all"].client_ids)


# ------------------------------------------------------------------------ sweeps and resume
def test_a_private_sweep_config_equals_its_single_run(data, problem):
    sim = sj.Simulation(private(sj.scaffold(problem.loss_fn)), problem, PLAN, 5)
    hp, seeds, configs = grid(
        client_lr=[0.1], dp_noise_multiplier=[0.5, 2.0], dp_clip=[0.2, 1.0], seeds=[0]
    )
    result = sweep(sim, data, hp, seeds, 4, 2)
    for j, config in enumerate(configs):
        alone = sim.run(data, {k: v for k, v in config.items() if k != "seed"}, 4, 2, seed=0)
        assert_trees_close(
            jax.tree.map(lambda a, j=j: a[j], result.server_states), alone.state.server
        )
        for mine, theirs in zip(result.records[j], alone.records, strict=True):
            assert mine["dp_epsilon"] == theirs["dp_epsilon"]
            np.testing.assert_allclose(mine["test_loss"], theirs["test_loss"], rtol=1e-5)
    # The accountant runs per config: more noise, less epsilon.
    final = [result.records[j][-1]["dp_epsilon"] for j in range(4)]
    assert final[0] > final[2] and final[1] > final[3]


def test_resume_continues_the_state_and_the_accountant_exactly(data, problem, tmp_path):
    sim = sj.Simulation(private(sj.fedavg(problem.loss_fn)), problem, PLAN, 5)
    hp = _hp("fedavg", dp_noise_multiplier=0.4, dp_clip=0.5, dp_clip_lr=0.2)
    whole = sim.run(data, hp, 6, 2)
    sim.run(data, hp, 3, 1, checkpoint_dir=tmp_path, checkpoint_every=1)
    resumed = sim.run(data, hp, 6, 2, checkpoint_dir=tmp_path, resume=True)
    for x, y in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert whole.records[-1]["dp_epsilon"] == resumed.records[-1]["dp_epsilon"]
    assert whole.records[-1]["dp_epsilon"] == accounting.epsilon(
        accounting.Sampling("fixed_size", data.num_clients, 5),
        float(np.float32(0.4)),  # the float32 value the rounds used
        6,
        accounting.default_delta(data.num_clients),
    )


# ------------------------------------------------------------------------ refusals
def test_what_a_private_run_refuses(data, problem):
    for name in ("fednova", "fedexp"):
        with pytest.raises(ValueError, match="cannot be made differentially private"):
            private(getattr(sj, name)(problem.loss_fn))
    with pytest.raises(ValueError, match="private already"):
        private(private(sj.fedavg(problem.loss_fn)))
    dp = private(sj.fedavg(problem.loss_fn))
    weighted = sj.Simulation(dp, problem, PLAN, 5, weighting="num_examples")
    with pytest.raises(ValueError, match="weighting = 'uniform'"):
        weighted.check(data)
    warm_alg = private(sj.scaffold(problem.loss_fn, warm_controls=True))
    warm = sj.Simulation(warm_alg, problem, PLAN, 5)
    with pytest.raises(ValueError, match="warm_controls=False"):
        warm.check(data)
    with pytest.raises(ValueError, match="dp_noise_multiplier=-1 is invalid"):
        sj.Simulation(dp, problem, PLAN, 5).resolve_hparams(
            {"client_lr": 0.1, "dp_noise_multiplier": -1.0}
        )
    with pytest.raises(ValueError, match="dp_clip=0 is invalid"):
        sj.Simulation(dp, problem, PLAN, 5).resolve_hparams(
            {"client_lr": 0.1, "dp_noise_multiplier": 1.0, "dp_clip": 0.0}
        )


# ------------------------------------------------------------------------ the command line
QUAD = ["--dataset", "quadratic", "--num-clients", "50", "--eval-every", "5", "--quiet",
        "--no-compile-cache"]  # fmt: skip


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # the accountant's calibration from the command line: ~4 s
def test_the_command_line_calibrates_the_noise_for_a_target_epsilon(tmp_path):
    """--dp-epsilon 3 over 10 Poisson rounds: the last record's epsilon is within 1% of 3
    and not above it, and the calibrated multiplier is in the summary; a resume to more
    rounds is refused unless the run's noise is given instead (then epsilon grows)."""
    out = tmp_path / "dp"
    argv = ["run", *QUAD, "--rounds", "10", "--dp-epsilon", "3", "--sampler", "poisson"]
    assert main([*argv, "--out", str(out)]) == 0
    last = _records(out)[-1]
    assert 0.99 * 3 <= last["dp_epsilon"] <= 3
    summary = json.loads((out / "summary.json").read_text())
    z = summary["runs"]["scaffold"]["hparams"]["dp_noise_multiplier"]
    assert summary["runs"]["scaffold"]["final"]["dp_epsilon"] == last["dp_epsilon"]
    longer = ["run", *QUAD, "--rounds", "20", "--sampler", "poisson", "--out", str(out)]
    assert main([*longer, "--dp-epsilon", "3", "--resume"]) == 2
    assert main([*longer, "--dp-noise-multiplier", str(z), "--resume"]) == 0
    assert _records(out)[-1]["dp_epsilon"] > 3


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--dp-epsilon", "0"], "dp_epsilon = 0.0 is invalid"),
        (["--dp-epsilon", "3", "--dp-delta", "1"], "dp_delta = 1"),
        (["--dp-noise-multiplier", "-1"], "dp_noise_multiplier = -1.0 is invalid"),
        (["--dp-noise-multiplier", "1", "--dp-clip", "0"], "dp_clip = 0.0 is invalid"),
        (["--dp-clip", "1"], "a private run needs its noise"),
        (["--dp-epsilon", "3", "--dp-noise-multiplier", "1"], "are both set"),
        (["--dp-epsilon", "3", "--dp-accountant", "pld"], "does not cover sampling"),
        (["--dp-epsilon", "3", "--weighting", "num_examples"], "weighting = 'uniform'"),
        (["--dp-epsilon", "3", "--algorithm", "fednova"], "cannot be made differentially"),
        (["--dp-epsilon", "1e-6", "--dp-delta", "1e-10"], "is out of reach"),
    ],
)
def test_bad_privacy_settings_are_usage_errors(flags, says, capsys, tmp_path):
    out = tmp_path / "out"
    argv = ["run", *QUAD, "--rounds", "10", *flags, "--no-checkpoint", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("scaffold-jax: error: ") and "Traceback" not in err
    assert says in err, err
    assert not out.exists()


def test_a_delta_of_one_over_n_or_more_is_refused_by_the_config_and_the_api(data, problem):
    """δ >= 1/N is no privacy: refused with one message by the config (it was a Python
    warning) and by a Simulation of the Python API (it was accepted silently)."""
    says = (
        "dp_delta = 0.05 >= 1/N = 2.0e-02 (N = 50 clients) is no privacy: a delta of 1/N or "
        "more lets a mechanism publish one client's data outright. Use delta < 1/N, e.g. "
        "N^-1.1 = 1.4e-02 (the default)."
    )
    config = RunConfig(dataset="quadratic", num_clients=50, rounds=5, dp_noise_multiplier=1.0,
                       dp_delta=0.05)  # fmt: skip
    with pytest.raises(ConfigError) as info:
        config.validate()
    assert str(info.value) == f"invalid config: privacy = 'gaussian': {says}"
    with pytest.raises(ConfigError, match=re.escape(says)):
        config.resolved_hparams()
    n = data.num_clients
    algorithm = sj.privacy.private(sj.fedavg(problem.loss_fn), delta=1.0 / n)
    sim = sj.Simulation(algorithm, problem, sj.BatchPlan.fixed(2, 1), 2)
    with pytest.raises(ValueError, match=re.escape(f"dp_delta = {1.0 / n} >= 1/N = ")):
        sim.run(data, sj.hparams(0.1, dp_clip=1.0, dp_noise_multiplier=1.0), num_rounds=1)


def test_without_the_extra_the_message_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ImportError, match=r"pip install 'scaffold-jax\[privacy\]'"):
        # Arguments no earlier call used: the memoised values are not asked.
        accounting.epsilon(accounting.Sampling("poisson", 101, 10), 1.2345, 5, 1e-3)


def test_a_sweep_over_target_epsilons_calibrates_each_config(tmp_path):
    """`sweep --grid dp_epsilon=3,8`: one config per target, each with the noise multiplier
    calibrated for it (the same as `run --dp-epsilon`'s), each ending within 1% under it."""
    out = tmp_path / "sweep"
    argv = ["sweep", *QUAD, "--rounds", "6", "--algorithms", "fedavg", "--grid",
            "dp_epsilon=3,8", "--sampler", "poisson", "--seeds", "0", "--no-checkpoint",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = sorted(csv.DictReader((out / "sweep.csv").open()), key=lambda r: r["final_dp_epsilon"])
    assert [r["algorithm"] for r in rows] == ["fedavg", "fedavg"]
    for row, target in zip(rows, (3.0, 8.0), strict=True):
        assert 0.99 * target <= float(row["final_dp_epsilon"]) <= target
        config = RunConfig(dataset="quadratic", num_clients=50, rounds=6, sampler="poisson",
                           algorithm="fedavg", dp_epsilon=target)  # fmt: skip
        expected = config.validate().resolved_hparams()["dp_noise_multiplier"]
        assert float(row["dp_noise_multiplier"]) == pytest.approx(float(expected), rel=1e-6)
