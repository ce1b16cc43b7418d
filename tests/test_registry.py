"""The open vocabularies: the Registry class, and models, partitioners and datasets that a
test registers (as a plugin would) being usable through RunConfig and the loaders."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from scaffold_jax import cli, experiments, models
from scaffold_jax.data import partition, sources
from scaffold_jax.experiments import ConfigError, RunConfig
from scaffold_jax.models import MODELS, ModelSpec
from scaffold_jax.registry import PLUGIN_HINT, Option, Registry


@pytest.fixture
def scratch(monkeypatch):
    """``scratch(registry)``: entries registered during the test are gone after it."""

    def scratch(registry: Registry) -> Registry:
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
        return registry

    return scratch


def toy_dataset(n_train=120, n_test=40, num_classes=4, seed=0) -> sources.Dataset:
    rng = np.random.default_rng(seed)

    def split(n):
        y = rng.integers(0, num_classes, n).astype(np.int32)
        return {"x": rng.integers(0, 255, (n, 8, 8)).astype(np.uint8), "y": y}

    return sources.Dataset("toy", "memory", split(n_train), split(n_test), num_classes)


def choices(field_name: str) -> tuple[str, ...]:
    """The choices a field offers the command line, read now."""
    (field,) = [f for f in dataclasses.fields(RunConfig) if f.name == field_name]
    return tuple(field.metadata["choices"])


# ----------------------------------------------------------------------------- Registry
def test_registry_refuses_a_taken_name_unless_replace():
    colours = Registry("colour")
    red = colours.register("red", (255, 0, 0))
    assert colours["red"] is red and "red" in colours and "blue" not in colours
    with pytest.raises(ValueError, match="colour 'red' is already registered"):
        colours.register("red", (254, 0, 0))
    colours.register("red", red)  # the same entry again (a re-imported plugin) is fine
    colours.register("red", (254, 0, 0), replace=True)
    assert colours["red"] == (254, 0, 0)
    colours.register("blue", (0, 0, 255))
    assert colours.names() == ("red", "blue") and list(colours) == ["red", "blue"]
    assert len(colours) == 2


@pytest.mark.parametrize("name", ["", " red", "red ", None, 3])
def test_registry_refuses_names_that_are_not_clean_strings(name):
    with pytest.raises(ValueError, match="colour name must be a non-empty string"):
        Registry("colour").register(name, 1)


def test_an_unknown_name_is_one_line_with_a_suggestion_and_the_known_ones():
    colours = Registry("colour")
    colours.register("red", 1)
    colours.register("green", 2)
    with pytest.raises(ValueError) as err:
        colours["gren"]
    # How a plugin registers its entries is said once, in --help, not after every typo.
    assert str(err.value) == (
        "colour 'gren' is unknown (did you mean 'green'?); use one of red, green."
    )
    run_help = cli._build_parsers()[1]["run"].format_help()
    assert " ".join(PLUGIN_HINT.split()) in " ".join(run_help.split())


# ----------------------------------------------------------------------------- unknown names
def test_unknown_model_partitioner_and_dataset_names_say_what_is_known():
    with pytest.raises(ValueError, match=r"model 'vit' is unknown; use one of logreg, mlp\b"):
        experiments.make_problem("vit", toy_dataset())
    with pytest.raises(ValueError, match=r"partitioner 'dirichet' is unknown \(did you mean "):
        partition.PARTITIONERS["dirichet"]
    with pytest.raises(ConfigError) as err:
        RunConfig(partition="dirichet", model="mpl").validate()
    text = str(err.value)
    assert (
        "partition = 'dirichet' is invalid: it must be one of 'similarity', 'dirichlet', "
        "'shards', 'iid' (did you mean 'dirichlet'?)" in text
    )
    # Every registered model is listed (the built-in ones first), then the nearest name.
    assert re.search(
        r"model = 'mpl' is invalid: it must be one of 'logreg', 'mlp'[^\n]* "
        r"\(did you mean 'mlp'\?\)",
        text,
    )
    assert PLUGIN_HINT not in text
    with pytest.raises(ConfigError, match="model = 3 is invalid"):
        RunConfig(model=3).validate()


# ----------------------------------------------------------------------------- partitioners
def halves(labels, num_clients, *, seed, stride, calls=None):
    """Client 0 gets the first half of the examples, the others share the rest."""
    n = len(labels)
    if calls is not None:
        calls.append({"n": n, "num_clients": num_clients, "seed": seed, "stride": stride})
    rest = np.array_split(np.arange(n // 2, n), num_clients - 1)
    return [np.arange(n // 2), *rest]


def test_a_registered_partitioner_is_validated_and_built_from_the_config(scratch):
    # Before it is registered it is an error; validation reads the registry when it runs.
    with pytest.raises(ConfigError, match="partition = 'halves' is invalid"):
        RunConfig(partition="halves").validate()
    calls = []
    split = functools.partial(halves, calls=calls)
    scratch(partition.PARTITIONERS).register(
        "halves",
        partition.PartitionerSpec(
            split, {"shards_per_client": Option(3, "stride", "int", low=1, argument="stride")}
        ),
    )
    assert "halves" in choices("partition")

    config = RunConfig(partition="halves", num_clients=4, clients_per_round=2, seed=5)
    assert config.validate().resolved_partition() == ("halves", {"stride": 3})
    given = config.replace(shards_per_client=7)
    assert given.validate().resolved_partition() == ("halves", {"stride": 7})
    with pytest.raises(
        ConfigError,
        match=r"similarity = 10 does not apply to partition = 'halves'; remove it or set "
        r"partition = 'similarity'",
    ):
        config.replace(similarity=10).validate()

    built = experiments.build(given, dataset=toy_dataset())
    assert calls == [{"n": 120, "num_clients": 4, "seed": 5, "stride": 7}]
    assert np.asarray(built.data.counts).tolist() == [60, 20, 20, 20]
    assert built.info["partition"] == {"kind": "halves", "stride": 7}


def test_a_registered_partitioner_without_parameters_keeps_the_builtin_inference(scratch):
    scratch(partition.PARTITIONERS).register(
        "halves", partition.PartitionerSpec(functools.partial(halves, stride=0), {})
    )
    # A field set without a partition still picks the built-in that takes it.
    assert RunConfig(dirichlet_alpha=0.3).validate().resolved_partition() == (
        "dirichlet",
        {"alpha": 0.3},
    )
    with pytest.raises(ConfigError, match="dirichlet_alpha = 0.3 does not apply to partition"):
        RunConfig(partition="halves", dirichlet_alpha=0.3).validate()
    assert RunConfig(partition="halves").validate().resolved_partition() == ("halves", {})


def test_a_partitioner_declares_an_option_no_config_field_names(scratch):
    # A plugin's own option needs no RunConfig field: it is a key, a flag and checked.
    scratch(partition.PARTITIONERS).register(
        "odd",
        partition.PartitionerSpec(
            halves, {"stride_of_clients": Option(1, "stride", "int", low=1, argument="stride")}
        ),
    )
    config = RunConfig(partition="odd", stride_of_clients=4)
    assert config.validate().resolved_partition() == ("odd", {"stride": 4})
    assert config.stride_of_clients == 4 and "stride_of_clients" not in RunConfig.field_names()
    with pytest.raises(
        ConfigError, match="stride_of_clients = 0 is invalid: it must be an integer >= 1"
    ):
        RunConfig(partition="odd", stride_of_clients=0).validate()
    # Setting it picks the partitioner that declares it.
    assert RunConfig(stride_of_clients=2).validate().resolved_partition()[0] == "odd"


# ----------------------------------------------------------------------------- models
def test_a_registered_model_builds_the_problem_of_a_config(scratch):
    calls = []

    def wide_logreg(input_shape, num_classes, *, key, hidden_sizes):
        calls.append((input_shape, num_classes, list(hidden_sizes)))
        return models.logistic_regression(input_shape, num_classes, key=key, zero_init=False)

    with pytest.raises(ConfigError, match="model = 'wide' is invalid"):
        RunConfig(model="wide").validate()
    scratch(MODELS).register(
        "wide",
        ModelSpec(wide_logreg, "Wide", {"hidden_sizes": MODELS["mlp"].options["hidden_sizes"]}),
    )
    assert "wide" in choices("model")

    config = RunConfig(model="wide", hidden_sizes=[3], num_clients=4, clients_per_round=2)
    built = experiments.build(config.validate(), dataset=toy_dataset())
    assert calls == [((8, 8), 4, [3])]
    assert built.problem.params["linear"]["kernel"].shape == (4, 64)  # [out, in]
    # The key comes from the config's seed: another seed, other initial params.
    other = experiments.build(config.replace(seed=1), dataset=toy_dataset())
    kernel, other_kernel = (b.problem.params["linear"]["kernel"] for b in (built, other))
    assert not np.allclose(kernel, other_kernel)


def test_models_build_takes_only_the_declared_options():
    problem = models.build(
        "mlp", (6,), 3, key=jax.random.key(0), options={"hidden_sizes": [5], "similarity": 3}
    )
    assert problem.params["hidden_0"]["kernel"].shape == (5, 6)  # [out, in]
    logreg = models.build("logreg", (6,), 3, key=jax.random.key(0), options={"hidden_sizes": [5]})
    assert set(logreg.params) == {"linear"}
    with pytest.raises(TypeError, match="options must map config fields"):
        models.build("mlp", (6,), 3, key=jax.random.key(0), options=[5])


# ----------------------------------------------------------------------------- datasets
def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    path.write_bytes(gzip.compress(header + np.asarray(array, ">u1").tobytes()))


def test_a_registered_dataset_loads_from_idx_files_and_validates(scratch, tmp_path):
    with pytest.raises(ConfigError, match="dataset = 'Glyphs' is invalid"):
        RunConfig(dataset="Glyphs").validate()
    scratch(sources.DATASETS).register("Glyphs", sources.DatasetSpec(3, "glyphs-", False, ("g",)))
    rng = np.random.default_rng(0)
    folder = tmp_path / "g"
    folder.mkdir()
    for split, n in (("train", 12), ("t10k", 5)):
        _write_idx(folder / f"glyphs-{split}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 4, 4)))
        _write_idx(folder / f"glyphs-{split}-labels-idx1-ubyte.gz", rng.integers(0, 3, n))
    assert sources.canonical_name("Glyphs") == "Glyphs"
    assert "Glyphs" in choices("dataset")
    RunConfig(dataset="Glyphs").validate()
    ds = sources.load("Glyphs", data_dir=tmp_path, cache_dir=tmp_path / "cache")
    assert ds.name == "Glyphs" and ds.num_classes == 3 and ds.source == str(folder)
    assert ds.train["x"].shape == (12, 4, 4) and ds.test["y"].shape == (5,)


def test_the_model_owns_its_kernel_layout():
    """models.Dense stores [out, in] and starts from flax nn.Dense's numbers, transposed:
    the same function of the same key, with the layout the local solver computes in."""
    import flax.linen as nn

    x = jax.random.normal(jax.random.key(1), (4, 6))
    ours = models.Dense(3)
    theirs = nn.Dense(3)
    p_ours = ours.init(jax.random.key(0), x)["params"]
    p_theirs = theirs.init(jax.random.key(0), x)["params"]
    assert p_ours["kernel"].shape == (3, 6) and p_theirs["kernel"].shape == (6, 3)
    np.testing.assert_array_equal(p_ours["kernel"], p_theirs["kernel"].T)
    np.testing.assert_allclose(
        ours.apply({"params": p_ours}, x), theirs.apply({"params": p_theirs}, x), rtol=1e-6
    )


# ----------------------------------------------------------------------------- isolation
def test_a_snapshot_restores_every_registry_and_forgets_plugin_modules(tmp_path):
    """What the tests' autouse fixtures rely on: after restore, entries registered since
    the snapshot are gone, and a plugin file imported since registers again when loaded."""
    import sys

    from scaffold_jax import registry
    from scaffold_jax.algorithms import ALGORITHMS
    from scaffold_jax.registry import load_plugins

    plugin = tmp_path / "one_more.py"
    plugin.write_text(
        "from scaffold_jax.models import MODELS, ModelSpec, logistic_regression\n"
        "MODELS.register('one_more', ModelSpec(logistic_regression, 'one more'))\n"
    )
    snap = registry.snapshot()
    (name,) = load_plugins([str(plugin)])
    ALGORITHMS.register("alias_of_fedavg", ALGORITHMS["fedavg"])
    assert "one_more" in MODELS and "alias_of_fedavg" in ALGORITHMS and name in sys.modules
    registry.restore(snap)
    assert "one_more" not in MODELS and "alias_of_fedavg" not in ALGORITHMS
    assert name not in sys.modules
    load_plugins([str(plugin)])  # imported again: registers again
    assert "one_more" in MODELS
