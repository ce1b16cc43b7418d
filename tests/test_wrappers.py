"""The wrappers' one table (scaffold_jax.wrappers.WRAPPERS): its order is the order
make_algorithm applies them in (compression inside privacy), and every layer above finds
each wrapper's config field, kinds and --help group there."""

import pytest

from scaffold_jax import cli
from scaffold_jax.experiments import OPTION_OWNERS, RunConfig, resolve
from scaffold_jax.wrappers import WRAPPERS, outermost_first, turned_off


def test_the_table_applies_the_attack_first_and_privacy_outermost():
    assert list(WRAPPERS) == ["attack", "compression", "aggregator", "privacy"]
    assert [spec.field for spec in outermost_first()] == [
        "privacy", "aggregator", "compression", "attack"]  # fmt: skip
    assert turned_off() == {"privacy": None, "aggregator": "mean", "compression": "none",
                            "attack": "none"}  # fmt: skip


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_each_wrapper_has_its_config_field_and_its_kinds_in_its_help_group(name):
    spec = WRAPPERS[name]
    field = RunConfig.__dataclass_fields__[spec.field]
    assert getattr(RunConfig(), spec.field) == spec.off
    assert field.metadata["choices"] is spec.kinds and field.metadata["help"] == spec.help
    assert OPTION_OWNERS[spec.field] is spec.kinds
    parser = cli._build_parsers()[1]["run"]
    group = next(g for g in parser._action_groups if g.title == spec.group)
    flags = {a.option_strings[0]: a for a in group._group_actions}
    flag = flags["--" + spec.field.replace("_", "-")]
    for kind, entry in spec.kinds.items():
        assert kind in flag.help
        for declared in (*entry.hparams, *entry.options):
            assert "--" + declared.replace("_", "-") in flags, (kind, declared)


def test_make_algorithm_wraps_in_the_tables_order(monkeypatch):
    config = RunConfig(compression="qsgd", privacy="gaussian", dp_noise_multiplier=1.0)
    algorithm = resolve.make_algorithm(config)
    plain = resolve.make_algorithm(RunConfig())
    # Each wrapper adds its options' entry: the last one added is the outermost wrapper.
    assert list(algorithm.options) == [*plain.options, "compression", "privacy"]
    assert algorithm.options["compression"]["compressor"] == "qsgd"
    # The order is the table's: privacy first would be compressed(private(...)), refused.
    monkeypatch.setattr(WRAPPERS, "_entries", dict(reversed(WRAPPERS.items())))
    with pytest.raises(ValueError, match=r"compressed\(private\(\.\.\.\), 'qsgd'\) is refused"):
        resolve.make_algorithm(config)
