"""The virtual clock of a synchronous round (scaffold_jax.participation.clock): device
profiles, each client's duration, the round's duration under a deadline and
over-selection, against references written here; and BatchPlan.examples, which the
durations read, against the plans' own masks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scaffold_jax as sj
from scaffold_jax import participation
from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.participation.clock import FileProfiles, LogNormal, load_profiles
from tests.conftest import binary_clients

HEADER = "seconds_per_example,down_bytes_per_s,up_bytes_per_s\n"


def _select_reference(durations, present, keep, deadline):
    """Who reports and how long the round lasts, in plain Python."""
    taking = [j for j in range(len(durations)) if present[j]]
    ranked = sorted(taking, key=lambda j: (durations[j], j))[:keep]
    kept = [
        j in ranked and (deadline is None or durations[j] <= deadline)
        for j in range(len(durations))
    ]
    last = max((durations[j] for j in ranked), default=0.0)
    if deadline is not None:
        last = min(last, deadline)
    return kept, last


@pytest.mark.parametrize("seed", range(40))
def test_select_equals_the_reference(seed):
    rng = np.random.default_rng(seed)
    width = int(rng.integers(1, 12))
    # Few distinct values: ties are common.
    durations = rng.choice([0.5, 1.0, 1.5, 2.0, 4.0], width).astype(np.float32)
    present = rng.random(width) < 0.8
    keep = int(rng.integers(1, width + 1))
    deadline = None if seed % 3 == 0 else float(rng.choice([0.75, 1.5, 3.0]))
    clock = LogNormal(deadline=deadline, over_selection=1.0)
    kept, last = clock.select(jnp.asarray(durations), jnp.asarray(present), keep)
    want_kept, want_last = _select_reference(durations.tolist(), present.tolist(), keep, deadline)
    assert np.asarray(kept).tolist() == want_kept
    assert float(last) == pytest.approx(want_last)


def test_the_sampled_count_of_over_selection():
    assert LogNormal(over_selection=1.3).sampled(10) == 13
    assert LogNormal(over_selection=1.0).sampled(7) == 7
    assert LogNormal(over_selection=1.1).sampled(10) == 11  # 1.1 * 10 is 11.000000000000002
    assert LogNormal(over_selection=1.25).sampled(3) == 4


@pytest.mark.parametrize(
    "plan",
    [BatchPlan.fixed(3, 4), BatchPlan.epochs(3, 2), BatchPlan.fraction_of_data(0.2, 2),
     BatchPlan.full(3), BatchPlan.fraction_of_data(0.3, 1)],
    ids=repr,
)  # fmt: skip
def test_examples_are_the_plans_unmasked_slots(plan):
    """BatchPlan.examples(n, k): the examples in the first k steps, as the mask counts them."""
    for count in (1, 2, 5, 7, 13):
        steps, _ = plan.shape(count)
        _, mask = plan.positions(jax.random.key(0), jnp.int32(count), count)
        per_step = np.asarray(mask).sum(axis=1)
        for k in range(steps + 1):
            assert int(plan.examples(count, k)) == int(per_step[:k].sum()), (count, k)


@pytest.fixture(scope="module")
def data():
    sizes = [4, 8, 4, 12, 4, 8, 4, 4]
    return binary_clients(sizes, seed=0)


@pytest.fixture(scope="module")
def problem():
    return sj.models.logistic_regression((3,), 2)


def _write(tmp_path, rows, name="devices.csv"):
    path = tmp_path / name
    path.write_text(HEADER + "\n".join(rows) + "\n")
    return str(path)


def _sim(problem, profile_path, S=3, **options):
    part = participation.make(profiles="file", options={"profile_file": profile_path, **options})
    return sj.Simulation(sj.scaffold(problem.loss_fn), problem, sj.BatchPlan.fixed(2, 3), S,
                         participation=part)  # fmt: skip


def test_equal_profiles_and_no_deadline_make_rounds_times_one_duration(data, problem, tmp_path):
    """With every device alike and no deadline, R rounds last R x one client's duration:
    bytes_down/d + K·B·t + bytes_up/u (every client here processes K·B = 6 examples)."""
    path = _write(tmp_path, ["0.25,64,32"])
    sim = _sim(problem, path)
    per = sim.traffic()
    one = per.down / 64 + 3 * 2 * 0.25 + per.up / 32
    result = sim.run(data, sj.hparams(client_lr=0.1), num_rounds=6, eval_every=3)
    assert [r.get("virtual_time") for r in result.records] == [0.0, 3 * one, 6 * one]
    assert result.records[-1]["round_duration"] == one
    assert result.records[-1]["late"] == 0.0


def test_the_clock_without_a_deadline_changes_nothing_else(data, problem, tmp_path):
    """Profiles alone only time the rounds: the state equals the run without them."""
    plain = sj.Simulation(sj.scaffold(problem.loss_fn), problem, sj.BatchPlan.fixed(2, 3), 3)
    timed = _sim(problem, _write(tmp_path, ["0.25,64,32", "0.5,32,64"]))
    a = plain.run(data, sj.hparams(client_lr=0.1), num_rounds=4)
    b = timed.run(data, sj.hparams(client_lr=0.1), num_rounds=4)
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _durations(sim, data, ids):
    """Each client's duration on its device, in float64 (the profile file's row i mod R)."""
    table, per = sim.participation.profiles.table.astype(np.float64), sim.traffic()
    out = []
    for i in ids:
        t, d, u = table[i % len(table)]
        examples = 3 * min(2, int(data.counts[i]))
        out.append(per.down / d + examples * t + per.up / u)
    return out


@pytest.mark.parametrize(
    ("options", "S"),
    [({"round_deadline": 3.0}, 3), ({"over_selection": 1.7}, 3),
     ({"round_deadline": 2.5, "over_selection": 2.0}, 2)],
)  # fmt: skip
def test_deadline_and_over_selection_equal_the_reference(options, S, data, problem, tmp_path):
    """Round by round: the sampled clients (⌈f·S⌉ of them), who reports (the S earliest
    within the deadline), the round's duration, and SCAFFOLD's c_i: a late client's
    row is untouched (its update is lost, as a dropout's)."""
    path = _write(tmp_path, ["0.25,64,32", "0.5,32,64", "0.125,128,16"])
    sim = _sim(problem, path, S=S, **options)
    hparams = sim.resolve_hparams(sj.hparams(client_lr=0.1))
    state, key = sim.init(data), jax.random.key(1)
    width = math.ceil(options.get("over_selection", 1.0) * S - 1e-9)
    deadline = options.get("round_deadline")
    seen_late = 0
    for _ in range(6):
        before = np.asarray(jax.tree.leaves(state.clients)[0]).copy()
        state, metrics = sim.round(hparams, state, data, key)
        ids = np.asarray(metrics["client_ids"]).tolist()
        assert len(ids) == width
        durations = _durations(sim, data, ids)
        kept, last = _select_reference(durations, [True] * width, S, deadline)
        assert np.asarray(metrics["reported"]).tolist() == kept
        assert float(metrics["round_duration"]) == pytest.approx(last)
        assert float(metrics["late"]) == width - sum(kept)
        after = np.asarray(jax.tree.leaves(state.clients)[0])
        for i, k in zip(ids, kept, strict=True):
            if not k:
                np.testing.assert_array_equal(after[i], before[i])
        seen_late += width - sum(kept)
    assert seen_late > 0  # the settings drop someone: the test exercises it


def test_lognormal_profiles_are_fixed_per_client_and_centred_on_their_medians():
    model = LogNormal(seconds_per_example=0.01, down_bytes_per_s=1e6, up_bytes_per_s=1e5,
                      compute_sigma=0.5, bandwidth_sigma=0.75)  # fmt: skip
    key = jax.random.key(7)
    ids = jnp.arange(20_000, dtype=jnp.int32)
    t, d, u = (np.asarray(a, np.float64) for a in model.profile(key, ids))
    # The same client has the same device whatever its position in the sample.
    t2, _, _ = model.profile(key, ids[::-1])
    np.testing.assert_array_equal(np.asarray(t2)[::-1], t)
    for values, median, sigma in ((t, 0.01, 0.5), (d, 1e6, 0.75), (u, 1e5, 0.75)):
        logs = np.log(values / median)
        assert abs(np.median(logs)) < 0.03 and abs(np.std(logs) - sigma) < 0.03 * sigma
    # Another run's seed, other devices.
    other, _, _ = model.profile(jax.random.key(8), ids)
    assert not np.allclose(np.asarray(other), t)


def test_a_profile_file_cycles_its_rows(tmp_path):
    path = _write(tmp_path, ["1,2,3", "4,5,6"])
    model = FileProfiles(path=path)
    t, d, u = model.profile(jax.random.key(0), jnp.asarray([0, 1, 2, 5], jnp.int32))
    assert np.asarray(t).tolist() == [1, 4, 1, 4] and np.asarray(u).tolist() == [3, 6, 3, 6]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("a,b,c\n1,2,3\n", "starts with 'a,b,c'"),
        (HEADER + "1,2\n", "row 2"),
        (HEADER + "1,2,3\n1,-2,3\n", "row 3"),
        (HEADER + "1,2,x\n", "row 2"),
        (HEADER, "no device"),
        ("", "starts with 'nothing'"),
    ],
)
def test_a_malformed_profile_file_is_refused_naming_the_file_and_row(text, match, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        load_profiles(path)
    assert str(path) in str(err.value) and "header seconds_per_example" in str(err.value)


def test_bad_clock_settings_are_refused(data, problem, tmp_path):
    with pytest.raises(ValueError, match="round_deadline = 0 is invalid"):
        LogNormal(deadline=0)
    with pytest.raises(ValueError, match="over_selection = 0.5 is invalid"):
        LogNormal(over_selection=0.5)
    sim = _sim(problem, _write(tmp_path, ["1,2,3"]), S=6, over_selection=1.5)
    with pytest.raises(ValueError, match="samples ceil.f . S. = 9 clients a round, more than"):
        sim.init(data)


@pytest.mark.parametrize(("compressor", "hparams"), [
    ("topk", {"compress_fraction": 0.3}), ("qsgd", {"compress_bits": 2.0}),
    pytest.param("randk", {"compress_fraction": 0.2}, marks=pytest.mark.slow),
    pytest.param("signef", {}, marks=pytest.mark.slow),
])  # fmt: skip
def test_the_clock_times_a_compressed_uplink_at_its_exact_bytes(
    compressor, hparams, data, problem, tmp_path
):
    """A compressed upload lasts its compressed bytes / u: the round's duration is the
    host's exact byte count (``traffic`` with the config's values) through the same
    formula, not the uncompressed size (here even randk's index overhead is timed: on
    this 8-parameter model it sends more)."""
    path = _write(tmp_path, ["0.25,64,32"])
    part = participation.make(profiles="file", options={"profile_file": path})
    algorithm = sj.compression.compressed(sj.scaffold(problem.loss_fn), compressor)
    sim = sj.Simulation(algorithm, problem, sj.BatchPlan.fixed(2, 3), 3, participation=part)
    values = sim.resolve_hparams(sj.hparams(client_lr=0.1, **hparams))
    sent = sj.engine.communication.traffic(
        algorithm, problem.params, {k: float(v) for k, v in values.items()}
    )
    plain = _sim(problem, path).traffic()
    assert sent.up != plain.up
    result = sim.run(data, values, num_rounds=2, eval_every=1)
    want = np.float32(sent.down / 64 + 3 * 2 * 0.25 + sent.up / 32)
    assert result.records[-1]["round_duration"] == pytest.approx(float(want), rel=1e-6)


def test_top_k_uplinks_shorten_a_synchronous_round_in_virtual_time():
    """Top-k with 10% of a 7,850-parameter model's entries (and their indices) sends ~14%
    of the bytes, so on the same devices the same rounds take less virtual time: the
    question "does top-k pay in wall-clock time?" has an answer."""
    rng = np.random.default_rng(0)
    clients = [{"x": rng.normal(size=(8, 784)).astype(np.float32),
                "y": rng.integers(0, 10, 8).astype(np.int32)} for _ in range(6)]  # fmt: skip
    data = sj.data.from_client_arrays(clients)
    problem = sj.models.logistic_regression((784,), 10)
    part = participation.make(profiles="lognormal")
    times = {}
    for compressor in ("none", "topk"):
        algorithm = sj.compression.compressed(sj.scaffold(problem.loss_fn), compressor)
        sim = sj.Simulation(algorithm, problem, BatchPlan.fixed(4, 2), 3, participation=part)
        hparams = {"client_lr": 0.1, **({"compress_fraction": 0.1} if compressor != "none" else {})}
        times[compressor] = sim.run(data, hparams, num_rounds=3).records[-1]["virtual_time"]
    assert times["topk"] < 0.6 * times["none"]
