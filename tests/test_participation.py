"""Participation models: availability, stragglers and dropouts (scaffold_jax.participation).

What must hold: with the defaults a run is today's bitwise; each availability model's
draws match its stated stationary rate; the sampler draws only among the available
clients; a straggler round equals a per-client reference loop in which client i takes
exactly K_i steps; a dropped client changes neither the server state nor its own row;
the availability state checkpoints and resumes exactly and is shared by a sweep's
configs of one seed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import assert_trees_close, make_classification_clients, reference_grad
from scipy import stats

import scaffold_jax as sj
from scaffold_jax import participation
from scaffold_jax.engine import (
    AVAILABILITY_STREAM,
    DROPOUT_STREAM,
    STRAGGLER_STREAM,
    constants_key,
    participation_key,
)
from scaffold_jax.participation.availability import Cyclic, Markov, Trace, load_trace
from scaffold_jax.participation.dropouts import Bernoulli
from scaffold_jax.participation.stragglers import Speed, UniformSteps
from scaffold_jax.sampling import sample_clients

#: The false-alarm rate of every statistical test here: z = 5.3 (two-sided 1.2e-7).
Z = 5.3


@pytest.fixture(scope="module")
def data():
    """12 clients of 6..28 examples, 5 features, 3 classes."""
    sizes = [6 + 2 * i for i in range(12)]
    test = make_classification_clients([30], seed=1, skew=False)[0]
    return sj.from_client_arrays(make_classification_clients(sizes, seed=2), test=test)


@pytest.fixture(scope="module")
def problem():
    return sj.models.logistic_regression((5,), 3, zero_init=False, key=jr.key(3))


def simulation(problem, part=None, name="scaffold", plan=None, sampled=4, **kw):
    plan = plan or sj.BatchPlan.fixed(batch_size=3, num_steps=6)
    alg = sj.algorithms.make(name, problem.loss_fn)
    return sj.Simulation(alg, problem, plan, clients_per_round=sampled, participation=part, **kw)


def leaves_equal(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# ------------------------------------------------------------------ today, bitwise
# The Poisson cases run under -m slow (tests/test_privacy.py covers that sampler's rounds).
@pytest.mark.parametrize(
    ("name", "sampler"),
    [
        ("scaffold", "uniform"),
        ("mime", "uniform"),
        pytest.param("scaffold", "poisson", marks=pytest.mark.slow),
        pytest.param("fednova", "poisson", marks=pytest.mark.slow),
    ],
)
def test_the_default_models_are_todays_run_bitwise(data, problem, name, sampler):
    """availability 'always', stragglers 'none', dropouts 'none': the state, every record
    and the sampled ids equal a simulation built without participation, bit for bit."""
    hp = sj.hparams(client_lr=0.2)
    chosen = sj.sampling.make(sampler)
    runs = [
        simulation(problem, part, name, sampler=chosen).run(data, hp, num_rounds=4, eval_every=2)
        for part in (None, participation.make())
    ]
    assert runs[0].state.participation is None and runs[1].state.participation is None
    assert leaves_equal(runs[0].state, runs[1].state)
    assert runs[0].records == [{**r, "seconds": runs[0].records[i]["seconds"]}
                               for i, r in enumerate(runs[1].records)]  # fmt: skip
    np.testing.assert_array_equal(runs[0].client_ids, runs[1].client_ids)


# ------------------------------------------------------------------ availability models
def markov_sd(model: Markov, clients: int, rounds: int) -> float:
    """The standard deviation of the fraction of (client, round) pairs available, for N
    independent stationary chains of T rounds: π(1−π)/(NT) · (1+λ)/(1−λ), λ = 1 − a − b
    (the chain's second eigenvalue), up to O(1/T²)."""
    pi, lam = model.rate_on, 1.0 - model.turn_off - model.turn_on
    return math.sqrt(pi * (1 - pi) / (clients * rounds) * (1 + lam) / (1 - lam))


@pytest.mark.parametrize(("rate", "mean_on"), [(0.3, 4.0), (0.8, 10.0), (0.05, 1.0)])
def test_markov_availability_matches_its_stationary_rate_and_spell_length(rate, mean_on):
    """N × T draws of the chain (from its stationary start): the fraction available is π
    within Z standard deviations of the autocorrelated mean, and the on→off rate is
    1/mean_on_rounds within Z binomial standard deviations."""
    model = Markov(rate, mean_on)
    clients, rounds = 2000, 400
    keys = jr.split(jr.key(11), rounds)

    def step(state, key):
        state, on = model.step(state, key, jnp.int32(0), clients)
        return state, on

    _, on = jax.lax.scan(step, model.init(clients), keys)
    on = np.asarray(on)
    assert abs(on.mean() - rate) < Z * markov_sd(model, clients, rounds)
    was_on = on[:-1]
    turned_off = (was_on & ~on[1:]).sum()
    a, trials = model.turn_off, was_on.sum()
    assert abs(turned_off / trials - a) < Z * math.sqrt(a * (1 - a) / trials) + 1e-12


def test_markov_refuses_unavailable_spells_shorter_than_a_round():
    with pytest.raises(ValueError, match=r"mean_on_rounds >= 4"):
        Markov(0.8, 2.0)
    with pytest.raises(ValueError, match="mean_on_rounds >= 1"):
        Markov(0.5, 0.5)


def test_cyclic_availability_gives_each_group_its_block_of_the_day():
    model = Cyclic(groups=3, cycle_rounds=6)
    on = np.stack([np.asarray(model.step((), None, jnp.int32(t), 9)[1]) for t in range(12)])
    groups = np.arange(9) * 3 // 9  # contiguous: 0 0 0 1 1 1 2 2 2
    for t in range(12):
        np.testing.assert_array_equal(on[t], groups == (t % 6) // 2)
    np.testing.assert_allclose(on.mean(0), model.rate(9))  # exactly 1/G over whole days
    inter = Cyclic(groups=3, cycle_rounds=3, grouping="interleaved")
    np.testing.assert_array_equal(inter.step((), None, jnp.int32(1), 6)[1], [0, 1, 0, 0, 1, 0])
    with pytest.raises(ValueError, match="multiple of 4"):
        Cyclic(groups=4, cycle_rounds=10)
    with pytest.raises(ValueError, match="exceeds the number of clients"):
        Cyclic(groups=4).check(3)


def test_trace_availability_replays_the_file_and_repeats_it(tmp_path):
    rng = np.random.default_rng(0)
    bits = rng.random((5, 13)) < 0.4
    np.save(tmp_path / "trace.npy", bits)
    (tmp_path / "trace.txt").write_text(
        "# client availability\n" + "\n".join(", ".join(str(int(b)) for b in row) for row in bits)
    )
    (tmp_path / "packed.txt").write_text("\n".join("".join(str(int(b)) for b in r) for r in bits))
    for name in ("trace.npy", "trace.txt", "packed.txt"):
        np.testing.assert_array_equal(load_trace(tmp_path / name), bits)
        model = Trace(str(tmp_path / name))
        got = np.stack([np.asarray(model.step((), None, jnp.int32(t), 4)[1]) for t in range(26)])
        np.testing.assert_array_equal(got, np.concatenate([bits[:4].T, bits[:4].T]))
        np.testing.assert_allclose(model.rate(4), bits[:4].mean(1))
    with pytest.raises(ValueError, match="has 5 clients"):
        Trace(str(tmp_path / "trace.npy")).check(6)


@pytest.mark.parametrize(
    ("text", "match"),
    [("0102\n", "other than 0/1"), ("0110\n01\n", "different numbers of rounds"),
     ("", "holds no clients"), (",\n", "shape")],
)  # fmt: skip
def test_a_malformed_trace_is_refused_with_where(tmp_path, text, match):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_trace(path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_trace(tmp_path / "missing.npy")


def test_a_trace_with_rounds_of_no_client_runs_them_with_no_participant(data, problem, tmp_path):
    """Rounds in which no client is available (a trace's nights) are research, not a
    mistake: they run with 0 participants (the model stays put for SCAFFOLD and FedAvg)
    and the records say so; only a trace with no client available in ANY round is
    refused."""
    path = tmp_path / "nights.txt"
    path.write_text("\n".join(["1010"] * 12))  # rounds 2 and 4 of every 4: nobody
    part = participation.make("trace", options={"availability_trace": str(path)})
    result = simulation(problem, part).run(data, sj.hparams(client_lr=0.1), num_rounds=8)
    np.testing.assert_array_equal(result.round_metrics["participants"], [4, 0] * 4)
    np.testing.assert_array_equal(result.round_metrics["available"], [12, 0] * 4)
    losses = [r["test_loss"] for r in result.records]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    path.write_text("\n".join(["0000"] * 12) + "\n1111\n")  # the 13th client: not in the run
    with pytest.raises(ValueError, match="makes no client available in any round"):
        simulation(problem, part.__class__(availability=Trace(str(path)))).init(data)


# ------------------------------------------------------------------ sampling among them
def test_the_sampler_draws_only_available_clients_and_runs_short(data, problem):
    """Cyclic groups of 3 clients and S = 4: every round samples exactly the 3 available
    clients of its block (fewer than S), and the record says so."""
    part = participation.make("cyclic", options={"cycle_groups": 4, "cycle_rounds": 8})
    result = simulation(problem, part).run(data, sj.hparams(client_lr=0.1), num_rounds=8)
    groups = np.arange(12) * 4 // 12
    for t, ids in enumerate(result.client_ids):
        taken = ids[ids >= 0]
        assert sorted(taken) == list(np.flatnonzero(groups == (t % 8) // 2))
    assert result.records[-1]["participants"] == 3.0
    assert result.records[-1]["available"] == 3.0


def test_uniform_among_available_is_uniform():
    """S of the available clients, every one equally often (chi-square, p > 1e-7), and
    never an unavailable one."""
    available = jnp.asarray(np.arange(20) % 3 != 0)  # 13 available
    keys = jr.split(jr.key(5), 4000)
    ids, present = jax.vmap(lambda k: sj.sampling.uniform(k, 0, 20, 5, available=available))(keys)
    ids, present = np.asarray(ids), np.asarray(present)
    assert present.all() and np.asarray(available)[ids].all()
    assert all(len(set(row)) == 5 for row in ids)
    counts = np.bincount(ids.ravel(), minlength=20)[np.asarray(available)]
    assert stats.chisquare(counts).pvalue > 1e-7


def test_poisson_among_available_draws_each_available_client_with_probability_q():
    available = jnp.asarray(np.arange(40) < 30)
    keys = jr.split(jr.key(6), 3000)
    sampler = sj.sampling.make("poisson")
    ids, present = jax.vmap(lambda k: sampler(k, 0, 40, 8, available=available))(keys)
    ids, present = np.asarray(ids), np.asarray(present)
    assert np.asarray(available)[ids[present]].all()
    q, n = 8 / 40, 3000
    per_client = np.bincount(ids[present], minlength=40)[:30] / n
    assert np.all(np.abs(per_client - q) < Z * math.sqrt(q * (1 - q) / n))


def test_an_availability_model_needs_a_sampler_that_takes_the_mask(data, problem):
    def mine(key, round_index, num_clients, clients_per_round):
        return sample_clients(key, num_clients, clients_per_round)

    part = participation.make("markov")
    with pytest.raises(ValueError, match="available="):
        simulation(problem, part, sampler=mine).init(data)


# ------------------------------------------------------------------ the reference loop
def reference_rounds(name, problem, data, plan, sampled, hp, rounds, seed, part):
    """SCAFFOLD (option II), FedAvg or FedNova client by client, uniform weights: client i
    takes exactly its K_i steps and a dropped client is skipped. Shares with the engine
    only the documented randomness (the round, sampler and client keys, the batch plan's
    positions, and the models' draws from participation_key / constants_key)."""
    n = data.num_clients
    lr, glr = float(hp.client_lr), float(hp.server_lr)
    x = jax.tree.map(lambda a: np.asarray(a, np.float64), problem.params)
    c = jax.tree.map(np.zeros_like, x)
    c_i = [jax.tree.map(np.zeros_like, x) for _ in range(n)]
    counts = np.asarray(data.counts)
    root = jr.key(seed)
    for r in range(rounds):
        round_key = jr.fold_in(root, r)
        sample_key, clients_key = jr.split(round_key)
        ids = np.asarray(sample_clients(sample_key, n, sampled))
        steps = np.asarray(plan.local_steps(counts[ids]))
        if part.stragglers is not None:
            steps = np.asarray(
                part.stragglers.steps(
                    participation_key(round_key, STRAGGLER_STREAM), constants_key(root), ids, steps
                )
            )
        dropped = np.zeros(len(ids), bool)
        if part.dropouts is not None:
            dropped = np.asarray(
                part.dropouts.dropped(participation_key(round_key, DROPOUT_STREAM), ids)
            )
        dys, taus, dcs = [], [], []
        for j, i in enumerate(ids):
            if dropped[j]:
                continue
            pos, mask = plan.positions(jr.fold_in(clients_key, int(i)), counts[i], data.max_count)
            pos, mask = np.asarray(pos), np.asarray(mask)
            examples = data.client_examples(int(i))
            y = jax.tree.map(np.copy, x)
            for k in range(int(steps[j])):  # exactly K_i steps
                g = reference_grad(
                    problem.loss_fn, y, jax.tree.map(lambda a, k=k: a[pos[k]], examples), mask[k]
                )
                if name == "scaffold":
                    g = jax.tree.map(lambda gg, ci, cc: gg - ci + cc, g, c_i[i], c)
                y = jax.tree.map(lambda yy, gg: yy - lr * gg, y, g)
            if name == "scaffold":
                new = jax.tree.map(
                    lambda ci, cc, xx, yy: ci - cc + (xx - yy) / (steps[j] * lr), c_i[i], c, x, y
                )
                dcs.append(jax.tree.map(lambda a, b: a - b, new, c_i[i]))
                c_i[i] = new
            dys.append(jax.tree.map(lambda yy, xx: yy - xx, y, x))
            taus.append(float(steps[j]))
        if not dys:
            continue
        if name == "fednova":
            tau_eff = np.mean(taus)
            dx = jax.tree.map(
                lambda *d: sum(v * tau_eff / t for v, t in zip(d, taus, strict=True)) / len(d), *dys
            )
        else:
            dx = jax.tree.map(lambda *d: sum(d) / len(d), *dys)
        x = jax.tree.map(lambda xx, d: xx + glr * d, x, dx)
        for dc in dcs:
            c = jax.tree.map(lambda cc, d: cc + d / n, c, dc)
    return x, c, c_i


# Every chunking (None: one vmap; 1: one client at a time; 2: chunks of 2 and a tail of 1);
# the one-vmap cases run under -m slow.
CASES = [
    ("scaffold", "speed", "bernoulli", 2),
    ("fednova", "uniform", "none", 2),
    ("scaffold", "none", "bernoulli", 1),
    pytest.param("scaffold", "uniform", "none", None, marks=pytest.mark.slow),
    pytest.param("fedavg", "uniform", "bernoulli", None, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("name", "stragglers", "dropouts", "chunk"), CASES)
def test_stragglers_and_dropouts_match_the_per_client_reference(
    data, problem, name, stragglers, dropouts, chunk
):
    """K_i steps for client i, the dropped clients left out of the aggregate and of their
    own rows: the engine (vmapped, sorted into chunks, the dropped chunks skipped) equals
    the loop above, whatever the chunking."""
    part = participation.make(
        stragglers=stragglers, dropouts=dropouts, options={"dropout_rate": 0.4}
    )
    plan = sj.BatchPlan.fixed(batch_size=3, num_steps=6)
    hp = sj.hparams(client_lr=0.3, server_lr=0.9)
    sim = simulation(problem, part, name, plan, sampled=5, client_chunk=chunk)
    result = sim.run(data, hp, num_rounds=4, seed=3)
    x, c, c_i = reference_rounds(name, problem, data, plan, 5, hp, 4, 3, part)
    assert_trees_close(result.state.server.params, x, rtol=2e-5, atol=2e-6)
    if name == "scaffold":
        assert_trees_close(result.state.server.control, c, rtol=2e-5, atol=2e-6)
        table = jax.tree.map(lambda *rows: np.stack(rows), *c_i)
        assert_trees_close(result.state.clients.control, table, rtol=2e-5, atol=2e-6)
    if stragglers != "none":
        assert 1.0 <= result.records[-1]["steps_taken"] < 6.0


def test_straggler_steps_are_uniform_on_their_range_and_fixed_speeds_persist():
    ids = jnp.arange(3000)
    planned = jnp.full((3000,), 6, jnp.int32)
    k = np.asarray(UniformSteps(2).steps(jr.key(1), None, ids, planned))
    assert k.min() == 2 and k.max() == 6
    assert stats.chisquare(np.bincount(k, minlength=7)[2:]).pvalue > 1e-7
    speed = Speed(min_speed=0.5, jitter=0.0)
    seed_key = jr.key(9)
    a = np.asarray(speed.steps(jr.key(1), seed_key, ids, planned))
    b = np.asarray(speed.steps(jr.key(2), seed_key, ids, planned))
    np.testing.assert_array_equal(a, b)  # no jitter: a device's speed alone, every round
    assert a.min() >= 3 and a.max() <= 6
    short = np.asarray(UniformSteps(4).steps(jr.key(1), None, ids[:5], jnp.arange(1, 6)))
    assert (short <= np.arange(1, 6)).all() and (short >= np.minimum(4, np.arange(1, 6))).all()


def test_dropouts_drop_at_their_rate():
    dropped = np.asarray(Bernoulli(0.3).dropped(jr.key(4), jnp.arange(20000)))
    assert abs(dropped.mean() - 0.3) < Z * math.sqrt(0.3 * 0.7 / 20000)


@pytest.mark.parametrize("name", ["scaffold", "fedavg", "fedprox", "fednova", "feddyn", "mime"])
def test_a_dropped_client_changes_neither_the_server_nor_its_row(data, problem, name):
    """Every sampled client drops: the client table is untouched for every algorithm, and
    the server model is too where the aggregate of nothing is the whole update (FedDyn
    still steps by −h/α, Mime's momentum by the pre-round gradients: their contracts)."""
    # The largest rate below 1 (1 is refused): above every float32 uniform draw.
    every = math.nextafter(1.0, 0.0)
    part = participation.make(dropouts="bernoulli", options={"dropout_rate": every})
    sim = simulation(problem, part, name)
    state = sim.init(data)
    before = jax.tree.map(np.asarray, state)
    after, metrics = sim.round(
        sim.resolve_hparams(sj.hparams(client_lr=0.2)), state, data, jr.key(0)
    )
    assert leaves_equal(before.clients, after.clients)
    assert float(metrics["dropped"]) == 4.0 and float(metrics["participants"]) == 0.0
    ids = np.asarray(metrics["client_ids"])  # the sampled clients, kept: who dropped
    assert (ids >= 0).all() and len(set(ids.tolist())) == 4
    assert not np.asarray(metrics["reported"]).any()
    if name in ("scaffold", "fedavg", "fedprox", "fednova"):
        assert leaves_equal(before.server, after.server)


def test_the_result_keeps_the_sampled_ids_and_says_who_reported(data, problem):
    """With dropouts, RunResult.client_ids holds every sampled client (none is -1) and
    RunResult.reported which of them reported: its False entries are the round's
    dropped count, and the reporting ones are the round's participants."""
    part = participation.make(dropouts="bernoulli", options={"dropout_rate": 0.5})
    result = simulation(problem, part).run(data, sj.hparams(client_lr=0.1), num_rounds=12)
    ids, reported = np.asarray(result.client_ids), np.asarray(result.reported)
    assert ids.shape == reported.shape == (12, 4) and reported.dtype == bool
    assert (ids >= 0).all() and all(len(set(row)) == 4 for row in ids.tolist())
    np.testing.assert_array_equal((~reported).sum(axis=1), result.round_metrics["dropped"])
    np.testing.assert_array_equal(reported.sum(axis=1), result.round_metrics["participants"])
    assert 0 < reported.sum() < reported.size  # some reported, some dropped
    # Without dropouts every sampled client reported.
    plain = simulation(problem, participation.make()).run(
        data, sj.hparams(client_lr=0.1), num_rounds=2
    )
    assert np.asarray(plain.reported).all()


# ------------------------------------------------------------------ state: resume, sweeps
def test_resume_mid_cycle_and_mid_chain_is_exact(data, problem, tmp_path):
    """Markov availability (its [N] state in SimState) with stragglers and dropouts: a run
    stopped after 5 rounds and resumed from its checkpoint equals the run straight through,
    bit for bit (its last record, of rounds 7-9, too); so does a cyclic run stopped
    mid-day."""
    hp = sj.hparams(client_lr=0.2)
    for part in (
        participation.make("markov", "uniform", "bernoulli"),
        participation.make("cyclic", options={"cycle_groups": 3, "cycle_rounds": 6}),
    ):
        sim = simulation(problem, part)
        straight = sim.run(data, hp, num_rounds=9, eval_every=3, seed=2)
        folder = tmp_path / part.availability.name
        sim.run(data, hp, num_rounds=5, eval_every=3, seed=2, checkpoint_dir=folder)
        resumed = sim.run(
            data, hp, num_rounds=9, eval_every=3, seed=2, checkpoint_dir=folder, resume=True
        )
        assert resumed.resumed_from == 5
        assert leaves_equal(straight.state, resumed.state)
        last = [{k: v for k, v in r.records[-1].items() if k != "seconds"}
                for r in (straight, resumed)]  # fmt: skip
        assert last[0] == last[1] and "available" in last[0]
    assert straight.state.participation == ()


def test_a_sweep_shares_the_availability_state_per_seed_and_equals_single_runs(data, problem):
    """3 step sizes × 2 seeds under Markov availability, speed stragglers and dropouts:
    the carry holds one [N] chain per seed (not per config), and every config's final
    server state equals its single run's (the same available, sampled, straggling and
    dropped clients)."""
    part = participation.make("markov", "speed", "bernoulli")
    sim = simulation(problem, part)
    carry = sj.sweep.Sweep(sim).init(data, num_seeds=2, group_size=3)
    assert carry.state.participation.shape == (2, 12)
    hp, seeds, configs = sj.sweep.grid(client_lr=[0.05, 0.2, 0.4], seeds=[1, 4])
    swept = sj.sweep.sweep(sim, data, hp, seeds, num_rounds=6)
    for j, config in enumerate(configs):
        single = sim.run(
            data, sj.hparams(client_lr=config["client_lr"]), num_rounds=6, seed=config["seed"]
        )
        assert_trees_close(
            jax.tree.map(lambda a, j=j: a[j], swept.server_states),
            single.state.server,
            rtol=1e-5,
            atol=1e-6,
        )


def test_participation_keys_are_independent_streams():
    """The three models' keys differ from each other and from the round's other streams."""
    round_key = jr.fold_in(jr.key(0), 3)
    keys = [participation_key(round_key, s) for s in (AVAILABILITY_STREAM, STRAGGLER_STREAM,
                                                       DROPOUT_STREAM)]  # fmt: skip
    others = [*jr.split(round_key), jr.fold_in(round_key, 2), jr.fold_in(round_key, 3)]
    data = {tuple(np.asarray(jr.key_data(k)).tolist()) for k in keys + others}
    assert len(data) == 7


# ------------------------------------------------------------------ what refuses them
def test_privacy_and_scaffnew_refuse_partial_participation(data, problem):
    from scaffold_jax.privacy import private

    alg = private(sj.fedavg(problem.loss_fn))
    sim = sj.Simulation(
        alg, problem, sj.BatchPlan.fixed(3, 2), 4,
        participation=participation.make(dropouts="bernoulli"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="with dropouts = 'bernoulli' who takes part changes"):
        sim.init(data)
    ok = sim.replace(participation=participation.make(stragglers="uniform"))
    ok.init(data)  # stragglers are fine: clipping bounds any update
    scaffnew = sj.algorithms.make("scaffnew", problem.loss_fn)
    sim = sj.Simulation(
        scaffnew, problem, sj.BatchPlan.fixed(3, 2), 12,
        participation=participation.make(stragglers="uniform"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="Scaffnew needs every client"):
        sim.init(data)


# ------------------------------------------------------------------ the command line
@pytest.mark.slow  # command-line runs, sweeps and resumes: ~11 s
def test_the_command_line_runs_sweeps_resumes_and_reports_participation(tmp_path, capsys):
    """`run` with all three kinds on: the records carry what happened, the summary line says
    it, a resume with the same models continues and one with another model is refused;
    `sweep --grid dropout_rate=...` runs each rate as its own setting."""
    import json

    from scaffold_jax.cli import main

    quad = ["--dataset", "quadratic", "--num-clients", "20", "--eval-every", "4",
            "--no-compile-cache"]  # fmt: skip
    models = ["--availability", "markov", "--availability-rate", "0.5", "--stragglers",
              "uniform", "--dropouts", "bernoulli", "--dropout-rate", "0.25"]  # fmt: skip
    out = tmp_path / "run"
    assert main(["run", *quad, *models, "--rounds", "4", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "participation (mean a round, since the previous evaluation):" in said
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < last["participants"] <= last["available"] and 0 <= last["dropped"] <= 4
    assert 1 <= last["steps_taken"] <= 5
    again = ["run", *quad, "--rounds", "8", "--out", str(out), "--resume"]
    assert main([*again, *models[:-2], "--dropout-rate", "0.5"]) == 2  # another model: refused
    assert "dropout_rate" in capsys.readouterr().err
    assert main([*again, *models]) == 0
    sweep = ["sweep", *quad, "--rounds", "4", "--dropouts", "bernoulli", "--quiet"]
    assert main([*sweep, "--grid", "dropout_rate=0,0.5", "--out", str(tmp_path / "s")]) == 0
    rates = {json.loads(line).get("dropout_rate")
             for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()}  # fmt: skip
    assert rates == {0.0, 0.5}


def test_a_resume_after_the_trace_file_changed_is_refused(data, problem, tmp_path):
    """The run identity holds the trace's bits (a digest), not only its path."""
    trace = tmp_path / "devices.txt"
    trace.write_text("\n".join(["1101", "0111", "1011"] * 4))
    folder = tmp_path / "ckpt"

    def run(rounds, **kw):
        part = participation.make("trace", options={"availability_trace": str(trace)})
        sim = simulation(problem, part)
        return sim.run(
            data, sj.hparams(client_lr=0.1), num_rounds=rounds, checkpoint_dir=folder, **kw
        )

    run(2)
    trace.write_text("\n".join(["1111", "0111", "1011"] * 4))
    with pytest.raises(ValueError, match="bits_sha256"):
        run(4, resume=True)
