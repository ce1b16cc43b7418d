"""``make docs``: the API reference (HTML, by pdoc) and the config key reference.

``python -m scaffold_jax.docs`` writes

* ``docs/api/``: the API reference, a page for every public module of the package
  (:func:`public_modules`, whatever ``__all__`` lists), rendered by pdoc (the ``dev``
  extra) from the Google-style docstrings; generated, not committed;
* ``docs/config.md``: every config key (:func:`scaffold_jax.experiments.config_reference`)
  and every other flag of the command line (:func:`command_line_reference`, read from
  the argparse parser), committed, and checked by the tests to equal what
  :func:`config_markdown` makes.

:func:`build_api` returns every warning: pdoc's own, and each Sphinx-style cross-reference
(the roles func, class, mod, meth, attr, data, exc) that names nothing, which pdoc would
print as plain code instead of a link. The tests build the reference and fail on any.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import re
import warnings
from pathlib import Path

PACKAGE = "scaffold_jax"
#: A reference to an object of another project (jax.jit, optax...): pdoc cannot link it.
EXTERNAL = ("jax", "jaxlib", "optax", "flax", "numpy", "np", "orbax", "matplotlib", "tqdm")
_ROLE = re.compile(r":(?:py:)?(?:mod|func|data|const|class|meth|attr|exc|obj):`([^`]+)`")


def public_modules() -> list[str]:
    """The name of every public module of the package (no part of it starts with ``_``),
    each imported: the pages of the API reference."""
    package = importlib.import_module(PACKAGE)
    names = [PACKAGE]
    for info in pkgutil.walk_packages(package.__path__, PACKAGE + "."):
        if not any(part.startswith("_") for part in info.name.split(".")):
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
    """Renders the API reference of the package into ``output_directory`` with pdoc: a
    page for each of :func:`public_modules`, and each package's page lists all of its
    public submodules.

    pdoc alone would follow ``__all__``, which names what ``from scaffold_jax import *``
    brings, not what a user imports: ``scaffold_jax.experiments``, ``results``, ``types``
    or ``paper`` would have no page.

    Returns:
      Every warning: pdoc's (an annotation it cannot resolve, a module it cannot import)
      and each unresolved cross-reference (:func:`unresolved_references`). Empty when
      the reference is clean.
    """
    import pdoc.doc
    import pdoc.render

    output_directory = Path(output_directory)
    names = public_modules()
    _fix_namedtuple_constructors(names)
    pdoc.render.configure(docformat="google", show_source=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        modules = {name: pdoc.doc.Module.from_name(name) for name in names}
        for name, module in modules.items():
            # ``submodules`` is a cached property: this list replaces pdoc's ``__all__`` one.
            module.__dict__["submodules"] = [
                modules[child] for child in names if child.rpartition(".")[0] == name
            ]
        for module in modules.values():
            page = output_directory / f"{module.fullname.replace('.', '/')}.html"
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(pdoc.render.html_module(module, modules), encoding="utf-8")
        (output_directory / "index.html").write_text(
            pdoc.render.html_index(modules), encoding="utf-8"
        )
        (output_directory / "search.js").write_text(
            pdoc.render.search_index(modules), encoding="utf-8"
        )
    found = [f"{w.category.__name__}: {w.message}" for w in caught]
    return found + [f"unresolved reference {r}" for r in unresolved_references(modules)]


def _is_config_flag(action: argparse.Action, fields: set[str]) -> bool:
    """Whether a flag stands for a config key (a :class:`~scaffold_jax.experiments.RunConfig`
    field or a declared name): the CLI gives those ``default=SUPPRESS`` so that only a
    flag actually given overrides the config file."""
    return action.default is argparse.SUPPRESS and (
        action.dest in fields or action.dest.startswith("declared:")
    )


def _flags_table(parser: argparse.ArgumentParser, fields: set[str]) -> list[str]:
    """One row per flag of ``parser`` that is not a config key (nor ``--help``)."""

    def text(value: str) -> str:
        return " ".join(value.split()).replace("|", "\\|").replace("<", "&lt;")

    rows = ["| flag | argument | default | meaning |", "|---|---|---|---|"]
    # argparse has no public way to list a parser's arguments; its help formatter reads
    # these same attributes.
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if _is_config_flag(action, fields) or action.help == argparse.SUPPRESS:
            continue  # a config key (tables above), or a flag --help hides too
        name = " ".join(action.option_strings) or action.dest
        if action.nargs == 0:
            argument = "—"  # a switch
        elif not action.option_strings:
            argument = "(positional)"
        else:
            metavar = action.metavar or action.dest.upper()
            argument = {"+": f"{metavar} ...", "*": f"[{metavar} ...]", "?": f"[{metavar}]"}
            argument = argument.get(action.nargs, metavar)
            if isinstance(action, argparse._AppendAction):
                argument += " (repeatable)"
        meaning = (action.help or "") % {**vars(action), "prog": parser.prog}  # as argparse
        if action.choices is not None:
            meaning += ". One of: " + ", ".join(f"`{choice}`" for choice in action.choices)
        default = action.default
        unset = default is None or default is False or default == [] or default is argparse.SUPPRESS
        shown = "—" if unset else f"`{default}`"
        rows.append(f"| `{name}` | {text(argument)} | {shown} | {text(meaning)} |")
    return rows


def command_line_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """The flags of ``scaffold-jax`` and of each of its commands that are not config keys
    (``--out`` of ``diagnose``, ``--resume``, ``--seeds``, ``--grid``, ``--set``...), as
    Markdown, read from the argparse parser itself (``parser``, by default
    :func:`scaffold_jax.cli.build_parser`): its help text, argument and default."""
    from scaffold_jax import cli, experiments
    from scaffold_jax.experiments import RunConfig

    parser = parser if parser is not None else cli.build_parser()
    fields = {field.name for field in dataclasses.fields(RunConfig)}
    every_field = {
        f.name for f in dataclasses.fields(RunConfig) if f.metadata["kind"] != "table"
    } - {"plugins"}
    every_declared = {**experiments.declared_hparams(), **experiments.declared_options()}
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    lines = [
        "",
        "## Command-line flags",
        "",
        "Generated from the parser of `scaffold-jax` (`scaffold_jax.cli.build_parser`).",
        "Besides the config keys above, which each command takes as flags as listed,",
        "every command has flags of its own: they say where the output goes and how the",
        "run is driven, and are not config keys.",
    ]
    if any(not isinstance(a, argparse._HelpAction) for a in parser._actions if a.option_strings):
        lines += ["", "### `scaffold-jax` (before the command)", ""]
        lines += _flags_table(parser, fields)
    for name, command in commands.choices.items():
        given = [a for a in command._actions if _is_config_flag(a, fields)]
        keys = {a.dest for a in given if a.dest in fields}
        declared = {a.dest.removeprefix("declared:") for a in given} - keys
        if keys == every_field and declared == set(every_declared):
            takes = "every config key above, and every declared hyper-parameter and option"
        elif not keys and not declared:
            takes = "no config key (its flags are its own)"
        else:
            takes = ", ".join(f"`{key}`" for key in sorted(keys))
            if declared:
                takes += "; the declared " + ", ".join(f"`{d}`" for d in sorted(declared))
        lines += [
            "",
            f"### `scaffold-jax {name}`",
            "",
            f"Takes as flags {takes}. Its own flags:",
            "",
        ]
        lines += _flags_table(command, fields)
    return "\n".join(lines) + "\n"


def config_markdown() -> str:
    """``docs/config.md``: :func:`~scaffold_jax.experiments.config_reference` (the config
    keys) and :func:`command_line_reference` (the flags that are not config keys). Run it
    in a process without plugins: what they register would be listed too."""
    from scaffold_jax.experiments import config_reference

    return config_reference() + command_line_reference()


def write_config_reference(path: str | Path) -> Path:
    """Writes :func:`config_markdown` to ``path``."""
    path = Path(path)
    path.write_text(config_markdown())
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
