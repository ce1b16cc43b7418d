"""The oldest versions of the core dependencies that scaffold_jax works with, checked at import.

pip enforces pyproject.toml's floors, but an install that skips dependency resolution
(``pip install --no-deps``, as the notebooks' Colab cell does to keep Colab's own jax) can
leave an older jax, flax or optax in place. Without this check that shows up as an error
deep inside the import (jax < 0.5.3 has no ``jax.sharding.AxisType``) or, worse, not at all:
with jax 0.5.3 and 0.6.0, programs reloaded from the persistent compilation cache (which
the command line turns on) return NaN. These floors are pyproject.toml's (tests/test_versions.py
checks that they agree) and ``make test-min`` runs the smoke tests at exactly these versions.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import metadata

#: Distribution name -> the oldest version that passes ``make test-min``.
MINIMUM = {
    "jax": "0.6.1",
    "flax": "0.10.0",
    "optax": "0.2.5",
    "numpy": "1.25.2",
    "orbax-checkpoint": "0.10.0",
}


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"0.6.1rc1"`` and ``"0.6.1.dev2025"`` give
    ``(0, 6, 1)``; ``()`` when it does not start with a number."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def check(version_of: Callable[[str], str] = metadata.version) -> None:
    """Raises ImportError naming every dependency older than :data:`MINIMUM`, with the found
    and the required version and the pip command that fixes it.

    A dependency that pip does not know (built from source, vendored) or whose version is
    not a number is not judged: its own import then decides."""
    too_old = []
    for name, floor in MINIMUM.items():
        try:
            found = version_of(name)
        except metadata.PackageNotFoundError:
            continue
        if release(found) and release(found) < release(floor):
            too_old.append((name, found, floor))
    if too_old:
        found = ", ".join(f"{name} {version}" for name, version, _ in too_old)
        needed = " ".join(f"'{name}>={floor}'" for name, _, floor in too_old)
        raise ImportError(
            f"scaffold_jax needs newer dependencies than this environment has (found {found}); "
            f"upgrade them with: pip install -U {needed}"
        )
