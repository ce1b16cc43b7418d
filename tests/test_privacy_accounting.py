"""Tests of scaffold_jax.privacy.accounting against dp-accounting computed by hand."""

import math
import re
import sys

import numpy as np
import pytest

dp = pytest.importorskip("dp_accounting")

from scaffold_jax.privacy import accounting  # noqa: E402
from scaffold_jax.privacy.accounting import Sampling  # noqa: E402

POISSON = Sampling("poisson", 1000, 10)
FIXED = Sampling("fixed_size", 1000, 10)
FIXED_50 = Sampling("fixed_size", 50, 10)  # the bad-input cases' private run (N = 50, S = 10)


def _direct(event, rounds, delta, accountant):
    accountant.compose(dp.SelfComposedDpEvent(event, rounds))
    return float(accountant.get_epsilon(delta))


def _poisson(q, z):
    return dp.PoissonSampledDpEvent(q, dp.GaussianDpEvent(z))


# (N, S, z, rounds): a large ε, the usual regime, and a small ε where a fixed PLD grid of
# 1e-3 would be 0.8% off.
CASES = [(1000, 10, 1.0, 1000), (100, 10, 2.0, 100), (1000, 10, 3.0, 100), (200, 20, 0.6, 300)]


@pytest.mark.parametrize("n, s, z, rounds", CASES)
def test_pld_matches_a_finer_direct_pld(n, s, z, rounds):
    delta = accounting.default_delta(n)
    mine = accounting.epsilon(Sampling("poisson", n, s), z, rounds, delta)
    fine = _direct(
        _poisson(s / n, z), rounds, delta, dp.pld.PLDAccountant(value_discretization_interval=1e-4)
    )
    # The pessimistic PLD never understates ε, and its coarser grid costs < 0.5%.
    assert fine <= mine <= fine * 1.005


@pytest.mark.parametrize("n, s, z, rounds", CASES)
def test_rdp_matches_direct_rdp(n, s, z, rounds):
    delta = accounting.default_delta(n)
    poisson = accounting.epsilon(Sampling("poisson", n, s), z, rounds, delta, "rdp")
    expected = _direct(_poisson(s / n, z), rounds, delta, dp.rdp.RdpAccountant())
    assert poisson == pytest.approx(expected, rel=1e-12)
    # Fixed-size: replace-one, sensitivity 2C, so the multiplier is z/2.
    fixed = accounting.epsilon(Sampling("fixed_size", n, s), z, rounds, delta)
    replace_one = dp.rdp.RdpAccountant(neighboring_relation=dp.NeighboringRelation.REPLACE_ONE)
    event = dp.SampledWithoutReplacementDpEvent(n, s, dp.GaussianDpEvent(z / 2))
    assert fixed == pytest.approx(_direct(event, rounds, delta, replace_one), rel=1e-12)
    assert fixed > poisson  # twice the sensitivity costs more than sampling saves


def test_round_events():
    assert accounting.round_event(POISSON, 1.5) == _poisson(0.01, 1.5)
    assert accounting.round_event(FIXED, 1.5) == dp.SampledWithoutReplacementDpEvent(
        1000, 10, dp.GaussianDpEvent(0.75)
    )
    assert accounting.round_event(POISSON, 0.0) == dp.NonPrivateDpEvent()


def test_defaults():
    assert accounting.default_accountant(POISSON) == "pld"
    assert accounting.default_accountant(FIXED) == "rdp"
    assert accounting.default_delta(1000) == pytest.approx(1000**-1.1)
    assert POISSON.rate == 0.01


@pytest.mark.parametrize("sampling", [POISSON, FIXED])
def test_epsilon_grows_with_rounds_and_falls_with_noise(sampling):
    delta = accounting.default_delta(1000)
    by_rounds = [accounting.epsilon(sampling, 1.0, t, delta) for t in (0, 1, 10, 100, 500)]
    assert by_rounds[0] == 0.0
    assert all(a < b for a, b in zip(by_rounds, by_rounds[1:], strict=False))
    by_noise = [accounting.epsilon(sampling, z, 100, delta) for z in (0.0, 0.5, 0.7, 1.0, 2.0)]
    assert by_noise[0] == math.inf
    assert all(a > b for a, b in zip(by_noise, by_noise[1:], strict=False))


def test_epsilon_is_memoised():
    args = (POISSON, 1.25, 77, 1e-4)
    first = accounting.epsilon(*args)
    hits = accounting._epsilon.cache_info().hits
    assert accounting.epsilon(*args) == first
    assert accounting._epsilon.cache_info().hits == hits + 1


def test_rdp_computes_one_round_once_per_sampling_and_noise(monkeypatch):
    """A run asks for ε at every record (a new round count each time): the RDP of one
    round is computed once and scaled, bitwise what dp-accounting composes for T rounds
    (a fixed-size run spent 2.7-4.7 s per Simulation.run in the accountant before)."""
    sampling = Sampling("fixed_size", 123, 7)  # a (sampling, z) no other test uses
    composed = []
    original = dp.rdp.RdpAccountant.compose

    def compose(self, event, count=1):
        composed.append(count)
        return original(self, event, count)

    monkeypatch.setattr(dp.rdp.RdpAccountant, "compose", compose)
    delta = accounting.default_delta(123)
    mine = [accounting.epsilon(sampling, 1.3, t, delta) for t in (1, 2, 5, 50, 400, 1000)]
    assert composed == [1]  # one round's RDP, once
    monkeypatch.undo()
    replace_one = dp.NeighboringRelation.REPLACE_ONE
    for t, eps in zip((1, 2, 5, 50, 400, 1000), mine, strict=True):
        event = accounting.round_event(sampling, 1.3)
        assert eps == _direct(
            event, t, delta, dp.rdp.RdpAccountant(neighboring_relation=replace_one)
        )


@pytest.mark.parametrize(
    "sampling, target", [(POISSON, 1.0), (POISSON, 3.0), (POISSON, 8.0), (FIXED, 3.0)]
)
def test_calibrate_hits_the_target(sampling, target):
    delta = accounting.default_delta(1000)
    z = accounting.calibrate(sampling, 500, target, delta)
    eps = accounting.epsilon(sampling, z, 500, delta)
    assert target * 0.99 <= eps <= target * (1 + 1e-9)


def test_calibrate_with_rdp_for_poisson():
    delta = 1e-5
    z = accounting.calibrate(POISSON, 200, 2.0, delta, "rdp")
    expected = _direct(_poisson(0.01, z), 200, delta, dp.rdp.RdpAccountant())
    assert 2.0 * 0.99 <= expected <= 2.0 * (1 + 1e-9)


@pytest.mark.parametrize(
    ("sampling", "accountant"),
    [(Sampling("poisson", 20, 5), "pld"), (Sampling("poisson", 41, 5), "pld"),
     (Sampling("fixed_size", 50, 10), "rdp")],
)  # fmt: skip
def test_calibrate_returns_the_float32_a_run_accounts_and_meets_the_target(sampling, accountant):
    """A run holds z as a float32 and reports the epsilon of that value: the calibrated z
    is one, rounded up, so the reported epsilon never exceeds the target (rounded to the
    nearest float32, z = 8.524 for 20 clients reported 1.0001x a target of 3e-6, and 2e-9
    for a target of 1e-300)."""
    delta = sampling.num_clients**-1.1
    for target in (3e-6, 1e-3, 3.0):
        z = accounting.calibrate(sampling, 10, target, delta, accountant)
        assert float(np.float32(z)) == z
        assert 0.99 * target <= accounting.epsilon(sampling, z, 10, delta, accountant) <= target


@pytest.mark.parametrize(
    ("sampling", "accountant"), [(Sampling("poisson", 50, 10), "pld"), (FIXED_50, "rdp")]
)
def test_a_target_below_what_the_accountant_resolves_is_refused(sampling, accountant):
    """At delta = N^-1.1 the accountant's epsilon is 0 from a finite z on: a target of
    1e-300 (or 1e-9) was "met" there, by the same z as any tiny target, and reported as
    epsilon 0 or, with z rounded down to a float32, ~1e-9. Refused, with a target that
    works."""
    delta = sampling.num_clients**-1.1
    for target in (1e-300, 1e-12):
        with pytest.raises(ValueError) as info:
            accounting.calibrate(sampling, 10, target, delta, accountant)
        message = str(info.value)
        assert message.startswith(f"dp_epsilon = {target} at delta = {delta:.3g} after 10 rounds")
        assert "is below what the accountant resolves: its epsilon is already 0" in message
        works = float(re.search(r"Use dp_epsilon >= (\S+), or a smaller delta\.$", message)[1])
    z = accounting.calibrate(sampling, 10, works, delta, accountant)
    assert 0.99 * works <= accounting.epsilon(sampling, z, 10, delta, accountant) <= works


def test_calibrate_unreachable_and_too_large_targets():
    with pytest.raises(ValueError, match=r"dp_epsilon = 0.001 .*out of reach.*fewer rounds"):
        accounting.calibrate(Sampling("poisson", 10, 5), 1000, 0.001, 1e-3)
    with pytest.raises(ValueError, match=r"dp_epsilon = 1000.0 is so large"):
        accounting.calibrate(POISSON, 1, 1000.0, 1e-3)


def test_update_noise_multiplier():
    z, sigma_b = 1.0, 5.0
    z_delta = accounting.update_noise_multiplier(z, sigma_b)
    assert z_delta == pytest.approx((1 - 0.01) ** -0.5)
    # The update's Gaussian and the count's (multiplier 2σ_b) compose to one of multiplier z.
    pair = dp.ComposedDpEvent([dp.GaussianDpEvent(z_delta), dp.GaussianDpEvent(2 * sigma_b)])
    assert _direct(pair, 1, 1e-5, dp.rdp.RdpAccountant()) == pytest.approx(
        _direct(dp.GaussianDpEvent(z), 1, 1e-5, dp.rdp.RdpAccountant()), rel=1e-9
    )
    assert accounting.update_noise_multiplier(0.0, 5.0) == 0.0
    with pytest.raises(ValueError, match=r"sigma_b = 0.5 .*2\*sigma_b > z.*raise the count"):
        accounting.update_noise_multiplier(1.0, 0.5)


def test_check_refuses_bad_samplings():
    with pytest.raises(ValueError, match="'pld' does not cover sampling = 'fixed_size'.*'rdp'"):
        accounting.check(FIXED, "pld")
    with pytest.raises(ValueError, match="'pld' does not cover"):
        accounting.epsilon(FIXED, 1.0, 10, 1e-4, "pld")
    with pytest.raises(ValueError, match="sampling = 'uniform' is unknown"):
        accounting.check(Sampling("uniform", 100, 10))
    with pytest.raises(ValueError, match="accountant = 'gdp' is unknown"):
        accounting.check(POISSON, "gdp")
    for s in (0, 101):
        with pytest.raises(ValueError, match=f"clients_per_round = {s} with num_clients = 100"):
            accounting.check(Sampling("poisson", 100, s))
    accounting.check(Sampling("fixed_size", 100, 100), "rdp")


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"epsilon": 0.0}, "dp_epsilon = 0.0"),
        ({"epsilon": -1.0}, "dp_epsilon = -1.0"),
        ({"epsilon": math.inf}, "dp_epsilon = inf"),
        ({"epsilon": math.nan}, "dp_epsilon = nan"),
        ({"delta": 0.0}, "dp_delta = 0.0"),
        ({"delta": 1.0}, "dp_delta = 1.0"),
        ({"delta": 1.5, "num_clients": 1000}, "dp_delta = 1.5 is invalid: it must be in (0, 1)"),
        ({"noise_multiplier": -0.1}, "dp_noise_multiplier = -0.1"),
        ({"noise_multiplier": math.inf}, "dp_noise_multiplier = inf"),
        ({"noise_multiplier": math.nan}, "dp_noise_multiplier = nan"),
    ],
)
def test_bad_parameters_raise_naming_the_value(kwargs, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        accounting.check_privacy_parameters(**kwargs)


def test_bad_delta_message_suggests_the_usual_choice():
    with pytest.raises(ValueError, match=re.escape("1/N^1.1 = 5.0e-04 is the usual choice")):
        accounting.check_privacy_parameters(delta=1.5, num_clients=1000)
    with pytest.raises(ValueError, match="dp_delta = 2"):
        accounting.epsilon(POISSON, 1.0, 10, 2)
    with pytest.raises(ValueError, match="rounds = -1"):
        accounting.epsilon(POISSON, 1.0, -1, 1e-4)


def test_a_delta_of_one_over_n_or_more_is_refused():
    """δ >= 1/N is no privacy: refused (it was only a warning), naming N^-1.1."""
    with pytest.raises(ValueError) as info:
        accounting.check_privacy_parameters(delta=0.01, num_clients=1000)
    assert str(info.value) == (
        "dp_delta = 0.01 >= 1/N = 1.0e-03 (N = 1000 clients) is no privacy: a delta of 1/N or "
        "more lets a mechanism publish one client's data outright. Use delta < 1/N, e.g. "
        "N^-1.1 = 5.0e-04 (the default)."
    )
    with pytest.raises(ValueError, match="is no privacy"):
        accounting.check_privacy_parameters(delta=1e-3, num_clients=1000)  # 1/N itself
    usual = accounting.default_delta(1000)
    assert accounting.check_privacy_parameters(1.0, usual, 1.0, 1000) is None


def test_require_names_the_extra(monkeypatch):
    assert accounting.require() is dp
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'scaffold-jax[privacy]'")):
        accounting.require()
