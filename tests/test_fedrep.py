"""FedRep and FedPer (scaffold_jax.algorithms.fedrep): the engine against a plain float64
per-client loop (a 2-layer MLP written out in numpy, its body the hidden layer, its head
the output layer), the identities of PERSONAL.md §2, the head option and its refusals,
and the bytes: φ down, Δφ up, compressed or private."""

import math
import os

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import assert_trees_close

import scaffold_jax as sj
from scaffold_jax import participation
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.algorithms.fedrep import head_paths
from scaffold_jax.compression import compressed
from scaffold_jax.engine import DROPOUT_STREAM, communication, participation_key
from scaffold_jax.engine.keys import extra_batches_key
from scaffold_jax.sampling import sample_clients
from scaffold_jax.tree import tree_bytes

PLAN = sj.BatchPlan.epochs(batch_size=3, num_epochs=1)  # 1..5 steps per client, padded
HIDDEN = 4


@pytest.fixture(scope="module")
def mlp():
    return sj.models.mlp((5,), 3, hidden_sizes=(HIDDEN,), key=jr.key(1))


def _sim(name, problem, part=None, chunk=None, sampled=3, **options):
    alg = ALGORITHMS[name].build(problem.loss_fn, **options)
    return sj.Simulation(alg, problem, PLAN, sampled, participation=part, client_chunk=chunk)


def _np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# ----------------------------------------------------------------------- reference loop
def mlp_grad(p, x, y, mask):
    """The gradient of the masked mean cross-entropy of logits W2 relu(W1 x + b1) + b2
    (kernels [out, in]), by hand in float64."""
    pre = x @ p["hidden_0"]["kernel"].T + p["hidden_0"]["bias"]
    h = np.maximum(pre, 0.0)
    z = h @ p["output"]["kernel"].T + p["output"]["bias"]
    prob = np.exp(z - z.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    dz = (prob - np.eye(z.shape[1])[y]) * (mask / max(mask.sum(), 1.0))[:, None]
    dh = (dz @ p["output"]["kernel"]) * (pre > 0)
    return {"hidden_0": {"kernel": dh.T @ x, "bias": dh.sum(0)},
            "output": {"kernel": dz.T @ h, "bias": dz.sum(0)}}  # fmt: skip


def reference(name, params, data, rounds, seed, lr, sampled=3, head_steps=math.inf,
              head_lr=None, server_lr=1.0, dropouts=None):  # fmt: skip
    """FedRep / FedPer client by client: x = (body, h⁰) and every client's head h_i as
    float64 numpy. Shared with the engine only the documented randomness: the round key
    fold_in(root, r) split into (sampler, clients), client key fold_in(clients, id), the
    head steps' batches from extra_batches_key(client key, 0), the plan's positions, and
    the dropout model's draws."""
    x, n, counts = _np(params), data.num_clients, np.asarray(data.counts)
    heads = [dict(x["output"]) for _ in range(n)]
    root, ids_all, dropped_all = jr.key(seed), [], []
    for r in range(rounds):
        round_key = jr.fold_in(root, r)
        sample_key, clients_key = jr.split(round_key)
        ids = np.asarray(sample_clients(sample_key, n, sampled))
        dropped = np.zeros(len(ids), bool)
        if dropouts is not None:
            dropped = np.asarray(
                dropouts.dropped(participation_key(round_key, DROPOUT_STREAM), ids)
            )
        ids_all.append(ids), dropped_all.append(dropped)
        deltas = []
        for i, lost in zip(ids, dropped, strict=True):
            key, examples = jr.fold_in(clients_key, int(i)), data.client_examples(int(i))
            p = {"hidden_0": dict(x["hidden_0"]), "output": dict(heads[i])}

            def steps(key, parts, rate, limit=math.inf, i=i, examples=examples, p=p):
                pos, mask = (np.asarray(a) for a in PLAN.positions(key, counts[i], data.max_count))
                for k in range(len(pos)):
                    if k >= limit or mask[k].sum() == 0:
                        continue
                    g = mlp_grad(p, examples["x"][pos[k]].astype(np.float64),
                                 examples["y"][pos[k]], mask[k])  # fmt: skip
                    for part in parts:
                        p[part] = {w: p[part][w] - rate * g[part][w] for w in p[part]}

            if name == "fedrep":
                steps(extra_batches_key(key, 0), ["output"], head_lr or lr, head_steps)
                steps(key, ["hidden_0"], lr)
            else:
                steps(key, ["hidden_0", "output"], lr)
            heads[i] = p["output"]  # kept by a client that drops after training too
            if not lost:
                deltas.append({w: p["hidden_0"][w] - x["hidden_0"][w] for w in p["hidden_0"]})
        if deltas:
            x["hidden_0"] = {w: x["hidden_0"][w] + server_lr * np.mean([d[w] for d in deltas], 0)
                             for w in x["hidden_0"]}  # fmt: skip
    return x, heads, np.stack(ids_all), np.stack(dropped_all)


CASES = [  # name, head_steps, head_lr, dropouts, client_chunk
    ("fedrep", 2, 0.5, "bernoulli", 2),
    ("fedper", None, None, "bernoulli", None),
    pytest.param("fedrep", None, None, "none", None, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("name", "head_steps", "head_lr", "dropouts", "chunk"), CASES)
def test_engine_matches_the_per_client_reference_loop(
    name, head_steps, head_lr, dropouts, chunk, small_data, mlp
):
    part = participation.make(dropouts=dropouts, options={"dropout_rate": 0.4})
    sim = _sim(name, mlp, part, chunk)
    hp = {"client_lr": 0.3, "server_lr": 0.8}
    if head_steps is not None:
        hp.update(head_steps=head_steps, head_lr=head_lr)
    result = sim.run(small_data, hp, num_rounds=5, seed=4)
    x, heads, ids, dropped = reference(
        name, mlp.params, small_data, 5, 4, 0.3, head_steps=head_steps or math.inf,
        head_lr=head_lr, server_lr=0.8, dropouts=part.dropouts,
    )  # fmt: skip
    np.testing.assert_array_equal(result.client_ids, ids)
    if dropouts != "none":  # someone trained, dropped and kept the head it trained
        np.testing.assert_array_equal(~np.asarray(result.reported), dropped)
        assert dropped.any()
    assert_trees_close(result.state.server.params, x, rtol=1e-5, atol=1e-6)
    own = result.state.clients.own
    assert set(own) == {"output/bias", "output/kernel"}
    for i in range(small_data.num_clients):
        for w in ("bias", "kernel"):
            np.testing.assert_allclose(own[f"output/{w}"][i], heads[i][w], rtol=1e-5, atol=1e-6)
        row = jax.tree.map(lambda a, i=i: a[i], result.state.clients)
        p_i = sim.algorithm.personal(sim.resolve_hparams(hp), result.state.server, row, None)
        assert_trees_close(p_i, {"hidden_0": x["hidden_0"], "output": heads[i]}, 1e-5, 1e-6)
    untouched = [i for i in range(small_data.num_clients) if i not in ids]
    moved = [i for i in set(ids.ravel().tolist())]
    for i in untouched:  # never sampled: h_i = h⁰
        np.testing.assert_array_equal(own["output/kernel"][i], mlp.params["output"]["kernel"])
    assert all(np.abs(heads[i]["kernel"] - x["output"]["kernel"]).max() > 1e-4 for i in moved)
    assert np.abs(x["hidden_0"]["kernel"] - mlp.params["hidden_0"]["kernel"]).max() > 1e-3


# ----------------------------------------------------------------------- identities
def test_fedper_whose_head_is_every_leaf_never_changes_x(small_data, small_problem):
    sim = _sim("fedper", small_problem, head="linear")
    result = sim.run(small_data, {"client_lr": 0.3}, num_rounds=3, seed=1)
    for a, b in zip(jax.tree.leaves(result.state.server.params),
                    jax.tree.leaves(small_problem.params), strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    assert communication.traffic(sim.algorithm, small_problem.params)[:2] == (0, 0)
    kernels = np.asarray(result.state.clients.own["linear/kernel"])
    assert np.abs(kernels - np.asarray(small_problem.params["linear"]["kernel"])).max() > 1e-3


def test_fedrep_without_head_steps_is_fedper_with_the_head_frozen_at_h0(small_data, mlp):
    def frozen_head_loss(params, batch):  # FedPer's joint steps, the head's gradient stopped
        return mlp.loss_fn({**params, "output": jax.lax.stop_gradient(params["output"])}, batch)

    hp = {"client_lr": 0.3, "server_lr": 0.8}
    rep = _sim("fedrep", mlp).run(small_data, {**hp, "head_steps": 0}, num_rounds=4, seed=2)
    per = _sim("fedper", mlp._replace(loss_fn=frozen_head_loss)).run(
        small_data, hp, num_rounds=4, seed=2
    )
    assert_trees_close(rep.state.server.params, per.state.server.params, rtol=1e-6, atol=1e-7)
    h0 = {f"output/{w}": np.broadcast_to(a, (7, *a.shape)) for w, a in mlp.params["output"].items()}
    for table in (rep.state.clients.own, per.state.clients.own):
        for k, a in table.items():
            np.testing.assert_array_equal(a, h0[k])
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(),
                                         rep.state.server.params, mlp.params))  # fmt: skip
    assert max(moved) > 1e-3


# ----------------------------------------------------------------------- the head option
def test_the_default_head_is_the_classifiers_last_layer(mlp, small_problem):
    assert head_paths(mlp.params) == {"output/bias", "output/kernel"}
    assert head_paths(small_problem.params) == {"linear/bias", "linear/kernel"}
    # ResNet-18's params: "output" is not last in flatten order ("stem_norm" is).
    resnet = {"stem": {"kernel": 0}, "output": {"bias": 0, "kernel": 0}, "stem_norm": {"scale": 0}}
    assert head_paths(resnet) == {"output/bias", "output/kernel"}
    assert head_paths({"conv": {"w": 0}, "logits": {"w": 0}}) == {"logits/w"}
    assert head_paths(mlp.params, "output/kernel, hidden_0/bias") == {
        "output/kernel", "hidden_0/bias"}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "head", "why"),
    [
        ("fedrep", "out", "out names no leaf"),
        ("fedper", "output,hidden_1", "hidden_1 names no leaf"),
        ("fedrep", "output,hidden_0", "it covers every leaf"),
        ("fedrep", " , ", "it names no leaf"),
    ],
)
def test_a_head_naming_no_leaf_or_all_of_fedreps_is_refused(name, head, why, small_data, mlp):
    with pytest.raises(ValueError, match=f"{why}.*leaves are hidden_0/bias, hidden_0/kernel, out"):
        _sim(name, mlp, head=head).init(small_data)


def test_they_are_registered_as_personalized_and_synchronous():
    rep, per = ALGORITHMS["fedrep"], ALGORITHMS["fedper"]
    assert (rep.display_name, per.display_name) == ("FedRep", "FedPer")
    assert list(rep.hparams) == ["client_lr", "server_lr", "head_steps", "head_lr"]
    assert list(per.hparams) == ["client_lr", "server_lr"]
    assert rep.hparams["head_steps"].default == 2**24 and rep.hparams["head_lr"].default == 0
    assert not rep.asynchronous and not per.asynchronous
    assert rep.personalized and per.personalized
    alg = rep.build(lambda p, b: jnp.zeros(()))
    assert alg.personal is not None and alg.personal.global_model is False


# ----------------------------------------------------------------------- bytes
@pytest.mark.parametrize("name", ["fedrep", "fedper"])
def test_bytes_are_the_bodys_down_and_up(name, small_data, mlp):
    body = tree_bytes(mlp.params["hidden_0"])
    sim = _sim(name, mlp)
    traffic = communication.traffic(sim.algorithm, mlp.params)
    assert (traffic.down, traffic.up, traffic.pre_round) == (body, body, 0)
    assert body == 4 * HIDDEN * (5 + 1) < tree_bytes(mlp.params)
    result = sim.run(small_data, {"client_lr": 0.3}, num_rounds=2, seed=0)
    assert (
        result.records[-1]["bytes_up_total"] == result.records[-1]["bytes_down_total"] == 6 * body
    )


@pytest.mark.slow
def test_compression_and_privacy_work_on_the_body_alone(small_data, mlp):
    rep = ALGORITHMS["fedrep"].build(mlp.loss_fn)
    topk = compressed(rep, "topk")
    k = math.ceil(0.5 * HIDDEN * 5) + math.ceil(0.5 * HIDDEN)  # fraction 0.5 of each leaf
    bits = {"compress_fraction": 0.5}
    sizes = [math.ceil(n * (32 + math.ceil(math.log2(s))) / 8)
             for n, s in ((10, HIDDEN * 5), (2, HIDDEN))]  # fmt: skip
    assert k == 12 and communication.traffic(topk, mlp.params, bits).up == sum(sizes)
    sim = sj.Simulation(topk, mlp, PLAN, 3)
    result = sim.run(small_data, {"client_lr": 0.3, **bits}, num_rounds=2, seed=0)
    residual = result.state.messages  # the error feedback's residual: the body's shapes only
    assert {a.shape[1:] for a in jax.tree.leaves(residual)} == {(HIDDEN, 5), (HIDDEN,)}
    private = sj.privacy.private(rep)
    assert communication.traffic(private, mlp.params).up == tree_bytes(mlp.params["hidden_0"])
    sim = sj.Simulation(private, mlp, PLAN, 3)
    hp = {"client_lr": 0.3, "dp_noise_multiplier": 0.0, "dp_clip": 1e-3}
    result = sim.run(small_data, hp, num_rounds=2, seed=0)
    moved = np.abs(np.asarray(result.state.server.inner.params["hidden_0"]["kernel"])
                   - np.asarray(mlp.params["hidden_0"]["kernel"])).max()  # fmt: skip
    assert 0 < moved <= 2e-3 + 1e-6  # two rounds of a mean Δφ clipped to 1e-3
    row = jax.tree.map(lambda a: a[0], result.state.clients)
    p = private.personal(sim.resolve_hparams(hp), result.state.server, row, None)
    assert_trees_close(p["hidden_0"], result.state.server.inner.params["hidden_0"], 0, 0)
    assert private.personal.global_model is False


# ----------------------------------------------------------------------- command line
FASHION = "/usr/share/datasets/fashion-mnist"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist")
def test_the_command_line_runs_resumes_and_sweeps_them(tmp_path):
    """Options and hyper-parameters from flags, a resume to the same state (h_i
    checkpointed), a sweep over τ_h, and no local_* records (the server has no head)."""
    from conftest import run_folder_final_state

    from scaffold_jax.cli import main

    data = ["--dataset", "fashion_mnist", "--max-train-examples", "400", "--max-test-examples",
            "100", "--model", "mlp", "--hidden-sizes", "8", "--num-clients", "8",
            "--clients-per-round", "3", "--local-test-fraction", "0.25"]  # fmt: skip
    out = tmp_path / "run"
    argv = ["run", "--algorithm", "fedrep", "--head", "output", "--head-steps", "2",
            "--head-lr", "0.05", *data, "--eval-every", "2", "--checkpoint-every", "2",
            "--out", str(out), "--quiet"]  # fmt: skip
    assert main([*argv, "--rounds", "4"]) == 0
    whole = run_folder_final_state(out, 4)
    last = sj.results.read_records(out)[-1]
    assert 0 <= last["personal_accuracy_mean"] <= 1 and "local_accuracy_mean" not in last
    assert main([*argv, "--rounds", "2", "--out", str(tmp_path / "half")]) == 0
    resumed = [*argv[:-3], "--out", str(tmp_path / "half"), "--quiet", "--rounds", "4"]
    assert main([*resumed, "--resume"]) == 0
    again = run_folder_final_state(tmp_path / "half", 4)
    assert all(np.array_equal(a, b) for a, b in zip(whole, again, strict=True))
    sweep = ["sweep", "--algorithms", "fedrep", "--grid", "head_steps=0,3", *data,
             "--rounds", "2", "--out", str(tmp_path / "sweep"), "--quiet"]  # fmt: skip
    assert main(sweep) == 0
