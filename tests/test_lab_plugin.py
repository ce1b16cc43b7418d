"""Every vocabulary is open: a plugin file outside the package (tests/plugins/lab.py) adds
a model with an option (dropout rate), a partitioner with a parameter (log-normal client
sizes), a pooled dataset with its own loader (an .npz file) and a client sampler; each
runs from the Python API, `scaffold-jax run`, `sweep --grid` over its own option and
`reproduce table3 --plugin`, and none of them needs a RunConfig field."""

import csv
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaffold_jax import experiments, paper, sampling
from scaffold_jax.cli import main
from scaffold_jax.data import partition
from scaffold_jax.experiments import ConfigError, RunConfig
from scaffold_jax.registry import load_plugins

LAB = str(Path(__file__).parent / "plugins" / "lab.py")
DAMPED = str(Path(__file__).parent / "plugins" / "damped_fedavg.py")
FASHION = "/usr/share/datasets/fashion-mnist"


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("blobs")
    lab = load_plugins([LAB])
    import sys

    sys.modules[lab[0]].write_blobs(folder)
    return folder


@pytest.fixture
def lab():
    import sys

    (name,) = load_plugins([LAB])
    return sys.modules[name]


def _config(blobs, **changes):
    values = dict(
        plugins=[LAB], dataset="blobs_npz", data_dir=str(blobs), model="dropout_mlp",
        num_clients=12, clients_per_round=4, rounds=6, eval_every=3, client_lr=0.3,
        algorithm="fedavg", local_steps=3, batch_size=8, targets=[0.5],
    )  # fmt: skip
    return RunConfig(**{**values, **changes})


def test_the_plugin_options_are_config_keys_but_no_fields(blobs, lab):
    declared = experiments.declared_options()
    for name in ("dropout_rate", "width", "size_sigma", "feature_scale", "cyclic_stride"):
        assert name in declared and name not in RunConfig.field_names(), name
    config = _config(blobs, dropout_rate=0.25, size_sigma=2.0).validate()
    assert config.options == {
        "dropout_rate": 0.25, "size_sigma": 2.0, "local_steps": 3, "batch_size": 8
    }  # fmt: skip
    assert config.resolved("model") == {"dropout_rate": 0.25, "width": 16}
    assert config.resolved_partition() == ("lognormal", {"sigma": 2.0})
    with pytest.raises(ConfigError, match=r"dropout_rate = 1.5 is invalid: it must be a number"):
        _config(blobs, dropout_rate=1.5).validate()
    # Another model's option at a non-default value is refused, naming the owner.
    with pytest.raises(ConfigError, match="dropout_rate = 0.5 does not apply to model = 'mlp'"):
        _config(blobs, model="mlp", dropout_rate=0.5).validate()
    with pytest.raises(ConfigError, match="cyclic_stride = 0 is invalid"):
        _config(blobs, sampler="cyclic", cyclic_stride=0).validate()


def test_each_entry_builds_what_its_options_say(blobs, lab):
    config = _config(
        blobs, dropout_rate=0.5, width=7, size_sigma=1.5, feature_scale=2.0, partition_seed=3
    )
    built = experiments.build(config)
    # The loader's own option scaled the features it read.
    raw = np.load(Path(blobs) / lab.BLOBS_FILE)
    np.testing.assert_allclose(built.dataset.train["x"], raw["x_train"] * 2.0)
    # The partitioner's parameter reached the split: the sizes are iid_split's log-normal ones.
    direct = partition.iid_split(len(raw["y_train"]), 12, 3, sizes="lognormal", sigma=1.5)
    assert np.asarray(built.data.counts).tolist() == [len(ix) for ix in direct]
    assert built.info["partition"] == {"kind": "lognormal", "sigma": 1.5}
    # The model's options: its width, and dropout that changes the training loss.
    assert built.problem.params["Dense_0"]["kernel"].shape == (6, 7)  # flax: [in, out]
    batch = {"x": jnp.asarray(raw["x_test"][:32]), "y": jnp.asarray(raw["y_test"][:32])}
    loss = built.problem.loss_fn
    assert not np.allclose(
        loss(built.problem.params, batch, key=jax.random.key(1)),
        loss(built.problem.params, batch),
    )
    no_dropout = experiments.build(config.replace(dropout_rate=0.0)).problem
    np.testing.assert_allclose(
        no_dropout.loss_fn(no_dropout.params, batch, key=jax.random.key(1)),
        no_dropout.loss_fn(no_dropout.params, batch),
        rtol=1e-6,
    )


def test_the_sampler_chooses_the_rounds_clients(blobs, lab):
    sampler = sampling.make("cyclic", {"cyclic_stride": 1})
    built = experiments.build(_config(blobs))
    sim = built.simulation.replace(sampler=sampler)
    state = sim.init(built.data)
    seen = []
    for _ in range(4):
        state, metrics = sim.round(built.hparams, state, built.data, jax.random.key(0))
        seen.append(np.asarray(metrics["client_ids"]).tolist())
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]]
    # A sampler whose ids repeat is refused before anything is compiled.
    bad = sampling.make("cyclic", {"cyclic_stride": 6})
    with pytest.raises(ValueError, match="DISTINCT ids"):
        sim.replace(sampler=bad).init(built.data)


@pytest.mark.slow  # command-line runs: ~4 s (the extending page's run stays quick)
def test_the_command_line_runs_every_plugin_entry(blobs, tmp_path):
    out = tmp_path / "run"
    argv = [
        "run", "--plugin", LAB, "--dataset", "blobs_npz", "--data-dir", str(blobs),
        "--model", "dropout_mlp", "--dropout-rate", "0.2", "--width", "8",
        "--partition", "lognormal", "--size-sigma", "1.0", "--feature-scale", "0.5",
        "--sampler", "cyclic", "--algorithm", "fedavg", "--client-lr", "0.3",
        "--num-clients", "12", "--clients-per-round", "4", "--local-steps", "3",
        "--batch-size", "8", "--rounds", "12", "--eval-every", "6", "--targets", "0.5",
        "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["sampler"] == "cyclic"
    assert config["options"] == {
        "dropout_rate": 0.2, "width": 8, "size_sigma": 1.0, "feature_scale": 0.5,
        "local_steps": 3, "batch_size": 8,
    }  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["round"] == 12 and records[-1]["test_accuracy"] > 0.6
    # The folder resumes with the same plugin options, and refuses other ones.
    assert main([*argv[:-3], "--rounds", "12", "--out", str(out), "--quiet", "--resume"]) == 0
    changed = [a if a != "0.2" else "0.3" for a in argv]
    assert main([*changed, "--resume"]) == 2


@pytest.mark.slow
def test_a_sweep_grids_over_a_plugin_models_option(blobs, tmp_path):
    out = tmp_path / "sweep"
    argv = [
        "sweep", "--plugin", LAB, "--dataset", "blobs_npz", "--data-dir", str(blobs),
        "--model", "dropout_mlp", "--algorithms", "fedavg", "--grid", "dropout_rate=0,0.5",
        "--grid", "size_sigma=0.5,2", "--lr-grid", "0.1", "0.3", "--num-clients", "12",
        "--clients-per-round", "4", "--local-steps", "2", "--batch-size", "8",
        "--rounds", "4", "--eval-every", "2", "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    settings = {(float(r["dropout_rate"]), float(r["size_sigma"])) for r in rows}
    assert settings == {(0.0, 0.5), (0.0, 2.0), (0.5, 0.5), (0.5, 2.0)}


def test_natural_datasets_are_unaffected_by_the_plugin(lab):
    config = RunConfig(dataset="shakespeare", model="char_lstm", num_clients=3).validate()
    assert config.resolved("dataset") == {"min_client_examples": 1}
    assert config.chosen()[-1][0] == "dataset"  # no partitioner for natural data
    with pytest.raises(ConfigError, match="size_sigma cannot be set with dataset = 'shakespeare'"):
        config.replace(size_sigma=2.0).validate()


@pytest.mark.slow  # a real table (~16 s); plugins from the command line: test_doc_blocks
@pytest.mark.skipif(not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist")
def test_reproduce_takes_plugins_for_its_extra_methods(tmp_path):
    out = tmp_path / "table3"
    argv = [
        "reproduce", "table3", "--quick", "--plugin", DAMPED, "--rounds", "2",
        "--set", 'extra_methods=["damped_fedavg"]', "--set", "max_train_examples=1500",
        "--set", "max_test_examples=300", "--set", 'lr_grids={"damped_fedavg": [1.0]}',
        "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    methods = {cell["method"] for cell in summary["cells"]}
    assert methods == {"sgd", "scaffold", "fedavg", "fedprox", "damped_fedavg"}


def test_an_extra_method_without_a_grid_names_the_fix():
    """A plugin algorithm has no default η_l grid: the error gives the --set that adds one,
    and that --set is then enough."""
    load_plugins([DAMPED])
    protocol = paper.table3_protocol(quick=True, extra_methods=["damped_fedavg"])
    with pytest.raises(ValueError) as err:
        protocol.validate()
    fix = "--set 'lr_grids={\"damped_fedavg\":[0.03,0.1,0.3]}'"
    assert "lr_grids has no step sizes for method 'damped_fedavg'" in str(err.value)
    assert fix in str(err.value)
    grids = {"damped_fedavg": [0.03, 0.1, 0.3]}
    fixed = paper.table3_protocol(quick=True, extra_methods=["damped_fedavg"], lr_grids=grids)
    assert fixed.validate().lr_grid("damped_fedavg") == (0.03, 0.1, 0.3)


def test_an_api_resume_with_another_sampler_is_refused(blobs, lab, tmp_path):
    """The run identity names a sampler other than the paper's uniform one, with its
    options: a checkpoint of a cyclic run does not resume under another stride."""
    built = experiments.build(_config(blobs))
    sim = built.simulation.replace(sampler=sampling.make("cyclic", {"cyclic_stride": 1}))
    args = dict(num_rounds=2, eval_every=2, checkpoint_dir=tmp_path / "ckpt")
    sim.run(built.data, built.hparams, **args)
    other = sim.replace(sampler=sampling.make("cyclic", {"cyclic_stride": 5}))
    with pytest.raises(ValueError, match=r"sampler: .*cyclic\(stride=1\).* in the checkpoint"):
        other.run(built.data, built.hparams, resume=True, **args)
    resumed = sim.run(built.data, built.hparams, resume=True, **{**args, "num_rounds": 3})
    assert resumed.records[-1]["round"] == 3


def test_a_weighting_with_an_option_weighs_the_round_and_the_objective(blobs, lab):
    """A plugin weighting (p_i = min(n_i, cap)) from the config: with the cap above every
    client's size it IS num_examples, with cap 1 it is uniform (rounds and train_loss)."""
    config = _config(blobs, partition="lognormal", size_sigma=1.0, clients_per_round=12)
    built = experiments.build(config)
    counts = np.asarray(built.data.counts)
    assert counts.min() > 1 and len(set(counts.tolist())) > 1  # unequal clients

    def run(name, **options):
        sim = experiments.build(config.replace(weighting=name, **options)).simulation
        assert sim.weighting == name and sim.weighting_options == {
            k: float(v) for k, v in options.items()
        }
        return sim.run(built.data, built.hparams, 3, eval_every=3, seed=1)

    examples, uniform = run("num_examples"), run("uniform")
    for other, cap in ((examples, float(counts.max())), (uniform, 1.0)):
        capped = run("capped_examples", weight_cap=cap)
        for name in ("test_loss", "train_loss"):
            assert capped.final(name) == pytest.approx(other.final(name), rel=1e-5)
        np.testing.assert_allclose(
            jax.tree.leaves(capped.state.server)[0], jax.tree.leaves(other.state.server)[0],
            rtol=1e-5, atol=1e-6,
        )  # fmt: skip
    # In between it is neither (the weights differ where clients exceed the cap).
    middle = run("capped_examples", weight_cap=float(np.median(counts)))
    assert middle.final("train_loss") != pytest.approx(examples.final("train_loss"), rel=1e-6)
    assert middle.final("train_loss") != pytest.approx(uniform.final("train_loss"), rel=1e-6)
    # An option of a weighting the config does not choose is refused.
    with pytest.raises(ConfigError, match="weight_cap = 3.0 does not apply to weighting"):
        config.replace(weight_cap=3.0).validate()


@pytest.mark.slow  # sweeps resumed from the command line: ~6 s
def test_a_sweep_resumes_only_onto_its_own_data(lab, tmp_path, capsys):
    """A finished sweep resumed with more rounds continues every cell from its
    checkpoints (each round once in the records); resumed after its data changed in place
    under the same --data-dir, it is refused and the folder is left as it was."""
    data = tmp_path / "blobs"
    data.mkdir()
    lab.write_blobs(data)
    out = tmp_path / "sweep"
    argv = [
        "sweep", "--plugin", LAB, "--dataset", "blobs_npz", "--data-dir", str(data),
        "--model", "dropout_mlp", "--algorithms", "fedavg", "sgd", "--lr-grid", "0.1", "0.3",
        "--num-clients", "8", "--clients-per-round", "4", "--eval-every", "2",
        "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert main([*argv, "--rounds", "4"]) == 0
    assert main([*argv, "--rounds", "6", "--resume"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = {}
    for r in records:
        rounds.setdefault(r["series"], []).append(r["round"])
    assert len(rounds) == 4 and all(v == [0, 2, 4, 6] for v in rounds.values()), rounds
    summary = (out / "summary.json").read_bytes()
    lab.write_blobs(data, seed=1)  # other data, same folder and flags
    capsys.readouterr()
    assert main([*argv, "--rounds", "6", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "holds a finished cell 'fedavg' of another run" in err and "data_fingerprint" in err
    assert (out / "summary.json").read_bytes() == summary
