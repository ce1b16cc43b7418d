"""The software and hardware a run used, recorded in its summary: :func:`environment`
(library versions, devices) and :func:`git_revision` (the checkout's commit)."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


@functools.cache
def git_revision() -> dict[str, Any]:
    """``{"git_commit": <sha>, "git_dirty": <bool>}`` of the checkout the package is
    imported from (dirty: tracked files changed since that commit); both None when it is
    not in one (an installed wheel), or git is missing or fails."""
    root = Path(__file__).resolve().parents[3]  # src/scaffold_jax/results/provenance.py

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *argv], capture_output=True, text=True, check=True,
            timeout=10,
        ).stdout.strip()  # fmt: skip

    try:
        # The checkout must be the package's own: a wheel installed into a virtualenv
        # that happens to sit inside some other repository is not in a checkout.
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return {"git_commit": None, "git_dirty": None}
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit or None, "git_dirty": dirty if commit else None}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """The software and hardware a run used: the package's version and git commit (see
    :func:`git_revision`), the versions of python, jax, jaxlib, flax, optax and numpy
    (None for one not installed), and the devices."""
    import jax
    import jaxlib

    devices = jax.devices()
    return {
        "scaffold_jax": _version("scaffold-jax"),
        **git_revision(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": _version("flax"),
        "optax": _version("optax"),
        "numpy": _version("numpy"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind if devices else None,
        "num_devices": len(devices),
    }
