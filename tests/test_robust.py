"""Byzantine clients and robust aggregation in the round (scaffold_jax.robust): the engine's
SCAFFOLD round under attack against a numpy float64 reference built from the honest run's
own client table, the contract's identities, and the refusals. (The attacks and the
aggregators alone are checked in tests/test_robust_attacks.py and
tests/test_robust_aggregators.py.)"""

from __future__ import annotations

import jax
import jax.random as jr
import numpy as np
import pytest

import scaffold_jax as sj
from scaffold_jax import robust
from scaffold_jax.engine import constants_key
from scaffold_jax.robust import malicious
from tests.conftest import binary_clients

PLAN = sj.BatchPlan.fixed(batch_size=2, num_steps=2)
SIZES = [4, 6, 4, 5, 8, 4, 6, 4]
N = len(SIZES)
LR = 0.1


@pytest.fixture(scope="module")
def setting():
    problem = sj.models.logistic_regression((3,), 2)
    return problem, binary_clients(SIZES, 1)


def _run(setting, algorithm, s=N, rounds=1, **hparams):
    problem, data = setting
    sim = sj.Simulation(algorithm, problem, PLAN, s, weighting="uniform")
    return sim.run(data, sj.hparams(client_lr=LR, **hparams), num_rounds=rounds, seed=3)


def _flat(tree) -> np.ndarray:
    return np.concatenate(
        [np.asarray(a, np.float64).reshape(N, -1) for a in jax.tree.leaves(tree)], 1
    )


def _vector(tree) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(tree)])


@pytest.fixture(scope="module")
def honest(setting):
    """Round 1 of SCAFFOLD with every client: c = c_i = 0 before it, so each client's
    Δy_i = −K η_l c_i⁺ and Δc_i = c_i⁺ (option II), read from the client table."""
    problem, _ = setting
    result = _run(setting, sj.scaffold(problem.loss_fn))
    dc = _flat(result.state.clients.control)
    dy = -PLAN.num_steps * LR * dc
    x0 = _vector(problem.params)
    # The derivation itself: the plain round moves x by the mean Δy and c by (n/N) mean Δc.
    np.testing.assert_allclose(_vector(result.state.server.params), x0 + dy.mean(0), rtol=1e-5,
                               atol=1e-7)  # fmt: skip
    np.testing.assert_allclose(_vector(result.state.server.control), dc.mean(0), rtol=1e-5,
                               atol=1e-7)  # fmt: skip
    return result, dy, dc, x0


def _median(rows):
    return np.array([np.median(column) for column in rows.T])


def _trimmed(rows, beta):
    k = int(np.floor(beta * len(rows)))
    return np.array([np.mean(sorted(column)[k : len(column) - k]) for column in rows.T])


def _krum(rows, f):
    n = len(rows)
    q = max(1, n - f - 2)
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((rows[i] - rows[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(d[:q]))
    return rows[int(np.argmin(scores))]


@pytest.mark.parametrize(
    ("aggregator", "reference"),
    [("median", _median), ("trimmed_mean", lambda r: _trimmed(r, 0.25)),
     ("krum", lambda r: _krum(r, 2))],
)  # fmt: skip
def test_scaffold_under_signflip_moves_x_and_c_by_the_robust_aggregate(
    setting, honest, aggregator, reference
):
    """The malicious clients (the run's rank set: f = 0.25 of N = 8, two clients) send
    −2·(Δy_i, Δc_i); the server moves x by agg(Δy) and c by (n/N)·agg(Δc), each client's
    whole message (Δy, Δc) one vector for Krum, and every client writes its HONEST c_i⁺."""
    problem, _ = setting
    _, dy, dc, x0 = honest
    algorithm = robust.robustly_aggregated(
        robust.attacked(sj.scaffold(problem.loss_fn), "signflip"), aggregator
    )
    extra = {"trim_fraction": 0.25} if aggregator == "trimmed_mean" else {}
    result = _run(setting, algorithm, byzantine_fraction=0.25, attack_scale=2.0, **extra)
    bad = np.asarray(malicious.is_malicious(constants_key(jr.key(3)), N, 0.25, np.arange(N)))
    assert bad.sum() == 2
    sent = np.where(bad[:, None], -2.0 * np.concatenate([dy, dc], 1), np.concatenate([dy, dc], 1))
    width = dy.shape[1]
    agg = reference(sent)  # Krum on each whole message, the others per coordinate
    np.testing.assert_allclose(_vector(result.state.server.params), x0 + agg[:width], rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    np.testing.assert_allclose(_vector(result.state.server.control), agg[width:], rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    np.testing.assert_array_equal(_flat(result.state.clients.control), dc.astype(np.float32))
    record = result.records[-1]
    assert record["malicious_sampled"] == 2 and record["malicious_reported"] == 2
    if aggregator == "krum":
        chosen = int(np.flatnonzero(np.all(np.isclose(sent, agg), 1))[0])
        assert record["aggregator_selected_malicious"] == float(bad[chosen])


def test_a_zero_fraction_is_the_plain_run_and_no_attack_no_wrapper(setting, honest):
    """f = 0 leaves every message as it is (the same numbers; a different program, whose
    fusions may order a sum differently: equal to float tolerance, bitwise on jax 0.10);
    attack = 'none' and aggregator = 'mean' wrap nothing (bitwise today's run)."""
    problem, _ = setting
    plain = honest[0]
    for attack in ("signflip", "gaussian", "alie", "ipm"):
        run = _run(setting, robust.attacked(sj.scaffold(problem.loss_fn), attack),
                   byzantine_fraction=0.0)  # fmt: skip
        for a, b in zip(jax.tree.leaves(run.state), jax.tree.leaves(plain.state), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)
    algorithm = sj.scaffold(problem.loss_fn)
    assert robust.attacked(algorithm, "none") is algorithm
    assert robust.robustly_aggregated(algorithm, "mean") is algorithm


@pytest.mark.parametrize(
    ("aggregator", "hparams", "options"),
    [("trimmed_mean", {"trim_fraction": 0.0}, {}), ("multikrum", {}, {"krum_m": N}),
     ("median", {}, {})],
)  # fmt: skip
def test_the_contracts_identities_equal_the_mean_over_rounds(setting, aggregator, hparams, options):
    """β = 0, m = n, and the median of n ≤ 2 are the uniform mean. Three rounds of SCAFFOLD,
    two clients a round for the median (n ≤ 2), the whole cohort otherwise."""
    problem, _ = setting
    s = 2 if aggregator == "median" else N
    plain = _run(setting, sj.scaffold(problem.loss_fn), s=s, rounds=3)
    algorithm = robust.robustly_aggregated(sj.scaffold(problem.loss_fn), aggregator, **options)
    run = _run(setting, algorithm, s=s, rounds=3, **hparams)
    for a, b in zip(jax.tree.leaves(run.state), jax.tree.leaves(plain.state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_sweep_over_the_fraction_and_bucket_size_is_one_program_equal_to_its_single_runs(
    setting,
):
    from scaffold_jax.sweep import grid, sweep

    problem, data = setting
    algorithm = robust.robustly_aggregated(
        robust.attacked(sj.scaffold(problem.loss_fn), "ipm"), "median"
    )
    sim = sj.Simulation(algorithm, problem, PLAN, 4, weighting="uniform")
    hparams, seeds, configs = grid(client_lr=[LR], byzantine_fraction=[0.0, 0.375],
                                   bucket_size=[1, 2, 3], seeds=[3])  # fmt: skip
    result = sweep(sim, data, hparams, seeds, num_rounds=3)
    finals = {}
    for i, config in enumerate(configs):
        hp = sj.hparams(**{k: v for k, v in config.items() if k != "seed"})
        single = sim.run(data, hp, num_rounds=3, seed=3)
        for a, b in zip(jax.tree.leaves(single.state.server),
                        jax.tree.leaves(jax.tree.map(lambda x: x[i], result.server_states)),
                        strict=True):  # fmt: skip
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        finals[config["byzantine_fraction"], config["bucket_size"]] = _vector(
            single.state.server.params
        )
    # The bucket size is read: buckets of 2 or 3 aggregate other rows than s = 1.
    assert not np.allclose(finals[0.375, 1], finals[0.375, 2])
    assert not np.allclose(finals[0.375, 2], finals[0.375, 3])


def test_the_malicious_set_is_nested_in_the_fraction_and_fixed_for_the_run(setting):
    key = constants_key(jr.key(3))
    ids = np.arange(100)
    sets = [np.asarray(malicious.is_malicious(key, 100, f, ids)) for f in (0.1, 0.2, 0.3)]
    assert [s.sum() for s in sets] == [10, 20, 30]
    assert np.all(sets[0] <= sets[1]) and np.all(sets[1] <= sets[2])


def test_refusals_name_the_problem(setting):
    problem, data = setting
    scaffold = sj.scaffold(problem.loss_fn)
    with pytest.raises(ValueError, match="with differential privacy is refused"):
        sj.privacy.private(robust.robustly_aggregated(scaffold, "median"))
    with pytest.raises(ValueError, match="reads each client's output on its own"):
        robust.robustly_aggregated(sj.fednova(problem.loss_fn), "median")
    with pytest.raises(ValueError, match="takes no option 'bucket_size'.*hyper-parameter"):
        robust.robustly_aggregated(scaffold, "median", bucket_size=2)
    sim = sj.Simulation(robust.robustly_aggregated(scaffold, "median"), problem, PLAN, 4,
                        weighting="num_examples")  # fmt: skip
    with pytest.raises(ValueError, match="use weighting = 'uniform', not 'num_examples'"):
        sim.run(data, sj.hparams(client_lr=LR), num_rounds=1)
    with pytest.raises(ValueError, match="byzantine_fraction"):
        _run(setting, robust.attacked(scaffold, "signflip"), byzantine_fraction=0.5)
    warm = sj.scaffold(problem.loss_fn, warm_controls=True)
    with pytest.raises(ValueError, match=r"warm controls is refused.*warm_controls=False"):
        robust.attacked(warm, "ipm")
    with pytest.raises(ValueError, match=r"warm controls is refused.*warm_controls=False"):
        robust.robustly_aggregated(warm, "krum")
    from scaffold_jax import participation

    buffered = sj.Simulation(robust.attacked(scaffold, "signflip"), problem, PLAN, 2,
                             participation=participation.make(profiles="lognormal"),
                             execution=sj.FedBuff(4, 2))  # fmt: skip
    with pytest.raises(ValueError, match="FedBuff with Byzantine clients"):
        buffered.run(data, sj.hparams(client_lr=LR), num_rounds=1)


def test_the_command_line_runs_an_attack_and_refuses_what_cannot_compose(tmp_path, capsys):
    from scaffold_jax.cli import main
    from scaffold_jax.results import read_records

    base = ["run", "--dataset", "synthetic", "--num-clients", "10", "--clients-per-round", "5",
            "--rounds", "2", "--eval-every", "1", "--quiet"]  # fmt: skip
    argv = [*base, "--attack", "ipm", "--byzantine-fraction", "0.2", "--aggregator",
            "trimmed_mean", "--trim-fraction", "0.2", "--bucket-size", "2"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    records = read_records(tmp_path / "run")
    assert all(0 <= r["malicious_reported"] <= r["malicious_sampled"] <= 2 for r in records[1:])
    capsys.readouterr()
    refused = [*base, "--aggregator", "median", "--dp-noise-multiplier", "1", "--dp-clip", "1",
               "--out", str(tmp_path / "dp")]  # fmt: skip
    assert main(refused) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "aggregator = 'median' with differential privacy" in err


def _cclip(rows, centre, tau, iterations=1):
    v = np.array(centre, np.float64)
    for _ in range(iterations):
        step = np.zeros_like(v)
        for u in rows:
            distance = np.linalg.norm(u - v)
            step += (u - v) * (1.0 if distance == 0 else min(1.0, tau / distance))
        v = v + step / len(rows)
    return v


def test_centered_clipping_starts_at_zero_and_keeps_its_centre_in_the_server_state(setting, honest):
    """Round 1: the centre is 0, so x and c move by cclip(sent; 0, τ) (a numpy loop);
    the new centre is that aggregate, in the server state."""
    problem, _ = setting
    _, dy, dc, x0 = honest
    algorithm = robust.robustly_aggregated(
        robust.attacked(sj.scaffold(problem.loss_fn), "signflip"), "cclip", cclip_iters=2
    )
    result = _run(setting, algorithm, byzantine_fraction=0.25, attack_scale=3.0, clip_radius=0.5)
    bad = np.asarray(malicious.is_malicious(constants_key(jr.key(3)), N, 0.25, np.arange(N)))
    honest_rows = np.concatenate([dy, dc], 1)
    sent = np.where(bad[:, None], -3.0 * honest_rows, honest_rows)
    agg = _cclip(sent, np.zeros(sent.shape[1]), 0.5, iterations=2)
    server = result.state.server
    assert isinstance(server, robust.CentredServerState)
    width = dy.shape[1]
    # The centre is the whole message flattened in tree order: delta_control, delta_params.
    in_tree_order = np.concatenate([agg[width:], agg[:width]])
    np.testing.assert_allclose(np.asarray(server.centre), in_tree_order, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_vector(server.inner.params), x0 + agg[:width], rtol=1e-5,
                               atol=1e-7)  # fmt: skip
    np.testing.assert_allclose(_vector(server.inner.control), agg[width:], rtol=1e-5, atol=1e-7)


def test_centered_clipping_with_an_unbounded_radius_is_the_mean_and_resumes_exactly(
    setting, tmp_path
):
    problem, data = setting
    plain = _run(setting, sj.scaffold(problem.loss_fn), s=4, rounds=3)
    algorithm = robust.robustly_aggregated(sj.scaffold(problem.loss_fn), "cclip")
    hp = sj.hparams(client_lr=LR, clip_radius=1e30)  # beyond any distance: the mean
    sim = sj.Simulation(algorithm, problem, PLAN, 4, weighting="uniform")
    whole = sim.run(data, hp, num_rounds=3, seed=3)
    for a, b in zip(jax.tree.leaves(whole.state.server.inner), jax.tree.leaves(plain.state.server),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # Killed after round 2 and resumed: the centre comes back from the checkpoint.
    sim.run(data, hp, num_rounds=2, seed=3, checkpoint_dir=tmp_path, checkpoint_every=1)
    resumed = sim.run(data, hp, num_rounds=3, seed=3, checkpoint_dir=tmp_path, resume=True)
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["scaffold", "mime"])
def test_labelflip_trains_the_malicious_clients_on_flipped_labels(setting, name):
    """The attacked run equals the plain run on data whose malicious clients' labels are
    y → 1 − y (C = 2): their updates and their own controls honest on the flipped data
    (Mime's pre-round gradient computed on the flipped labels too)."""
    make = getattr(sj, name)
    problem, data = setting
    bad = np.asarray(malicious.is_malicious(constants_key(jr.key(3)), N, 0.25, np.arange(N)))
    clients = binary_clients(SIZES, 1)
    y = np.asarray(clients.examples["y"]).copy()
    counts, offsets = np.asarray(clients.counts), np.asarray(clients.offsets)
    for i in np.flatnonzero(bad):
        rows = slice(offsets[i], offsets[i] + counts[i])
        y[rows] = 1 - y[rows]
    flipped = clients.replace(examples={**clients.examples, "y": jax.numpy.asarray(y)})
    algorithm = robust.attacked(make(problem.loss_fn), "labelflip")
    attacked = _run(setting, algorithm, rounds=2, byzantine_fraction=0.25)
    sim = sj.Simulation(make(problem.loss_fn), problem, PLAN, N, weighting="uniform")
    reference = sim.run(flipped, sj.hparams(client_lr=LR), num_rounds=2, seed=3)
    for a, b in zip(jax.tree.leaves((attacked.state.server, attacked.state.clients)),
                    jax.tree.leaves((reference.state.server, reference.state.clients)),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert attacked.records[-1]["malicious_reported"] == 2
    quadratic, qproblem, _ = __import__("tests.conftest", fromlist=["x"]).quadratic_clients()
    with pytest.raises(ValueError, match="labelflip' flips a classifier's labels"):
        sj.Simulation(robust.attacked(sj.scaffold(qproblem.loss_fn), "labelflip"), qproblem,
                      sj.BatchPlan.full(1), 2).run(quadratic, sj.hparams(client_lr=0.1),
                                                    num_rounds=1)  # fmt: skip


def _full_gradients(data) -> np.ndarray:
    """Each client's full-batch gradient of the mean cross-entropy at x⁰ = 0 (numpy
    float64; p = 1/2 for both classes), as rows in the params' tree order: bias, kernel
    ``[out, in]``."""
    x, y = np.asarray(data.examples["x"], np.float64), np.asarray(data.examples["y"])
    counts, offsets = np.asarray(data.counts), np.asarray(data.offsets)
    rows = []
    for i in range(N):
        xi, yi = x[offsets[i] : offsets[i] + counts[i]], y[offsets[i] : offsets[i] + counts[i]]
        residual = 0.5 - np.eye(2)[yi]  # softmax(0) − one-hot, [n_i, 2]
        rows.append(np.concatenate([residual.mean(0), (residual.T @ xi / len(xi)).ravel()]))
    return np.stack(rows)


@pytest.mark.parametrize(
    ("aggregator", "reference"), [("mean", lambda r: r.mean(0)), ("median", _median)]
)
def test_mimes_pre_round_gradient_is_attacked_and_robustly_aggregated(
    setting, aggregator, reference
):
    """Mime's clients also send ∇f_i(x) before their local steps: the malicious ones send
    −2·∇f_i(x) there too, and the server's c (its control) is agg of what was sent."""
    problem, data = setting
    algorithm = robust.robustly_aggregated(
        robust.attacked(sj.mime(problem.loss_fn), "signflip"), aggregator
    )
    result = _run(setting, algorithm, byzantine_fraction=0.25, attack_scale=2.0)
    bad = np.asarray(malicious.is_malicious(constants_key(jr.key(3)), N, 0.25, np.arange(N)))
    gradients = _full_gradients(data)
    sent = np.where(bad[:, None], -2.0 * gradients, gradients)
    np.testing.assert_allclose(_vector(result.state.server.control), reference(sent),
                               rtol=1e-5, atol=1e-7)  # fmt: skip
    assert result.records[-1]["malicious_reported"] == 2


def test_mimes_pre_round_has_a_centre_of_its_own_and_resumes_exactly(setting, tmp_path):
    """Centered clipping on Mime: the pre-round gradient's aggregate is clipped around the
    previous pre-round aggregate (``pass_centre``, 0 before round 1), kept in the server
    state and restored by a resume bit for bit."""
    problem, data = setting
    algorithm = robust.robustly_aggregated(
        robust.attacked(sj.mime(problem.loss_fn), "signflip"), "cclip"
    )
    hp = sj.hparams(client_lr=LR, byzantine_fraction=0.25, attack_scale=3.0, clip_radius=0.05)
    sim = sj.Simulation(algorithm, problem, PLAN, N, weighting="uniform")
    first = sim.run(data, hp, num_rounds=1, seed=3)
    bad = np.asarray(malicious.is_malicious(constants_key(jr.key(3)), N, 0.25, np.arange(N)))
    gradients = _full_gradients(data)
    agg = _cclip(np.where(bad[:, None], -3.0 * gradients, gradients), np.zeros(8), 0.05)
    server = first.state.server
    np.testing.assert_allclose(np.asarray(server.pass_centre), agg, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_vector(server.inner.control), agg, rtol=1e-5, atol=1e-7)
    whole = sim.run(data, hp, num_rounds=3, seed=3)
    sim.run(data, hp, num_rounds=2, seed=3, checkpoint_dir=tmp_path, checkpoint_every=1)
    resumed = sim.run(data, hp, num_rounds=3, seed=3, checkpoint_dir=tmp_path, resume=True)
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_under_privacy_mimes_pre_round_is_attacked_before_it_is_clipped(setting):
    """attack → privacy on Mime: with a clip beyond every message and no noise, the
    private pre-round mean is the mean of what the malicious clients sent."""
    problem, data = setting
    algorithm = sj.privacy.private(robust.attacked(sj.mime(problem.loss_fn), "signflip"))
    result = _run(setting, algorithm, byzantine_fraction=0.25, attack_scale=2.0,
                  dp_noise_multiplier=0.0, dp_clip=1e6)  # fmt: skip
    bad = np.asarray(malicious.is_malicious(constants_key(jr.key(3)), N, 0.25, np.arange(N)))
    gradients = _full_gradients(data)
    sent = np.where(bad[:, None], -2.0 * gradients, gradients)
    np.testing.assert_allclose(_vector(result.state.server.inner.control), sent.mean(0),
                               rtol=1e-5, atol=1e-7)  # fmt: skip
