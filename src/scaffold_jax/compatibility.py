"""Which features compose with which execution mode: ONE matrix, read by the simulation's
checks (a "no" cell is refused with its reason, before anything is compiled), by the
command line's help and by the manual's composition table (generated from it; a test runs
every "yes" cell and checks every "no" cell's refusal).

A feature is on when the simulation uses it (:func:`features_of`); a cell is None where
the feature composes with the mode, else the reason it does not, in words a user reads.
The algorithms' own row is their registry entry's ``asynchronous`` (FedBuff runs an
algorithm whose client work is a function of the model it downloaded and whose contract
for a stale update is written)."""

from __future__ import annotations

from collections.abc import Mapping

#: The execution modes (``execution``, ``--execution``): the paper's synchronous rounds and
#: FedBuff's buffered asynchronous server steps.
MODES = ("sync", "fedbuff")
_NAMES = {"sync": "Synchronous rounds", "fedbuff": "FedBuff"}

#: The features, in the order the table lists them, with what each is.
FEATURES: Mapping[str, str] = {
    "availability": "availability model (clients online part of the time)",
    "stragglers": "stragglers (a client completes K_i <= K local steps)",
    "dropouts": "dropouts (an upload lost after the local work)",
    "profiles": "device profiles (the virtual clock)",
    "deadline": "round deadline D (a client slower than D is lost)",
    "over_selection": "over-selection (sample ceil(f S), keep the S first)",
    "compression": "compression of the uplink (error feedback kept per client)",
    "privacy": "user-level differential privacy (clip, Gaussian noise, accountant)",
    "attack": "Byzantine clients (an attack on what a malicious client sends)",
    "robust_aggregation": "a robust aggregator (median, trimmed mean, Krum, ...)",
    "model_statistics": "a model with running statistics (BatchNorm)",
}

_OVER_SELECTION = (
    "over-selection keeps the S first of a synchronous cohort, and FedBuff has no cohort (its "
    "buffer of B arrivals is its policy): unset over_selection, or use synchronous rounds"
)
_PRIVACY = (
    "differential privacy's accountant covers rounds of uniformly sampled clients; a FedBuff "
    "step's buffer holds whichever clients arrive first, so that amplification by sampling "
    "does not apply and no accountant here covers it: use synchronous rounds for a private run"
)

_BYZANTINE = (
    "the attacks and robust aggregators act on a synchronous round's cohort (the malicious "
    "set is drawn per run, ALIE and IPM read the round's benign messages, an aggregator the "
    "round's reporting clients), which a FedBuff step's buffer is not: use synchronous rounds"
)

#: ``MATRIX[mode][feature]``: None (composes) or the reason it does not.
MATRIX: Mapping[str, Mapping[str, str | None]] = {
    "sync": {feature: None for feature in FEATURES},
    "fedbuff": {
        **{feature: None for feature in FEATURES},
        "over_selection": _OVER_SELECTION,
        "privacy": _PRIVACY,
        "attack": _BYZANTINE,
        "robust_aggregation": _BYZANTINE,
    },
}


def features_of(algorithm, participation, problem) -> list[str]:
    """The features a simulation of ``algorithm``, ``participation`` and ``problem`` uses."""
    profiles = participation.profiles
    on = {
        # A participation model is on when it is set (its kind's name is the feature's).
        **{kind: getattr(participation, kind) is not None for kind in participation._fields},
        "deadline": profiles is not None and profiles.deadline is not None,
        "over_selection": profiles is not None and profiles.over_selection > 1.0,
        "compression": "compression" in algorithm.options,
        "privacy": "privacy" in algorithm.options,
        "attack": "attack" in algorithm.options,
        "robust_aggregation": "aggregator" in algorithm.options,
        "model_statistics": problem.model_state is not None,
    }
    return [feature for feature in FEATURES if on[feature]]


def refusal(mode: str, features: list[str]) -> str | None:
    """The first reason ``mode`` refuses one of ``features``, naming it; None if all
    compose."""
    for feature in features:
        why = MATRIX[mode][feature]
        if why is not None:
            return f"{_NAMES[mode]} with {FEATURES[feature]}: {why}."
    return None


def summary(mode: str) -> str:
    """One line for ``--help``: what ``mode`` does not compose with."""
    refused = [feature for feature in FEATURES if MATRIX[mode][feature] is not None]
    if not refused:
        return "composes with every feature"
    return f"composes with every feature but {' and '.join(refused)}"


def table() -> str:
    """The matrix as a Markdown table (the manual's composition page)."""
    lines = ["| feature | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    for feature, what in FEATURES.items():
        cells = ["yes" if MATRIX[m][feature] is None else f"no: {MATRIX[m][feature]}"
                 for m in MODES]  # fmt: skip
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
