"""The package's layers (../shared/DESIGN.md): imports point down only, nothing imports the
package face, and no module imports, even late (inside a function), one above it.

The graph is read from the source with ``ast`` (every ``import`` anywhere in a module), so a
late import that would hide a circle counts like a top-level one.
"""

import ast
import collections
from pathlib import Path

import scaffold_jax

PACKAGE = Path(scaffold_jax.__file__).parent

# Bottom to top. A module may import modules of its own layer or below; within a layer the
# graph must still be free of circles. A sub-package's modules share its layer.
LAYERS = [
    ["types", "tree", "registry", "compilation_cache", "resources", "versions", "compatibility"],
    ["local", "messages", "optimizers", "sampling", "weighting", "layout", "data"],
    ["algorithms", "models", "privacy", "participation", "compression", "robust"],
    ["wrappers"],
    ["engine"],
    ["checkpoint", "diagnostics", "sweep"],
    ["loop"],
    ["progress", "results"],
    ["experiments"],
    ["paper"],
    ["cli_flags"],
    ["cli", "docs", "demo"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__")
        out[name] = path
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = collections.defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}".removeprefix("scaffold_jax.") in modules
                    else node.module
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                if target == "scaffold_jax" or target.startswith("scaffold_jax."):
                    target = target.removeprefix("scaffold_jax").lstrip(".")
                    if target != name:
                        graph[name].add(target)
    return graph


def _layer(module: str) -> int:
    top = module.split(".")[0]
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"module {module!r} has no layer in tests/test_layers.py: add it")


def test_every_import_points_down():
    upward = []
    for module, targets in _graph().items():
        if module == "":  # the package face imports what it re-exports
            continue
        for target in targets:
            assert target != "", f"{module} imports the package face scaffold_jax"
            if _layer(target) > _layer(module):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports pointing up: " + ", ".join(sorted(upward))


def test_the_import_graph_has_no_circles():
    graph = {k: v for k, v in _graph().items() if k != ""}

    def package_of(name):  # a package's __init__ may import its own modules
        return name.split(".")[0]

    edges = {m: {t for t in ts if not (m == package_of(t) and "." in t)} for m, ts in graph.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path, nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in list(edges):
        if node not in state:
            visit(node)


def test_the_benchmark_scripts_import_each_other_without_circles():
    """benchmarks/ imports its helpers by module name (scripts run from that folder):
    common (timing and output) below workloads (the programs), below the scripts."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    names = {p.stem for p in folder.glob("*.py")}
    edges = {}
    for path in folder.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
        # bench_peers imports itself by name for Ray's workers: not a circle.
        edges[path.stem] = {n for n in found if n in names and n != path.stem}

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n}))
                   for n in edges[start])  # fmt: skip

    circles = sorted(m for m in edges if reaches(m, m, {m}))
    assert not circles, f"benchmarks/ modules on an import circle: {circles}"


def test_a_clone_in_the_working_directory_does_not_shadow_the_package(tmp_path):
    """With the package under src/, a folder named after it (a clone, the usual
    ``git clone .../scaffold_jax``) in the directory a script or REPL starts from is a
    namespace package at most; it used to be imported instead of the installed package
    (``AttributeError: module 'scaffold_jax' has no attribute 'from_partition'``)."""
    import subprocess
    import sys

    clone = tmp_path / "scaffold_jax"
    (clone / "src").mkdir(parents=True)
    (clone / "README.md").write_text("a clone\n")
    done = subprocess.run(
        [sys.executable, "-c", "import scaffold_jax as sj; print(sj.__file__, sj.from_partition)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(str(PACKAGE / "__init__.py")), done.stdout


def test_no_module_is_a_hub():
    """No package file over 800 lines, none of the engine's over 450: growth goes into new
    files named for what they hold (issue 41)."""
    sizes = {path.relative_to(PACKAGE): len(path.read_text().splitlines())
             for path in PACKAGE.rglob("*.py")}  # fmt: skip
    assert not {p: n for p, n in sizes.items() if n > 800}
    assert not {p: n for p, n in sizes.items() if p.parts[0] == "engine" and n > 450}


def test_one_run_identity_builder():
    """Every program and command builds what a resume must agree on with one function,
    scaffold_jax.loop.run_identity; the command line's config_identity adds its config's
    facts on top of it (issue 41: the sweep's inline identity left out the sampler)."""
    builders = [
        f"{path.relative_to(PACKAGE)}:{node.name}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name.endswith("run_identity")
    ]
    assert builders == ["loop/identity.py:run_identity"]
    config_identity = (PACKAGE / "experiments" / "identity.py").read_text()
    assert "loop.run_identity(built.simulation, built.data, more=facts)" in config_identity
