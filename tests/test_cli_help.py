"""`scaffold-jax <command> --help` scans: every flag in a named group (scaffold_jax.cli's
HELP_GROUPS, declared names by their owner), the groups in a fixed order, the flags a
first run needs first and within one screen, and a pointer to the full reference."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from scaffold_jax import cli, cli_flags, experiments, registry
from scaffold_jax.cli import main
from scaffold_jax.cli_flags import HELP_GROUPS, _help_group
from scaffold_jax.experiments import RunConfig
from scaffold_jax.registry import load_plugins

PLUGINS = Path(__file__).parent / "plugins"

EVERY_GROUP = [
    "basic run", "data", "model", "algorithm", "local work", "sampling, participation and time",
    "privacy", "robustness", "communication", "evaluation", "personalization",
    "output and resuming",
]  # fmt: skip
TITLES = {
    "run": EVERY_GROUP,
    "sweep": EVERY_GROUP,
    "reproduce": ["basic run", "data", "evaluation", "output and resuming"],
    "diagnose": ["basic run", "data", "model", "evaluation", "output and resuming"],
}
RUN_BASIC = [
    "--algorithm", "--dataset", "--model", "--num-clients", "--clients-per-round",
    "--client-fraction", "--rounds", "--local-epochs", "--local-steps", "--batch-size",
    "--client-lr", "--server-lr", "--seed", "--config", "--out",
]  # fmt: skip
# argparse's own groups: the positionals and the optionals of no group.
DEFAULT_GROUPS = ("positional arguments", "options")


def _commands() -> dict[str, argparse.ArgumentParser]:
    return cli._build_parsers()[1]


def _groups(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """The non-empty groups of ``parser`` in --help order: their flags (a positional by its
    dest) in order."""
    return {
        group.title: [a.option_strings[0] if a.option_strings else a.dest for a in actions]
        for group in parser._action_groups
        if (actions := group._group_actions)
    }


def _name(action: argparse.Action) -> str:
    return (action.option_strings or [action.dest])[0].lstrip("-").replace("-", "_")


def _help_text(argv, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


# ----------------------------------------------------------------------------- groups
@pytest.mark.parametrize("command", sorted(TITLES))
def test_each_command_shows_its_groups_in_the_fixed_order(command):
    groups = _groups(_commands()[command])
    assert list(groups) == ["options", *TITLES[command]]
    assert groups["options"] == ["-h"]  # only argparse's --help is in no group of ours


def test_the_first_group_of_run_is_exactly_what_a_first_run_sets():
    groups = _groups(_commands()["run"])
    assert list(groups)[1] == "basic run"
    assert groups["basic run"] == RUN_BASIC


def test_the_first_group_of_the_other_commands():
    commands = _commands()
    assert _groups(commands["reproduce"])["basic run"] == [
        "experiment", "--quick", "--dataset", "--rounds", "--lr-grid", "--seed", "--out",
    ]  # fmt: skip
    sweep = _groups(commands["sweep"])["basic run"]
    assert sweep == [*RUN_BASIC[:1], "--algorithms", *RUN_BASIC[1:12], "--lr-grid", "--grid",
                     "--seed", "--seeds", "--config", "--out"]  # fmt: skip
    assert _groups(commands["diagnose"])["basic run"] == [
        "--dataset", "--model", "--num-clients", "--client-lr", "--seed", "--config", "--out",
    ]  # fmt: skip


@pytest.mark.parametrize("command", sorted(TITLES))
def test_every_flag_is_in_the_group_the_table_gives(command):
    parser = _commands()[command]
    seen = set()
    for group in parser._action_groups:
        for action in group._group_actions:
            seen.add(id(action))
            if isinstance(action, argparse._HelpAction):
                assert group.title == "options"
                continue
            assert group.title not in DEFAULT_GROUPS, f"{command} {action.option_strings}"
            declared = action.dest.startswith("declared:")
            assert group.title == _help_group(_name(action), declared), action.option_strings
    assert seen == {id(action) for action in parser._actions}  # none outside a group


def test_declared_names_go_to_their_owners_group():
    placed = {
        "prox_mu": "algorithm", "alpha": "algorithm", "scaffold_option": "algorithm",
        "server_optimizer": "algorithm", "hidden_sizes": "model", "resnet_norm": "model",
        "similarity": "data", "dirichlet_alpha": "data", "quad_G": "data",
        "min_client_examples": "data", "batch_fraction": "local work",
        "poisson_bound": "sampling, participation and time",
        "cycle_groups": "sampling, participation and time",
        "straggler_jitter": "sampling, participation and time",
        "dropout_rate": "sampling, participation and time", "dp_clip": "privacy",
        "dp_epsilon": "privacy", "compress_bits": "communication",
        "compress_entries": "communication",
        # Declared by batch plans, but what a first run sets: the table names them.
        "local_epochs": "basic run", "local_steps": "basic run", "batch_size": "basic run",
    }  # fmt: skip
    assert {name: _help_group(name, declared=True) for name in placed} == placed
    assert cli_flags.declared_owners("compress_bits") == ["compression"]
    assert cli_flags.declared_owners("dp_epsilon") == ["privacy"]
    assert cli_flags.declared_owners("local_steps") == ["batch_plan"]


# ----------------------------------------------------------------------------- the table
def test_the_table_places_every_field_and_every_declared_name():
    """A RunConfig field or a declared name added without a group fails here (and the
    parser refuses to build), instead of landing in a catch-all group."""
    flagged = [
        "plugin" if f.name == "plugins" else f.name
        for f in dataclasses.fields(RunConfig)
        if f.metadata["kind"] != "table"
    ]
    for name in flagged:
        assert _help_group(name) in EVERY_GROUP, name
    declared = {**experiments.declared_hparams(), **experiments.declared_options()}
    for name in declared:
        assert _help_group(name, declared=True) in EVERY_GROUP, name
    # Every kind of entry that declares names has a group.
    assert set(cli_flags._OWNER_GROUPS) == set(experiments.OPTION_OWNERS)
    assert set(cli_flags._OWNER_GROUPS.values()) <= set(EVERY_GROUP)


def test_the_table_names_each_flag_once_and_only_real_groups():
    assert list(HELP_GROUPS) == EVERY_GROUP  # no "other"
    names = [name for names in HELP_GROUPS.values() for name in names]
    assert len(names) == len(set(names))


def test_a_flag_the_table_does_not_place_is_refused_not_put_in_a_catch_all(monkeypatch):
    with pytest.raises(LookupError, match="--brand-new-field has no --help group"):
        _help_group("brand_new_field")
    # A declared name whose owner is placed goes there; an undeclared one is refused.
    with pytest.raises(LookupError):
        _help_group("brand_new_option", declared=True)
    # A new kind of entry that declares options, without a group: refused by its owner.
    monkeypatch.delitem(cli_flags._OWNER_GROUPS, "compression")
    with pytest.raises(LookupError, match="its owner 'compression'"):
        _help_group("compress_bits", declared=True)
    with pytest.raises(LookupError):
        cli.build_parser()


@pytest.fixture
def plugins_loaded():
    """The lab and damped_fedavg plugins registered, for this test alone (lab's model
    declares dropout_rate too, which would move it for the others)."""
    snap = registry.snapshot()
    load_plugins([str(PLUGINS / "lab.py"), str(PLUGINS / "damped_fedavg.py")])
    yield
    registry.restore(snap)


def test_a_plugins_declared_names_go_to_their_owners_groups(plugins_loaded):
    placed = {
        "damping": "algorithm",  # an algorithm's hyper-parameter
        "width": "model",
        "size_sigma": "data",  # a partitioner's
        "feature_scale": "data",  # a dataset's
        "cyclic_stride": "sampling, participation and time",  # a sampler's
        "weight_cap": "algorithm",  # a weighting's
    }
    assert {name: _help_group(name, declared=True) for name in placed} == placed
    groups = _groups(_commands()["run"])
    for name, title in placed.items():
        assert cli_flags._flag(name) in groups[title]


# ----------------------------------------------------------------------------- the text
def test_run_help_shows_the_basic_flags_on_the_first_screen(capsys, monkeypatch):
    text = _help_text(["run", "--help"], capsys, monkeypatch)
    lines = text.splitlines()
    assert lines[0].startswith("usage: scaffold-jax run [--algorithm NAME] [--dataset NAME]")
    usage = lines[: lines.index("")]
    assert len(usage) <= 3 and usage[-1].endswith("[options]")
    first = [i for i, line in enumerate(lines) if line.startswith("  --algorithm ")]
    assert first and first[0] < 50
    # The whole "basic run" group, down to its last flag's help, in the first 50 lines.
    basic = lines.index("basic run:")
    end = lines.index("", basic)
    assert end <= 50
    shown = {line.split()[0] for line in lines[basic + 1 : end] if line.startswith("  -")}
    assert shown == set(RUN_BASIC)
    assert lines.index("data:") == end + 1
    # Every flag is listed, and the end points to the full reference.
    assert sum(line.startswith("  --") for line in lines) == len(_commands()["run"]._actions) - 1
    flat = " ".join(text.split())
    assert "docs/config.md" in flat and "lists every flag of run, by group" in flat
    # The facts the description held, now in the epilog.
    assert "0% similarity, batches of 0.2 of the client's data for 1 epoch" in flat
    assert "(--resume too) finds it again" in flat


@pytest.mark.parametrize("command", ["reproduce", "sweep", "diagnose"])
def test_every_help_points_to_the_reference(command, capsys, monkeypatch):
    text = _help_text([command, "--help"], capsys, monkeypatch)
    lines = text.splitlines()
    assert lines[0].startswith(f"usage: scaffold-jax {command}")
    assert "docs/config.md" in " ".join(text.split())
    assert [line[:-1] for line in lines if line in {f"{t}:" for t in EVERY_GROUP}] == TITLES[
        command
    ]
    if command != "reproduce":  # a short usage, not every flag
        usage = lines[: lines.index("")]
        assert len(usage) <= 3 and usage[-1].endswith("[options]")
