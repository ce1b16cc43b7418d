"""The library versions a run's identity records, and the resume check on them.

A run resumed under other versions of jax, jaxlib or numpy continues correctly but may
differ from an uninterrupted run in the last bits, so a resume across versions is refused,
naming both, unless accepted (``--accept-new-versions``, :func:`accept_new_versions`).
The versions are recorded rather than a hash of any library file: a patch release must
not make every resume fail with an opaque digest mismatch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from scaffold_jax.registry import ConfigError

_ACCEPT_NEW_VERSIONS = contextvars.ContextVar("accept_new_versions", default=False)


def library_versions() -> dict[str, str]:
    """The versions of the libraries a run's numbers depend on (a run's identity holds
    them): a resume under others may differ from an uninterrupted run in the last bits."""
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__}


@contextlib.contextmanager
def accept_new_versions(accept: bool = True):
    """Within it, a resume whose checkpoint was written under other library versions
    (:func:`library_versions`) goes on instead of being refused (``--accept-new-versions``).

    Example:
      >>> with accept_new_versions():  # doctest: +SKIP
      ...     sim.run(data, hp, 100, checkpoint_dir="ckpt", resume=True)
    """
    token = _ACCEPT_NEW_VERSIONS.set(bool(accept))
    try:
        yield
    finally:
        _ACCEPT_NEW_VERSIONS.reset(token)


def check_versions(saved: Mapping[str, Any], where: str) -> None:
    """Refuses to resume ``saved`` (a run identity) under other library versions than it
    was written with, naming both, unless within :func:`accept_new_versions`. An identity
    written before versions were recorded is not checked."""
    then = saved.get("versions")
    if not isinstance(then, Mapping):
        return
    now = library_versions()
    changed = [k for k in now if then.get(k) != now[k]]
    if not changed or _ACCEPT_NEW_VERSIONS.get():
        return
    was = ", ".join(f"{k} {then.get(k)}" for k in changed)
    is_ = ", ".join(f"{k} {now[k]}" for k in changed)
    raise ConfigError(
        f"cannot resume from {where}: it was written with {was}, and this is {is_}; a resume "
        "across versions continues correctly but may differ from an uninterrupted run in "
        "the last bits. Pass --accept-new-versions (Python: within "
        "scaffold_jax.loop.accept_new_versions()) to resume anyway, or start a new run."
    )
