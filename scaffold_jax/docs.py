"""``make docs``: the API reference (HTML, by pdoc) and the config key reference.

``python -m scaffold_jax.docs`` writes

* ``docs/api/``: the API reference of every module of the package, rendered by pdoc
  (the ``dev`` extra) from the Google-style docstrings; generated, not committed;
* ``docs/config.md``: every config key (:func:`scaffold_jax.experiments.config_reference`),
  committed, and checked by the tests to equal what the generator makes.

:func:`build_api` returns every warning: pdoc's own, and each Sphinx-style cross-reference
(the roles func, class, mod, meth, attr, data, exc) that names nothing, which pdoc would
print as plain code instead of a link. The tests build the reference and fail on any.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import warnings
from pathlib import Path

PACKAGE = "scaffold_jax"
#: A reference to an object of another project (jax.jit, optax...): pdoc cannot link it.
EXTERNAL = ("jax", "jaxlib", "optax", "flax", "numpy", "np", "orbax", "matplotlib", "tqdm")
_ROLE = re.compile(r":(?:py:)?(?:mod|func|data|const|class|meth|attr|exc|obj):`([^`]+)`")


def _modules() -> list[str]:
    """The names of every module of the package, each imported."""
    package = importlib.import_module(PACKAGE)
    names = [PACKAGE]
    for info in pkgutil.walk_packages(package.__path__, PACKAGE + "."):
        names.append(info.name)
        importlib.import_module(info.name)
    return names


def _fix_namedtuple_constructors(names: list[str]) -> None:
    """Gives each NamedTuple's generated ``__new__`` its class's module.

    ``collections.namedtuple`` makes ``__new__`` in a module of its own
    (``namedtuple_<Name>``), so pdoc resolves the annotations of the constructor's
    signature (under ``from __future__ import annotations``, strings such as ``"PyTree"``)
    in an empty namespace and warns for each. The class's own module holds those names.
    """
    import sys

    for name in names:
        for value in vars(sys.modules[name]).values():
            if isinstance(value, type) and issubclass(value, tuple) and hasattr(value, "_fields"):
                if value.__new__.__module__.startswith("namedtuple_"):
                    value.__new__.__module__ = value.__module__


def _target(reference: str) -> str:
    """The object a role names: ``~a.b`` → ``a.b``, ``title <a.b>`` → ``a.b``."""
    match = re.search(r"<([^>]+)>\s*$", reference)
    target = match.group(1) if match else reference
    return target.strip().lstrip("~").removesuffix("()")


def _lookup(namespace, dotted: str) -> bool:
    """Whether ``dotted`` names something inside ``namespace``: a pdoc ``Module`` or
    ``Class`` doc (which knows the attributes set in ``__init__`` and dataclass fields)
    or, failing that, its Python object's attributes (imported names included)."""
    if namespace.get(dotted) is not None:
        return True
    value = namespace.obj
    for part in dotted.split("."):
        if not hasattr(value, part):
            return False
        value = getattr(value, part)
    return True


def _resolves(target: str, module, owner, modules) -> bool:
    """Sphinx's order: the enclosing class, the module, the package, the builtins, then
    an absolute name (its longest documented module prefix, then what is inside)."""
    import builtins

    if target.split(".")[0] in EXTERNAL or hasattr(builtins, target):
        return True
    scopes = [owner, module, modules[PACKAGE]]
    if any(scope is not None and _lookup(scope, target) for scope in scopes):
        return True
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in modules:
            return cut == len(parts) or _lookup(modules[head], ".".join(parts[cut:]))
    return False


def unresolved_references(modules) -> list[str]:
    """Each Sphinx-style reference in a docstring of ``modules`` (``{name: pdoc Module
    doc}``) that names nothing: ``"<where>: <reference>"``."""
    import pdoc.doc

    out, seen = [], set()

    def visit(doc, module, owner) -> None:
        if id(doc) in seen or doc.taken_from[0] != module.modulename:
            return  # documented where it is defined
        seen.add(id(doc))
        if isinstance(doc, pdoc.doc.Class):
            owner = doc
        for reference in _ROLE.findall(doc.docstring or ""):
            if not _resolves(_target(reference), module, owner, modules):
                out.append(f"{doc.fullname}: {' '.join(reference.split())}")
        for member in getattr(doc, "own_members", ()):
            visit(member, module, owner)

    for module in modules.values():
        visit(module, module, None)
    return out


def build_api(output_directory: str | Path) -> list[str]:
    """Renders the API reference of the package into ``output_directory`` with pdoc.

    Returns:
      Every warning: pdoc's (an annotation it cannot resolve, a module it cannot import)
      and each unresolved cross-reference (:func:`unresolved_references`). Empty when
      the reference is clean.
    """
    import pdoc
    import pdoc.doc
    import pdoc.render

    names = _modules()
    _fix_namedtuple_constructors(names)
    pdoc.render.configure(docformat="google", show_source=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        modules = {name: pdoc.doc.Module(importlib.import_module(name)) for name in names}
        pdoc.pdoc(PACKAGE, output_directory=Path(output_directory))
    found = [f"{w.category.__name__}: {w.message}" for w in caught]
    return found + [f"unresolved reference {r}" for r in unresolved_references(modules)]


def write_config_reference(path: str | Path) -> Path:
    """Writes :func:`~scaffold_jax.experiments.config_reference` to ``path``."""
    from scaffold_jax.experiments import config_reference

    path = Path(path)
    path.write_text(config_reference())
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", default="docs/api", help="API reference folder [docs/api]")
    parser.add_argument(
        "--config", default="docs/config.md", help="config key reference [docs/config.md]"
    )
    args = parser.parse_args(argv)
    print(f"wrote {write_config_reference(args.config)}")
    problems = build_api(args.api)
    for line in problems:
        print(line)
    print(f"wrote {args.api}/ ({len(problems)} warnings)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
