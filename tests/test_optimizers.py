"""Optimizers by name (scaffold_jax.optimizers): the spec strings, the paper's FedAdam
against its formula, server optimizers (FedOpt) for every algorithm, local optimizers for
FedAvg / FedProx against a per-client reference loop, and SCAFFOLD's refusal."""

import json
import os

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from conftest import assert_trees_close, reference_grad

import scaffold_jax as sj
from scaffold_jax import optimizers
from scaffold_jax.algorithms import ALGORITHMS, feddyn, fednova
from scaffold_jax.algorithms.common import ServerState
from scaffold_jax.cli import main
from scaffold_jax.experiments import ConfigError, RunConfig
from scaffold_jax.sampling import sample_clients
from scaffold_jax.types import ClientOutput

FASHION = "/usr/share/datasets/fashion-mnist"
PLAN = sj.BatchPlan.epochs(batch_size=3, num_epochs=1)


# ----------------------------------------------------------------------- spec strings
def test_specs_parse_with_defaults_and_have_one_canonical_spelling():
    assert optimizers.parse("adam") == ("adam", {"b1": 0.9, "b2": 0.999, "eps": 1e-8})
    assert optimizers.parse(" adam : b2 = 0.99 , eps=1e-3 ")[1] == {
        "b1": 0.9, "b2": 0.99, "eps": 1e-3,
    }  # fmt: skip
    assert optimizers.canonical("adam:eps=1e-3,b2=0.99") == "adam:b2=0.99,eps=0.001"
    assert optimizers.canonical("momentum:momentum=0.9") == "momentum"
    assert optimizers.build("sgd") is None and optimizers.build(None) is None
    tx = optax.trace(0.5)
    assert optimizers.build(tx) is tx


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("adamw", r"optimizer 'adamw' is unknown \(did you mean 'adam'\?\); use one of sgd"),
        ("adam:beta1=0.9", r"adam has no parameter 'beta1'; it takes b1, b2, eps"),
        ("sgd:momentum=0.9", r"sgd has no parameter 'momentum'; it takes no parameters"),
        ("momentum:momentum=fast", r"momentum = 'fast' is invalid; give a finite number"),
        ("momentum:momentum", r"momentum = '' is invalid"),
        # Each parameter is a declared option with its range.
        ("adam:b2=1.5", r"'adam:b2=1.5': b2 = 1.5 is invalid: it must be a number in \[0, 1\)"),
        ("fedadam:tau=0", r"tau = 0.0 is invalid: it must be a number > 0"),
        ("", r"give a name \(sgd, momentum, adagrad, adam, fedadam, yogi\)"),
        (3, r"optimizer 3 is invalid"),
    ],
)
def test_bad_specs_are_refused_naming_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        optimizers.parse(spec)


def test_fedadam_follows_the_papers_formula_and_differs_from_optax_adam():
    """Reddi et al. 2021, Algorithm 2: m ← β1 m + (1−β1) g, v ← β2 v + (1−β2) g²,
    u = m / (√v + τ), m₋₁ = 0, v₋₁ = τ²; no bias correction."""
    b1, b2, tau = 0.9, 0.99, 1e-2
    tx = optimizers.build(f"fedadam:tau={tau}")
    grads = [np.array([0.5, -2.0, 1e-3]), np.array([0.1, 1.0, -1e-3]), np.array([-1.0, 0, 2.0])]
    state = tx.init(jnp.zeros(3, jnp.float32))
    m, v = np.zeros(3), np.full(3, tau**2)
    for g in grads:
        out, state = tx.update(jnp.asarray(g, jnp.float32), state)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        np.testing.assert_allclose(np.asarray(out), m / (np.sqrt(v) + tau), rtol=1e-5)
    # optax's Adam corrects the bias: its first step is ≈ sign(g) for every g; the paper's
    # is (1−β1) g / (√((1−β2) g² + β2 τ²) + τ): ≈ sign(g) too where |g| ≫ τ (β2 = 0.99),
    # but damped to ≈ g / 10τ where |g| ≪ τ.
    adam = optimizers.build("adam")
    first, _ = adam.update(jnp.asarray(grads[0], jnp.float32), adam.init(jnp.zeros(3)))
    np.testing.assert_allclose(np.asarray(first), np.sign(grads[0]), rtol=1e-3, atol=1e-4)
    paper, _ = tx.update(jnp.asarray(grads[0], jnp.float32), tx.init(jnp.zeros(3)))
    paper = np.asarray(paper)
    assert np.all(np.abs(paper[:2]) > 0.8) and np.all(np.sign(paper[:2]) == np.sign(grads[0][:2]))
    assert abs(paper[2]) < 0.01 and abs(float(first[2])) > 0.99


# ----------------------------------------------------------------------- server (FedOpt)
def test_every_builtin_algorithm_takes_a_server_optimizer():
    for name, spec in ALGORITHMS.items():
        assert spec.options["server_optimizer"].default == "sgd", name


def test_a_named_server_optimizer_is_the_optax_one(small_data, small_problem):
    hp = sj.hparams(client_lr=0.2, server_lr=0.5)
    by_name = sj.fedavg(small_problem.loss_fn, server_optimizer="momentum:momentum=0.7")
    by_optax = sj.fedavg(small_problem.loss_fn, server_optimizer=optax.trace(0.7))
    a, b = (
        sj.Simulation(alg, small_problem, PLAN, 3).run(small_data, hp, num_rounds=3, seed=1)
        for alg in (by_name, by_optax)
    )
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sgd_with_the_papers_fedadam_matches_a_reference(small_data, small_problem):
    """Large-batch SGD (one full gradient per client) with FedAdam on the server, written
    out in float64: Δ = −η_l mean ∇f_i(x), x ← x + η_g m / (√v + τ) with the moments of
    the pseudo-gradient −Δ taken with their signs."""
    lr, server_lr, b1, b2, tau, rounds, seed = 0.5, 0.1, 0.9, 0.99, 1e-3, 4, 3
    alg = sj.sgd(small_problem.loss_fn, server_optimizer=f"fedadam:tau={tau}")
    sim = sj.Simulation(alg, small_problem, sj.BatchPlan.full(1), 3)
    result = sim.run(small_data, sj.hparams(client_lr=lr, server_lr=server_lr),
                     num_rounds=rounds, seed=seed)  # fmt: skip
    x = jax.tree.map(lambda a: np.asarray(a, np.float64), small_problem.params)
    m = jax.tree.map(np.zeros_like, x)
    v = jax.tree.map(lambda a: np.full_like(a, tau**2), x)
    for r in range(rounds):
        sample_key, _ = jr.split(jr.fold_in(jr.key(seed), r))
        ids = np.asarray(sample_clients(sample_key, small_data.num_clients, 3))
        grads = [
            reference_grad(
                small_problem.loss_fn,
                x,
                small_data.client_examples(int(i)),
                np.ones(int(small_data.counts[i])),
            )  # fmt: skip
            for i in ids
        ]
        pseudo = jax.tree.map(lambda *g: lr * sum(g) / len(g), *grads)  # −Δ
        m = jax.tree.map(lambda mm, g: b1 * mm + (1 - b1) * g, m, pseudo)
        v = jax.tree.map(lambda vv, g: b2 * vv + (1 - b2) * g**2, v, pseudo)
        x = jax.tree.map(lambda xx, mm, vv: xx - server_lr * mm / (np.sqrt(vv) + tau), x, m, v)
    assert_trees_close(result.state.server.params, x, rtol=1e-4, atol=1e-5)


def test_fednova_hands_its_normalised_update_to_the_server_optimizer(small_problem):
    """The pseudo-gradient of FedNova is τ_eff η_l Σ p_i d_i = −τ_eff Σ p_i Δy_i / τ_i."""
    alg = fednova(small_problem.loss_fn, server_optimizer="momentum:momentum=0.5")
    x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), small_problem.params)
    state, _ = alg.init(x)
    rng = np.random.default_rng(0)
    tau = np.array([1.0, 2.0, 4.0], np.float32)
    hp = sj.HParams(client_lr=0.1, server_lr=0.3)
    momentum = jax.tree.map(np.zeros_like, jax.tree.map(np.asarray, x))
    expect = jax.tree.map(lambda a: np.asarray(a, np.float64), x)
    for _ in range(2):
        deltas = jax.tree.map(lambda a: rng.normal(size=(3, *a.shape)).astype(np.float32), x)
        outputs = ClientOutput(deltas, jnp.ones(3, jnp.float32), {},
                               message={"local_steps": jnp.asarray(tau)})  # fmt: skip
        state = alg.server_update(hp, state, outputs, jnp.float32(3.0))
        tau_eff = tau.mean()
        pseudo = jax.tree.map(lambda d: -tau_eff * np.mean(d / tau[:, None, None]
                              if d.ndim == 3 else d / tau[:, None], axis=0), deltas)  # fmt: skip
        momentum = jax.tree.map(lambda mm, g: g + 0.5 * mm, momentum, pseudo)
        expect = jax.tree.map(lambda e, mm: e - 0.3 * mm, expect, momentum)
    assert_trees_close(state.params, expect, rtol=1e-5, atol=1e-6)


def test_feddyn_with_a_server_optimizer_declares_server_lr(small_data, small_problem):
    plain = feddyn(small_problem.loss_fn)
    opt = feddyn(small_problem.loss_fn, server_optimizer="momentum:momentum=0")
    assert "server_lr" not in plain.hparams and "server_lr" in opt.hparams
    hp = {"client_lr": 0.2, "alpha": 0.1}
    a = sj.Simulation(plain, small_problem, PLAN, 3).run(small_data, hp, num_rounds=3, seed=4)
    b = sj.Simulation(opt, small_problem, PLAN, 3).run(small_data, hp, num_rounds=3, seed=4)
    # Momentum 0 and η_g = 1: the transformation is the identity, FedDyn's own step.
    assert_trees_close(a.state.server.params, b.state.server.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(a.state.server.h, b.state.server.h, rtol=1e-6, atol=1e-7)
    c = sj.Simulation(opt, small_problem, PLAN, 3).run(
        small_data, {**hp, "server_lr": 0.5}, num_rounds=3, seed=4
    )
    assert not np.allclose(
        np.asarray(jax.tree.leaves(c.state.server.params)[0]),
        np.asarray(jax.tree.leaves(b.state.server.params)[0]),
    )


# ----------------------------------------------------------------------- local optimizers
def reference_fedavg(problem, data, plan, lr, rounds, seed, local, prox_mu=0.0):
    """FedAvg / FedProx with a local optimizer, client by client: ``local`` is "momentum"
    (β = 0.8 by hand, float64) or an optax transformation run on one client at a time; its
    state restarts every round."""
    x = jax.tree.map(lambda a: np.asarray(a, np.float64), problem.params)
    counts = np.asarray(data.counts)
    for r in range(rounds):
        sample_key, clients_key = jr.split(jr.fold_in(jr.key(seed), r))
        ids = np.asarray(sample_clients(sample_key, data.num_clients, 3))
        deltas = []
        for i in ids:
            key = jr.fold_in(clients_key, int(i))
            pos, mask = (np.asarray(a) for a in plan.positions(key, counts[i], data.max_count))
            examples = data.client_examples(int(i))
            y = jax.tree.map(np.copy, x)
            m = jax.tree.map(np.zeros_like, x)
            opt_state = (
                None
                if local == "momentum"
                else local.init(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), y))
            )
            for k in range(len(pos)):
                if mask[k].sum() == 0:
                    continue
                batch = jax.tree.map(lambda a, k=k: a[pos[k]], examples)
                g = reference_grad(problem.loss_fn, y, batch, mask[k])
                g = jax.tree.map(lambda gg, yy, xx: gg + prox_mu * (yy - xx), g, y, x)
                if local == "momentum":
                    m = jax.tree.map(lambda mm, gg: gg + 0.8 * mm, m, g)
                    u = m
                else:
                    u, opt_state = local.update(
                        jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), g), opt_state
                    )
                    u = jax.tree.map(lambda a: np.asarray(a, np.float64), u)
                y = jax.tree.map(lambda yy, uu: yy - lr * uu, y, u)
            deltas.append(jax.tree.map(lambda yy, xx: yy - xx, y, x))
        x = jax.tree.map(lambda xx, *d: xx + sum(d) / len(d), x, *deltas)
    return x


@pytest.mark.parametrize(
    ("name", "spec", "local"),
    [
        ("fedavg", "momentum:momentum=0.8", "momentum"),
        pytest.param("fedprox", "momentum:momentum=0.8", "momentum", marks=pytest.mark.slow),
        ("fedavg", "adam:eps=1e-3", "adam"),
    ],
)
def test_local_optimizers_match_a_per_client_reference_loop(name, spec, local, small_data,
                                                            small_problem):  # fmt: skip
    lr, rounds, seed, mu = 0.05, 3, 2, 0.5
    alg = ALGORITHMS[name].factory(small_problem.loss_fn, local_optimizer=spec)
    hp = sj.hparams(client_lr=lr, **({"prox_mu": mu} if name == "fedprox" else {}))
    result = sj.Simulation(alg, small_problem, PLAN, 3).run(
        small_data, hp, num_rounds=rounds, seed=seed
    )
    reference = "momentum" if local == "momentum" else optax.scale_by_adam(eps=1e-3)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, see optimizers
        x = reference_fedavg(small_problem, small_data, PLAN, lr, rounds, seed, reference,
                             prox_mu=mu if name == "fedprox" else 0.0)  # fmt: skip
    assert_trees_close(result.state.server.params, x, rtol=1e-4, atol=1e-6)
    plain = sj.Simulation(ALGORITHMS[name].factory(small_problem.loss_fn), small_problem, PLAN,
                          3).run(small_data, hp, num_rounds=rounds, seed=seed)  # fmt: skip
    assert not np.allclose(
        np.asarray(jax.tree.leaves(plain.state.server.params)[0]),
        np.asarray(jax.tree.leaves(result.state.server.params)[0]),
        rtol=1e-3,
    )


def test_a_local_optimizer_starts_fresh_every_round(small_data, small_problem):
    """Nothing is kept on the client: FedAvg with local momentum has no client state."""
    alg = sj.fedavg(small_problem.loss_fn, local_optimizer="momentum")
    server, client = alg.init(small_problem.params)
    assert client == () and isinstance(server, ServerState) and server.opt_state == ()


def test_scaffold_refuses_a_local_optimizer_and_says_why():
    with pytest.raises(ConfigError) as err:
        RunConfig(algorithm="scaffold", options={"local_optimizer": "momentum"}).validate()
    text = str(err.value)
    assert "local_optimizer = 'momentum' does not apply to algorithm = 'scaffold'" in text
    assert "defined for plain SGD local steps" in text
    # Plain SGD, its default, is fine, spelled any way.
    RunConfig(algorithm="scaffold", options={"local_optimizer": "sgd"}).validate()
    with pytest.raises(ConfigError, match="Mime's local steps already apply the base"):
        RunConfig(algorithm="mime", options={"local_optimizer": "adam"}).validate()
    with pytest.raises(TypeError):
        sj.scaffold(lambda p, b: jnp.zeros(()), local_optimizer="momentum")


@pytest.mark.skipif(not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist")
def test_the_command_line_takes_server_and_local_optimizers(tmp_path, capsys):
    tiny = [
        "--dataset", "fashion_mnist", "--max-train-examples", "600", "--max-test-examples",
        "200", "--num-clients", "6", "--clients-per-round", "3", "--rounds", "2",
        "--eval-every", "2", "--quiet",
    ]  # fmt: skip
    out = tmp_path / "fedavgm"
    argv = [
        "run",
        "--algorithm",
        "fedavg",
        "--server-optimizer",
        "fedadam:tau=1e-2",
        "--local-optimizer",
        "momentum",
        "--server-lr",
        "0.1",
        *tiny,
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["options"] == {"server_optimizer": "fedadam:tau=1e-2",
                                 "local_optimizer": "momentum"}  # fmt: skip
    assert RunConfig.from_dict(config).resolved_options() == {
        "server_optimizer": "fedadam:tau=0.01", "local_optimizer": "momentum",
    }  # fmt: skip
    bad = ["run", "--algorithm", "scaffold", "--local-optimizer", "adam", *tiny,
           "--out", str(tmp_path / "bad")]  # fmt: skip
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert "does not apply to algorithm = 'scaffold'" in err and "plain SGD" in err
    assert not (tmp_path / "bad").exists()


def test_a_config_of_feddyn_with_a_server_optimizer_takes_a_server_lr():
    config = RunConfig(algorithm="feddyn", server_lr=0.5,
                       options={"server_optimizer": "momentum"})  # fmt: skip
    config.validate()
    assert float(config.resolved_hparams().server_lr) == 0.5
    with pytest.raises(ValueError, match="feddyn does not take the hyper-parameter"):
        RunConfig(algorithm="feddyn", server_lr=0.5).resolved_hparams()
