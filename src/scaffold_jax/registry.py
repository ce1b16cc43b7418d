"""Open vocabularies: name → entry registries, and plugins that add to them.

Algorithms, models, datasets and partitioners each have one :class:`Registry`. The layers
above them (experiments, sweeps, the paper's protocols, the command line) look names up
here and never compare a name with a string of their own, so an entry added from outside
the package (a researcher's own algorithm in their own module) is usable everywhere a
built-in one is.

A plugin is any module that registers entries when it is imported. Load it with
:func:`load_plugins` (the command line's ``--plugin`` flag and the config key ``plugins``
call it): a dotted module name (``mylab.algorithms``) or the path of a ``.py`` file.

Examples:
  >>> colours = Registry("colour")
  >>> _ = colours.register("red", (255, 0, 0))
  >>> colours["red"], colours.names()
  ((255, 0, 0), ('red',))
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import math
import re
import signal
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

T = TypeVar("T")

#: How an entry defined outside scaffold_jax gets registered: said once, in ``--help``
#: (the ``--plugin`` flag's), not after every unknown name (a typo's message stays one
#: line: the name, the nearest known one, the known ones).
PLUGIN_HINT = (
    "an entry defined outside scaffold_jax is registered when its module is imported: "
    "pass --plugin MODULE_OR_FILE.py (config key 'plugins')"
)


def suggest(name: object, known: Iterable[str]) -> str | None:
    """The known name ``name`` most likely meant, or None: the same name up to case, ``-``
    and ``_`` (``Fashion-MNIST``), an abbreviation made of the initials of its first words
    and its last word (``fmnist`` for ``fashion_mnist``), else the closest spelling.

    Examples:
      >>> suggest("fmnist", ["mnist", "fashion_mnist", "femnist"])
      'fashion_mnist'
      >>> suggest("gren", ["red", "green"])
      'green'
    """
    known = list(known)
    text = str(name)

    def plain(s: str) -> str:
        return s.lower().replace("-", "_")

    for candidate in known:
        if plain(candidate) == plain(text):
            return candidate
    for candidate in known:
        words = [w for w in re.split(r"[_/]", plain(candidate)) if w]
        if len(words) > 1 and plain(text).replace("_", "") == (
            "".join(w[0] for w in words[:-1]) + words[-1]
        ):
            return candidate
    close = difflib.get_close_matches(text, known, n=1)
    return close[0] if close else None


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for :func:`suggest`'s name, else ``""``."""
    close = suggest(name, known)
    return f" (did you mean {close!r}?)" if close is not None else ""


class ConfigError(ValueError):
    """An invalid configuration; the message names every bad field, its value and the
    allowed range."""


def in_one_line(what: str, errors: Iterable[str]) -> str:
    """``errors`` as one line after ``what`` (``"invalid config: a = 1 is invalid: ...
    b = 2 ..."``): each error a sentence, any line break inside one a space, so that the
    command line's error is one line whatever was wrong.

    Examples:
      >>> in_one_line("invalid config", ["rounds = 0 is invalid: it must be >= 1.", "seed = -1"])
      'invalid config: rounds = 0 is invalid: it must be >= 1. seed = -1.'
    """
    sentences = [" ".join(str(e).split()) for e in errors]
    return f"{what}: " + " ".join(s if s.endswith((".", "?", "!")) else s + "." for s in sentences)


#: The kinds of value an :class:`Option` takes, and the Python type of one element.
KINDS = {"int": int, "float": float, "str": str, "bool": bool, "ints": int, "floats": float}


class Option(NamedTuple):
    """An option a registered entry declares (a model's width, a partitioner's α, a
    dataset's minimum client size, an algorithm's variant): the one description from which
    the config file, ``--set``, the generated flags, ``docs/config.md``, ``sweep --grid``
    and the run identity are derived.

    Attributes:
      default: the value used when none is given.
      help: one line for ``--help`` and the docs.
      kind: ``int``, ``float``, ``str``, ``bool``, ``ints`` or ``floats`` (lists).
      choices: the allowed values, or None for any of the kind.
      low, high: the allowed range of a number (of every element of a list); None: open.
      strict: whether ``low`` itself is excluded (``> low`` rather than ``>= low``).
      argument: the keyword the entry's factory takes it as (default: its name).
      normalize: maps a given value to its canonical form before it is checked (e.g.
        SCAFFOLD's option ``2`` to ``"II"``; raises ValueError saying why it refuses one).
      what: what a valid value is, in words, for messages (default: from the kind and
        range, :meth:`describe`).
      tradeoff: whether the value is a cost the user trades against accuracy (a target
        epsilon, a round deadline, FedBuff's concurrency) rather than a knob tuned for it:
        a sweep reports one row per value of such an axis (the frontier) and picks its
        best only over the other axes.

    Examples:
      >>> opt = Option(0.5, "Dirichlet concentration", "float", low=0.0, strict=True)
      >>> opt.error("alpha", -1.0)
      'alpha = -1.0 is invalid: it must be a number > 0.'
    """

    default: Any
    help: str = ""
    kind: str = "str"
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    strict: bool = False
    argument: str | None = None
    normalize: Callable[[Any], Any] | None = None
    what: str | None = None
    tradeoff: bool = False

    @property
    def is_switch(self) -> bool:
        """Whether it is an on/off option (the command line gives it as a bare flag)."""
        return self.kind == "bool"

    @property
    def is_number(self) -> bool:
        """Whether it is one number (a sweep may take it as an axis)."""
        return self.kind in ("int", "float") and self.choices is None

    def parse(self, value: Any) -> Any:
        """``value`` in its canonical form: normalised, a switch's text as a bool, an int
        given for a float as a float, a tuple as a list.

        Raises:
          ValueError: ``normalize`` refuses it (the message says why).
        """
        if self.normalize is not None:
            value = self.normalize(value)
        if self.kind == "bool" and isinstance(value, (str, int)) and not isinstance(value, bool):
            words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
            value = words.get(str(value).strip().lower(), value)
        if self.kind == "float":
            value = _as_float(value)
        if self.kind == "floats" and isinstance(value, (list, tuple)):
            value = [_as_float(v) for v in value]
        if isinstance(value, tuple):
            value = list(value)
        return value

    def error(self, name: str, value: Any) -> str | None:
        """Why ``value`` is invalid for the option ``name`` (None: it is valid)."""
        try:
            parsed = self.parse(value)
        except (ValueError, TypeError) as err:  # a normaliser's refusal
            return f"{name} = {value!r} is invalid: {err}"
        if self.choices is not None:
            if parsed in self.choices:
                return None
            return (
                f"{name} = {value!r} is invalid: it must be one of "
                + ", ".join(repr(c) for c in self.choices)
                + "."
            )
        many = self.kind in ("ints", "floats")
        values = parsed if many and isinstance(parsed, list) else [parsed]
        if (many and (not isinstance(parsed, list) or not parsed)) or not all(
            self._fits(v) for v in values
        ):
            return f"{name} = {value!r} is invalid: it must be {self.describe()}."
        return None

    def describe(self) -> str:
        """What a valid value is, in words ("an integer >= 1", "a list of numbers > 0")."""
        if self.what is not None:
            return self.what
        element = KINDS[self.kind]
        what = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
        words = what[element]
        if self.low is not None:
            words += f" {'>' if self.strict else '>='} {self.low:g}"
        if self.high is not None:
            words += f"{' and' if self.low is not None else ''} <= {self.high:g}"
        if self.kind in ("ints", "floats"):
            words = "a non-empty list of " + words.replace("an integer", "integers").replace(
                "a number", "numbers"
            )
        return words

    def _fits(self, value: Any) -> bool:
        element = KINDS[self.kind]
        if element is bool:
            return isinstance(value, bool)
        if element is str:
            return isinstance(value, str)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if element is int and not isinstance(value, int):
            return False
        try:
            if not math.isfinite(value):
                return False
        except OverflowError:  # an int beyond float64
            return False
        if self.low is not None and (value < self.low or (self.strict and value == self.low)):
            return False
        return self.high is None or value <= self.high


def _as_float(value: Any) -> Any:
    """An int given for a float option as a float (one beyond float64 as it is, for the
    range check to refuse); anything else as it is."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return value
    return value


def resolve_options(declared: Mapping[str, Option], given: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: value}`` of every declared option: the given value (parsed) or its
    default, in declaration order."""
    return {name: opt.parse(given.get(name, opt.default)) for name, opt in declared.items()}


def factory_kwargs(declared: Mapping[str, Option], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` of the declared options as the factory's keyword arguments."""
    return {opt.argument or name: values[name] for name, opt in declared.items() if name in values}


class Registry(Generic[T]):
    """Entries of one kind by name, in registration order.

    Args:
      kind: what the entries are, for messages ("algorithm", "model", ...).
    """

    #: Every registry made, for :func:`snapshot` (weak: a scratch registry may go).
    _all: weakref.WeakSet[Registry] = weakref.WeakSet()

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}
        Registry._all.add(self)

    def register(self, name: str, entry: T, *, replace: bool = False) -> T:
        """Adds ``entry`` under ``name`` and returns it.

        Raises:
          ValueError: ``name`` is not a non-empty string, or is taken (unless ``replace``:
            re-importing a plugin module re-registers its entries).
        """
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}.")
        if name in self._entries and not replace and self._entries[name] is not entry:
            raise ValueError(
                f"{self.kind} {name!r} is already registered; choose another name or pass "
                "replace=True."
            )
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(self.unknown_message(name))
        return self._entries[name]

    def unknown_message(self, name: object) -> str:
        """``"<kind> 'x' is unknown (did you mean ...?); use one of ..."``: one line (how a
        plugin registers its entries is said in ``--help``)."""
        hint = did_you_mean(name, self._entries)
        return f"{self.kind} {name!r} is unknown{hint}; use one of {', '.join(self._entries)}."

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def items(self):
        return self._entries.items()


class RegistryUnion(Registry):
    """Several registries read as one (e.g. the pooled and the naturally federated
    datasets a config's ``dataset`` may name); entries are added to the parts.

    Args:
      kind: what the entries are, for messages.
      parts: the registries, searched in order.
    """

    def __init__(self, kind: str, *parts: Registry):
        self.kind, self.parts = kind, parts

    @property
    def _entries(self) -> dict:  # read by every Registry method: always the parts' now
        return {name: entry for part in self.parts for name, entry in part.items()}

    def register(self, name: str, entry, *, replace: bool = False):
        raise TypeError(
            f"register {self.kind}s in one of its parts ({', '.join(p.kind for p in self.parts)})."
        )


class Snapshot(NamedTuple):
    """Every registry's entries, and the plugin modules imported, at one moment."""

    entries: dict[Registry, dict[str, Any]]
    plugins: frozenset[str]


def snapshot() -> Snapshot:
    """The entries of every registry and the plugin modules imported so far; hand it to
    :func:`restore` to undo what was registered since (the tests do around each test)."""
    plugins = frozenset(n for n in sys.modules if n.startswith(_PLUGIN_PREFIX))
    return Snapshot({r: dict(r._entries) for r in list(Registry._all)}, plugins)


def restore(snap: Snapshot) -> None:
    """Every registry as it was at ``snap``; plugin modules imported since are forgotten,
    so loading one again registers its entries again."""
    for registry, entries in snap.entries.items():
        registry._entries = dict(entries)
    for name in [n for n in sys.modules if n.startswith(_PLUGIN_PREFIX)]:
        if name not in snap.plugins:
            del sys.modules[name]


_PLUGIN_PREFIX = "scaffold_jax_plugin_"


_PLUGIN_MODULES: set[str] = set()  # every plugin module loaded, by name


def plugin_blamed(err: BaseException) -> str | None:
    """``"<file>:<line> (in <function>)"`` of the innermost frame of ``err``'s traceback
    that runs a plugin's code (None: none does), so that a plugin's bug is reported as
    the plugin's, in one line."""
    where = None
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_globals.get("__name__", "")
        if module in _PLUGIN_MODULES or module.startswith(_PLUGIN_PREFIX):
            where = f"{frame.f_code.co_filename}:{tb.tb_lineno} (in {frame.f_code.co_name})"
        tb = tb.tb_next
    return where


@contextlib.contextmanager
def _sigint_watched() -> Iterator[Callable[[], bool]]:
    """Yields whether a SIGINT arrived since entering (the previous handler still runs:
    Ctrl-C interrupts as before). Outside the main thread, where no handler can be set,
    every KeyboardInterrupt counts as a real one."""
    seen = []
    try:
        previous = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            seen.append(signum)
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, handler)
    except (ValueError, TypeError):  # not the main thread (or no handler to restore)
        yield lambda: True
        return
    try:
        yield lambda: bool(seen)
    finally:
        signal.signal(signal.SIGINT, previous)


def _innermost(err: BaseException) -> str | None:
    """``"<file>:<line> (in <function>)"`` of the frame that raised ``err``."""
    tb = err.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno} (in {tb.tb_frame.f_code.co_name})"


def _import_file(path: Path) -> str:
    """Imports a plugin file under ``scaffold_jax_plugin_<stem>`` (a second file of the
    same stem in another folder gets a name of its own, never the first one's module);
    importing the same file again reuses its module."""
    name = f"{_PLUGIN_PREFIX}{path.stem}"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(loaded.__file__).resolve() != path.resolve():
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
        name = f"{name}_{digest}"
    if name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return name


def code_of(entry: Any) -> dict[str, str]:
    """Where an entry's code lives, when outside scaffold_jax: ``{module: "<file> sha256
    <digest>"}`` of every module that defines one of its callables (a spec's factory, a
    partial's function). A run's identity holds it, so that a resume refuses a plugin file
    edited since, or a plugin that replaced a built-in entry; the package's own code is
    left out (an upgrade of scaffold_jax may resume its runs)."""
    found: dict[str, str] = {}
    fields = entry._asdict().values() if hasattr(entry, "_asdict") else vars(entry).values()
    for value in [entry, *fields] if callable(entry) else fields:
        value = getattr(value, "func", value)  # functools.partial
        name = getattr(value, "__module__", None) if callable(value) else None
        if not name or name == "scaffold_jax" or name.startswith("scaffold_jax."):
            continue
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        installed = _distribution(name)
        if installed is not None:  # an installed library's (jax's own jnp.ones_like): its
            found[name] = installed  # version, which a resume names if it changed
        elif path and Path(path).is_file():
            digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            found[name] = f"{Path(path).name} sha256 {digest}"
        else:
            found[name] = "(no source file)"
    return found


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distribution(module: str) -> str | None:
    """``"<distribution> <version>"`` of the installed package that holds ``module``,
    None for a module of no installed distribution (a plugin file)."""
    names = _distributions().get(module.partition(".")[0])
    if not names:
        return None
    try:
        return f"{names[0]} {importlib.metadata.version(names[0])}"
    except importlib.metadata.PackageNotFoundError:
        return None


def load_plugins(specs: Iterable[str]) -> list[str]:
    """Imports plugin modules so that their entries register themselves.

    Args:
      specs: dotted module names, or paths of ``.py`` files (imported under their stem;
        importing the same file twice reuses the module).

    Returns:
      The names of the imported modules.

    Raises:
      ConfigError: a module that cannot be found, or that fails (or exits) while
        importing (the original error is chained).
    """
    loaded = []
    for spec in specs:
        spec = str(spec)
        path = Path(spec)
        if spec.endswith(".py") and not path.is_file():
            raise ConfigError(
                f"plugin file {spec} "
                + ("is a directory; give a .py file." if path.is_dir() else "does not exist.")
            )
        try:
            with _sigint_watched() as pressed:
                if spec.endswith(".py"):
                    name = _import_file(path)
                else:
                    name = spec
                    importlib.import_module(spec)
        except KeyboardInterrupt as err:
            if pressed():
                raise  # a real Ctrl-C while importing: the command is interrupted
            where = _innermost(err)
            raise ConfigError(
                f"plugin {spec!r} failed while importing: it raised KeyboardInterrupt"
                f"{f' at {where}' if where else ''} (no Ctrl-C was pressed); a plugin only "
                "registers entries: fix that line or leave the plugin out."
            ) from err
        except ModuleNotFoundError as err:
            raise ConfigError(
                f"plugin {spec!r} cannot be imported ({err}); give a module on sys.path "
                "(e.g. mylab.algorithms) or the path of a .py file."
            ) from err
        except SystemExit as err:  # a script's sys.exit(): never a silent exit 0 here
            raise ConfigError(
                f"plugin {spec!r} called sys.exit({err.code!r}) while importing; a plugin "
                "only registers entries (move its script part under "
                "`if __name__ == '__main__':`)."
            ) from err
        except Exception as err:
            raise ConfigError(f"plugin {spec!r} failed while importing: {err!r}") from err
        loaded.append(name)
        _PLUGIN_MODULES.add(name)
    return loaded
