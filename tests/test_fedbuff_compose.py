"""FedBuff composed with the participation models, the clock's deadline and compression,
against a separate event-driven float64 reference (an extension of the one of
tests/test_fedbuff.py), and with a model that keeps running statistics; the features
FedBuff refuses, with their one-line reasons.

The reference takes from the engine only its random draws, replayed where a draw has a
documented key (the participation model's public function called with it) and read from
the step's metrics otherwise:

- which clients start: the first M from ``buffered.first_clients``, the replacements from
  ``metrics["started_ids"]`` (checked: distinct, available, not in flight, as many as
  ``min(B, eligible)``);
- the availability mask of step t: ``model.step`` with
  ``participation_key(fold_in(key, t), AVAILABILITY_STREAM)``, its state carried;
- a started client's K_i: ``stragglers.steps`` with
  ``participation_key(round_key, STRAGGLER_STREAM)`` (``round_key``: ``fold_in(key, t)``
  for step t's replacements, ``fold_in(key, 2**32 - 2)`` for the first M); checked equal
  to ``metrics["started_steps"]``;
- whether it drops: ``dropouts.dropped`` with ``participation_key(round_key,
  DROPOUT_STREAM)``; checked against ``metrics["dropped"]``.

Everything else is the reference's own, in plain Python and float64 numpy: the durations
(from the profile CSV it reads itself, the bytes it counts itself, compressed ones from
top-k's cost k (32 + ceil(log2 n)) bits per leaf), the deadline's timeouts, which events
a step takes, their staleness, which of them report, the clients' local steps, top-k with
error feedback per client and leaf, the server update, SCAFFOLD's c and every c_i, the
residual table and the virtual time.

Semantics the reference implements (where the brief leaves a choice, the engine's): a
dropped client's event is at its start plus its duration (start + D if it is also slower
than the deadline D); a timed-out one's at start + D; a slot left free (no eligible
client) has its event at its start time, with staleness counted from the version it was
freed at.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import reference_grad

import scaffold_jax as sj
from scaffold_jax import compatibility, participation
from scaffold_jax.engine import buffered, communication
from scaffold_jax.engine.keys import (
    AVAILABILITY_STREAM,
    DROPOUT_STREAM,
    STRAGGLER_STREAM,
    constants_key,
    participation_key,
)
from tests.conftest import binary_clients

K, LR = 2, 0.5
#: The key of the first M clients' draws, as documented in buffered.start_key.
FILL = np.uint32(2**32 - 2)


@pytest.fixture(scope="module")
def data():
    sizes = [4, 4, 8, 4, 8, 4, 12, 4, 8, 4]  # equal sizes: ties in finish times
    return binary_clients(sizes, seed=3)


@pytest.fixture(scope="module")
def problem():
    # Three classes from a random start: with two, the rows of a leaf's gradient are exact
    # negatives, and from zeros two classes no client labels are alike: top-k choices would
    # be exact ties that float32's and float64's rounding break apart.
    return sj.models.logistic_regression((3,), 3, zero_init=False)


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    # Powers of two: every duration (and every sum of them) is exact in float32.
    path = tmp_path_factory.mktemp("profiles") / "devices.csv"
    rows = ["0.25,64,32", "0.5,32,64", "0.25,64,32", "0.125,128,16"]
    path.write_text("seconds_per_example,down_bytes_per_s,up_bytes_per_s\n" + "\n".join(rows))
    return str(path)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(tree)])


def _rows(table) -> np.ndarray:
    """A client table (a pytree of ``[N, ...]`` leaves) as float64 ``[N, P]``."""
    leaves = [np.asarray(a, np.float64) for a in jax.tree.leaves(table)]
    return np.concatenate([a.reshape(a.shape[0], -1) for a in leaves], axis=1)


class Setting:
    """One composition: the algorithm, M and B, and which features are on."""

    def __init__(self, kind, concurrency=4, size=2, *, availability=None, stragglers=False,
                 dropout_rate=None, deadline=None, fraction=None):  # fmt: skip
        self.kind, self.concurrency, self.size = kind, concurrency, size
        self.availability = availability  # None, or Markov options
        self.stragglers, self.dropout_rate = stragglers, dropout_rate
        self.deadline, self.fraction = deadline, fraction

    def simulation(self, problem, profile_file):
        algorithm = (sj.scaffold if self.kind == "scaffold" else sj.fedavg)(problem.loss_fn)
        if self.fraction is not None:
            algorithm = sj.compression.compressed(algorithm, "topk")
        options = {"profile_file": profile_file}
        names = {}
        if self.availability is not None:
            names["availability"] = "markov"
            options.update(self.availability)
        if self.stragglers:
            names["stragglers"] = "uniform"
            options["straggler_min_steps"] = 1
        if self.dropout_rate is not None:
            names["dropouts"] = "bernoulli"
            options["dropout_rate"] = self.dropout_rate
        if self.deadline is not None:
            options["round_deadline"] = self.deadline
        part = participation.make(profiles="file", options=options, **names)
        return sj.Simulation(
            algorithm, problem, sj.BatchPlan.full(K), clients_per_round=self.size,
            participation=part, execution=sj.FedBuff(self.concurrency, self.size),
        )  # fmt: skip

    def hparams(self):
        extra = {} if self.fraction is None else {"compress_fraction": self.fraction}
        return sj.hparams(client_lr=LR, **extra)

    @property
    def losing(self):
        """Whether an upload can be lost (the step's metrics then say which reported)."""
        return (self.availability is not None or self.dropout_rate is not None
                or self.deadline is not None)  # fmt: skip


class Slot:
    """A slot of the reference's in-flight table."""

    def __init__(self, client, version, start, finish, reported, dy=None, dc=None, ci=None):
        self.client, self.version, self.start, self.finish = client, version, start, finish
        self.reported, self.dy, self.dc, self.ci = reported, dy, dc, ci


class Reference:
    """FedBuff as an event loop in float64, with every composing feature."""

    def __init__(self, setting, problem, data, sim, key, profile_file):
        self.s, self.problem, self.data, self.sim, self.key = setting, problem, data, sim, key
        self.unflat = jax.flatten_util.ravel_pytree(problem.params)[1]
        self.x = _flat(problem.params)
        p = self.x.size
        self.sizes = [int(np.size(a)) for a in jax.tree.leaves(problem.params)]
        self.bounds = np.cumsum([0, *self.sizes])
        self.n = data.num_clients
        self.counts = np.asarray(data.counts, np.int64)
        scaffold = setting.kind == "scaffold"
        self.entries = ["delta_params", *(["delta_control"] if scaffold else [])]
        self.c = np.zeros(p)
        self.ci = np.zeros((self.n, p))
        self.residual = (
            None if setting.fraction is None else {e: np.zeros((self.n, p)) for e in self.entries}
        )
        # The bytes, counted here: float32 x (and c) down; Δy (and Δc) up, each entry
        # 4 bytes an entry, or top-k's k = ceil(f n) values and indices per leaf.
        self.down = 4 * p * len(self.entries)
        if setting.fraction is None:
            per_entry = 4 * p
        else:
            per_entry = sum(-(-self.topk_bits(n) // 8) for n in self.sizes)
        self.up = per_entry * len(self.entries)
        hp = dict(setting.hparams()._asdict())
        traffic = communication.traffic(sim.algorithm, problem.params, hp)
        assert (traffic.down, traffic.up) == (self.down, self.up)  # the accounting agrees
        # The devices, read from the file here: client i reads row i mod R.
        self.devices = np.loadtxt(profile_file, delimiter=",", skiprows=1, ndmin=2)
        model = sim.participation.availability
        self.availability = None if model is None else model.init(self.n)
        self.stats = {"dropped": 0, "late": 0, "free": 0, "short": 0, "silent_steps": 0,
                      "ties": 0, "lost_events": 0}  # fmt: skip

    # ---------------------------------------------------------------- the engine's draws
    def available(self, t):
        """Step t's availability mask (the model's public step with its documented key),
        None without a model."""
        model = self.sim.participation.availability
        if model is None:
            return None
        key = participation_key(jr.fold_in(self.key, t), AVAILABILITY_STREAM)
        self.availability, mask = model.step(self.availability, key, jnp.int32(t), self.n)
        return np.asarray(mask)

    def round_key(self, t):
        return jr.fold_in(self.key, FILL if t is None else np.uint32(t))

    def steps_of(self, t, ids):
        """The clients' K_i, replayed (K without stragglers)."""
        model = self.sim.participation.stragglers
        if model is None:
            return np.full(len(ids), K)
        ids = jnp.asarray(np.maximum(ids, 0), jnp.int32)
        key = participation_key(self.round_key(t), STRAGGLER_STREAM)
        return np.asarray(model.steps(key, constants_key(self.key), ids, jnp.full(ids.shape, K)))

    def dropped_of(self, t, ids):
        model = self.sim.participation.dropouts
        if model is None:
            return np.zeros(len(ids), bool)
        key = participation_key(self.round_key(t), DROPOUT_STREAM)
        return np.asarray(model.dropped(key, jnp.asarray(np.maximum(ids, 0), jnp.int32)))

    # ---------------------------------------------------------------- the reference's own
    def topk_bits(self, n):
        k = math.ceil(Fraction(str(self.s.fraction)) * n)
        return min(max(k, 1), n) * (32 + math.ceil(math.log2(n)))

    def topk(self, u):
        """Top-k of every leaf of the flat ``u`` (largest |u_j|, ties: the lowest index)."""
        sent = np.zeros_like(u)
        for leaf, n in enumerate(self.sizes):
            a, b = self.bounds[leaf], self.bounds[leaf + 1]
            k = min(max(math.ceil(Fraction(str(self.s.fraction)) * n), 1), n)
            seg = u[a:b]
            ranked = np.lexsort((np.arange(n), -np.abs(seg)))
            if k < n:
                # A choice float32's rounding could make otherwise would be no test; near 0
                # (a SCAFFOLD client restarting where its c_i was set sends Δy = 0 up to
                # float32 rounding) either choice sends the same to within the tolerance.
                kth, next_ = np.abs(seg[ranked[k - 1]]), np.abs(seg[ranked[k]])
                assert kth < 1e-7 or kth - next_ > 1e-4 * kth, ("a near-tie in top-k", seg)
            order = ranked[:k]
            sent[a + order] = seg[order]
        return sent

    def duration(self, i, steps):
        t, d, u = self.devices[i % len(self.devices)]
        return self.down / d + steps * int(self.counts[i]) * t + self.up / u

    def batch(self, i):
        batches, mask = self.data.client_batches(jnp.int32(i), jr.key(0), sj.BatchPlan.full(K))
        return jax.tree.map(lambda a: a[0], batches), mask[0]

    def train(self, i, x, c, steps):
        """Client i's ``steps`` full-batch steps from (x, c): (Δy, Δc, c_i⁺)."""
        batch, mask = self.batch(i)
        y = x.copy()
        for _ in range(steps):
            g = _flat(reference_grad(self.problem.loss_fn, self.unflat(y), batch, mask))
            if self.s.kind == "scaffold":
                g = g - self.ci[i] + c
            y = y - LR * g
        if self.s.kind != "scaffold":
            return y - x, None, None
        ci_new = self.ci[i] - c + (x - y) / (steps * LR)
        return y - x, ci_new - self.ci[i], ci_new

    def start(self, client, version, when, x, c, steps, dropped):
        """A slot started at ``when`` (-1: left free)."""
        if client < 0:
            self.stats["free"] += 1
            return Slot(-1, version, when, when, False)
        self.stats["short"] += int(steps < K)
        dy, dc, ci = self.train(client, x, c, steps)
        spent = self.duration(client, steps)
        late = self.s.deadline is not None and spent > self.s.deadline
        if late:
            spent = self.s.deadline
        self.stats["dropped"] += int(dropped)
        self.stats["late"] += int(late and not dropped)
        return Slot(client, version, when, when + spent, not (dropped or late), dy, dc, ci)


def _check_draws(ids, candidates, width):
    """The engine's draw of ``ids`` (-1: free) among ``candidates`` (bool [N]): distinct,
    eligible, as many as there are (up to ``width``)."""
    drawn = [int(i) for i in ids if i >= 0]
    assert len(set(drawn)) == len(drawn), ids
    assert all(candidates[i] for i in drawn), (ids, np.flatnonzero(candidates))
    assert len(drawn) == min(width, int(np.sum(candidates))), (ids, np.flatnonzero(candidates))


def _run_against_reference(setting, problem, data, profile_file, steps):
    sim = setting.simulation(problem, profile_file)
    hparams = sim.resolve_hparams(setting.hparams())
    key = jr.key(0)
    state = sim.init(data)
    ref = Reference(setting, problem, data, sim, key, profile_file)
    m, b, n = setting.concurrency, setting.size, data.num_clients
    x0 = ref.x.copy()

    now, version = 0.0, 0
    slots = []
    for t in range(steps):
        available = ref.available(t)
        everyone = np.ones(n, bool) if available is None else available
        if t == 0:  # the table is filled at time 0 from x^0, among the available
            ids = buffered.first_clients(sim.participation, key, n, m)
            _check_draws(ids, everyone, m)
            ids = np.asarray(ids)
            k_i, dropped = ref.steps_of(None, ids), ref.dropped_of(None, ids)
            slots = [ref.start(int(i), 0, 0.0, ref.x, ref.c, int(k), bool(d))
                     for i, k, d in zip(ids, k_i, dropped, strict=True)]  # fmt: skip

        state, metrics = sim.round(hparams, state, data, key)
        metrics = jax.device_get(metrics)

        # 1. The B earliest events, ties to the lower slot.
        order = sorted(range(m), key=lambda s: (slots[s].finish, s))[:b]
        events = [slots[s] for s in order]
        ref.stats["ties"] += len({e.finish for e in events}) < b
        np.testing.assert_array_equal(metrics["arrived_ids"], [e.client for e in events])
        np.testing.assert_array_equal(metrics["arrival_staleness"],
                                      [version - e.version for e in events])  # fmt: skip
        reported = [e.reported for e in events]
        assert ("reported" in metrics) == setting.losing
        if setting.losing:
            np.testing.assert_array_equal(metrics["reported"], reported)
        ref.stats["lost_events"] += b - sum(reported)
        assert metrics["uploads"] == sum(reported)
        if available is not None:
            assert metrics["available"] == available.sum()

        # 2. The server update over the events; the lost ones count nothing.
        sent_dy, sent_dc = [], []
        for e in events:
            if e.client < 0:  # a free slot: no message
                sent_dy.append(None)
                sent_dc.append(None)
                continue
            messages = {"delta_params": e.dy, "delta_control": e.dc}
            if ref.residual is not None:  # top-k with error feedback
                for name in ref.entries:
                    u = messages[name] + ref.residual[name][e.client]
                    messages[name] = ref.topk(u)
                    if e.reported:
                        ref.residual[name][e.client] = u - messages[name]
            sent_dy.append(messages["delta_params"])
            sent_dc.append(messages["delta_control"])
        taus = [version - e.version for e in events]
        weigh = [1.0 / math.sqrt(1.0 + tau) for tau in taus]
        counted = [j for j in range(b) if events[j].reported]
        ref.stats["silent_steps"] += not counted
        dx = np.zeros_like(ref.x)
        if counted:
            dx = sum(weigh[j] * sent_dy[j] for j in counted) / len(counted)
        x_new = ref.x + 1.0 * dx
        c_new = ref.c
        if setting.kind == "scaffold":
            c_new = ref.c + sum((sent_dc[j] for j in counted), np.zeros_like(ref.c)) / n
            for j in counted:
                ref.ci[events[j].client] = events[j].ci
        previous, now = now, max(now, max(e.finish for e in events))

        # 3. The replacements: the engine's draw among the available clients not in flight.
        started = np.asarray(metrics["started_ids"]).astype(int)
        flying = {slots[s].client for s in range(m) if s not in order and slots[s].client >= 0}
        eligible = everyone.copy()
        eligible[list(flying)] = False
        _check_draws(started, eligible, b)
        k_i, dropped = ref.steps_of(t, started), ref.dropped_of(t, started)
        live = started >= 0
        if setting.stragglers:
            np.testing.assert_array_equal(metrics["started_steps"][live], k_i[live])
        if setting.dropout_rate is not None:
            assert metrics["dropped"] == np.sum(dropped & live)
        late_before = ref.stats["late"]
        for j, (s, client) in enumerate(zip(order, started, strict=True)):
            newest = j == b - 1  # the B-th event's replacement starts after the step
            x_from, c_from = (x_new, c_new) if newest else (ref.x, ref.c)
            slots[s] = ref.start(int(client), version + int(newest), events[j].finish, x_from,
                                 c_from, int(k_i[j]), bool(dropped[j]))  # fmt: skip
        if setting.deadline is not None:
            assert metrics["late"] == ref.stats["late"] - late_before
        filled = m - sum(ids < 0) if t == 0 else 0
        assert metrics["downloads"] == live.sum() + filled
        ref.x, ref.c, version = x_new, c_new, version + 1

        # The engine's state against the reference's.
        np.testing.assert_allclose(_flat(state.server.params), ref.x, rtol=1e-5, atol=1e-6)
        if setting.kind == "scaffold":
            np.testing.assert_allclose(_flat(state.server.control), ref.c, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(_rows(state.clients), ref.ci, rtol=1e-5, atol=1e-6)
        if ref.residual is not None:
            for name in ref.entries:
                np.testing.assert_allclose(_rows(state.messages[name]), ref.residual[name],
                                           rtol=1e-5, atol=1e-6)  # fmt: skip
        # Exact: dyadic durations (and a dyadic deadline).
        assert float(state.inflight.now) == now, (float(state.inflight.now), now)
        assert metrics["round_duration"] == now - previous
        assert int(state.round) == version
    assert not np.allclose(ref.x, x0)  # the model moved
    return ref.stats


MARKOV = {"availability_rate": 0.4, "mean_on_rounds": 2.0}

#: name -> (Setting keywords, the counters of the reference that must be > 0). The deadlines
#: (per algorithm: SCAFFOLD sends twice the bytes) time out about half of the clients.
FEATURES = {
    "dropouts": ({"dropout_rate": 0.3}, ["dropped", "lost_events"]),
    "availability": ({"availability": MARKOV}, ["free", "lost_events"]),
    "stragglers": ({"stragglers": True}, ["short"]),
    "deadline": ({"deadline": {"fedavg": 6.0, "scaffold": 8.0}}, ["late", "lost_events"]),
    "topk": ({"fraction": 0.5}, []),
    "all": (
        {
            "availability": MARKOV,
            "stragglers": True,
            "dropout_rate": 0.2,
            "deadline": {"fedavg": 5.0, "scaffold": 6.0},
            "fraction": 0.5,
        },
        ["free", "dropped", "late", "short", "lost_events"],
    ),
}


@pytest.mark.parametrize(
    ("feature", "kind"),
    # Each feature alone with SCAFFOLD (x, c and every c_i checked; the slow tier), all of
    # them at once with both algorithms (SCAFFOLD's in the quick tier).
    [
        *(pytest.param(f, "scaffold", marks=pytest.mark.slow) for f in FEATURES if f != "all"),
        pytest.param("all", "fedavg", marks=pytest.mark.slow),
        ("all", "scaffold"),
    ],  # fmt: skip
)
def test_fedbuff_composed_equals_the_event_driven_reference(
    feature, kind, data, problem, profile_file
):
    options, exercised = FEATURES[feature]
    options = dict(options)
    if isinstance(options.get("deadline"), dict):
        options["deadline"] = options["deadline"][kind]
    stats = _run_against_reference(Setting(kind, 4, 2, **options), problem, data, profile_file,
                                   steps=8)  # fmt: skip
    for name in exercised:
        assert stats[name] > 0, (name, stats)


# ------------------------------------------------------------ a model with running statistics
def _bn_simulation(policy, profile_file, **names_and_options):
    """FedBuff(3, 2) on test_model_state's BatchNorm network (4 clients of 3 to 9 examples,
    offset features: their statistics differ), FedAvg, 2 local steps of 4 examples."""
    from tests.test_model_state import make_data, make_problem

    _, data = make_data()
    problem = make_problem(policy)
    options = {"profile_file": profile_file, **names_and_options.pop("options", {})}
    part = participation.make(profiles="file", options=options, **names_and_options)
    sim = sj.Simulation(
        sj.fedavg(problem.loss_fn), problem, sj.BatchPlan.fixed(batch_size=4, num_steps=2),
        clients_per_round=2, participation=part, execution=sj.FedBuff(3, 2),
    )  # fmt: skip
    return sim, data, problem


@pytest.mark.parametrize(
    ("policy", "availability"),
    # Each client's own statistics under an availability model (lost events, free slots);
    # the server's averaged ones with every upload counted (a lost one: the test below).
    # (The slow tier; the quick tier's statistics under masked rows are test_model_state's.)
    [
        pytest.param(*case, marks=pytest.mark.slow)
        for case in (("local", "markov"), ("average", "always"))
    ],
)
def test_fedbuff_with_running_statistics_moves_them_and_resumes_bit_for_bit(
    policy, availability, profile_file, tmp_path
):
    names = {}
    if availability == "markov":
        names = {"availability": "markov", "options": {"availability_rate": 0.4,
                                                       "mean_on_rounds": 2.0}}  # fmt: skip
    sim, data, problem = _bn_simulation(policy, profile_file, **names)
    hp = sj.hparams(client_lr=0.2)
    hparams, key = sim.resolve_hparams(hp), jr.key(0)
    state = sim.init(data)
    initial = _rows(jax.tree.map(lambda a: a[None], problem.model_state))[0]
    lost = 0
    for t in range(7):
        before = jax.device_get(state)
        state, metrics = sim.round(hparams, state, data, key)
        metrics, model = jax.device_get((metrics, state.model))
        if t == 0:  # the table was filled inside this step: nothing to compare with yet
            continue
        # The step's events as the in-flight table held them before it: the reported ones'
        # statistics are written (each client's own row, or their mean into the server's).
        table = before.inflight
        slots = np.argsort(np.asarray(table.finish), kind="stable")[:2]
        ids = np.asarray(table.ids)[slots]
        reported = np.asarray(metrics.get("reported", np.ones(2, bool)))
        lost += int(np.sum(~reported))
        stats = _rows(table.stats)[slots]
        if policy == "local":
            want = _rows(before.model["clients"])
            want[ids[reported]] = stats[reported]
            np.testing.assert_array_equal(_rows(model["clients"]), want)
        else:
            np.testing.assert_allclose(_rows(jax.tree.map(lambda a: a[None], model["server"]))[0],
                                       stats.mean(0), rtol=1e-6, atol=1e-7)  # fmt: skip
    if availability == "markov":
        assert lost > 0
    # The statistics moved.
    if policy == "local":
        moved = np.abs(_rows(model["clients"]) - initial).max(1)
        assert np.sum(moved > 1e-3) >= 2, moved
    else:
        moved = _rows(jax.tree.map(lambda a: a[None], model["server"]))[0] - initial
        assert np.abs(moved).max() > 1e-3

    # Stopped after 3 steps and resumed to 6: the uninterrupted run, bit for bit.
    whole = sim.run(data, hp, num_rounds=6, eval_every=3)
    folder = tmp_path / "ckpt"
    sim.run(data, hp, num_rounds=3, eval_every=3, checkpoint_dir=folder, checkpoint_every=3)
    resumed = sim.run(data, hp, num_rounds=6, eval_every=3, checkpoint_dir=folder, resume=True)
    assert resumed.resumed_from == 3
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert whole.records[-1]["virtual_time"] == resumed.records[-1]["virtual_time"]
    assert whole.records[-1]["test_loss"] == resumed.records[-1]["test_loss"]


def test_fedbuff_with_averaged_running_statistics_and_dropouts_runs(profile_file):
    sim, data, problem = _bn_simulation(
        "average", profile_file, dropouts="bernoulli", options={"dropout_rate": 0.5}
    )
    state = sim.init(data)
    hparams, key = sim.resolve_hparams(sj.hparams(client_lr=0.2)), jr.key(0)
    for _ in range(4):
        state, metrics = sim.round(hparams, state, data, key)
    stats = jax.device_get(state.model["server"])
    assert np.all(np.isfinite(_rows(jax.tree.map(lambda a: a[None], stats))))


# --------------------------------------------------------------------------- what is refused
def _refusal(problem, data, algorithm, options, feature):
    part = participation.make(profiles="file", options=options)
    sim = sj.Simulation(algorithm, problem, sj.BatchPlan.full(K), clients_per_round=2,
                        participation=part, execution=sj.FedBuff(4, 2))  # fmt: skip
    with pytest.raises(ValueError) as caught:
        sim.init(data)
    message = str(caught.value)
    assert "\n" not in message  # one line
    assert message == compatibility.refusal("fedbuff", [feature])  # the matrix's reason
    return message


def test_fedbuff_refuses_over_selection_with_its_reason(data, problem, profile_file):
    options = {"profile_file": profile_file, "over_selection": 1.5}
    message = _refusal(problem, data, sj.fedavg(problem.loss_fn), options, "over_selection")
    assert message == (
        "FedBuff with over-selection (sample ceil(f S), keep the S first): over-selection "
        "keeps the S first of a synchronous cohort, and FedBuff has no cohort (its buffer of "
        "B arrivals is its policy): unset over_selection, or use synchronous rounds."
    )


@pytest.mark.parametrize("compress", [False, True])
def test_fedbuff_refuses_differential_privacy_with_its_reason(
    compress, data, problem, profile_file
):
    algorithm = sj.scaffold(problem.loss_fn)
    if compress:  # the order a private, compressed run takes
        algorithm = sj.compression.compressed(algorithm, "topk")
    algorithm = sj.privacy.private(algorithm)
    message = _refusal(problem, data, algorithm, {"profile_file": profile_file}, "privacy")
    assert message == (
        "FedBuff with user-level differential privacy (clip, Gaussian noise, accountant): "
        "differential privacy's accountant covers rounds of uniformly sampled clients; a "
        "FedBuff step's buffer holds whichever clients arrive first, so that amplification by "
        "sampling does not apply and no accountant here covers it: use synchronous rounds for "
        "a private run."
    )
