"""Privacy accounting of user-level DP rounds: ε after some rounds, and z for a target ε.

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models",
ICLR 2018 (arXiv:1710.06963): every round clips each sampled client's whole message to L2 norm
C and adds N(0, (zC)²) to their sum. The rounds are composed with Google's dp-accounting (the
optional extra ``privacy``); which neighbouring relation and sensitivity it assumes depends on
how the cohort is drawn:

- ``"poisson"``: each of the N clients joins independently with probability q = S/N.
  Add/remove-one adjacency; one client moves the sum by at most C, so a round is
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``. The PLD accountant (the default, the
  tighter) and the RDP accountant both cover it.
- ``"fixed_size"``: exactly S of the N clients, uniformly without replacement. The cohort size
  is public, so the adjacency is replace-one: replacing one client's clipped message moves the
  sum by up to 2C, and noise of std zC is a Gaussian of multiplier z/2 relative to that
  sensitivity: ``SampledWithoutReplacementDpEvent(N, S, GaussianDpEvent(z / 2))``. Only the
  RDP accountant covers it (``NeighboringRelation.REPLACE_ONE``).

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021, arXiv:1905.03871) also releases a count of clients whose norm
is at most C, of centred bits (sensitivity 1/2, or 1 under replace-one: halved like the sum's)
with noise std σ_b. The pair of releases is one Gaussian of multiplier z with
z⁻² = z_Δ⁻² + (2σ_b)⁻², so the accountant always accounts the total z and the update's own
noise uses z_Δ (:func:`update_noise_multiplier`).

Everything here is host-side Python; dp-accounting is imported only when an ε is computed.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np

SAMPLINGS = ("poisson", "fixed_size")
ACCOUNTANTS = ("pld", "rdp")
#: :func:`calibrate` searches noise multipliers in [MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER].
MAX_NOISE_MULTIPLIER = 1000.0
# Below 1/16 every realistic configuration has ε above 100, and the PLD of so weak a Gaussian
# grows costly, so the search stops there.
MIN_NOISE_MULTIPLIER = 1 / 16
# calibrate stops once ε is within this fraction below the target.
_CALIBRATION_RTOL = 1e-3


class Sampling(NamedTuple):
    """How the clients of a round are drawn, as the accountant sees it.

    Attributes:
      kind: ``"poisson"`` or ``"fixed_size"`` (:data:`SAMPLINGS`).
      num_clients: N, the population.
      clients_per_round: S, the cohort (its expected size under Poisson sampling).
    """

    kind: str
    num_clients: int
    clients_per_round: int

    @property
    def rate(self) -> float:
        """The sampling rate q = S / N."""
        return self.clients_per_round / self.num_clients


def require() -> Any:
    """Returns the ``dp_accounting`` module.

    Raises:
      ImportError: if dp-accounting is not installed, saying how to install it.
    """
    try:
        import dp_accounting
    except ImportError as err:
        raise ImportError(
            "privacy accounting needs dp-accounting: install the extra with "
            "`pip install 'scaffold-jax[privacy]'` (or `pip install dp-accounting`)."
        ) from err
    return dp_accounting


def default_accountant(sampling: Sampling) -> str:
    """Returns ``"pld"`` for Poisson sampling (tighter), ``"rdp"`` for fixed-size sampling."""
    check(sampling)
    return "pld" if sampling.kind == "poisson" else "rdp"


def default_delta(num_clients: int) -> float:
    """Returns N^-1.1, the usual δ: below 1/N, which would allow publishing one client."""
    if num_clients < 1:
        raise ValueError(f"num_clients = {num_clients} is invalid: it must be >= 1.")
    return float(num_clients) ** -1.1


def check(sampling: Sampling, accountant: str | None = None) -> None:
    """Checks that ``accountant`` (None: the default) can account ``sampling``.

    Raises:
      ValueError: naming the bad value and the fix, for an unknown sampling or accountant,
        clients_per_round outside [1, num_clients], or the PLD accountant with fixed-size
        sampling (which dp-accounting's PLD does not cover).
    """
    kind, n, s = sampling
    if kind not in SAMPLINGS:
        raise ValueError(f"sampling = {kind!r} is unknown: use one of {SAMPLINGS}.")
    if accountant is not None and accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant = {accountant!r} is unknown: use one of {ACCOUNTANTS}.")
    if not 1 <= s <= n:
        raise ValueError(
            f"clients_per_round = {s} with num_clients = {n} is invalid: accounting needs "
            "1 <= clients_per_round <= num_clients."
        )
    if kind == "fixed_size" and accountant == "pld":
        raise ValueError(
            "accountant = 'pld' does not cover sampling = 'fixed_size' (sampling without "
            "replacement, replace-one adjacency): use accountant = 'rdp', or the poisson "
            "sampler (sampler = 'poisson')."
        )


def round_event(sampling: Sampling, noise_multiplier: float) -> Any:
    """Returns the ``dp_accounting.DpEvent`` of one round (see the module docstring).

    Args:
      sampling: how the round's clients are drawn.
      noise_multiplier: z, the std of the noise on the sum in units of the clip norm C
        (0: no noise, a ``NonPrivateDpEvent``).
    """
    dp = require()
    check(sampling)
    check_privacy_parameters(noise_multiplier=noise_multiplier)
    if noise_multiplier == 0:
        return dp.NonPrivateDpEvent()
    if sampling.kind == "poisson":
        return dp.PoissonSampledDpEvent(sampling.rate, dp.GaussianDpEvent(noise_multiplier))
    # Replace-one moves the sum by 2C: relative to that sensitivity the multiplier is z/2.
    return dp.SampledWithoutReplacementDpEvent(
        sampling.num_clients, sampling.clients_per_round, dp.GaussianDpEvent(noise_multiplier / 2)
    )


def _pld_interval(rate: float, noise_multiplier: float, delta: float) -> float:
    # The pessimistic PLD overstates ε by a relative error that grows like
    # rounds · (interval / ε)², and ε grows like q · sqrt(2 · rounds · log(1/δ)) / z, so an
    # interval proportional to q · sqrt(2 log(1/δ)) / z keeps that error about constant (well
    # within 0.5%, tested against a finer grid): coarse, and fast, where ε is large.
    width = 0.04 * rate * math.sqrt(2 * math.log(1 / delta)) / noise_multiplier
    return min(1e-2, max(1e-5, width))


@functools.lru_cache(maxsize=4096)
def _epsilon(
    sampling: Sampling, noise_multiplier: float, rounds: int, delta: float, accountant: str
) -> float:
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    dp = require()
    if accountant == "rdp":
        orders, one_round = _rdp_of_one_round(sampling, noise_multiplier)
        return float(dp.rdp.compute_epsilon(orders, rounds * one_round, delta)[0])
    ledger = dp.pld.PLDAccountant(
        value_discretization_interval=_pld_interval(sampling.rate, noise_multiplier, delta)
    )
    ledger.compose(dp.SelfComposedDpEvent(round_event(sampling, noise_multiplier), rounds))
    return float(ledger.get_epsilon(delta))


@functools.lru_cache(maxsize=256)
def _rdp_of_one_round(sampling: Sampling, noise_multiplier: float) -> tuple[Any, Any]:
    """The RDP orders and one round's RDP at each, computed once per (sampling, z).

    RDP composes by addition, and dp-accounting's ledger composes T rounds as
    ``0 + T * rdp(one round)``: ``rounds * one_round`` is that very array, while the
    one-round RDP of fixed-size sampling (without replacement) costs ~0.2 s to compute,
    which every record of a run or a sweep would otherwise pay again."""
    dp = require()
    relation = dp.NeighboringRelation.REPLACE_ONE
    if sampling.kind == "poisson":
        relation = dp.NeighboringRelation.ADD_OR_REMOVE_ONE
    ledger = dp.rdp.RdpAccountant(neighboring_relation=relation)
    ledger.compose(round_event(sampling, noise_multiplier), 1)
    # The ledger's own arrays (no public getter): read once, copied, never changed.
    return ledger._orders.copy(), ledger._rdp.copy()


def epsilon(
    sampling: Sampling,
    noise_multiplier: float,
    rounds: int,
    delta: float,
    accountant: str | None = None,
) -> float:
    """Returns the ε at ``delta`` after ``rounds`` rounds of noise multiplier z.

    Memoised: the run loop asks at every evaluation record, and a sweep for every config.

    Args:
      sampling: how each round's clients are drawn.
      noise_multiplier: z, the total (with adaptive clipping, the z the count shares).
      rounds: the rounds run so far (0 gives 0.0).
      delta: the δ of the (ε, δ) guarantee.
      accountant: ``"pld"`` or ``"rdp"``; None picks :func:`default_accountant`.

    Returns:
      ε, ``math.inf`` when z is 0 (and rounds > 0).

    Raises:
      ValueError: for a bad sampling, accountant, δ, z or number of rounds.
    """
    sampling = Sampling(*sampling)
    accountant = accountant or default_accountant(sampling)
    check(sampling, accountant)
    check_privacy_parameters(delta=delta, noise_multiplier=noise_multiplier)
    if rounds < 0:
        raise ValueError(f"rounds = {rounds} is invalid: it must be >= 0.")
    return _epsilon(sampling, float(noise_multiplier), int(rounds), float(delta), accountant)


def calibrate(
    sampling: Sampling,
    rounds: int,
    target_epsilon: float,
    delta: float,
    accountant: str | None = None,
) -> float:
    """Returns the noise multiplier z whose ε after ``rounds`` rounds is ``target_epsilon``.

    Searches z on :func:`epsilon` itself, so that the z returned reports
    ``epsilon(...) <= target_epsilon`` (at most 0.1% below it) with the same accountant: z
    errs on the larger, safer side. It is a float32 (rounded up): the value a run holds
    and accounts, as its hyper-parameters are float32.

    Raises:
      ValueError: for bad parameters; when no z <= :data:`MAX_NOISE_MULTIPLIER` reaches the
        target (saying roughly the z it would need and what to change); when the target
        is so large that z = :data:`MIN_NOISE_MULTIPLIER` already meets it; or when it is so
        small that the z found has an epsilon of 0 (delta alone bounds the privacy loss
        there, and any smaller target would give the same z).
    """
    sampling = Sampling(*sampling)
    check_privacy_parameters(epsilon=target_epsilon, delta=delta)
    if rounds < 1:
        raise ValueError(f"rounds = {rounds} is invalid: calibrating needs at least one round.")

    def eps(z: float) -> float:
        return epsilon(sampling, z, rounds, delta, accountant)

    ceiling = eps(MAX_NOISE_MULTIPLIER)
    if ceiling > target_epsilon:
        # Far in the tail ε falls about like 1/z, which estimates the z it would take.
        need = MAX_NOISE_MULTIPLIER * ceiling / target_epsilon
        raise ValueError(
            f"dp_epsilon = {target_epsilon} at delta = {delta:.3g} after {rounds} rounds "
            f"(sampling rate {sampling.rate:.3g}) is out of reach: it would need a noise "
            f"multiplier of about {need:.3g}, above {MAX_NOISE_MULTIPLIER:g} (epsilon there is "
            f"{ceiling:.3g}). Use fewer rounds, a larger epsilon or delta, or a smaller "
            "sampling rate (fewer clients_per_round or more num_clients)."
        )
    # Invariant from here on: eps(hi) <= target < eps(lo).
    hi = 1.0
    while eps(hi) > target_epsilon:
        hi = min(2 * hi, MAX_NOISE_MULTIPLIER)
    lo = hi / 2
    while eps(lo) <= target_epsilon:
        hi, lo = lo, lo / 2
        if lo < MIN_NOISE_MULTIPLIER:
            raise ValueError(
                f"dp_epsilon = {target_epsilon} is so large that z = {hi:g} already meets it "
                f"after {rounds} rounds (epsilon {eps(hi):.3g}): such a target protects "
                "nobody; ask for a smaller epsilon, or set dp_noise_multiplier directly."
            )
    # Over a narrow bracket ε is close to a power of z: interpolate log ε in log z, aiming a
    # little below the target so that the step lands on the safe side, and keep each step
    # inside the bracket's middle so that it shrinks even where the power law is off.
    aim = math.log(target_epsilon * (1 - _CALIBRATION_RTOL / 2))
    while eps(hi) < target_epsilon * (1 - _CALIBRATION_RTOL) and hi / lo > 1 + 1e-9:
        if eps(hi) == 0.0:  # no power law to follow where epsilon is 0: halve the bracket
            mid = math.sqrt(lo * hi)  # (the interpolation's 0.1 steps took ~3x as many)
        else:
            above, below = math.log(eps(lo)) - aim, math.log(eps(hi)) - aim
            mid = lo * (hi / lo) ** min(max(above / (above - below), 0.1), 0.9)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    # A run holds z as a float32 and accounts that value: rounded down, it could report an
    # epsilon above the target (far above a target of 1e-300); rounded up, it meets it.
    z = _float32_at_least(hi)
    if eps(z) == 0.0:
        # The accountant's epsilon reaches 0 at a finite z (there delta alone bounds the
        # loss): a target below what double precision resolves of its approach is met
        # only by that z, whatever the target. A z 0.01% lower is clearly resolved.
        works = _rounded_up(eps(z * (1 - 1e-4)))
        raise ValueError(
            f"dp_epsilon = {target_epsilon} at delta = {delta:.3g} after {rounds} rounds "
            f"(sampling rate {sampling.rate:.3g}) is below what the accountant resolves: its "
            f"epsilon is already 0 at a noise multiplier of {z:.6g} (delta alone bounds the "
            "privacy loss there), so such a target does not set the noise. Use dp_epsilon >= "
            f"{works:.0e}, or a smaller delta."
        )
    return z


def _float32_at_least(value: float) -> float:
    """The smallest float32 >= ``value``."""
    single = np.float32(value)
    if float(single) < value:
        single = np.nextafter(single, np.float32(np.inf))
    return float(single)


def _rounded_up(value: float) -> float:
    """``value`` rounded up to one significant digit (2.3e-06 -> 3e-06)."""
    scale = 10.0 ** math.floor(math.log10(value))
    return math.ceil(value / scale * (1 - 1e-12)) * scale


def update_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """Returns z_Δ, the update's noise multiplier when adaptive clipping's count shares z.

    z⁻² = z_Δ⁻² + (2σ_b)⁻² (Andrew et al. 2021), so z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2) >= z.

    Args:
      noise_multiplier: z, the total the accountant accounts.
      count_noise: σ_b, the noise std on the count of unclipped clients.

    Returns:
      z_Δ (0.0 when z is 0: no privacy to share).

    Raises:
      ValueError: if 2σ_b <= z: the count alone would spend more than the whole budget.
    """
    check_privacy_parameters(noise_multiplier=noise_multiplier)
    if noise_multiplier == 0:
        return 0.0
    if not 2 * count_noise > noise_multiplier:
        raise ValueError(
            f"count noise sigma_b = {count_noise} is too small for dp_noise_multiplier = "
            f"{noise_multiplier}: adaptive clipping needs 2*sigma_b > z; raise the count "
            "noise or lower z."
        )
    return (noise_multiplier**-2 - (2 * count_noise) ** -2) ** -0.5


def check_privacy_parameters(
    epsilon: float | None = None,
    delta: float | None = None,
    noise_multiplier: float | None = None,
    num_clients: int | None = None,
) -> None:
    """Checks the privacy parameters given (None: not given).

    Raises:
      ValueError: naming the value and the fix, for ε not finite and > 0, δ outside (0, 1),
        δ >= 1/N (with ``num_clients``: no privacy), or z not finite and >= 0.
    """
    usual = ""
    if num_clients is not None:
        usual = f" 1/N^1.1 = {default_delta(num_clients):.1e} is the usual choice."
    if epsilon is not None and not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(
            f"dp_epsilon = {epsilon} is invalid: it must be finite and > 0 (e.g. 1, 3 or 8)."
        )
    if delta is not None and not 0 < delta < 1:
        raise ValueError(f"dp_delta = {delta} is invalid: it must be in (0, 1).{usual}")
    if noise_multiplier is not None and not (
        math.isfinite(noise_multiplier) and noise_multiplier >= 0
    ):
        raise ValueError(
            f"dp_noise_multiplier = {noise_multiplier} is invalid: it must be finite and >= 0 "
            "(0 adds no noise: no privacy)."
        )
    if delta is not None and num_clients is not None and delta >= 1 / num_clients:
        raise ValueError(
            f"dp_delta = {delta} >= 1/N = {1 / num_clients:.1e} (N = {num_clients} clients) is "
            "no privacy: a delta of 1/N or more lets a mechanism publish one client's data "
            f"outright. Use delta < 1/N, e.g. N^-1.1 = {default_delta(num_clients):.1e} (the "
            "default)."
        )
