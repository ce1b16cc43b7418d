"""The paper's experiments as protocols: Figure 3 and Tables 3, 4 and 5.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
ICML 2020 (arXiv:1910.06378). :func:`reproduce` runs a named protocol: ``fig3`` (the
simulated quadratics of Figure 3) and ``table3`` / ``table4`` / ``table5`` (EMNIST in the
paper; Fashion-MNIST offline). η_l is tuned per algorithm over a grid, as the paper did,
with one vmapped program per grid (a cell of :func:`scaffold_jax.experiments.run_grid`); the chosen
values are reported next to the tables.

Choices the paper (Karimireddy et al., ICML 2020, Section 7) leaves open are fields of the protocol
dataclasses, documented where they are defined: :class:`Fig3Protocol` (the quadratic
family, start point, error target, η_l grid) and :class:`TableProtocol` (dataset, target,
η_l grids, hidden sizes, evaluation cadence).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from scaffold_jax.experiments import ConfigError
from scaffold_jax.experiments.identity import short_digest
from scaffold_jax.paper.protocols import (
    Fig3Protocol,
    Row,
    TableProtocol,
    fig3_protocol,
    table3_protocol,
    table4_protocol,
    table5_protocol,
    table_target,
)
from scaffold_jax.paper.runs import (
    fig3_grid,
    fig3_table,
    format_table,
    reproduce_fig3,
    reproduce_table,
    resolve_dataset,
    table_grid,
)

__all__ = [
    "PROTOCOLS", "Fig3Protocol", "Row", "TableProtocol", "default_folder", "fig3_grid",
    "fig3_protocol", "fig3_table", "format_table", "reproduce", "reproduce_fig3",
    "reproduce_table", "resolve_dataset", "table3_protocol", "table4_protocol",
    "table5_protocol", "table_grid", "table_target",
]  # fmt: skip

PROTOCOLS: dict[str, Callable[..., Any]] = {
    "fig3": fig3_protocol,
    "table3": table3_protocol,
    "table4": table4_protocol,
    "table5": table5_protocol,
}


#: Protocol fields a ``--resume`` may change (a cell run with another horizon runs again):
#: left out of the default folder's name, so that the resumed command finds its folder.
_RESUMABLE = ("num_rounds", "eval_every", "data_dir", "download")


def default_folder(name: str, quick: bool, overrides: Mapping[str, Any]) -> Path:
    """``results/<name>`` (``-quick``), followed by a digest of the protocol fields set
    (those a resume may change aside) when there are any: two protocols never share a
    folder, and the same command with ``--resume`` finds its own.

    Examples:
      >>> str(default_folder("table3", True, {"num_rounds": 50}))
      'results/table3-quick'
      >>> str(default_folder("table3", False, {"seeds": (0, 1, 2)}))
      'results/table3-3dc3171d'
    """
    folder = name + ("-quick" if quick else "")
    fixed = {k: v for k, v in overrides.items() if k not in _RESUMABLE}
    if fixed:
        folder += "-" + short_digest(fixed)
    return Path("results") / folder


def reproduce(
    name: str,
    out: str | os.PathLike | None = None,
    *,
    quick: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    resume: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """Runs a named protocol (``fig3``, ``table3``, ``table4``, ``table5``).

    Args:
      name: the protocol.
      out: the output folder (default: :func:`default_folder`).
      quick: the test-sized variant.
      overwrite: replace a folder that holds a run.
      quiet: print nothing but errors.
      resume: continue the protocol the folder holds: its finished cells (one η_l grid
        each, recorded in ``parts.jsonl``) are kept, the others run again.
      **overrides: protocol fields to change (e.g. ``dataset="fashion_mnist"``,
        ``num_rounds=300``, ``target=0.6``).

    Returns:
      The summary written to ``summary.json``.
    """
    if name not in PROTOCOLS:
        raise ConfigError(f"experiment = {name!r} is unknown: it must be one of {list(PROTOCOLS)}.")
    protocol = PROTOCOLS[name](quick=quick, **overrides)
    out = Path(out) if out is not None else default_folder(name, quick, overrides)
    if name == "fig3":
        return reproduce_fig3(protocol, out, overwrite=overwrite, quiet=quiet, resume=resume)
    return reproduce_table(protocol, out, overwrite=overwrite, quiet=quiet, resume=resume)
