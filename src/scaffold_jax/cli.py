"""The ``scaffold-jax`` command.

Commands:

* ``scaffold-jax run``: one experiment from flags and/or a config file (TOML or JSON;
  flags override the file). Every field of :class:`~scaffold_jax.experiments.RunConfig`
  is a flag (``client_lr`` -> ``--client-lr``).
* ``scaffold-jax reproduce {fig3,table3,table4,table5}``: a protocol of Karimireddy et
  al. (ICML 2020), with ``--quick`` for a test-sized run.
* ``scaffold-jax sweep``: a grid over any declared hyper-parameter × seeds per algorithm,
  one vmapped program each, times an outer product over data and shape settings
  (similarity, N, S, epochs...), one program per setting; a tidy ``sweep.csv``.
* ``scaffold-jax diagnose``: G, B, δ, β and the suggested K for a dataset/partition/model,
  printed and written to ``--out`` (``diagnose.json``, ``gradient_fit.png``).

``--help`` lists a command's flags by group (:data:`scaffold_jax.cli_flags.HELP_GROUPS`):
first the ones a first run sets ("basic run"), then data, model, algorithm, local work,
sampling, participation and time, privacy, communication, evaluation, output and
resuming; a declared hyper-parameter or option is in the group of the entry that
declares it.

Progress (loading, each compilation with its time, a bar with rate and ETA) goes to
stderr, as plain lines when stderr is not a terminal; ``--quiet`` silences it.

``--plugin MODULE_OR_FILE.py`` (repeatable, before or after the command; config key
``plugins``) imports a module that registers algorithms, models, datasets or partitioners
before the parser is built, so their declared hyper-parameters and options have flags;
``--set NAME=VALUE`` sets any field or declared name. An unknown flag is refused in one
line that names the closest flag of the command (``--client_lr``: did you mean
``--client-lr``?).

Each run writes its output folder (see :mod:`scaffold_jax.results`): ``config.json``,
``metrics.jsonl``, ``summary.json``, ``metrics.csv`` and plots; a folder that already
holds a run is refused unless ``--overwrite``. Without ``--out`` (or a config's ``out``)
the folder is ``results/<algorithm>-<dataset>-<digest>`` (``sweep-...``, ``diagnose-...``),
the digest that of the settings a resume compares
(:func:`scaffold_jax.experiments.commands.default_folder`): the same command, ``--resume``
included, finds its folder again, and different commands never share one.

Exit status: 0 success; 1 a run that could not start or did not finish although its
arguments were valid (missing data, an occupied, read-only or full folder, divergence); 2
invalid arguments or config (what argparse, the config's checks, its build or the run's
own checks before it starts refuse, such as Scaffnew's S = N or a private run's noise: a
:class:`~scaffold_jax.registry.ConfigError`), said in ONE line on stderr that names the
setting and the fix (a bad flag value without argparse's usage block); 130 (SIGINT) or 143
(SIGTERM) interrupted: the folder keeps every finished record and says
``"status": "interrupted"``.

Examples::

    scaffold-jax run --algorithm scaffold --dataset fashion_mnist --similarity 0 \\
        --num-clients 100 --client-fraction 0.2 --local-epochs 1 --client-lr 0.1 \\
        --rounds 200 --out results/scaffold-s0
    scaffold-jax run --config my_run.toml --rounds 50 --overwrite
    scaffold-jax reproduce fig3 --quick
    scaffold-jax reproduce table3 --dataset fashion_mnist --out results/table3
    scaffold-jax sweep --algorithms scaffold fedavg --lr-grid 0.03 0.1 0.3 --seeds 0 1 \\
        --rounds 100 --out results/sweep
    scaffold-jax sweep --algorithms fedprox --grid server_lr=0.5,1 --grid prox_mu=0.01,0.1 \\
        --grid similarity=0,50 --seeds 0 1 --out results/sweep-fedprox
    scaffold-jax diagnose --dataset fashion_mnist --similarity 0 --gd-steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from scaffold_jax import compilation_cache
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.cli_flags import (
    _checked_checkpoint_flags,
    _checkpoint_flags,
    _common,
    _config_flags,
    _Flags,
    _Parser,
    _tensorboard_flag,
)
from scaffold_jax.experiments import DIAGNOSE_FIELDS, ConfigError, RunConfig
from scaffold_jax.experiments.schema import route, same_value
from scaffold_jax.loop import RunTerminated, sigterm_exits
from scaffold_jax.paper import PROTOCOLS


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``scaffold-jax`` (run, reproduce, sweep, diagnose)."""
    return _build_parsers()[0]


def _algorithm_names() -> str:
    """Every registered algorithm (plugins' too) as tables name it: "SCAFFOLD, FedAvg ..."."""
    *names, last = [spec.display_name for _, spec in ALGORITHMS.items()]
    return f"{', '.join(names)} and {last}" if names else last


#: The pointer every command's ``--help`` ends with.
_REFERENCE = (
    "Every flag and config key, with its type, default and meaning: docs/config.md "
    "(generated from this parser)."
)


def _build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The argument parser and its commands' parsers by name."""
    parser = _Parser(
        prog="scaffold-jax",
        description="Simulate federated learning in JAX with every registered algorithm "
        f"({_algorithm_names()}) and reproduce the experiments of Karimireddy et al., "
        "'SCAFFOLD: Stochastic Controlled Averaging for Federated Learning' (ICML 2020).",
        epilog="Run 'scaffold-jax <command> --help' for a command's options.",
    )
    # Before the command too (`scaffold-jax --plugin X run ...`); merged with the command's.
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        dest="plugins_first",
        help="import a module (dotted name or .py file) that registers algorithms, models, "
        "datasets... before the command's flags are made; repeatable, here or after the "
        "command",
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)

    run = commands.add_parser(
        "run",
        help="one experiment from flags or a config file",
        usage="%(prog)s [--algorithm NAME] [--dataset NAME] [--model NAME]\n"
        "       [--rounds N] [--client-lr X] [--config FILE] [--out PATH] [options]",
        description="Run one federated experiment with any registered algorithm "
        f"(--algorithm: {', '.join(ALGORITHMS)}). Settings come from --config (TOML or "
        "JSON, top-level keys named like the flags with underscores) and are overridden "
        "by flags. The flags a first run sets come first, the others by topic.",
        epilog="Unset partition / batch-plan / sampling fields take the paper's defaults: "
        "0% similarity, batches of 0.2 of the client's data for 1 epoch (SGD: one "
        "full-batch step), 20% of clients per round. Without --out the folder is "
        "results/<algorithm>-<dataset>-<digest of the settings>: the same command "
        "(--resume too) finds it again.\n\n"
        "This help lists every flag of run, by group. " + _REFERENCE,
    )
    flags = _Flags()
    _config_flags(flags)
    _common(flags, out=False)  # --out is a RunConfig field, added above
    flags.add_argument(
        "--resume",
        action="store_true",
        help="continue the run the --out folder holds, from its newest checkpoint, bit for "
        "bit (only --rounds, --eval-every and --targets may change)",
    )
    flags.add_argument(
        "--accept-new-versions",
        action="store_true",
        help="with --resume: go on although jax, jaxlib or numpy changed since the checkpoint "
        "(the rest may then differ from an uninterrupted run in the last bits)",
    )
    _checkpoint_flags(flags)
    _tensorboard_flag(flags)
    flags.add_to(run)

    rep = commands.add_parser(
        "reproduce",
        help="a protocol of the paper: fig3, table3, table4, table5",
        description="Reproduce a paper experiment. fig3: quadratics (N = 2, beta = 1, "
        "G in {1, 10, 100}, K in {2, 10}), error f(x) - f* vs rounds. table3/4/5: EMNIST "
        "when it can be loaded, else Fashion-MNIST (the dataset is named in every output); "
        "eta_l tuned per algorithm over a grid, chosen values reported.",
        epilog=_REFERENCE,
    )
    flags = _Flags()
    flags.add_argument("experiment", choices=sorted(PROTOCOLS), help="the protocol")
    flags.add_argument("--quick", action="store_true", help="test-sized variant (seconds)")
    flags.add_argument(
        "--resume",
        action="store_true",
        help="continue the protocol the --out folder holds: finished cells are kept",
    )
    flags.add_argument(
        "--accept-new-versions",
        action="store_true",
        help="with --resume: go on although jax, jaxlib or numpy changed since the checkpoint "
        "(the rest may then differ from an uninterrupted run in the last bits)",
    )
    flags.add_argument(
        "--dataset",
        help="tables: 'auto' (EMNIST balanced if available, else Fashion-MNIST) or a "
        "dataset name [default: auto]",
    )
    flags.add_argument("--data-dir", help="folder of IDX files (e.g. NIST's EMNIST gzip/)")
    flags.add_argument("--download", action="store_true", help="let TFDS download the dataset")
    flags.add_argument("--rounds", type=int, help="horizon in rounds (the paper: 1000)")
    flags.add_argument("--eval-every", type=int, help="evaluation period in rounds")
    flags.add_argument("--target", type=float, help="target accuracy (fig3: relative error)")
    flags.add_argument("--seed", type=int, help="seed")
    flags.add_argument(
        "--lr-grid", type=float, nargs="+", metavar="LR", help="eta_l grid for every method"
    )
    flags.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="set any protocol field (VALUE parsed as JSON when it can be), e.g. "
        "--set delta=0.99 or --set max_train_examples=20000; repeatable",
    )
    flags.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module (dotted name or .py file) that registers algorithms, models, "
        "datasets... first, e.g. for --set 'extra_methods=[\"mine\"]'; repeatable",
    )
    _common(flags)
    flags.add_to(rep)

    sw = commands.add_parser(
        "sweep",
        help="a grid of hyper-parameters x data settings x seeds, vmapped per algorithm",
        usage="%(prog)s [--algorithms NAME ...] [--lr-grid LR ...]\n"
        "       [--grid NAME=V1,V2,...] [--seeds N ...] [--target X] [--out PATH] [options]",
        description="Sweep the run described by the config flags over a grid, for one or "
        "more algorithms. An axis over a hyper-parameter an algorithm declares (--lr-grid, "
        "--grid server_lr=0.5,1, --grid prox_mu=0.01,0.1) is vmapped: each algorithm's "
        "hyper-parameters x --seeds are ONE compiled program. An axis over a data or shape "
        "setting (--grid similarity=0,50 or num_clients, clients_per_round, local_epochs, "
        "partition_seed...) is an outer product: each setting is its own programs, run one "
        "after the other into the same --out.",
        epilog="Writes metrics.jsonl as it goes (one series per config), then sweep.json "
        "(per-config records), sweep.csv (one row per config x seed: the swept values, "
        "final and best metrics, rounds to --target), summary.md (the best config per "
        "algorithm and setting by rounds to --target, mean +- std over seeds; the policy of "
        "scaffold_jax.results.select; a warning when a chosen value is at the edge of its "
        "grid) and two plots.\n\n"
        "Seeds: --seeds are the root keys of client sampling and minibatches, one per "
        "config; the data (subsets, split over clients) comes from --partition-seed, "
        "default --seed, and the model's initial params from --seed, the same for every "
        "config: config (hparams, seed s) computes what `scaffold-jax run --seed s "
        "--partition-seed P` computes for a model whose initial params do not depend on "
        "the seed (logreg starts at zero).\n\n" + _REFERENCE,
    )
    flags = _Flags()
    _config_flags(flags, without=("targets",))
    flags.add_argument(
        "--algorithms",
        nargs="+",
        metavar="NAME",
        help=f"algorithms to sweep ({' | '.join(ALGORITHMS)}), each its own programs, the "
        "axes it declares [default: --algorithm]",
    )
    flags.add_argument(
        "--lr-grid",
        type=float,
        nargs="+",
        metavar="LR",
        help="client step sizes eta_l to sweep, the same as --grid client_lr=LR1,LR2,... "
        "[default: --client-lr alone]",
    )
    flags.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="NAME=V1,V2,...",
        help="an axis of the grid; repeatable (axes multiply). NAME is a hyper-parameter an "
        "algorithm of the sweep declares (client_lr, server_lr, prox_mu, alpha...: vmapped "
        "in one program) or a numeric data / shape setting, i.e. any numeric config field "
        "(similarity, dirichlet_alpha, num_clients, clients_per_round, client_fraction, "
        "local_epochs, local_steps, batch_size, partition_seed, max_train_examples...: "
        "one program per value, run one after the other). An axis replaces the flag's value",
    )
    flags.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        metavar="N",
        default=[0],
        help="run seeds, one config each: the root key of client sampling and minibatches "
        "(jax.random.key(N)); they do NOT re-partition the data (--partition-seed, default "
        "--seed, does; --grid partition_seed=0,1 sweeps it) nor change the model's initial "
        "params (--seed) [0]",
    )
    flags.add_argument(
        "--target",
        type=float,
        default=0.7,
        help="target test accuracy: the summary's choice is by rounds to it, and sweep.csv "
        "reports them [0.7]",
    )
    # run's several --targets, refused by name (sweep counts rounds to one --target).
    flags.add_argument("--targets", nargs="+", dest="run_targets", help=argparse.SUPPRESS)
    flags.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep the --out folder holds: finished grids are kept, the others "
        "continue from their newest checkpoint",
    )
    flags.add_argument(
        "--accept-new-versions",
        action="store_true",
        help="with --resume: go on although jax, jaxlib or numpy changed since the checkpoint "
        "(the rest may then differ from an uninterrupted run in the last bits)",
    )
    _checkpoint_flags(flags)
    _tensorboard_flag(flags)
    _common(flags, out=False)
    flags.add_to(sw)

    diag = commands.add_parser(
        "diagnose",
        help="measure G, B, delta, beta and the suggested K on a dataset/partition/model",
        usage="%(prog)s [--dataset NAME] [--model NAME] [--similarity X]\n"
        "       [--gd-steps N] [--out PATH] [options]",
        description="Measure the paper's heterogeneity constants at the model's initial "
        "params (and after --gd-steps full gradient steps, to fit (G, B)): gradient "
        "dissimilarity G and B, Hessian dissimilarity delta and smoothness beta by power "
        "iteration on Hessian-vector products, and SCAFFOLD's suggested K ~ beta / delta. "
        "Writes diagnose.json and gradient_fit.png to --out.",
        epilog=_REFERENCE,
    )
    flags = _Flags()
    _config_flags(flags, fields=DIAGNOSE_FIELDS)
    flags.add_argument(
        "--gd-steps",
        type=int,
        default=0,
        help="extra points along a full-gradient descent path (step size --client-lr), to "
        "fit (G, B) [0]",
    )
    flags.add_argument("--num-iters", type=int, default=30, help="power iterations [30]")
    flags.add_argument(
        "--out", help="output folder: diagnose.json, gradient_fit.png, summary.json "
        "[default: results/diagnose-<dataset>-<digest of the settings>]"
    )  # fmt: skip
    flags.add_argument(
        "--overwrite", action="store_true", help="replace an output folder that holds a run"
    )
    flags.add_argument(
        "--quiet", action="store_true", help="print nothing (the output folder is still written)"
    )
    flags.add_to(diag)
    return parser, dict(commands.choices)


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} is invalid: it must be FIELD=VALUE.")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _config(args: argparse.Namespace, validate: bool = True) -> RunConfig:
    """The :class:`RunConfig` of --config and the flags given, validated unless told."""
    from scaffold_jax import experiments

    values: dict[str, Any] = {"hparams": {}, "options": {}}
    if args.config:
        values.update(
            route(
                experiments.load_config_file(args.config), "config",
                source=f"config file {args.config}",
            )
        )  # fmt: skip
    names = [f.name for f in dataclasses.fields(RunConfig)]
    flags = {name: getattr(args, name) for name in names if hasattr(args, name)}
    flags.update(
        {k.split(":", 1)[1]: v for k, v in vars(args).items() if k.startswith("declared:")}
    )
    sets = _parse_set(args.set)
    twice = [
        f"--{k.replace('_', '-')} {_shown(flags[k])} and --set {k}={_shown(v)}"
        for k, v in sets.items()
        if k in flags and not same_value(flags[k], v)
    ]
    if twice:
        raise ConfigError(
            f"{'; '.join(twice)} give a setting two values: give it once (a flag or --set)."
        )
    # Flags override the file; a declared name given as a flag or by --set replaces the
    # file's table entry (route moves it into the hparams / options tables).
    given = route({**flags, **sets}, "config", source="the command line")
    for table in ("hparams", "options"):
        values[table] = {**values[table], **given.pop(table)}
    values.update(given)
    if args.plugin:
        values["plugins"] = [*values.get("plugins", []), *args.plugin]
    config = RunConfig.from_dict(values, where="config")
    return config.validate() if validate else config


def _shown(value: Any) -> str:
    """A flag's value as typed (a list as its items)."""
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def _run_command(args: argparse.Namespace) -> int:
    from scaffold_jax import experiments

    experiments.run(_config(args), **_folder_options(args))
    return 0


def _folder_options(args: argparse.Namespace) -> dict[str, Any]:
    """What ``run`` and ``sweep`` take from the flags besides the config: the folder,
    checkpoint and output options."""
    _checked_checkpoint_flags(args)
    return {
        "overwrite": args.overwrite,
        "quiet": args.quiet,
        "resume": args.resume,
        "checkpoint": not args.no_checkpoint,
        "checkpoint_every": args.checkpoint_every,
        "checkpoint_minutes": args.checkpoint_minutes,
        "tensorboard": args.tensorboard,
    }


def _grid_axes(items: Sequence[str]) -> dict[str, list[float]]:
    """``--grid NAME=V1,V2,...`` → ``{NAME: [V1, V2, ...]}`` (the names are checked by
    :func:`scaffold_jax.experiments.split_axes`)."""
    axes: dict[str, list[float]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        example = f"e.g. --grid {name or 'server_lr'}=0.5,1"
        if not sep or not name:
            raise ConfigError(f"--grid {item!r} is invalid: it must be NAME=V1,V2,... ({example}).")
        if name in axes:
            raise ConfigError(
                f"--grid {name} is given twice: give each axis once, with all its values."
            )
        texts = [v.strip() for v in values.split(",")]
        if texts == [""]:
            raise ConfigError(
                f"--grid {item!r} has no values: list at least one after '=' ({example})."
            )
        if "" in texts:
            raise ConfigError(
                f"--grid {item!r} has an empty value: separate the values by single commas "
                f"({example})."
            )
        numbers = []
        for text in texts:
            try:
                numbers.append(float(text))
            except ValueError:
                raise ConfigError(_named_axis(name, texts) or (
                    f"--grid {item!r}: {text!r} is not a number; every value of an axis must "
                    f"be one ({example})."
                )) from None  # fmt: skip
        repeated = sorted({v for v in numbers if numbers.count(v) > 1})
        if repeated:
            raise ConfigError(
                f"--grid {item!r} repeats {', '.join(f'{v:g}' for v in repeated)}: give each "
                "value once (the seeds are --seeds)."
            )
        axes[name] = numbers
    return axes


def _named_axis(name: str, texts: Sequence[str]) -> str | None:
    """Why ``--grid NAME=a,b`` of a setting that takes names (an algorithm, a compressor)
    is no axis, and what sweeps it instead; None for any other name."""
    if name == "algorithm":
        return (
            f"--grid algorithm={','.join(texts)}: the algorithms of a sweep are "
            f"--algorithms {' '.join(texts)}, not a grid axis."
        )
    field = {f.name: f for f in dataclasses.fields(RunConfig)}.get(name)
    if field is None or field.metadata["kind"] != "str":
        return None
    flag = f"--{name.replace('_', '-')}"
    return (
        f"--grid {name}={','.join(texts)}: {name} takes a name, and a grid axis takes numbers "
        f"(one program per value); sweep each {name} on its own ({flag} {texts[0]}, then "
        f"{flag} {texts[-1]}, each with its own --out)."
    )


def _sweep_command(args: argparse.Namespace) -> int:
    from scaffold_jax import experiments

    if args.run_targets is not None:
        raise ConfigError(
            f"sweep: --targets {' '.join(args.run_targets)} is run's flag (the accuracies a "
            "run's summary reports); a sweep counts rounds to ONE target accuracy: give "
            "--target X (default 0.7)."
        )
    axes = _grid_axes(args.grid)
    if args.lr_grid:
        if "client_lr" in axes:
            raise ConfigError(
                "--lr-grid and --grid client_lr=... both give the client_lr axis: give one."
            )
        axes["client_lr"] = [float(v) for v in args.lr_grid]
    experiments.sweep(
        _config(args, validate=False),
        args.algorithms or (),
        axes,
        args.seeds,
        args.target,
        **_folder_options(args),
    )
    return 0


def _diagnose_command(args: argparse.Namespace) -> int:
    from scaffold_jax import experiments

    unused = sorted(set(_parse_set(args.set)) - set(DIAGNOSE_FIELDS))
    if unused:
        raise ConfigError(
            f"--set {', '.join(unused)}: diagnose does not use "
            f"{'them' if len(unused) > 1 else 'it'} (it measures the data, partition and "
            f"model: {', '.join(DIAGNOSE_FIELDS)})."
        )
    experiments.diagnose(
        _config(args),
        args.out,
        gd_steps=args.gd_steps,
        num_iters=args.num_iters,
        overwrite=args.overwrite,
        quiet=args.quiet,
    )
    return 0


def _reproduce_command(args: argparse.Namespace) -> int:
    from scaffold_jax import paper

    overrides = _parse_set(args.set)
    name = args.experiment
    if name == "fig3":
        for flag in ("dataset", "data_dir"):
            if getattr(args, flag):
                raise ConfigError(f"--{flag.replace('_', '-')} does not apply to fig3.")
        mapping = {"rounds": "num_rounds", "lr_grid": "lr_grid"}
    else:
        mapping = {
            "rounds": "num_rounds",
            "dataset": "dataset",
            "data_dir": "data_dir",
        }
        if args.download:
            overrides["download"] = True
        if args.lr_grid:
            protocol = paper.PROTOCOLS[name](quick=args.quick)
            overrides["lr_grids"] = {r.method: tuple(args.lr_grid) for r in protocol.rows}
    for flag in ("eval_every", "target", "seed"):
        mapping[flag] = flag
    for flag, field in mapping.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[field] = tuple(value) if isinstance(value, list) else value
    paper.reproduce(
        name,
        args.out,
        quick=args.quick,
        overwrite=args.overwrite,
        quiet=args.quiet,
        resume=args.resume,
        **overrides,
    )
    return 0


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed arguments, the ``--plugin`` s given before the command first.

    Raises:
      ConfigError: an unknown flag or a stray argument (argparse's own errors, a missing
        command or a bad value, exit with its message and status 2).
    """
    parser, commands = _build_parsers()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(_unknown_arguments(args.command, commands, unknown))
    args.plugin = [*args.plugins_first, *args.plugin]
    return args


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def _unknown_arguments(
    command: str, commands: dict[str, argparse.ArgumentParser], unknown: Sequence[str]
) -> str:
    """One line naming each unknown flag of ``command`` with the closest one it has (a
    flag spelled with underscores, ``--client_lr``, is its dashed form), or the commands
    that have it; and each stray argument (the values after an unknown flag are its own)."""
    own = _options(commands[command])
    said, after_flag = [], False
    for token in unknown:
        if not token.startswith("-") or _is_number(token):
            if not after_flag:
                said.append(f"unexpected argument {token!r}")
            continue
        after_flag = True
        flag = token.split("=", 1)[0]
        dashed = "--" + flag.lstrip("-").replace("_", "-")
        if dashed in own:
            said.append(f"unknown flag {flag} (did you mean {dashed}?)")
            continue
        # Compared without the dashes every flag shares, which would make '--foo' close
        # to '--out'.
        close = difflib.get_close_matches(dashed[2:], [o[2:] for o in own], n=1, cutoff=0.7)
        hints = [f"did you mean --{close[0]}?"] if close else []
        others = [name for name, p in commands.items() if name != command and dashed in _options(p)]
        if others:
            *rest, last = others
            hints.append(f"{dashed} is a flag of {', '.join(rest)}{' and ' if rest else ''}{last}")
        said.append(f"unknown flag {flag}" + (f" ({' '.join(hints)})" if hints else ""))
    return f"{command}: {', '.join(said)}. See 'scaffold-jax {command} --help'."


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _preload_plugins(argv: Sequence[str]) -> None:
    """Imports the ``--plugin`` modules before the parser is built, so that what they
    register (an algorithm's hyper-parameters, say) has its flags."""
    from scaffold_jax.registry import load_plugins

    pre = _Parser(prog="scaffold-jax", add_help=False)
    pre.add_argument("--plugin", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    load_plugins(known.plugin)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``scaffold-jax``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        # The plugins first: what they register has flags (and a broken one says so).
        _preload_plugins(argv)
        args = _parse(argv)
        if not getattr(args, "no_compile_cache", False):
            compilation_cache.enable()
        commands = {
            "run": _run_command,
            "reproduce": _reproduce_command,
            "sweep": _sweep_command,
            "diagnose": _diagnose_command,
        }
        from scaffold_jax.versions import accept_new_versions

        with sigterm_exits(), accept_new_versions(getattr(args, "accept_new_versions", False)):
            return commands[args.command](args)
    except ConfigError as err:  # what the flags, the config or its build got wrong
        # One line, whatever the message quotes (a plugin's or a library's text).
        message = re.sub(r"\s*\n\s*", " ", str(err))
        print(f"scaffold-jax: error: {message}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:
        # A run that could not start or finish although the arguments were valid: missing
        # data, an occupied or unwritable folder, divergence, a failed check at run time.
        from scaffold_jax.data.sources import DatasetNotFoundError

        message = err.for_cli() if isinstance(err, DatasetNotFoundError) else err
        print(f"scaffold-jax: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("scaffold-jax: interrupted; finished records are kept.", file=sys.stderr)
        return 130
    except Exception as err:
        from scaffold_jax.registry import plugin_blamed

        if _out_of_memory(err):  # what the checks before the run could not foresee
            first = str(err).strip().splitlines()[0]
            print(
                f"scaffold-jax: error: the run ran out of memory ({first}); finished records "
                "are kept. Use a smaller model, dataset, batch size, number of local steps "
                "or client_chunk, or a machine with more memory.",
                file=sys.stderr,
            )
            return 1

        where = plugin_blamed(err)
        if where is None:
            raise  # a bug of scaffold_jax: its traceback is what a report needs
        print(
            f"scaffold-jax: error: a plugin failed at {where}: {type(err).__name__}: {err}",
            file=sys.stderr,
        )
        return 1
    except SystemExit as err:  # RunTerminated, or SIGTERM outside a running loop
        if err.code != 128 + 15:
            raise  # another exit (a plugin's sys.exit): not ours to report
        where = f" ({err.message.rstrip('.')})" if isinstance(err, RunTerminated) else ""
        print(
            f"scaffold-jax: terminated (SIGTERM); finished records are kept{where}.",
            file=sys.stderr,
        )
        return 143


def _out_of_memory(err: Exception) -> bool:
    """Whether ``err`` is XLA's failure to allocate a buffer (``RESOURCE_EXHAUSTED``, or
    the CPU client's "Out of memory allocating N bytes"), or Python's."""
    import jax

    text = str(err)
    return isinstance(err, MemoryError) or (
        isinstance(err, jax.errors.JaxRuntimeError)
        and ("RESOURCE_EXHAUSTED" in text or "Out of memory" in text)
    )


if __name__ == "__main__":
    sys.exit(main())
