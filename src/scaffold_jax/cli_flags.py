"""The flags of the ``scaffold-jax`` commands (:mod:`scaffold_jax.cli` builds its parsers
from them): one flag per config field and per declared hyper-parameter or option, the
commands' own flags, and their ``--help`` groups (:data:`HELP_GROUPS`): first the flags a
first run sets ("basic run"), then data, model, algorithm, local work, sampling,
participation and time, privacy, communication, evaluation, output and resuming; a declared
hyper-parameter or option is in the group of the entry that declares it."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from scaffold_jax import participation
from scaffold_jax.experiments import ConfigError, RunConfig
from scaffold_jax.experiments.commands import DATA_OWNERS
from scaffold_jax.registry import PLUGIN_HINT
from scaffold_jax.types import HParam
from scaffold_jax.wrappers import outermost_first

_KIND_TYPES = {"int": int, "float": float, "str": str, "ints": int, "floats": float, "strs": str}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


#: What a flag of each type takes, in words (for a bad value's message).
_TAKES = {"float": "a number (e.g. 0.5 or 1e-3)", "int": "an integer (e.g. 10)"}


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, but a description or epilog keeps its paragraphs (separated
    by a blank line), each filled on its own."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text
        return "\n\n".join(fill(part, width, indent) for part in text.split("\n\n"))


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are ONE line (no usage block): the flag, the
    bad value and what the flag takes, then where to read more (``--help``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"scaffold-jax: error: {_usage_error(message)} See '{self.prog} --help'.\n")


def _usage_error(message: str) -> str:
    """argparse's error ``message`` in the words of the other errors: ``argument --rounds:
    invalid int value: 'ten'`` -> ``--rounds 'ten' is invalid: it takes an integer (e.g.
    10).``"""
    bad_type = re.fullmatch(r"argument (\S+?)(?:/\S+)?: invalid (\w+) value: (.+)", message)
    if bad_type:
        flag, kind, value = bad_type.groups()
        return f"{flag} {value} is invalid: it takes {_TAKES.get(kind, f'a {kind} value')}."
    choice = re.fullmatch(
        r"argument (\S+?)(?:/\S+)?: invalid choice: (.+?) \(choose from (.+)\)", message
    )
    if choice:
        flag, value, choices = choice.groups()
        return f"{flag} {value} is invalid: it takes one of {choices}."
    message = message.removeprefix("argument ")
    return message if message.endswith(".") else message + "."


def _wrapper_groups() -> dict[str, tuple[str, ...]]:
    """The wrappers' ``--help`` groups (:data:`~scaffold_jax.wrappers.WRAPPERS`: privacy,
    communication), outermost first, each holding the fields that choose them."""
    groups: dict[str, tuple[str, ...]] = {}
    for spec in outermost_first():
        groups[spec.group] = (*groups.get(spec.group, ()), spec.field)
    return groups


#: The groups of a command's ``--help``, in this order, and the flags each holds, by name
#: (a :class:`RunConfig` field, a declared hyper-parameter or option, or a command's own
#: flag; ``client_lr`` for ``--client-lr``, ``experiment`` for reproduce's protocol), in
#: the order shown. "basic run" holds what a first run sets. A declared name not listed
#: goes to its owner's group (:data:`_OWNER_GROUPS`); a flag placed neither way is a bug
#: (:func:`_help_group` raises, tests/test_cli_help.py fails), never a catch-all group.
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "basic run": (
        "experiment", "quick", "algorithm", "algorithms", "dataset", "model", "num_clients",
        "clients_per_round", "client_fraction", "rounds", "local_epochs", "local_steps",
        "batch_size", "client_lr", "server_lr", "lr_grid", "grid", "seed", "seeds",
        "config", "out",
    ),
    "data": (
        "data_dir", "download", "max_train_examples", "max_test_examples", "local_test_fraction",
        "partition", "partition_seed",
    ),
    "model": (),
    "algorithm": ("weighting",),
    "local work": ("batch_plan",),
    "sampling, participation and time": ("sampler", *participation.KINDS, "execution"),
    **_wrapper_groups(),
    "evaluation": (
        "eval_every", "train_eval_examples", "targets", "target", "gd_steps", "num_iters",
    ),
    "personalization": ("finetune_steps", "finetune_lr", "personal_eval_clients"),
    "output and resuming": (
        "overwrite", "quiet", "resume", "accept_new_versions", "checkpoint_every",
        "checkpoint_minutes", "keep_checkpoints", "no_checkpoint", "tensorboard",
        "no_compile_cache", "set",
        "plugin",
    ),
}  # fmt: skip

#: The ``--help`` group of the hyper-parameters and options an entry declares, by the
#: config key that names the entry (:data:`scaffold_jax.experiments.OPTION_OWNERS`).
_OWNER_GROUPS: dict[str, str] = {
    "algorithm": "algorithm", "weighting": "algorithm", "model": "model",
    "partition": "data", "dataset": "data", "batch_plan": "local work",
    **dict.fromkeys(
        ("sampler", *participation.KINDS, "execution"), "sampling, participation and time"
    ),
    **{spec.field: spec.group for spec in outermost_first()},
}  # fmt: skip


def declared_owners(name: str) -> list[str]:
    """The kinds of entry (``algorithm``, ``model``, ``privacy``...) whose registered
    entries declare the hyper-parameter or option ``name``, in the order of
    :data:`~scaffold_jax.experiments.OPTION_OWNERS` (the first declaration wins)."""
    from scaffold_jax.experiments import OPTION_OWNERS

    return [
        kind
        for kind, registry in OPTION_OWNERS.items()
        if any(
            name in getattr(spec, "hparams", {}) or name in getattr(spec, "options", {})
            for _, spec in registry.items()
        )
    ]


def _help_group(name: str, declared: bool = False) -> str:
    """The ``--help`` group of the flag ``name`` (:data:`HELP_GROUPS`; a ``declared``
    hyper-parameter or option not listed there: its owner's, :data:`_OWNER_GROUPS`).

    Raises:
      LookupError: a flag neither places (a new field or flag: list it in HELP_GROUPS).
    """
    for title, names in HELP_GROUPS.items():
        if name in names:
            return title
    owners = declared_owners(name) if declared else []
    if owners and owners[0] in _OWNER_GROUPS:
        return _OWNER_GROUPS[owners[0]]
    raise LookupError(
        f"the flag {_flag(name)} has no --help group: list it in scaffold_jax.cli_flags.HELP_GROUPS"
        + (f" or its owner {owners[0]!r} in _OWNER_GROUPS" if owners else "")
    )


class _Flags:
    """A command's flags, collected (``add_argument`` as argparse's) and then added to its
    parser group by group (:meth:`add_to`): each in its :data:`HELP_GROUPS` group, the
    groups in that order and, within one, the listed names in their order first."""

    def __init__(self) -> None:
        self.flags: list[tuple[tuple[str, ...], dict[str, Any]]] = []

    def add_argument(self, *names: str, **kwargs: Any) -> None:
        self.flags.append((names, kwargs))

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        groups: dict[str, list[tuple[str, tuple[str, ...], dict[str, Any]]]] = {
            title: [] for title in HELP_GROUPS
        }
        for names, kwargs in self.flags:
            name = names[0].lstrip("-").replace("-", "_")
            declared = str(kwargs.get("dest", "")).startswith("declared:")
            groups[_help_group(name, declared)].append((name, names, kwargs))
        for title, flags in groups.items():
            if not flags:
                continue
            listed = HELP_GROUPS[title]
            flags.sort(key=lambda f: listed.index(f[0]) if f[0] in listed else len(listed))
            group = parser.add_argument_group(title)
            for _, names, kwargs in flags:
                group.add_argument(*names, **kwargs)


#: Whose declared options mean something to ``diagnose`` (not the algorithms').
DIAGNOSE_OPTIONS = DATA_OWNERS


def _config_flags(
    parser: _Flags, fields: Sequence[str] | None = None, without: Sequence[str] = ()
) -> None:
    """--config, --plugin, --set, one flag per :class:`RunConfig` field and one per
    hyper-parameter or option a registered algorithm declares (flags override the file).

    ``fields``: only these fields have flags, and of the declared names only the options
    of models, partitioners and datasets (a command that does not run an algorithm);
    ``without``: fields the command spells its own way (sweep's one ``--target``)."""
    from scaffold_jax import experiments

    parser.add_argument("--config", metavar="FILE", help="a .toml or .json config file")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module (dotted name or .py file) that registers algorithms, models, "
        "datasets or partitioners before anything else; repeatable (config key: plugins). "
        f"A name no registered entry has is refused: {PLUGIN_HINT}",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set any config field or declared hyper-parameter / option (VALUE parsed as "
        "JSON when it can be), e.g. --set prox_mu=0.5; repeatable",
    )
    defaults = RunConfig()
    declared = {**experiments.declared_hparams(), **experiments.declared_options()}
    if fields is not None:
        declared = experiments.declared_options(DIAGNOSE_OPTIONS)
    for name, spec in declared.items():
        # Choices and ranges are checked with the config (naming the field), not argparse.
        choices = getattr(spec, "choices", None)
        help_text = spec.help + (f" ({' | '.join(map(str, choices))})" if choices else "")
        if spec.default is not None:
            help_text += f" [default: {spec.default}]"
        kind = "float" if isinstance(spec, HParam) else getattr(spec, "kind", "str")
        extra: dict[str, Any] = {"type": _KIND_TYPES.get(kind, str)}
        if kind in ("ints", "floats"):
            extra["nargs"] = "+"
        # An on/off option is a bare flag (``--warm-controls``); it still takes a value.
        if getattr(spec, "is_switch", False):
            extra = {"type": str, "nargs": "?", "const": "true"}
        parser.add_argument(
            _flag(name),
            metavar="N" if kind in ("int", "ints") else "X",
            help=help_text,
            default=argparse.SUPPRESS,
            dest=f"declared:{name}",
            **extra,
        )
    for field in dataclasses.fields(RunConfig):
        meta = field.metadata
        kind = meta["kind"]
        if kind == "table" or field.name == "plugins":
            continue  # filled by the declared flags and --set; plugins by --plugin
        if (fields is not None and field.name not in fields) or field.name in without:
            continue
        help_text = meta["help"]
        if meta.get("choices"):
            help_text += f" ({' | '.join(meta['choices'])})"
        default = getattr(defaults, field.name)
        # SUPPRESS: only flags actually given override the config file.
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": field.name}
        if kind == "bool":
            parser.add_argument(_flag(field.name), action="store_true", help=help_text, **kwargs)
            continue
        if kind in ("ints", "floats"):
            kwargs["nargs"] = "+"
        kwargs["type"] = _KIND_TYPES[kind]
        kwargs["metavar"] = {"int": "N", "ints": "N", "float": "X", "floats": "X"}.get(
            kind, "PATH" if field.name in ("data_dir", "out") else "NAME"
        )
        if default is not None:
            help_text += f" [default: {default}]"
        parser.add_argument(_flag(field.name), help=help_text, **kwargs)


def _checkpoint_flags(parser: _Flags) -> None:
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="checkpoint every N rounds [default: at evaluations, within 10%% of the run's time]",
    )
    parser.add_argument(
        "--checkpoint-minutes",
        type=float,
        default=5.0,
        metavar="M",
        help="and at least every M minutes (at the end of a block) [5]",
    )
    parser.add_argument(
        "--no-checkpoint", action="store_true", help="write no checkpoints (no --resume)"
    )


def _tensorboard_flag(parser: _Flags) -> None:
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write the metrics as TensorBoard event files into <out>/tensorboard, "
        "one scalar per metric, step = round (needs tensorboardX: pip install "
        "'scaffold-jax[tensorboard]')",
    )


def _checked_checkpoint_flags(args: argparse.Namespace) -> None:
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: give one of them.")
    if args.resume and args.no_checkpoint:
        raise ConfigError("--resume needs checkpoints: drop --no-checkpoint.")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise ConfigError(
            f"--checkpoint-every {args.checkpoint_every} is invalid: it must be >= 1."
        )
    if not args.checkpoint_minutes > 0:
        raise ConfigError(
            f"--checkpoint-minutes {args.checkpoint_minutes} is invalid: it must be > 0."
        )


def _common(parser: _Flags, out: bool = True) -> None:
    """--out (unless the command has it already), --overwrite and --quiet."""
    if out:
        parser.add_argument("--out", help="output folder")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an output folder that holds a run"
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar or printed tables (for scripts)"
    )
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not keep compiled programs on disk (by default a second run of the same "
        "configuration starts without compiling; folder: $SCAFFOLD_JAX_COMPILE_CACHE, "
        "else ~/.cache/scaffold_jax/xla)",
    )
