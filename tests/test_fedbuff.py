"""FedBuff (scaffold_jax.engine.buffered) against a separate event-driven reference: a heap
of arrival times in plain Python, the clients' local steps and the server in float64
numpy (their gradients from conftest.reference_grad, as the other reference loops'). The
reference takes the engine's draws of WHICH clients start (its sampling; checked to be
clients not in flight, distinct) and computes everything else itself: who arrives when,
the staleness of every arrival, the server model, SCAFFOLD's c and every c_i, and the
virtual time.

The devices come from a profile file of powers of two, so that every duration is exact in
float32 and ties in finish times happen (clients of equal size on equal devices).
"""

from __future__ import annotations

import heapq
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import reference_grad

import scaffold_jax as sj
from scaffold_jax import participation
from scaffold_jax.engine import buffered
from tests.conftest import binary_clients

K, LR = 2, 0.5


@pytest.fixture(scope="module")
def data():
    sizes = [4, 4, 8, 4, 8, 4, 12, 4, 8, 4]  # equal sizes: ties in finish times
    return binary_clients(sizes, seed=3)


@pytest.fixture(scope="module")
def problem():
    return sj.models.logistic_regression((3,), 2)


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "devices.csv"
    rows = ["0.25,64,32", "0.5,32,64", "0.25,64,32", "0.125,128,16"]
    path.write_text("seconds_per_example,down_bytes_per_s,up_bytes_per_s\n" + "\n".join(rows))
    return str(path)


def _simulation(algorithm, problem, profile_file, concurrency, size, staleness="sqrt"):
    part = participation.make(profiles="file", options={"profile_file": profile_file})
    return sj.Simulation(
        algorithm, problem, sj.BatchPlan.full(K), clients_per_round=size, participation=part,
        execution=sj.FedBuff(concurrency, size, staleness),
    )  # fmt: skip


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(tree)])


class Reference:
    """FedBuff as an event loop (NETWORK.md §4), float64."""

    def __init__(self, kind, problem, data, sim, staleness):
        self.kind, self.problem, self.data = kind, problem, data
        self.staleness = staleness
        self.unflat = jax.flatten_util.ravel_pytree(problem.params)[1]
        self.x = _flat(problem.params)
        self.c = np.zeros_like(self.x)
        self.ci = np.zeros((data.num_clients, self.x.size))
        table = sim.participation.profiles.table.astype(np.float64)
        per_client = sim.traffic()
        self.seconds = {}
        for i in range(data.num_clients):
            t, d, u = table[i % len(table)]
            n = int(data.counts[i])
            self.seconds[i] = per_client.down / d + K * n * t + per_client.up / u
        self.n = data.num_clients

    def batch(self, i):
        batches, mask = self.data.client_batches(
            jnp.int32(i), jax.random.key(0), sj.BatchPlan.full(K)
        )
        return jax.tree.map(lambda a: a[0], batches), mask[0]

    def train(self, i, x, c):
        """Client i's K full-batch steps from (x, c): (Δy, Δc, c_i⁺)."""
        batch, mask = self.batch(i)
        y = x.copy()
        for _ in range(K):
            g = _flat(reference_grad(self.problem.loss_fn, self.unflat(y), batch, mask))
            if self.kind == "scaffold":
                g = g - self.ci[i] + c
            y = y - LR * g
        if self.kind != "scaffold":
            return y - x, None, None
        ci_new = self.ci[i] - c + (x - y) / (K * LR)
        return y - x, ci_new - self.ci[i], ci_new

    def weight(self, tau):
        return 1.0 if self.staleness == "constant" else 1.0 / np.sqrt(1.0 + tau)


def _check_against_reference(kind, problem, data, profile_file, concurrency, size, steps,
                             staleness="sqrt"):  # fmt: skip
    algorithm = sj.scaffold(problem.loss_fn) if kind == "scaffold" else sj.fedavg(problem.loss_fn)
    sim = _simulation(algorithm, problem, profile_file, concurrency, size, staleness)
    hparams = sim.resolve_hparams(sj.hparams(client_lr=LR))
    key = jax.random.key(0)
    state = sim.init(data)
    ref = Reference(kind, problem, data, sim, staleness)

    # Time 0: the engine's M clients, trained from x^0.
    ids = buffered.first_clients(sim.participation, key, data.num_clients, concurrency)
    assert len(set(ids)) == concurrency
    slots = {}
    heap = []
    for slot, i in enumerate(ids):
        slots[slot] = (i, 0, *ref.train(i, ref.x, ref.c))
        heapq.heappush(heap, (ref.seconds[i], slot))
    now, version = 0.0, 0
    ties = 0
    for _ in range(steps):
        state, metrics = sim.round(hparams, state, data, key)
        # The B earliest arrivals, ties to the lower slot.
        arrivals = [heapq.heappop(heap) for _ in range(size)]
        ties += len({t for t, _ in arrivals}) < size
        arrived = [slots[s][0] for _, s in arrivals]
        taus = [version - slots[s][1] for _, s in arrivals]
        np.testing.assert_array_equal(np.asarray(metrics["arrived_ids"]), arrived)
        np.testing.assert_array_equal(np.asarray(metrics["arrival_staleness"]), taus)
        dy = np.mean(
            [ref.weight(tau) * slots[s][2] for (_, s), tau in zip(arrivals, taus, strict=True)], 0
        )
        x_new = ref.x + 1.0 * dy
        c_new = ref.c
        if kind == "scaffold":
            c_new = ref.c + np.sum([slots[s][3] for _, s in arrivals], 0) / ref.n
            for _, s in arrivals:
                ref.ci[slots[s][0]] = slots[s][4]
        now = max(now, max(t for t, _ in arrivals))
        # The engine's replacements: distinct, none of them in flight.
        started = [int(i) for i in np.asarray(metrics["started_ids"])]
        flying = {slots[s][0] for s in range(concurrency)} - set(arrived)
        assert len(set(started)) == size and not set(started) & flying
        for k, ((t_arrival, s), i) in enumerate(zip(arrivals, started, strict=True)):
            newest = k == size - 1  # the B-th arrival's replacement starts after the step
            x0, c0 = (x_new, c_new) if newest else (ref.x, ref.c)
            slots[s] = (i, version + int(newest), *ref.train(i, x0, c0))
            heapq.heappush(heap, (t_arrival + ref.seconds[i], s))
        ref.x, ref.c, version = x_new, c_new, version + 1
        np.testing.assert_allclose(_flat(state.server.params), ref.x, rtol=1e-5, atol=1e-6)
        if kind == "scaffold":
            np.testing.assert_allclose(_flat(state.server.control), ref.c, rtol=1e-5, atol=1e-6)
            table = np.asarray(
                jax.vmap(lambda r: jax.flatten_util.ravel_pytree(r)[0])(state.clients)
            )
            np.testing.assert_allclose(table, ref.ci, rtol=1e-5, atol=1e-6)
        assert float(state.inflight.now) == now  # exact: dyadic durations
        assert int(state.round) == version
    return ties


@pytest.mark.parametrize("kind", ["fedavg", "scaffold"])
@pytest.mark.parametrize(
    ("concurrency", "size"),
    [
        (4, 2),
        (3, 1),
        pytest.param(3, 3, marks=pytest.mark.slow),
        pytest.param(6, 4, marks=pytest.mark.slow),
    ],
)
def test_fedbuff_equals_the_event_driven_reference(
    kind, concurrency, size, data, problem, profile_file
):
    ties = _check_against_reference(kind, problem, data, profile_file, concurrency, size, steps=8)
    if (concurrency, size) == (4, 2):
        assert ties > 0  # the devices and sizes make arrivals tie: the tie rule is exercised


def test_constant_staleness_weighting(data, problem, profile_file):
    _check_against_reference("fedavg", problem, data, profile_file, 4, 2, steps=5,
                             staleness="constant")  # fmt: skip


def test_with_m_equal_b_and_equal_durations_the_replacements_start_stale(problem, tmp_path):
    """NETWORK.md §4: with M = B and equal durations every step's arrivals tie, and B − 1
    replacements start one version stale: FedBuff is not synchronous FedAvg there."""
    rng = np.random.default_rng(0)
    data = sj.data.from_client_arrays(
        [
            {"x": rng.normal(size=(4, 3)).astype("float32"), "y": rng.integers(0, 2, 4)}
            for _ in range(6)
        ]
    )
    path = tmp_path / "one.csv"
    path.write_text("seconds_per_example,down_bytes_per_s,up_bytes_per_s\n0.25,64,64\n")
    sim = _simulation(sj.fedavg(problem.loss_fn), problem, str(path), 3, 3)
    hparams = sim.resolve_hparams(sj.hparams(client_lr=LR))
    state, key = sim.init(data), jax.random.key(0)
    stalenesses = []
    for _ in range(4):
        state, metrics = sim.round(hparams, state, data, key)
        stalenesses.append(np.asarray(metrics["arrival_staleness"]).tolist())
    assert stalenesses[0] == [0, 0, 0]
    assert all(s == [1, 1, 0] for s in stalenesses[1:])


def test_virtual_time_advances_by_the_step_duration(data, problem, profile_file):
    sim = _simulation(sj.fedavg(problem.loss_fn), problem, profile_file, 4, 2)
    result = sim.run(data, sj.hparams(client_lr=LR), num_rounds=6, eval_every=3)
    times = [r.get("virtual_time") for r in result.records]
    assert times[0] == 0.0 and 0 < times[1] < times[2]  # the curve starts at its start
    durations = [r["round_duration"] for r in result.records[1:]]
    assert times[2] == pytest.approx(3 * durations[0] + 3 * durations[1])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p, f: sj.mime(p.loss_fn), "no asynchronous contract for 'mime'"),
        (lambda p, f: sj.feddyn(p.loss_fn), "no asynchronous contract for 'feddyn'"),
    ],
)
def test_an_algorithm_without_an_asynchronous_contract_is_refused(
    make, match, data, problem, profile_file
):
    sim = _simulation(make(problem, profile_file), problem, profile_file, 4, 2)
    with pytest.raises(ValueError, match=match):
        sim.init(data)


def test_bad_fedbuff_settings_are_refused(data, problem, profile_file):
    with pytest.raises(ValueError, match="buffer_size B = 5 exceeds concurrency M = 4"):
        sj.FedBuff(4, 5)
    with pytest.raises(ValueError, match="buffer_size = 0 is invalid"):
        sj.FedBuff(4, 0)
    sim = _simulation(sj.fedavg(problem.loss_fn), problem, profile_file, 11, 2)
    with pytest.raises(ValueError, match="concurrency M = 11 exceeds the N = 10"):
        sim.init(data)
    plain = sj.Simulation(sj.fedavg(problem.loss_fn), problem, sj.BatchPlan.full(K), 2,
                          execution=sj.FedBuff(4, 2))  # fmt: skip
    with pytest.raises(ValueError, match="needs device profiles"):
        plain.init(data)


def test_a_resumed_fedbuff_run_is_the_uninterrupted_one_bit_for_bit(
    data, problem, profile_file, tmp_path
):
    """The in-flight table (ids, versions, times, updates, rows) is checkpointed with the
    rest: stopping after 3 steps and resuming to 7 gives the 7-step run exactly."""
    sim = _simulation(sj.scaffold(problem.loss_fn), problem, profile_file, 4, 2)
    hp = sj.hparams(client_lr=LR)
    whole = sim.run(data, hp, num_rounds=7, eval_every=1)
    folder = tmp_path / "ckpt"
    sim.run(data, hp, num_rounds=3, eval_every=1, checkpoint_dir=folder, checkpoint_every=1)
    resumed = sim.run(data, hp, num_rounds=7, eval_every=1, checkpoint_dir=folder, resume=True)
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [r["virtual_time"] for r in whole.records[1:]] == [
        r["virtual_time"] for r in resumed.records[1:]
    ]


def test_a_resume_with_another_concurrency_or_profile_is_refused(
    data, problem, profile_file, tmp_path
):
    folder = tmp_path / "ckpt"
    hp = sj.hparams(client_lr=LR)
    _simulation(sj.fedavg(problem.loss_fn), problem, profile_file, 4, 2).run(
        data, hp, num_rounds=2, checkpoint_dir=folder
    )
    with pytest.raises(ValueError, match="another concurrency M"):
        _simulation(sj.fedavg(problem.loss_fn), problem, profile_file, 5, 2).run(
            data, hp, num_rounds=4, checkpoint_dir=folder, resume=True
        )
    with pytest.raises(ValueError, match=r"execution.*buffer_size=3"):
        _simulation(sj.fedavg(problem.loss_fn), problem, profile_file, 4, 3).run(
            data, hp, num_rounds=4, checkpoint_dir=folder, resume=True
        )
    other = tmp_path / "other.csv"
    other.write_text("seconds_per_example,down_bytes_per_s,up_bytes_per_s\n0.5,64,32\n")
    with pytest.raises(ValueError, match="rows_sha256"):
        _simulation(sj.fedavg(problem.loss_fn), problem, str(other), 4, 2).run(
            data, hp, num_rounds=4, checkpoint_dir=folder, resume=True
        )


def test_a_sweep_of_fedbuff_configs_equals_their_single_runs(data, problem, profile_file):
    """A step-size x seed grid is one vmapped program: each config computes its own run
    (the same clients start when: their durations do not depend on the step size)."""
    sim = _simulation(sj.scaffold(problem.loss_fn), problem, profile_file, 4, 2)
    grid, seeds, _ = sj.sweep.grid([0.1, 0.5], seeds=[0, 1])
    swept = sj.sweep.sweep(sim, data, grid, seeds, num_rounds=5, eval_every=5)
    for j, (lr, seed) in enumerate([(0.1, 0), (0.1, 1), (0.5, 0), (0.5, 1)]):
        single = sim.run(data, sj.hparams(client_lr=lr), num_rounds=5, eval_every=5, seed=seed)
        last, want = swept.records[j][-1], single.records[-1]
        assert last["virtual_time"] == want["virtual_time"]
        assert last["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)


@pytest.mark.slow  # command-line runs and a resume: ~4 s
def test_fedbuff_from_the_command_line_and_a_changed_concurrency_refused(tmp_path, capsys):
    from scaffold_jax.cli import main

    out = str(tmp_path / "run")
    argv = ["run", "--dataset", "quadratic", "--num-clients", "8", "--local-steps", "2",
            "--profiles", "lognormal", "--execution", "fedbuff", "--concurrency", "4",
            "--buffer-size", "2", "--eval-every", "2", "--quiet", "--out", out]  # fmt: skip
    assert main([*argv, "--rounds", "4"]) == 0
    import json
    from pathlib import Path

    records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["round"] == 4 and records[-1]["virtual_time"] > 0
    assert "staleness_mean" in records[-1]
    assert Path(out, "accuracy_vs_time.png").exists() or "test_accuracy" not in records[-1]
    code = main([*argv[:-2], "--concurrency", "5", "--rounds", "6", "--resume", "--out", out])
    err = capsys.readouterr().err
    assert code == 2 and "concurrency" in err, err


def test_data_size_weighting_weighs_the_arrivals_by_their_examples(data, problem, profile_file):
    """Under weighting="num_examples" a step averages its arrivals' (staleness-weighted)
    updates by their n_i and SCAFFOLD's c moves by Σ n_i Δc_i / Σ_all n_j, as a
    synchronous round's cohort does."""
    part = participation.make(profiles="file", options={"profile_file": profile_file})
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, sj.BatchPlan.full(K), 2,
                        weighting="num_examples", participation=part,
                        execution=sj.FedBuff(4, 2, "constant"))  # fmt: skip
    hparams = sim.resolve_hparams(sj.hparams(client_lr=LR))
    state, key = sim.init(data), jax.random.key(0)
    state, _ = sim.round(hparams, state, data, key)  # fills the table, then a first step
    # (Host copies: the next step donates the state.)
    table = jax.device_get(state.inflight)
    x0, c0 = _flat(state.server.params), _flat(state.server.control)
    slots = np.argsort(np.asarray(table.finish), kind="stable")[:2]
    n = np.asarray(data.counts)[np.asarray(table.ids)[slots]].astype(np.float64)
    dy = np.stack([_flat(jax.tree.map(lambda a, s=s: a[s], table.outputs.delta_params))
                   for s in slots])  # fmt: skip
    dc = np.stack([_flat(jax.tree.map(lambda a, s=s: a[s], table.outputs.message))
                   for s in slots])  # fmt: skip
    state, _ = sim.round(hparams, state, data, key)
    want_x = x0 + (n[:, None] * dy).sum(0) / n.sum()
    want_c = c0 + (n[:, None] * dc).sum(0) / float(np.sum(data.counts))
    np.testing.assert_allclose(_flat(state.server.params), want_x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_flat(state.server.control), want_c, rtol=1e-5, atol=1e-6)


def test_the_docs_state_the_weighting_of_a_step():
    """The engine's docstring and the how-to page give the step as the code computes it
    (see the test above): weights p_j of the simulation's weighting, not 1/B and 1/N
    whatever it is."""
    page = (Path(__file__).parents[1] / "docs" / "how-to" / "time.md").read_text()
    for text in (buffered.__doc__, page):
        assert "Σ_j p_j s(τ_j) Δy_j / Σ_j p_j" in text
        assert "Σ_j p_j Δc_j / Σ_i p_i" in text
        assert "num_examples" in text and "1/B" in text  # the default, named as such
