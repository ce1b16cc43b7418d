"""JAX's persistent compilation cache for the command line.

Every ``scaffold-jax`` command compiles its round and evaluation programs; with the cache a
second run of the same configuration (same shapes, algorithm, plan, S, jax version and
device) loads them from disk instead (first and second start-up times are in
benchmarks/README.md). The command line turns it on by default in a per-user folder:
``$SCAFFOLD_JAX_COMPILE_CACHE`` if set, else ``$XDG_CACHE_HOME/scaffold_jax/xla`` (default
``~/.cache/scaffold_jax/xla``); ``--no-compile-cache`` or ``SCAFFOLD_JAX_COMPILE_CACHE=off``
turns it off. The library never turns it on by itself: in a notebook or a script, call
:func:`enable` (or set JAX's own ``jax_compilation_cache_dir``).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV = "SCAFFOLD_JAX_COMPILE_CACHE"
_OFF = ("", "0", "off", "false", "no")

#: Every program is kept, however fast it compiled: a threshold would make what a second
#: run finds depend on how loaded the machine was during the first (the evaluation
#: compiles in 0.1-0.3 s), and the small ones cost a few KiB each.
MIN_COMPILE_SECONDS = 0.0


def default_directory() -> Path | None:
    """Where the command line caches compiled programs; None when ``$SCAFFOLD_JAX_COMPILE_CACHE``
    turns the cache off."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "scaffold_jax" / "xla"


def enable(directory: str | os.PathLike | None = None) -> Path | None:
    """Turns JAX's persistent compilation cache on in ``directory`` (default
    :func:`default_directory`) and returns it; None (and nothing changes) when the cache is
    off. It takes effect only if nothing has been compiled yet in this process (JAX reads
    the setting at its first compilation), so call it first."""
    folder = default_directory() if directory is None else Path(directory)
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache rather than fail
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder
