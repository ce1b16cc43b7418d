"""``make docs``: the documentation site, the API reference (HTML, by pdoc), the config key
reference and the command reference.

``python -m scaffold_jax.docs --site docs/_build/html`` writes

* the site (:func:`build_site`): the pages of ``docs/`` built by Sphinx with myst-nb,
  the tutorials the notebooks copied into ``docs/tutorials/`` (:func:`sync_notebooks`;
  with their outputs where :func:`execute_notebooks` ran them); generated, not committed;
* in it, ``api/``: the API reference, a page for every public module of the package
  (:func:`public_modules`, whatever ``__all__`` lists), rendered by pdoc (the ``dev``
  extra) from the Google-style docstrings;
* ``docs/reference/cli.md``: every command's ``--help`` (:func:`cli_markdown`),
  committed, checked by the tests to be current;
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


def _own_flags(actions: list[argparse.Action], fields: set[str]) -> list[argparse.Action]:
    """The flags of ``actions`` that are not config keys (nor ``--help``, nor hidden)."""
    return [
        action
        for action in actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        # a config key (tables above), or a flag --help hides too
        and not (_is_config_flag(action, fields) or action.help == argparse.SUPPRESS)
    ]


def _flags_table(
    parser: argparse.ArgumentParser, fields: set[str], actions: list[argparse.Action] | None = None
) -> list[str]:
    """One row per flag of ``parser`` (or of its ``actions``) that is not a config key (nor
    ``--help``)."""

    def text(value: str) -> str:
        return " ".join(value.split()).replace("|", "\\|").replace("<", "&lt;")

    rows = ["| flag | argument | default | meaning |", "|---|---|---|---|"]
    # argparse has no public way to list a parser's arguments; its help formatter reads
    # these same attributes.
    for action in _own_flags(parser._actions if actions is None else actions, fields):
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
        "run is driven, and are not config keys. They are listed by the group of",
        "`--help` that shows them.",
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
        lines += ["", f"### `scaffold-jax {name}`", "", f"Takes as flags {takes}. Its own flags:"]
        # By the groups of the command's --help (scaffold_jax.cli_flags.HELP_GROUPS).
        for group in command._action_groups:
            if _own_flags(group._group_actions, fields):
                lines += ["", f"#### {group.title}", ""]
                lines += _flags_table(command, fields, group._group_actions)
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


def cli_markdown() -> str:
    """``docs/reference/cli.md``: the ``--help`` of ``scaffold-jax`` and of every command, as
    each prints it at 88 columns (its flags in the groups of
    :data:`scaffold_jax.cli_flags.HELP_GROUPS`). Run it in a process without plugins."""
    import os
    from unittest import mock

    from scaffold_jax import cli

    with mock.patch.dict(os.environ, {"COLUMNS": "88"}):  # argparse wraps at $COLUMNS
        parser, commands = cli._build_parsers()
        helps = {"": parser.format_help()}
        helps.update({f" {name}": command.format_help() for name, command in commands.items()})
    lines = [
        "# Command line",
        "",
        "Every command's `--help`, generated from the parser (`python -m scaffold_jax.docs`;",
        "the tests check it is current). The flags that are config keys are described with",
        "their types, defaults and choices in the [config reference](../config.md).",
    ]
    for name, text in helps.items():
        lines += ["", f"## `scaffold-jax{name}`", "", "```text", text.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def execute_notebooks(source: str | Path, dest: str | Path, timeout: int = 1800) -> list[Path]:
    """Runs every notebook of ``source`` at its defaults in a fresh kernel (in a scratch
    folder, the datasets it builds cached there) and writes it with its outputs into
    ``dest``: the tutorials the site renders with their outputs (myst-nb does not execute
    them; ``dest`` is not committed). The notebooks of ``source`` stay clean (the tests
    check it); a copy older than its notebook is replaced by :func:`sync_notebooks`.
    Minutes: each notebook's defaults take up to 3 CPU-minutes."""
    import os
    import tempfile
    from unittest import mock

    import nbclient
    import nbformat

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(Path(source).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        with tempfile.TemporaryDirectory() as scratch:
            cache = {"SCAFFOLD_JAX_CACHE_DIR": os.path.join(scratch, "cache")}
            with mock.patch.dict(os.environ, cache):  # the kernel inherits the environment
                client = nbclient.NotebookClient(
                    nb, timeout=timeout, kernel_name="python3",
                    resources={"metadata": {"path": scratch}},
                )  # fmt: skip
                client.execute()
        nbformat.write(nb, dest / path.name)
        written.append(dest / path.name)
    return written


def sync_notebooks(source: str | Path, dest: str | Path) -> list[Path]:
    """Copies every notebook of ``source`` into ``dest`` (the site's tutorials, not
    committed) unless ``dest`` holds it already with the same cells: an executed copy
    (:func:`execute_notebooks`, ``make docs-notebooks``) is kept with its outputs until
    its notebook changes; otherwise the site renders the notebook without outputs.
    Returns the paths copied."""
    import nbformat

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(Path(source).glob("*.ipynb")):
        target = dest / path.name
        cells = [c.source for c in nbformat.read(path, as_version=4).cells]
        if target.exists():
            kept = [c.source for c in nbformat.read(target, as_version=4).cells]
            if kept == cells:
                continue
        target.write_bytes(path.read_bytes())
        copied.append(target)
    return copied


def build_site(out: str | Path, source: str | Path = "docs") -> list[str]:
    """Builds the documentation site: the pages of ``source`` (Sphinx with myst-nb, the
    ``dev`` extra) into ``out``, then the API reference (:func:`build_api`) into
    ``out/api``, which the reference pages link to. Returns every warning of both, each
    one line (an empty list: a clean build); the tests require none."""
    import contextlib
    import io

    from sphinx.cmd.build import build_main

    out, source = Path(out), Path(source)
    sync_notebooks("notebooks", source / "tutorials")
    warnings_file = out / ".sphinx-warnings.txt"
    out.mkdir(parents=True, exist_ok=True)
    argv = ["-b", "html", "-q", "-E", "-d", str(out / ".doctrees"), "-w", str(warnings_file)]
    with contextlib.redirect_stderr(io.StringIO()):  # the same lines go to warnings_file
        status = build_main([*argv, str(source), str(out)])
    found = [line for line in warnings_file.read_text().splitlines() if line.strip()]
    if status and not found:
        found = [f"sphinx-build exited with status {status}"]
    return found + build_api(out / "api")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--api", help="also write the API reference alone into this folder (the site has it)"
    )
    parser.add_argument(
        "--config", default="docs/config.md", help="config key reference [docs/config.md]"
    )
    parser.add_argument(
        "--cli", default="docs/reference/cli.md", help="command reference [docs/reference/cli.md]"
    )
    parser.add_argument("--site", help="build the documentation site into this folder")
    parser.add_argument("--source", default="docs", help="the site's pages [docs]")
    parser.add_argument(
        "--notebooks",
        metavar="FOLDER",
        help="execute notebooks/*.ipynb at their defaults into FOLDER (docs/tutorials: the "
        "site's tutorials; minutes) and do nothing else",
    )
    args = parser.parse_args(argv)
    if args.notebooks:
        for path in execute_notebooks("notebooks", args.notebooks):
            print(f"wrote {path}")
        return 0
    print(f"wrote {write_config_reference(args.config)}")
    Path(args.cli).write_text(cli_markdown())
    print(f"wrote {args.cli}")
    problems = []
    if args.api:
        problems += build_api(args.api)
        print(f"wrote {args.api}/")
    if args.site:
        problems += build_site(args.site, args.source)
        print(f"wrote {args.site}/ (open {args.site}/index.html)")
    for line in problems:
        print(line)
    print(f"{len(problems)} warnings")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
