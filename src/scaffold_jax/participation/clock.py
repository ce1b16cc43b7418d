"""Device profiles and the virtual clock of a synchronous round (see
the manual's page “The network model”).

Rounds are not time: a round lasts as long as its slowest reporting client's download,
local work and upload. A profile model gives every client a device: seconds per example
t_i and downlink and uplink bandwidths d_i, u_i in bytes per second. A participating
client's duration is

    bytes_down / d_i + examples_i · t_i + bytes_up / u_i

where ``examples_i`` are the examples its local steps processed (a straggler's fewer; the
whole of its data again for an algorithm's pre-round pass, whose message is uploaded
too) and the bytes are its algorithm's (:mod:`scaffold_jax.engine.communication`). The
round lasts the longest duration among the clients whose upload counts, with two policies
of real servers (Bonawitz et al., SysML 2019):

- ``round_deadline`` D: a client whose duration exceeds D is dropped (its update lost, as
  a dropout's; it still downloaded) and the round lasts at most D;
- ``over_selection`` f >= 1: ⌈f·S⌉ clients are sampled and the S that finish first are
  kept (ties: the earlier in the sampled order); the others are dropped.

So the round lasts min(D, the k-th shortest duration), k = min(S, clients taking part).
All of it runs inside the compiled round (durations, a sort, a mask); records carry
``round_duration`` (seconds, the mean per round since the previous record) and
``virtual_time`` (cumulative), and ``late`` (clients dropped by the clock).

Registered profile models (:data:`PROFILES`; ``--profiles``):

- ``none``: no clock (the default): rounds only, today's run bitwise.
- ``lognormal``: each of t_i, d_i, u_i log-normal around its median (``seconds_per_
  example``, ``down_bytes_per_s``, ``up_bytes_per_s``) with spreads ``compute_sigma`` and
  ``bandwidth_sigma``, drawn once per client from the run's seed (from the client's id,
  so a million clients cost nothing).
- ``file``: a CSV with the header ``seconds_per_example,down_bytes_per_s,up_bytes_per_s``
  (``profile_file``); client i reads row ``i mod R``. Its numbers' digest is in the run's
  identity: a resume after the file changed is refused.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import math
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.participation.base import ModelSpec, constants_key
from scaffold_jax.registry import Option, Registry

#: The columns of a profile file, in this order (its header).
COLUMNS = ("seconds_per_example", "down_bytes_per_s", "up_bytes_per_s")

#: The clock's precision: a duration, a profile value and the deadline are float32 there.
_F32 = np.finfo(np.float32)
#: The most clients whose profiles :meth:`_Clock.check` draws (64 chunks of 2^16); a
#: larger population is checked on its first clients.
CHECKED_CLIENTS = 2**22


def _float32_error(name: str, value: float, unit: str) -> str | None:
    """Why ``value`` (seconds, bytes/s) cannot be a float32 of the clock, None if it can:
    beyond the largest float32 it is inf; below the smallest normal it is 0 (or a
    subnormal, flushed to 0 on accelerators)."""
    if abs(value) > float(_F32.max):
        return (
            f"{name} = {value!r} is invalid: the virtual clock computes in float32, where it "
            f"is inf (the largest float32 is {float(_F32.max):.3g}); give at most that many "
            f"{unit}."
        )
    if 0 < abs(value) < float(_F32.tiny):
        return (
            f"{name} = {value!r} is invalid: the virtual clock computes in float32, where it "
            f"is 0 (the smallest normal float32 is {float(_F32.tiny):.3g}); give at least "
            f"that many {unit}."
        )
    return None


@dataclasses.dataclass(frozen=True)
class _Clock:
    """The synchronous round's policy, shared by every profile model: ``deadline`` D in
    seconds (None: none) and ``over_selection`` f >= 1."""

    deadline: float | None = None
    over_selection: float = 1.0

    def __post_init__(self):
        if self.deadline is not None and not (math.isfinite(self.deadline) and self.deadline > 0):
            raise ValueError(
                f"round_deadline = {self.deadline} is invalid: it must be a number of seconds "
                "> 0 (or unset: no deadline)."
            )
        if self.deadline is not None:
            error = _float32_error("round_deadline", self.deadline, "seconds (or unset it)")
            if error:
                raise ValueError(error)
        if not (math.isfinite(self.over_selection) and self.over_selection >= 1.0):
            raise ValueError(
                f"over_selection = {self.over_selection} is invalid: it must be >= 1 (sample "
                "ceil(f * S) clients and keep the S that finish first; 1: no over-selection)."
            )

    @property
    def drops(self) -> bool:
        """Whether the clock can drop a client (a deadline or over-selection)."""
        return self.deadline is not None or self.over_selection > 1.0

    def sampled(self, clients_per_round: int) -> int:
        """How many clients a round samples to keep ``clients_per_round``: ⌈f·S⌉ (rounded
        down where f·S is within float rounding of an integer)."""
        return math.ceil(self.over_selection * clients_per_round - 1e-9)

    def values(self, seed: int, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(t, d, u)`` of clients ``ids`` for a run of ``seed``, float32 as the clock
        computes them (the engine draws them from ``constants_key(jax.random.key(seed))``)."""
        raise NotImplementedError

    def where(self, client: int) -> str:
        """Where client ``client``'s profile comes from, for messages."""
        return f"client {client}"

    def check(self, seed: int, num_clients: int, least_examples: int, rounds: int) -> None:
        """Refuses, before a run, what the clock would compute as inf, 0 or NaN, in its own
        precision (float32), for the clients of a run of ``seed`` (the first
        :data:`CHECKED_CLIENTS` of a larger population): a seconds per example or a
        bandwidth that is not a positive normal float32 (a median beyond float32, a spread
        whose draws overflow), a client whose local work (``least_examples``, the fewest
        examples a client processes in a round) overflows, a virtual time that overflows
        within ``rounds`` rounds; and a deadline shorter than every client's local work
        alone (no client would ever report: the model would never train).

        Raises:
          ValueError: naming the setting, the client and the value.
        """
        count = min(int(num_clients), CHECKED_CLIENTS)
        chunk = 4096 if count <= 4096 else 2**16
        fastest, fastest_at = np.inf, 0
        for start in range(0, count, chunk):
            ids = np.arange(start, start + chunk)
            t, d, u = (np.asarray(v)[: count - start] for v in self.values(seed, ids))
            for name, column in (("seconds per example", t), ("downlink bytes/s", d),
                                 ("uplink bytes/s", u)):  # fmt: skip
                bad = ~(np.isfinite(column) & (column >= _F32.tiny))
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    raise ValueError(
                        f"{self.describe_values()} gives {self.where(start + i)} {name} = "
                        f"{float(column[i]):.3g} in the virtual clock's float32 (a positive "
                        f"number from {float(_F32.tiny):.3g} to {float(_F32.max):.3g} is "
                        f"needed): {self.fix()}."
                    )
                if name != "seconds per example" and not np.isfinite(1 / column).all():
                    i = int(np.flatnonzero(~np.isfinite(1 / column))[0])
                    raise ValueError(
                        f"{self.describe_values()} gives {self.where(start + i)} {name} = "
                        f"{float(column[i]):.3g}: a byte takes inf seconds in the virtual "
                        f"clock's float32; {self.fix()}."
                    )
            work = np.float32(least_examples) * t
            if not np.isfinite(work).all():
                i = int(np.flatnonzero(~np.isfinite(work))[0])
                raise ValueError(
                    f"{self.describe_values()} gives {self.where(start + i)} {float(t[i]):.3g} "
                    f"s per example: its {least_examples} example(s) a round take inf seconds in "
                    f"the virtual clock's float32; {self.fix()}."
                )
            i = int(np.argmin(work))
            if work[i] < fastest:
                fastest, fastest_at = float(work[i]), start + i
        if fastest * rounds > float(_F32.max):
            raise ValueError(
                f"{self.describe_values()}: even the fastest client ({self.where(fastest_at)}) "
                f"needs {fastest:.3g} s a round, so the virtual time of {rounds} rounds passes "
                f"the largest float32 ({float(_F32.max):.3g} s) and becomes inf; "
                f"{self.fix()}."
            )
        if self.deadline is not None and fastest > np.float32(self.deadline):
            of = f"the N = {num_clients} clients" if count == num_clients else (
                f"the first {count} clients checked"
            )  # fmt: skip
            raise ValueError(
                f"round_deadline = {self.deadline!r} s is shorter than every client's local "
                f"work alone: the fastest of {of} ({self.where(fastest_at)}) needs "
                f"{fastest:.3g} s for its {least_examples} example"
                f"{'' if least_examples == 1 else 's'} a round (before its "
                "download and upload), so every round would drop every client and the model "
                f"would never train; give round_deadline > {fastest:.3g}, or unset it."
            )

    def describe_values(self) -> str:
        """The settings the profile values come from, for messages."""
        raise NotImplementedError

    def fix(self) -> str:
        """What to change when a profile value is out of the clock's range."""
        raise NotImplementedError

    def durations(self, profile, bytes_down, bytes_up, examples) -> jax.Array:
        """Each client's duration in seconds (float32 ``[S]``) from its ``profile``
        ``(t, d, u)``, the bytes it receives and sends and the examples it processes."""
        t, d, u = profile
        examples = jnp.asarray(examples, jnp.float32)
        return (jnp.float32(bytes_down) / d + examples * t + jnp.float32(bytes_up) / u).astype(
            jnp.float32
        )

    def select(
        self, durations: jax.Array, present: jax.Array | None, keep: int
    ) -> tuple[jax.Array, jax.Array]:
        """``(kept, round_duration)``: which clients' uploads count (bool ``[S]``: taking
        part, among the ``keep`` earliest to finish, ties to the earlier position, and
        within the deadline) and how long the round lasts (min(D, the k-th shortest
        duration of those taking part, k = min(keep, their number)); 0 when none takes
        part)."""
        taking = jnp.ones(durations.shape, bool) if present is None else present
        inf = jnp.float32(jnp.inf)
        ranked = jnp.where(taking, durations, inf)
        order = jnp.argsort(ranked, stable=True)
        rank = jnp.zeros(durations.shape, jnp.int32).at[order].set(jnp.arange(durations.size))
        kept = taking & (rank < keep)
        count = jnp.minimum(jnp.sum(taking), keep)
        last = jnp.where(count > 0, jnp.sort(ranked)[jnp.maximum(count - 1, 0)], 0.0)
        if self.deadline is not None:
            kept = kept & (durations <= jnp.float32(self.deadline))
            last = jnp.minimum(last, jnp.float32(self.deadline))
        return kept, last.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class LogNormal(_Clock):
    """t_i, d_i, u_i log-normal around their medians, drawn once per client."""

    seconds_per_example: float = 0.005
    down_bytes_per_s: float = 1.25e6
    up_bytes_per_s: float = 2.5e5
    compute_sigma: float = 0.5
    bandwidth_sigma: float = 0.75
    name: ClassVar[str] = "lognormal"

    def __post_init__(self):
        super().__post_init__()
        for name in ("seconds_per_example", "down_bytes_per_s", "up_bytes_per_s"):
            unit = "seconds" if name.startswith("seconds") else "bytes per second"
            error = _float32_error(name, getattr(self, name), unit)
            if error:
                raise ValueError(error)

    def profile(self, seed_key: jax.Array, ids: jax.Array):
        """``(t, d, u)``, float32 ``[S]`` each, of clients ``ids`` (from their ids)."""
        sigma = jnp.asarray([self.compute_sigma, self.bandwidth_sigma, self.bandwidth_sigma])
        median = jnp.asarray([self.seconds_per_example, self.down_bytes_per_s, self.up_bytes_per_s])
        return _lognormal(seed_key, jnp.asarray(ids, jnp.int32), median, sigma)

    def values(self, seed: int, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        sigma = np.asarray([self.compute_sigma, self.bandwidth_sigma, self.bandwidth_sigma])
        median = np.asarray([self.seconds_per_example, self.down_bytes_per_s, self.up_bytes_per_s])
        key = constants_key(jr.key(seed))
        return _lognormal_jit(key, jnp.asarray(ids, jnp.int32), median.astype(np.float32),
                              sigma.astype(np.float32))  # fmt: skip

    def describe_values(self) -> str:
        return (
            f"profiles = 'lognormal' (seconds_per_example = {self.seconds_per_example!r}, "
            f"compute_sigma = {self.compute_sigma!r}, down_bytes_per_s = "
            f"{self.down_bytes_per_s!r}, up_bytes_per_s = {self.up_bytes_per_s!r}, "
            f"bandwidth_sigma = {self.bandwidth_sigma!r})"
        )

    def fix(self) -> str:
        return "use medians nearer 1 or smaller spreads (compute_sigma, bandwidth_sigma)"


def _lognormal(seed_key: jax.Array, ids: jax.Array, median: jax.Array, sigma: jax.Array):
    """Log-normal ``(t, d, u)`` of clients ``ids``: ``median · exp(sigma · z)``, z drawn
    from the client's id (what the engine and :meth:`LogNormal.check` compute)."""
    key = jr.fold_in(seed_key, 2)  # the speed stragglers' draws are stream 1
    z = jax.vmap(lambda i: jr.normal(jr.fold_in(key, i), (3,)))(ids)
    values = (median[None, :] * jnp.exp(sigma[None, :] * z)).astype(jnp.float32)
    return values[:, 0], values[:, 1], values[:, 2]


_lognormal_jit = jax.jit(_lognormal)


def load_profiles(path: str | Path) -> np.ndarray:
    """A profile file as float64 ``[rows, 3]`` (:data:`COLUMNS`).

    Raises:
      FileNotFoundError, IsADirectoryError: no such file.
      ValueError: a malformed file, in one line naming the file, the row and the fix; a
        path that is no regular file (a device, a pipe).
    """
    path = Path(path).expanduser()
    fix = f"the file must be a CSV with the header {','.join(COLUMNS)} and one row of three "
    fix += "positive numbers per device"
    if path.is_dir():
        raise IsADirectoryError(f"profile_file = {str(path)!r} is a directory: {fix}.")
    if path.exists() and not path.is_file():  # /dev/null, a FIFO: never read (it may block)
        raise ValueError(
            f"profile_file = {str(path)!r} is not a regular file (a device or a pipe): {fix}."
        )
    if not path.is_file():
        raise FileNotFoundError(f"profile_file = {str(path)!r}: no such file; {fix}.")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"the profile file {path} is not text: {fix}.") from None
    rows = [r for r in csv.reader(lines) if r and any(cell.strip() for cell in r)]
    if not rows or tuple(cell.strip() for cell in rows[0]) != COLUMNS:
        found = ",".join(rows[0]) if rows else "nothing"
        raise ValueError(f"the profile file {path} starts with {found!r}: {fix}.")
    values = []
    for number, row in enumerate(rows[1:], start=2):
        try:
            numbers = [float(cell) for cell in row]
        except ValueError:
            numbers = []
        if len(numbers) != 3 or not all(math.isfinite(v) and v > 0 for v in numbers):
            raise ValueError(f"the profile file {path}, row {number} ({','.join(row)!r}): {fix}.")
        values.append(numbers)
    if not values:
        raise ValueError(f"the profile file {path} has a header but no device: {fix}.")
    return np.asarray(values, np.float64)


@dataclasses.dataclass(frozen=True)
class FileProfiles(_Clock):
    """Profiles read from a CSV (:func:`load_profiles`); client i reads row ``i mod R``."""

    path: str | None = None
    name: ClassVar[str] = "file"

    def __post_init__(self):
        super().__post_init__()
        if self.path is None:
            raise ValueError(
                "profiles = 'file' needs profile_file = PATH (command line: --profile-file "
                f"PATH), a CSV with the header {','.join(COLUMNS)}."
            )
        table = load_profiles(self.path)
        object.__setattr__(self, "_table", table.astype(np.float32))
        # What the run uses, not only where it was read from: the run's identity holds
        # this repr, so a resume after the file changed is refused.
        digest = hashlib.sha256(np.ascontiguousarray(table).tobytes()).hexdigest()[:16]
        object.__setattr__(self, "_digest", digest)

    def __repr__(self) -> str:
        return (
            f"FileProfiles(path={self.path!r}, values_sha256={self._digest!r}, "
            f"deadline={self.deadline!r}, over_selection={self.over_selection!r})"
        )

    @property
    def table(self) -> np.ndarray:
        """The profiles, float32 ``[rows, 3]``."""
        return self._table

    def identity(self, num_clients: int) -> str:
        """What a run of ``num_clients`` clients computes with these profiles, for its
        resume identity: the digest of the rows its clients read (client i reads row
        i mod R: the first min(N, R) rows), not the file's path (the same devices at
        another path resume) nor rows no client reads."""
        read = np.ascontiguousarray(self._table[: min(int(num_clients), len(self._table))])
        digest = hashlib.sha256(read.tobytes()).hexdigest()[:16]
        return (
            f"FileProfiles(rows_read={len(read)}, rows_sha256={digest!r}, "
            f"deadline={self.deadline!r}, over_selection={self.over_selection!r})"
        )

    def profile(self, seed_key: jax.Array, ids: jax.Array):
        del seed_key
        rows = jnp.asarray(self._table)[jnp.asarray(ids, jnp.int32) % self._table.shape[0]]
        return rows[:, 0], rows[:, 1], rows[:, 2]

    def values(self, seed: int, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        del seed
        rows = self._table[np.asarray(ids) % self._table.shape[0]]
        return rows[:, 0], rows[:, 1], rows[:, 2]

    def where(self, client: int) -> str:
        # Row 1 is the header: client i reads the (i mod R)-th device, line i mod R + 2.
        return f"client {client} (row {client % self._table.shape[0] + 2})"

    def describe_values(self) -> str:
        return f"the profile file {self.path}"

    def fix(self) -> str:
        return f"give each device numbers from {float(_F32.tiny):.3g} to {float(_F32.max):.3g}"


#: The round policy's options, declared by every profile model.
_POLICY = {
    "round_deadline": Option(
        None, "virtual clock: a client slower than this many seconds is dropped and the "
        "round lasts at most this long (unset: no deadline)", "float", low=0.0, strict=True,
        argument="deadline", tradeoff=True,
    ),
    "over_selection": Option(
        1.0, "virtual clock: sample ceil(f * S) clients and keep the S that finish first",
        "float", low=1.0, tradeoff=True,
    ),
}  # fmt: skip

PROFILES: Registry[ModelSpec] = Registry("device profile model")
PROFILES.register("none", ModelSpec(None))
PROFILES.register(
    "lognormal",
    ModelSpec(
        LogNormal,
        {
            "seconds_per_example": Option(
                0.005, "lognormal profiles: median seconds of local work per example", "float",
                low=0.0, strict=True,
            ),
            "down_bytes_per_s": Option(
                1.25e6, "lognormal profiles: median downlink bandwidth (bytes/s; 10 Mbit/s)",
                "float", low=0.0, strict=True,
            ),
            "up_bytes_per_s": Option(
                2.5e5, "lognormal profiles: median uplink bandwidth (bytes/s; 2 Mbit/s)",
                "float", low=0.0, strict=True,
            ),
            "compute_sigma": Option(
                0.5, "lognormal profiles: spread (sigma of the log) of seconds per example",
                "float", low=0.0,
            ),
            "bandwidth_sigma": Option(
                0.75, "lognormal profiles: spread (sigma of the log) of the bandwidths",
                "float", low=0.0,
            ),
            **_POLICY,
        },
    ),
)  # fmt: skip
PROFILES.register(
    "file",
    ModelSpec(
        FileProfiles,
        {
            "profile_file": Option(
                None, "file profiles: a CSV seconds_per_example,down_bytes_per_s,"
                "up_bytes_per_s, one row per device (client i reads row i mod rows)", "str",
                argument="path",
            ),
            **_POLICY,
        },
    ),
)  # fmt: skip
