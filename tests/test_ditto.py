"""Ditto (Li et al., ICML 2021; docs PERSONAL.md §1): the engine against a per-client float64
loop, the global trajectory of ditto(base) equal to base's bitwise, K_p = 0, λ = 0, and
dropouts (a dropped client keeps its new v_i and its old c_i)."""

import os

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import assert_trees_close, reference_grad

import scaffold_jax as sj
from scaffold_jax import participation, results
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.engine import DROPOUT_STREAM, participation_key
from scaffold_jax.engine.keys import client_keys, extra_batches_key
from scaffold_jax.local import local_sgd
from scaffold_jax.sampling import sample_clients

PLAN = sj.BatchPlan.fixed(batch_size=3, num_steps=4)
SAMPLED = 3


def _sim(problem, base, part=None, chunk=None, **options):
    alg = ALGORITHMS["ditto"].build(problem.loss_fn, ditto_base=base, **options)
    return sj.Simulation(alg, problem, PLAN, SAMPLED, participation=part, client_chunk=chunk)


def _base_sim(problem, base):
    return sj.Simulation(ALGORITHMS[base].build(problem.loss_fn), problem, PLAN, SAMPLED)


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


def _row(table, i):
    return jax.tree.map(lambda a: np.asarray(a)[i], table)


def _x0(problem):
    return jax.tree.map(lambda a: np.asarray(a, np.float32), problem.params)


# ----------------------------------------------------------------------- registry
def test_it_is_registered_with_the_bases_options_and_hyper_parameters():
    spec = ALGORITHMS["ditto"]
    assert spec.display_name == "Ditto" and spec.personalized and not spec.asynchronous
    assert spec.options["ditto_base"].choices == ("fedavg", "fedprox", "scaffold")
    assert {"scaffold_option", "control_dtype", "warm_controls", "server_optimizer",
            "local_optimizer"} <= set(spec.options)  # fmt: skip
    assert list(spec.hparams) == [
        "client_lr", "server_lr", "ditto_lambda", "personal_lr", "personal_steps"
    ]  # fmt: skip
    assert "prox_mu" in spec.hparams_for({"ditto_base": "fedprox"})
    assert spec.hparams["ditto_lambda"].default == 0.1 and spec.hparams["personal_lr"].default == 0
    with pytest.raises(ValueError, match="base 'feddyn' is not supported; use one of fedavg, fedp"):
        sj.algorithms.ditto(lambda p, b: p, base="feddyn")
    with pytest.raises(ValueError, match="scaffold_option = 'I' does not apply to ditto_base = "):
        spec.build(lambda p, b: p, ditto_base="fedavg", scaffold_option="I")
    with pytest.raises(ValueError, match="local_optimizer = 'adam' .* SCAFFOLD's correction"):
        spec.build(lambda p, b: p, ditto_base="scaffold", local_optimizer="adam")
    built = spec.build(lambda p, b: p, ditto_base="scaffold", scaffold_option="I",
                       control_dtype="float32", local_optimizer="sgd")  # fmt: skip
    assert built.name == "ditto" and built.options["base"] == "scaffold"
    assert built.options["option"] == "I" and built.personal is not None


# ----------------------------------------------------------------------- reference loop
def reference_run(problem, data, base, hp, rounds, seed, part=None):
    """Ditto(FedAvg) or Ditto(SCAFFOLD, option II) client by client in float64 numpy,
    uniform weights. Shares with the engine only the documented randomness: the round key
    fold_in(root, r) split into (sampler, clients), the client key fold_in(clients, id),
    the personal batches' key extra_batches_key(client key, 0), the dropouts' key, and
    the batch plan's positions."""
    n = data.num_clients
    lr, glr, lam = float(hp["client_lr"]), float(hp["server_lr"]), float(hp["ditto_lambda"])
    plr = float(hp["personal_lr"]) or lr
    kp = float(hp["personal_steps"])
    x = jax.tree.map(lambda a: np.asarray(a, np.float64), problem.params)
    c = jax.tree.map(np.zeros_like, x)
    c_i = [jax.tree.map(np.zeros_like, x) for _ in range(n)]
    v = [jax.tree.map(np.copy, x) for _ in range(n)]
    counts, root = np.asarray(data.counts), jr.key(seed)

    def sgd(start, key, i, max_steps, step_size, offset):
        """Steps k < max_steps (of those with data) from ``start`` on ``key``'s batches:
        y ← y − step_size (∇f_i(y; b) + offset(y)); returns y and the steps taken."""
        pos, mask = PLAN.positions(key, counts[i], data.max_count)
        pos, mask = np.asarray(pos), np.asarray(mask)
        examples = data.client_examples(int(i))
        y, taken = jax.tree.map(np.copy, start), 0
        for k in range(len(pos)):
            if mask[k].sum() == 0 or k >= max_steps:
                continue
            batch = jax.tree.map(lambda a, k=k: a[pos[k]], examples)
            g = reference_grad(problem.loss_fn, y, batch, mask[k])
            y = jax.tree.map(lambda yy, gg, oo: yy - step_size * (gg + oo), y, g, offset(y))
            taken += 1
        return y, taken

    all_ids, num_dropped = [], 0
    for r in range(rounds):
        round_key = jr.fold_in(root, r)
        sample_key, clients_key = jr.split(round_key)
        ids = np.asarray(sample_clients(sample_key, n, SAMPLED))
        all_ids.append(ids)
        dropped = np.zeros(len(ids), bool)
        if part is not None:
            dropped = np.asarray(
                part.dropouts.dropped(participation_key(round_key, DROPOUT_STREAM), ids)
            )
        num_dropped += int(dropped.sum())
        dys, dcs = [], []
        for j, i in enumerate(ids):
            key = jr.fold_in(clients_key, int(i))
            if base == "scaffold":
                corr = jax.tree.map(lambda cc, ci: cc - ci, c, c_i[i])
                y, taken = sgd(x, key, i, np.inf, lr, lambda _, corr=corr: corr)
            else:
                y, taken = sgd(x, key, i, np.inf, lr, lambda yy: jax.tree.map(np.zeros_like, yy))
            # The personal steps from v_i on batches of their own, pulled to the x received.
            v[i], _ = sgd(v[i], extra_batches_key(key, 0), i, kp, plr,
                          lambda yy: jax.tree.map(lambda a, b: lam * (a - b), yy, x))  # fmt: skip
            if dropped[j]:
                continue  # trained (v_i is new), but its upload is lost: old c_i
            if base == "scaffold":
                new = jax.tree.map(
                    lambda ci, cc, xx, yy: ci - cc + (xx - yy) / (taken * lr), c_i[i], c, x, y
                )
                dcs.append(jax.tree.map(lambda a, b: a - b, new, c_i[i]))
                c_i[i] = new
            dys.append(jax.tree.map(lambda yy, xx: yy - xx, y, x))
        if dys:
            x = jax.tree.map(lambda xx, *d: xx + glr * sum(d) / len(d), x, *dys)
        for dc in dcs:
            c = jax.tree.map(lambda cc, d: cc + d / n, c, dc)
    stack = lambda rows: jax.tree.map(lambda *r: np.stack(r), *rows)  # noqa: E731
    return x, c, stack(c_i), stack(v), np.stack(all_ids), num_dropped


CASES = [  # base, hyper-parameters beyond client_lr = 0.3, dropouts, chunk
    ("fedavg", {"ditto_lambda": 0.5}, None, None),
    ("scaffold", {"ditto_lambda": 2.0, "personal_lr": 0.2, "personal_steps": 2.0,
                  "server_lr": 0.8}, "bernoulli", 2),
]  # fmt: skip


@pytest.mark.parametrize(("base", "extra", "dropouts", "chunk"), CASES)
def test_engine_matches_per_client_reference_loop(
    small_data, small_problem, base, extra, dropouts, chunk
):
    part = None
    if dropouts:
        part = participation.make(dropouts=dropouts, options={"dropout_rate": 0.3})
    sim = _sim(small_problem, base, part, chunk)
    hp = sim.resolve_hparams({"client_lr": 0.3, **extra})
    result = sim.run(small_data, hp, num_rounds=4, seed=5)
    x, c, c_i, v, ids, dropped = reference_run(small_problem, small_data, base, hp, 4, 5, part)
    assert (dropped > 0) == bool(dropouts)  # a dropped client trains, and keeps its v_i
    np.testing.assert_array_equal(result.client_ids, ids)
    assert np.bincount(ids.ravel()).max() >= 2  # some v_i is carried over rounds
    state = result.state
    assert_trees_close(state.server.params, x, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.clients.own, v, rtol=1e-5, atol=1e-6)
    if base == "scaffold":
        assert_trees_close(state.server.control, c, rtol=1e-5, atol=1e-6)
        assert_trees_close(state.clients.shared.control, c_i, rtol=1e-5, atol=1e-6)
    # v_i moved away from x for the sampled clients, and p_i is v_i.
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), state.clients.own,
                         _x0(small_problem))  # fmt: skip
    assert max(jax.tree.leaves(moved)) > 1e-2
    i = int(ids[-1][0])
    p_i = sim.algorithm.personal(hp, state.server, _row(state.clients, i), None)
    assert _leaves_equal(p_i, _row(state.clients.own, i))


# ----------------------------------------------------------------------- identities
@pytest.fixture(scope="module")
def scaffold_runs(small_data, small_problem):
    """SCAFFOLD and Ditto(SCAFFOLD) for several hyper-parameters, 3 rounds, same seed."""
    base = _base_sim(small_problem, "scaffold").run(
        small_data, sj.hparams(client_lr=0.3), num_rounds=3, seed=2
    )
    sim = _sim(small_problem, "scaffold")
    runs = {
        name: sim.run(small_data, {"client_lr": 0.3, **extra}, num_rounds=3, seed=2)
        for name, extra in {
            "lambda 0": {"ditto_lambda": 0.0},
            "lambda 3": {"ditto_lambda": 3.0, "personal_lr": 0.05},
            "no steps": {"ditto_lambda": 1.0, "personal_steps": 0.0},
        }.items()
    }
    return base, runs


def test_the_global_trajectory_is_the_bases_bitwise_for_any_lambda(scaffold_runs):
    base, runs = scaffold_runs
    for run in runs.values():
        np.testing.assert_array_equal(run.client_ids, base.client_ids)
        assert _leaves_equal(run.state.server, base.state.server)  # x, c, optimizer state
        assert _leaves_equal(run.state.clients.shared, base.state.clients)  # every c_i
    assert not _leaves_equal(runs["lambda 0"].state.clients.own, runs["lambda 3"].state.clients.own)


def test_with_no_personal_steps_every_v_i_stays_x0(scaffold_runs, small_problem):
    _, runs = scaffold_runs
    own = runs["no steps"].state.clients.own
    x0 = _x0(small_problem)
    for i in range(jax.tree.leaves(own)[0].shape[0]):
        assert _leaves_equal(_row(own, i), x0)


def test_with_lambda_zero_v_i_is_plain_local_sgd_on_the_rounds_it_was_sampled(
    scaffold_runs, small_data, small_problem
):
    _, runs = scaffold_runs
    run = runs["lambda 0"]
    v = [_x0(small_problem) for _ in range(small_data.num_clients)]
    root = jr.key(2)
    for r, ids in enumerate(np.asarray(run.client_ids)):
        keys = client_keys(jr.fold_in(root, r), jnp.asarray(ids))
        for i, key in zip(ids, keys, strict=True):
            batches, mask = small_data.client_batches(jnp.int32(i), extra_batches_key(key, 0), PLAN)
            v[i], _ = local_sgd(small_problem.loss_fn, v[i], batches, mask, jnp.float32(0.3))
    table = jax.tree.map(lambda *r: np.stack(r), *v)
    assert_trees_close(run.state.clients.own, table, rtol=1e-6, atol=1e-7)
    never = set(range(small_data.num_clients)) - set(np.asarray(run.client_ids).ravel())
    for i in never:  # not sampled: still x0
        assert _leaves_equal(_row(run.state.clients.own, i), _x0(small_problem))


def test_a_dropped_client_keeps_its_new_v_i_and_its_old_c_i(small_data, small_problem):
    part = participation.make(dropouts="bernoulli", options={"dropout_rate": 0.5})
    # A seed whose first round has a dropped and a reporting client (host-side draws).
    for seed in range(50):
        round_key = jr.fold_in(jr.key(seed), 0)
        ids = np.asarray(sample_clients(jr.split(round_key)[0], small_data.num_clients, SAMPLED))
        dropped = np.asarray(part.dropouts.dropped(participation_key(round_key, DROPOUT_STREAM),
                                                   jnp.asarray(ids)))  # fmt: skip
        if 0 < dropped.sum() < SAMPLED:
            break
    result = _sim(small_problem, "scaffold", part).run(
        small_data, {"client_lr": 0.3}, num_rounds=1, seed=seed
    )
    np.testing.assert_array_equal(result.client_ids[0], ids)
    x0, clients = _x0(small_problem), result.state.clients
    zero = jax.tree.map(np.zeros_like, x0)
    for i in range(small_data.num_clients):
        sampled = i in ids
        reported = sampled and not dropped[list(ids).index(i)]
        assert _leaves_equal(_row(clients.own, i), x0) == (not sampled)
        assert _leaves_equal(_row(clients.shared.control, i), zero) == (not reported)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("base", "options"),
    [("fedprox", {}), ("scaffold", {"warm_controls": True, "scaffold_option": "I"}),
     ("fedavg", {"server_optimizer": "adam", "local_optimizer": "momentum"})],
)  # fmt: skip
def test_every_base_keeps_its_trajectory_bitwise(small_data, small_problem, base, options):
    """FedProx's μ, SCAFFOLD's warm start (its pass sees only c_i), optimizers."""
    spec = ALGORITHMS[base]
    alg = spec.build(small_problem.loss_fn, **options)
    theirs = sj.Simulation(alg, small_problem, PLAN, SAMPLED).run(
        small_data, {"client_lr": 0.3}, num_rounds=3, seed=4
    )
    mine = _sim(small_problem, base, **options).run(
        small_data, {"client_lr": 0.3, "ditto_lambda": 0.7}, num_rounds=3, seed=4
    )
    assert _leaves_equal(mine.state.server, theirs.state.server)
    assert _leaves_equal(mine.state.clients.shared, theirs.state.clients)


#: A pooled dataset split with each client's held-out test data (personal evaluation).
DATA = ["--dataset", "fashion_mnist", "--max-train-examples", "400", "--max-test-examples", "100",
        "--model", "logreg", "--num-clients", "8", "--clients-per-round", "3",
        "--local-test-fraction", "0.25"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/usr/share/datasets/fashion-mnist"),
                    reason="needs Debian's dataset-fashion-mnist (CI installs it)")  # fmt: skip
def test_the_command_line_runs_resumes_and_sweeps_it(tmp_path):
    """Options and hyper-parameters from flags (the base's too), a resume to the same
    state (v_i checkpointed), and a sweep over λ."""
    from conftest import run_folder_final_state

    from scaffold_jax.cli import main

    out = tmp_path / "run"
    argv = ["run", "--algorithm", "ditto", "--ditto-base", "fedprox", "--prox-mu", "0.5",
            "--ditto-lambda", "0.3", "--personal-steps", "2", *DATA, "--eval-every", "2",
            "--checkpoint-every", "2", "--out", str(out), "--quiet"]  # fmt: skip
    assert main([*argv, "--rounds", "4"]) == 0
    whole = run_folder_final_state(out, 4)
    last = results.read_records(out)[-1]
    assert 0 <= last["personal_accuracy_mean"] <= 1 and "local_accuracy_mean" in last
    assert main([*argv, "--rounds", "2", "--out", str(tmp_path / "half")]) == 0
    resumed = [*argv[:-3], "--out", str(tmp_path / "half"), "--quiet", "--rounds", "4"]
    assert main([*resumed, "--resume"]) == 0
    again = run_folder_final_state(tmp_path / "half", 4)
    assert all(np.array_equal(a, b) for a, b in zip(whole, again, strict=True))
    sweep = ["sweep", "--algorithms", "ditto", "--grid", "ditto_lambda=0,1", *DATA, "--rounds",
             "2", "--out", str(tmp_path / "sweep"), "--quiet"]  # fmt: skip
    assert main(sweep) == 0
