"""RunConfig validation and resolution, config files, step-size selection, the η_l grid
runner (sweep vs loop), and run()/reproduce_table() end to end on an in-memory dataset."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from scaffold_jax import experiments, paper, results
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.data import sources
from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.experiments import CellResult, ConfigError, RunConfig
from scaffold_jax.loop import DivergenceError


def toy_dataset(n_train=600, n_test=200, num_classes=4, seed=0):
    """Learnable 8x8 uint8 "images" (each class lights up its own rows), noisy labels."""
    rng = np.random.default_rng(seed)

    def split(n):
        y = rng.integers(0, num_classes, n).astype(np.int32)
        x = rng.integers(0, 60, (n, 8, 8))
        for k in range(num_classes):
            x[y == k, 2 * k : 2 * k + 2, :] += 150
        # 25% label noise: no model gets near 100% accuracy.
        noisy = rng.random(n) < 0.25
        y[noisy] = rng.integers(0, num_classes, int(noisy.sum()))
        return {"x": x.astype(np.uint8), "y": y}

    return sources.Dataset("toy", "memory", split(n_train), split(n_test), num_classes)


# ----------------------------------------------------------------------------- RunConfig
def test_the_default_config_is_the_papers_setting():
    config = RunConfig().validate()
    assert config.resolved_plan() == BatchPlan.fraction_of_data(0.2, 1)
    assert config.resolved_partition() == ("similarity", {"similarity": 0.0})
    assert config.resolved_clients_per_round() == 20
    hp = config.resolved_hparams()
    # Exactly what SCAFFOLD declares: no μ for an algorithm that has none.
    assert list(hp) == ["client_lr", "server_lr"] and float(hp.client_lr) == pytest.approx(0.1)
    assert float(RunConfig(algorithm="fedprox").resolved_hparams().prox_mu) == 1.0


@pytest.mark.parametrize(
    "fields, plan",
    [
        ({"algorithm": "sgd"}, BatchPlan.full(1)),
        ({"local_epochs": 5}, BatchPlan.fraction_of_data(0.2, 5)),
        ({"batch_fraction": 0.5, "local_epochs": 2}, BatchPlan.fraction_of_data(0.5, 2)),
        ({"local_steps": 10, "batch_size": 32}, BatchPlan.fixed(32, 10)),
        ({"local_steps": 3}, BatchPlan.full(3)),
        ({"batch_size": 16, "local_epochs": 2}, BatchPlan.epochs(16, 2)),
        ({"batch_plan": "full"}, BatchPlan.full(1)),
    ],
)
def test_the_batch_plan_is_resolved_from_the_local_step_fields(fields, plan):
    assert RunConfig(**fields).validate().resolved_plan() == plan


@pytest.mark.parametrize(
    "fields, partition",
    [
        ({"similarity": 10.0}, ("similarity", {"similarity": 10.0})),
        ({"dirichlet_alpha": 0.3}, ("dirichlet", {"alpha": 0.3})),
        ({"shards_per_client": 3}, ("shards", {"shards_per_client": 3})),
        ({"partition": "iid"}, ("iid", {})),
        ({"partition": "dirichlet"}, ("dirichlet", {"alpha": 0.5})),
    ],
)
def test_the_partition_is_resolved_from_its_fields(fields, partition):
    assert RunConfig(**fields).validate().resolved_partition() == partition


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"algorithm": "fedsgd"}, r"algorithm = 'fedsgd' is invalid: it must be one of 'scaffold'"),
        ({"client_lr": 0.0}, r"client_lr = 0.0 is invalid: it must be finite and > 0"),
        ({"client_lr": float("nan")}, r"client_lr = nan is invalid"),
        ({"prox_mu": -1}, r"prox_mu = -1 is invalid: it must be finite and >= 0"),
        ({"num_clients": 0}, r"num_clients = 0 is invalid: it must be an integer in \[1, 2147"),
        ({"num_clients": 2.5}, r"num_clients = 2.5 is invalid: it must be an integer"),
        ({"rounds": True}, r"rounds = True is invalid: it must be an integer >= 1"),
        (
            {"num_clients": 10, "clients_per_round": 11},
            r"clients_per_round = 11 is invalid: it must be an integer in \[1, num_clients = 10\]",
        ),
        ({"client_fraction": 1.5}, r"client_fraction = 1.5 is invalid: it must be in \(0, 1\]"),
        (
            {"clients_per_round": 5, "client_fraction": 0.2},
            r"clients_per_round = 5 and client_fraction = 0.2 are both set",
        ),
        (
            {"similarity": 150},
            r"similarity = 150 is invalid: it must be a percentage in \[0, 100\]",
        ),
        ({"dirichlet_alpha": 0}, r"dirichlet_alpha = 0 is invalid: it must be finite and > 0"),
        (
            {"similarity": 10, "dirichlet_alpha": 0.1},
            r"similarity = 10, dirichlet_alpha = 0.1 are conflicting partition settings",
        ),
        (
            {"partition": "iid", "similarity": 10},
            r"similarity = 10 does not apply to partition = 'iid'",
        ),
        ({"batch_fraction": 0}, r"batch_fraction = 0 is invalid: it must be in \(0, 1\]"),
        ({"batch_plan": "fixed", "local_steps": 5}, r"batch_plan = 'fixed' needs batch_size"),
        (
            {"batch_plan": "full", "local_epochs": 2},
            r"local_epochs = 2 does not apply to batch_plan = 'full'",
        ),
        (
            {"local_steps": 5, "local_epochs": 2},
            r"local_epochs = 2, local_steps = 5 are conflicting batch plan settings",
        ),
        (
            {"targets": [0.5, 70]},
            r"targets = \[0.5, 70\] is invalid: every target must be an accuracy in \(0, 1\]",
        ),
        (
            {"dataset": "imagenet"},
            r"dataset = 'imagenet' is invalid: it must be one of .*fashion_mnist",
        ),
        ({"model": "vit"}, r"model = 'vit' is invalid: it must be one of 'logreg', 'mlp'"),
        ({"hidden_sizes": [0]}, r"hidden_sizes = \[0\] is invalid"),
        ({"scaffold_option": 3}, r"scaffold_option = 3 is invalid: it must be one of 'I', 'II'"),
        ({"seed": -1}, r"seed = -1 is invalid: it must be an integer >= 0"),
        ({"eval_every": 0}, r"eval_every = 0 is invalid: it must be an integer >= 1"),
    ],
)
def test_invalid_configs_name_the_field_the_value_and_the_range(fields, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(fields).validate()


def test_every_error_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        RunConfig(algorithm="x", rounds=0, seed=-2).validate()
    text = str(err.value)
    assert "algorithm = 'x'" in text and "rounds = 0" in text and "seed = -2" in text


def test_scaffold_option_accepts_the_papers_and_numeric_names():
    for option in ("I", "II", 1, 2):
        config = RunConfig.from_dict({"scaffold_option": option}).validate()
        assert config.resolved_options()["scaffold_option"] == ("I" if option in ("I", 1) else "II")


def test_a_config_is_resolved_once_into_a_frozen_description():
    config = RunConfig(algorithm="fedprox", dirichlet_alpha=0.3, local_steps=3, clients_per_round=5)
    resolved = config.resolve()
    assert (resolved.dataset, resolved.partition) == ("fashion_mnist", "dirichlet")
    assert resolved.of("partition") == {"dirichlet_alpha": 0.3} and resolved.of("model") == {}
    assert resolved.plan == BatchPlan.full(3) and resolved.clients_per_round == 5
    assert float(resolved.hparams.prox_mu) == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.plan = BatchPlan.full(1)
    config.num_clients = 7  # the caller's config, changed later, does not reach it
    assert resolved.config.num_clients == 100
    with pytest.raises(ConfigError, match="rounds = 0 is invalid"):
        config.replace(rounds=0).resolve()


@pytest.mark.parametrize("options", [{}, {"server_optimizer": "adam"}])
def test_declared_hyper_parameters_are_read_without_building_the_algorithm(monkeypatch, options):
    """No built-in algorithm is built (with a stand-in loss) to read its hyper-parameters:
    each entry declares them, FedDyn's as a function of its options (its server optimizer
    adds server_lr). What each declares is what the algorithm built with the options has."""

    def refuse(*args, **kwargs):
        raise AssertionError("an algorithm was built to read its hyper-parameters")

    built = {}  # every one first: Ditto builds its base through the registry
    for name, spec in list(ALGORITHMS.items()):
        if not (set(options) <= set(spec.options)):
            continue
        try:
            built[name] = spec.build(lambda params, batch: None, **options)
        except ValueError:  # Scaffnew refuses a server optimizer
            continue
    for name in built:
        monkeypatch.setitem(ALGORITHMS._entries, name, ALGORITHMS[name]._replace(factory=refuse))
    for name, algorithm in built.items():
        config = RunConfig(algorithm=name, **options)
        config = config.replace(clients_per_round=config.num_clients)  # S = N suits all
        assert list(config.resolved_hparams()) == list(algorithm.hparams), name
    assert "server_lr" in RunConfig(algorithm="feddyn", **options).resolved_hparams() or not options


def test_unknown_keys_are_errors_with_a_suggestion():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'client_lrr' \(did you mean 'client_lr'\?\)"
    ):
        RunConfig.from_dict({"client_lrr": 0.1})
    with pytest.raises(ConfigError, match="unknown config key 'colour'"):
        RunConfig.from_dict({"colour": "red"})


def test_config_files_toml_and_json(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('algorithm = "fedavg"\nclient_lr = 3.0\ntargets = [0.5, 0.7]\n')
    assert RunConfig.from_dict(experiments.load_config_file(toml)).validate().client_lr == 3.0
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"algorithm": "sgd", "rounds": 7}))
    assert RunConfig.from_dict(experiments.load_config_file(js)).rounds == 7
    for name, text, message in [
        ("run.yaml", "a: 1", "use .toml or .json"),
        ("bad.toml", "algorithm = ", "could not be parsed"),
        ("nested.toml", "[run]\nrounds = 3\n", "every field is a top-level key"),
        ("list.json", "[1, 2]", "must hold a table/object"),
    ]:
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            experiments.load_config_file(path)
    with pytest.raises(ConfigError, match="does not exist"):
        experiments.load_config_file(tmp_path / "missing.toml")


# ----------------------------------------------------------------------------- selection
def _cell(*runs):
    """A finished cell of one config per ``(lr, records, diverged)``."""
    return CellResult(
        key="cell",
        algorithm="fedavg",
        configs=[{"client_lr": lr, "seed": 0} for lr, _, _ in runs],
        series=[f"cell client_lr={lr:g}" for lr, _, _ in runs],
        settings=[{"client_lr": lr} for lr, _, _ in runs],
        records=[records for _, records, _ in runs],
        diverged_round=[3 if diverged else -1 for _, _, diverged in runs],
        info={},
        identity={},
    )


def _grid_run(lr, accuracies, diverged=False):
    return lr, [{"round": 5 * i, "test_accuracy": a} for i, a in enumerate(accuracies)], diverged


def _chosen(cell, *args, **kwargs):
    j, rounds = cell.choose(*args, **kwargs)
    return cell.configs[j]["client_lr"], rounds


def test_choose_takes_the_fewest_rounds_to_target():
    runs = _cell(
        _grid_run(0.1, [0.1, 0.3, 0.6, 0.7]),  # reaches 0.5 at round 10
        _grid_run(0.3, [0.1, 0.55, 0.6, 0.62]),  # round 5: the winner
        _grid_run(1.0, [0.1, 0.2, 0.3, 0.9]),
    )
    assert _chosen(runs, 0.5) == (0.3, 5)


def test_choose_breaks_ties_and_misses_by_the_best_value():
    tie = _cell(_grid_run(0.1, [0.1, 0.55, 0.6]), _grid_run(0.3, [0.1, 0.55, 0.8]))
    assert _chosen(tie, 0.5)[0] == 0.3
    missed = _cell(_grid_run(0.1, [0.1, 0.4]), _grid_run(0.3, [0.1, 0.45]))
    assert _chosen(missed, 0.5) == (0.3, None)
    diverged = _cell(_grid_run(1.0, [0.1, float("nan")], diverged=True), _grid_run(0.1, [0.1, 0.2]))
    assert _chosen(diverged, 0.5)[0] == 0.1
    best = _cell(_grid_run(0.1, [0.1, 0.7]), _grid_run(0.3, [0.1, 0.75]))
    assert _chosen(best, None) == (0.3, None)


def test_choose_for_errors_lower_is_better():
    runs = _cell(
        (0.1, [{"round": r, "e": 1.0 / (r + 1)} for r in range(10)], False),
        (0.3, [{"round": r, "e": 0.5**r} for r in range(10)], False),
    )
    assert _chosen(runs, 0.1, "e", higher_is_better=False) == (0.3, 4)


def test_choose_is_the_one_policy_of_results_select():
    def run(lr, loss):
        records = [
            {"round": 0, "test_accuracy": 0.1, "train_loss": 2.0},
            {"round": 5, "test_accuracy": 0.6, "train_loss": loss},
        ]
        return lr, records, False

    # Equal rounds and best value: the lower final training loss decides, then the smaller
    # η_l; exactly what a sweep's summary picks (scaffold_jax.results.select).
    runs = _cell(run(0.1, 0.9), run(0.3, 0.5), run(1.0, 0.5))
    assert _chosen(runs, 0.5) == (0.3, 5)
    assert _chosen(runs, None) == (0.3, None)
    candidates = [results.Candidate({"client_lr": c["client_lr"]}, r)
                  for c, r in zip(runs.configs, runs.records, strict=True)]  # fmt: skip
    assert results.select(candidates, 0.5)[0]["hparams"] == {"client_lr": 0.3}


# ----------------------------------------------------------------------------- grids
def _single_runs(sim, data, client_lrs, num_rounds, eval_every, seed):
    """The grid as separate Simulation.run calls (what the runner's sweep must equal)."""
    runs = []
    for lr in client_lrs:
        try:
            res, diverged = sim.run(data, {"client_lr": lr}, num_rounds, eval_every, seed), False
        except DivergenceError as err:
            res, diverged = err.result, True
        drift = np.asarray(res.round_metrics.get("client_drift", []))
        runs.append((lr, res.records, diverged, float(np.mean(drift))))
    return runs


def _grid_cell(tmp_path, config, client_lrs, dataset):
    cell = experiments.Cell("scaffold", config, {"client_lr": client_lrs})
    grid = experiments.Grid("grid", [cell], {"experiment": "grid"})
    outcome = experiments.run_grid(grid, tmp_path, quiet=True, dataset=dataset)
    return outcome.cells["scaffold"]


def test_the_sweep_and_the_loop_give_the_same_grid_results(tmp_path):
    ds = toy_dataset()
    config = RunConfig(
        dataset="fashion_mnist", num_clients=6, clients_per_round=3, rounds=4, eval_every=2,
        seed=3,
    )  # fmt: skip
    built = experiments.build(config, dataset=ds)
    swept = _grid_cell(tmp_path, config, [0.05, 0.2], ds)
    looped = _single_runs(built.simulation, built.data, [0.05, 0.2], 4, 2, 3)
    assert not swept.diverged.any()
    for j, (lr, records, diverged, drift) in enumerate(looped):
        assert swept.configs[j]["client_lr"] == lr and not diverged
        assert [r["round"] for r in swept.records[j]] == [0, 2, 4]
        for ra, rb in zip(swept.records[j], records, strict=True):
            assert ra["test_accuracy"] == pytest.approx(rb["test_accuracy"], abs=1e-6)
            assert ra["test_loss"] == pytest.approx(rb["test_loss"], rel=1e-5)
        # The summary's drift, from the records (each the mean since the previous one),
        # is the mean over every round of the loop's round metric.
        assert results.mean_over_rounds(swept.records[j], "client_drift") == pytest.approx(
            drift, rel=1e-5
        )
        assert ra["client_drift"] == pytest.approx(rb["client_drift"], rel=1e-5)


# ----------------------------------------------------------------------------- run()
def test_run_writes_its_folder_from_an_in_memory_dataset(tmp_path):
    config = RunConfig(
        algorithm="scaffold",
        num_clients=10,
        clients_per_round=5,
        client_lr=0.5,
        rounds=6,
        eval_every=3,
        targets=[0.3, 0.99],
    )
    drawn = {}

    def plot_curves(records, spec, path=None):
        drawn[spec.filename] = spec
        return None  # nothing written: the figure itself is tested in test_results.py

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(results.folder, "plot_curves", plot_curves)  # RunWriter.finish uses it
        summary = experiments.run(config, tmp_path / "out", quiet=True, dataset=toy_dataset())
    folder = tmp_path / "out"
    # The run's plots say what ran, and the accuracy plot shows the targets.
    title = "scaffold on toy: N = 10, S = 5, η_l = 0.5"
    assert {name: (spec.title, spec.target) for name, spec in drawn.items()} == {
        "accuracy.png": (title, (0.3, 0.99)),
        "loss.png": (title, None),
        "accuracy_vs_uplink.png": (title, (0.3, 0.99)),
    }
    assert summary["status"] == "finished"
    assert summary["dataset"] == "toy" and summary["clients_per_round"] == 5
    assert summary["rounds_to_target"]["0.99"] is None
    assert summary["runs"]["scaffold"]["rounds_per_second"] > 0
    assert [r["round"] for r in results.read_records(folder)] == [0, 3, 6]
    # config.json is a valid config file: the run can be repeated from it.
    again = RunConfig.from_dict(json.loads((folder / "config.json").read_text())).validate()
    assert again.out == str(folder) and again.rounds == 6
    with pytest.raises(FileExistsError):
        experiments.run(config, folder, quiet=True, dataset=toy_dataset())


def test_too_many_clients_for_the_data_is_a_named_error(tmp_path):
    config = RunConfig(num_clients=1000, max_train_examples=500)
    with pytest.raises(ConfigError, match="num_clients = 1000 is invalid"):
        experiments.run(config, tmp_path, quiet=True, dataset=toy_dataset(n_train=500))


# ----------------------------------------------------------------------------- protocols
def test_the_full_protocols_follow_the_paper():
    t3 = paper.table3_protocol().validate()
    assert t3.similarities == (0.0, 10.0, 100.0) and t3.num_rounds == 1000
    assert [(r.method, r.epochs) for r in t3.rows][:5] == [
        ("sgd", 1), ("scaffold", 1), ("scaffold", 5), ("scaffold", 10), ("scaffold", 20)
    ]  # fmt: skip
    assert len(t3.rows) == 13 and {r.sampled for r in t3.rows} == {0.2}
    t4 = paper.table4_protocol().validate()
    assert {r.sampled for r in t4.rows} == {0.2, 0.05, 0.01} and {r.epochs for r in t4.rows} == {5}
    t5 = paper.table5_protocol().validate()
    assert t5.model == "mlp" and t5.target is None
    fig3 = paper.fig3_protocol()
    assert fig3.gradient_dissimilarities == (1.0, 10.0, 100.0) and fig3.local_steps == (2, 10)


def test_table_targets_are_the_papers_on_emnist_and_scaled_elsewhere():
    t3, t4, t5 = (paper.PROTOCOLS[n]() for n in ("table3", "table4", "table5"))
    assert paper.table_target(t3, "emnist/balanced") == 0.5
    assert paper.table_target(t4, "emnist/balanced") == 0.45
    assert paper.table_target(t3, "fashion_mnist") == 0.7
    assert paper.table_target(t5, "fashion_mnist") is None
    assert paper.table_target(paper.table3_protocol(target=0.6), "x") == 0.6


def test_protocol_overrides_are_checked():
    with pytest.raises(ConfigError, match=r"unknown protocol field\(s\) \['horizon'\]"):
        paper.fig3_protocol(horizon=10)
    with pytest.raises(ConfigError, match="target = 2 is invalid"):
        paper.fig3_protocol(target=2)
    with pytest.raises(ConfigError, match="dataset = 'mnist2' is invalid"):
        paper.table3_protocol(dataset="mnist2").validate()
    with pytest.raises(ConfigError, match="unknown"):
        paper.reproduce("table9")


def test_reproduce_table_on_an_in_memory_dataset(tmp_path):
    protocol = paper.table3_protocol(
        quick=True,
        num_clients=10,
        num_rounds=6,
        eval_every=2,
        rows=[("sgd", 1), ("scaffold", 1)],
        similarities=[0, 100],
        target=0.5,
        lr_grids={"sgd": (1.0,), "scaffold": (0.3, 1.0)},
    )
    summary = paper.reproduce_table(protocol, tmp_path, quiet=True, dataset=toy_dataset())
    assert summary["dataset"] == "toy" and summary["target"] == 0.5
    assert [(c["method"], c["similarity"]) for c in summary["cells"]] == [
        ("sgd", 0), ("scaffold", 0), ("sgd", 100), ("scaffold", 100)
    ]  # fmt: skip
    table = (tmp_path / "table3.md").read_text()
    assert "— toy" in table and "Dataset: toy (memory)" in table
    assert "| method | epochs | 0% | 100% |" in table
    assert "Chosen η_l" in table and "Wall time:" in table
    # Every η_l's records are kept; the plots show the chosen ones.
    series = {r["series"] for r in results.read_records(tmp_path)}
    assert len(series) == 2 * 3
    assert (tmp_path / "accuracy.png").is_file()


def test_a_table_over_seeds_reports_each_cells_mean_and_std_of_one_chosen_step_size(tmp_path):
    common = dict(quick=True, num_clients=10, num_rounds=6, eval_every=1, rows=[("scaffold", 1)],
                  similarities=[0], target=0.5, lr_grids={"scaffold": (0.3, 1.0)})  # fmt: skip
    protocol = paper.table3_protocol(**common, seeds=[0, 1, 2])
    summary = paper.reproduce_table(protocol, tmp_path / "t", quiet=True, dataset=toy_dataset())
    (cell,) = summary["cells"]
    records = results.read_records(tmp_path / "t")
    # The grid's 2 step sizes x 3 seeds ran; the chosen step size's 3 runs are the cell's.
    assert len({r["series"] for r in records}) == 6
    series = f"SCAFFOLD E=1 s=0% client_lr={cell['client_lr']:g} seed="
    chosen = [[r for r in records if r["series"] == f"{series}{s}"] for s in (0, 1, 2)]
    per_seed = [results.rounds_to_target(runs, 0.5) for runs in chosen]
    assert cell["seeds"] == [0, 1, 2] and cell["rounds_per_seed"] == per_seed
    # Each seed sampled its own clients: three different runs.
    assert len({tuple(r["test_accuracy"] for r in c) for c in chosen}) == 3
    bests = [results.best_value(runs) for runs in chosen]
    assert cell["best_accuracy"] == pytest.approx(np.mean(bests))
    assert cell["best_accuracy_std"] == pytest.approx(np.std(bests))
    table = (tmp_path / "t" / "table3.md").read_text()
    if None not in per_seed:
        assert cell["rounds"] == pytest.approx(np.mean(per_seed))
        assert f"| SCAFFOLD | 1 | {np.mean(per_seed):.1f} ± {np.std(per_seed):.1f} |" in table
    assert f"{np.mean(bests):.3f} ± {np.std(bests):.3f}" in table
    assert "seeds 0, 1, 2 (mean ± std" in table
    # One seed: the table as before, plain numbers.
    single = paper.reproduce_table(paper.table3_protocol(**common), tmp_path / "one", quiet=True,
                                   dataset=toy_dataset())  # fmt: skip
    assert "±" not in (tmp_path / "one" / "table3.md").read_text()
    assert single["cells"][0]["rounds"] == results.rounds_to_target(
        [r for r in results.read_records(tmp_path / "one")
         if r["series"] == single["cells"][0]["series"]], 0.5)  # fmt: skip
    with pytest.raises(ConfigError, match="repeats a seed"):
        paper.table3_protocol(seeds=[1, 1]).validate()
    with pytest.raises(ConfigError, match="seeds = \\(-1,\\) is invalid"):
        paper.table3_protocol(seeds=[-1]).validate()


def test_reproduce_default_folders_differ_by_protocol_not_by_what_a_resume_may_change():
    quick = paper.default_folder("table3", True, {})
    assert quick == Path("results") / "table3-quick"
    extra = paper.default_folder("table3", True, {"extra_methods": ("feddyn",)})
    assert extra.parent == quick.parent and extra.name.startswith("table3-quick-")
    assert extra != quick != paper.default_folder("table3", False, {})
    # The same protocol (a list or a tuple) with another horizon: the same folder.
    resumed = {"extra_methods": ["feddyn"], "num_rounds": 5, "eval_every": 5}
    assert paper.default_folder("table3", True, resumed) == extra


def test_a_diverging_run_says_so_in_its_folder(tmp_path):
    config = RunConfig(num_clients=6, clients_per_round=3, client_lr=1e38, rounds=4, eval_every=2)
    with pytest.raises(experiments.DivergenceError):
        experiments.run(config, tmp_path, quiet=True, dataset=toy_dataset())
    summary = results.read_summary(tmp_path)
    assert summary["status"] == "diverged" and "diverged" in summary["error"]
    assert results.read_records(tmp_path)[0]["round"] == 0  # the records made before stay


def test_the_grid_keeps_a_diverged_step_size(tmp_path):
    config = RunConfig(num_clients=6, clients_per_round=3, rounds=4, eval_every=2)
    cell = _grid_cell(tmp_path, config, [0.1, 1e38], toy_dataset())
    assert cell.diverged.tolist() == [False, True]
    assert cell.records[1] and cell.records[1][-1]["status"] == "diverged"
    assert _chosen(cell, 0.99)[0] == 0.1


def test_fedprox_has_one_default_mu_in_the_api_the_config_and_the_cli(capsys):
    """FedProx's μ is its declared default everywhere: sj.hparams() leaves it to the
    algorithm (so sj.fedprox is not FedAvg), the config resolves it, the flag shows it;
    an algorithm without μ gets none."""
    import scaffold_jax as sj
    from scaffold_jax.algorithms import ALGORITHMS
    from scaffold_jax.cli import main

    declared = ALGORITHMS["fedprox"].hparams["prox_mu"].default
    assert declared == 1.0
    problem = sj.models.logistic_regression((4,), 2)
    sim = sj.Simulation(sj.fedprox(problem.loss_fn), problem, BatchPlan.full(1), 1)
    assert float(sim.resolve_hparams(sj.hparams(client_lr=0.1))["prox_mu"]) == declared
    assert float(RunConfig(algorithm="fedprox").resolved_hparams()["prox_mu"]) == declared
    assert "prox_mu" not in RunConfig(algorithm="scaffold").resolved_hparams()
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"FedProx proximal weight mu (the paper fixes 1) [default: {declared}]" in help_text


def test_resume_compares_configs_in_canonical_form():
    """An explicit default equals an omitted one; an option of an entry the config does not
    choose, at its default (as an earlier config.json holds it), changes nothing; another
    value of a chosen entry's option does."""
    from scaffold_jax.experiments import canonical

    plain = canonical(RunConfig().to_dict())
    assert canonical(RunConfig(similarity=0).to_dict()) == plain
    assert canonical({**RunConfig().to_dict(), "options": {"server_optimizer": "sgd"}}) == plain
    earlier = {k: v for k, v in RunConfig().to_dict().items() if k not in ("options", "sampler")}
    earlier.update(similarity=None, hidden_sizes=[256, 256], resnet_width=64, lstm_hidden=256)
    assert canonical(earlier) == plain
    assert canonical(RunConfig(similarity=50).to_dict())["similarity"] == 50.0
    assert canonical(RunConfig(similarity=50).to_dict()) != plain
    # The sweep's own keys are kept as they are.
    assert canonical({**RunConfig().to_dict(), "seeds": [0, 1]})["seeds"] == [0, 1]
