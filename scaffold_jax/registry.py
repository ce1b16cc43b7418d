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

import difflib
import importlib
import importlib.util
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

PLUGIN_HINT = (
    "an entry defined outside scaffold_jax is registered when its module is imported: "
    "pass --plugin MODULE_OR_FILE.py (config key 'plugins')"
)


class Registry(Generic[T]):
    """Entries of one kind by name, in registration order.

    Args:
      kind: what the entries are, for messages ("algorithm", "model", ...).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

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
        """``"<kind> 'x' is unknown (did you mean ...?); use one of ..."``."""
        close = difflib.get_close_matches(str(name), list(self._entries), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (
            f"{self.kind} {name!r} is unknown{hint}; use one of {', '.join(self._entries)} "
            f"({PLUGIN_HINT})."
        )

    def __contains__(self, name: object) -> bool:
        return name in self._entries

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


def load_plugins(specs: Iterable[str]) -> list[str]:
    """Imports plugin modules so that their entries register themselves.

    Args:
      specs: dotted module names, or paths of ``.py`` files (imported under their stem;
        importing the same file twice reuses the module).

    Returns:
      The names of the imported modules.

    Raises:
      ValueError: a module that cannot be found, or that fails while importing (the
        original error is chained).
    """
    loaded = []
    for spec in specs:
        spec = str(spec)
        path = Path(spec)
        try:
            if spec.endswith(".py"):
                if not path.is_file():
                    raise ValueError(f"plugin file {spec} does not exist.")
                name = f"scaffold_jax_plugin_{path.stem}"
                if name not in sys.modules:
                    module_spec = importlib.util.spec_from_file_location(name, path)
                    module = importlib.util.module_from_spec(module_spec)
                    sys.modules[name] = module
                    try:
                        module_spec.loader.exec_module(module)
                    except BaseException:
                        del sys.modules[name]
                        raise
            else:
                name = spec
                importlib.import_module(spec)
        except ValueError:
            raise
        except ModuleNotFoundError as err:
            raise ValueError(
                f"plugin {spec!r} cannot be imported ({err}); give a module on sys.path "
                "(e.g. mylab.algorithms) or the path of a .py file."
            ) from err
        except Exception as err:
            raise ValueError(f"plugin {spec!r} failed while importing: {err!r}") from err
        loaded.append(name)
    return loaded
