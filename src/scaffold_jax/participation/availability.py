"""Client availability: which of the N clients can be sampled in a round.

Real devices take part when idle, charging and on an unmetered network: at night in their
time zone, in on/off spells. An availability model gives, every round, a bool ``[N]`` mask
of the clients that are available; the sampler draws only among them
(:mod:`scaffold_jax.sampling`: S of the available uniformly, or each available client with
probability S/N), and a round with fewer available clients than S runs with those it has
(its record's ``available`` and ``participants`` say how many; a round with none
aggregates nothing, as one whose every sampled client drops). A model that makes no
client available in any round is refused (``check``).

A model is a frozen value with

- ``init(num_clients) -> state``: its initial state (a traceable pytree, ``()`` for a
  stateless model), kept in :attr:`SimState.participation <scaffold_jax.types.SimState>`:
  it is checkpointed and restored with the rest, and in a sweep it is one per seed, shared
  by every config of the seed (it depends on the seed's key and the round only);
- ``step(state, key, round_index, num_clients) -> (state, available)``: the round's mask
  (``key``: the round's availability key, ``round_index`` traced);
- ``rate(num_clients) -> float64 [N]``: each client's long-run fraction of rounds
  available (its stationary rate; what the tests check the draws against);
- ``check(num_clients)``: raises ValueError when it cannot serve N clients.

Registered (:data:`AVAILABILITY`; ``--availability``):

- ``always``: every client every round (the paper's; the default).
- ``cyclic``: Eichner et al. (ICML 2019, "Semi-Cyclic SGD"): the clients form G groups
  (time zones), and a day of ``cycle_rounds`` rounds is G blocks; in block g only group g
  is available. Its state is the position in the day, ``round mod cycle_rounds``, read from
  the round counter (which the state holds).
- ``markov``: a two-state on/off Markov chain per client with stationary availability π
  (``availability_rate``) and mean on-spell ``mean_on_rounds`` (1/a for the per-round
  on→off probability a; off→on is b = a·π/(1 − π)). The chain starts in its stationary
  law; its ``[N]`` int8 state is ``-1`` before the first round, then 0/1.
- ``trace``: a recorded log: per client, per round availability bits from a file
  (:func:`load_trace`; round t reads column ``t mod T``, so a trace of T rounds repeats).

Examples:
  >>> import jax, jax.numpy as jnp
  >>> model = Cyclic(groups=2, cycle_rounds=4)
  >>> [model.step((), jax.random.key(0), jnp.int32(t), 4)[1].tolist() for t in (0, 2)]
  [[True, True, False, False], [False, False, True, True]]
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import ClassVar

import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.participation.base import ModelSpec
from scaffold_jax.registry import Option, Registry


@dataclasses.dataclass(frozen=True)
class Cyclic:
    """Semi-cyclic availability: G groups, group g available in block g of every day.

    Args:
      groups: G, the number of groups (time zones).
      cycle_rounds: rounds in a day, a multiple of G (each block is ``cycle_rounds / G``
        rounds); default 5 G.
      grouping: ``"contiguous"``: client i is in group ``i·G // N`` (with the paper's
        similarity split the groups then hold different labels: the hard, semi-cyclic
        case); ``"interleaved"``: group ``i mod G`` (groups alike).
    """

    groups: int = 4
    cycle_rounds: int | None = None
    grouping: str = "contiguous"
    name: ClassVar[str] = "cyclic"

    def __post_init__(self):
        if self.grouping not in GROUPINGS:
            raise ValueError(f"cycle_grouping = {self.grouping!r}: use one of {GROUPINGS}.")
        if self.groups < 1:
            raise ValueError(f"cycle_groups = {self.groups}: use a number of groups >= 1.")
        if self.period % self.groups:
            raise ValueError(
                f"cycle_rounds = {self.period} does not split into cycle_groups = "
                f"{self.groups} equal blocks: use a multiple of {self.groups} (e.g. "
                f"{self.groups * max(1, round(self.period / self.groups))})."
            )

    @property
    def period(self) -> int:
        return 5 * self.groups if self.cycle_rounds is None else self.cycle_rounds

    def group_of(self, num_clients: int) -> np.ndarray:
        """Each client's group (int ``[N]``)."""
        ids = np.arange(num_clients)
        if self.grouping == "contiguous":
            return ids * self.groups // num_clients
        return ids % self.groups

    def check(self, num_clients: int) -> None:
        if self.groups > num_clients:
            raise ValueError(
                f"cycle_groups = {self.groups} exceeds the number of clients N = "
                f"{num_clients}: some groups would be empty. Use cycle_groups <= N."
            )

    def init(self, num_clients: int):
        del num_clients
        return ()

    def step(self, state, key, round_index, num_clients):
        del key
        block = (round_index % self.period) * self.groups // self.period
        return state, jnp.asarray(self.group_of(num_clients)) == block

    def rate(self, num_clients: int) -> np.ndarray:
        return np.full(num_clients, 1.0 / self.groups)


@dataclasses.dataclass(frozen=True)
class Markov:
    """Two-state on/off availability, independent across clients.

    Args:
      rate_on: π, the stationary probability that a client is available, in (0, 1].
      mean_on_rounds: the mean length of an available spell, in rounds (>= 1; the mean
        unavailable spell is then ``mean_on_rounds · (1 − π) / π``, which must be >= 1 too).
    """

    rate_on: float = 0.5
    mean_on_rounds: float = 5.0
    name: ClassVar[str] = "markov"

    def __post_init__(self):
        if not 0.0 < self.rate_on <= 1.0:
            raise ValueError(f"availability_rate = {self.rate_on}: use a probability in (0, 1].")
        if self.mean_on_rounds < 1.0:
            raise ValueError(
                f"mean_on_rounds = {self.mean_on_rounds}: an available spell lasts at least one "
                "round; use mean_on_rounds >= 1."
            )
        if self.turn_on > 1.0:
            least = self.rate_on / (1.0 - self.rate_on)
            raise ValueError(
                f"availability_rate = {self.rate_on} with mean_on_rounds = "
                f"{self.mean_on_rounds} asks for unavailable spells shorter than one round "
                f"(mean {self.mean_on_rounds * (1 - self.rate_on) / self.rate_on:.3g}): use "
                f"mean_on_rounds >= {least:.4g}, or a lower availability_rate."
            )

    @property
    def turn_off(self) -> float:
        """a: the per-round probability that an available client becomes unavailable."""
        return 0.0 if self.rate_on == 1.0 else 1.0 / self.mean_on_rounds

    @property
    def turn_on(self) -> float:
        """b: the per-round probability that an unavailable client becomes available."""
        if self.rate_on == 1.0:
            return 1.0
        return self.turn_off * self.rate_on / (1.0 - self.rate_on)

    def check(self, num_clients: int) -> None:
        del num_clients

    def init(self, num_clients: int):
        return jnp.full((num_clients,), -1, jnp.int8)  # -1: not drawn yet

    def step(self, state, key, round_index, num_clients):
        del round_index
        u = jr.uniform(key, (num_clients,))
        stay_on = u >= self.turn_off
        come_on = u < self.turn_on
        on = jnp.where(state < 0, u < self.rate_on, jnp.where(state > 0, stay_on, come_on))
        return on.astype(jnp.int8), on

    def rate(self, num_clients: int) -> np.ndarray:
        return np.full(num_clients, self.rate_on)


@dataclasses.dataclass(frozen=True)
class Trace:
    """Availability replayed from a recorded log (:func:`load_trace`).

    Args:
      path: the trace file. Client i reads row i (the file needs >= N rows); round t
        reads column ``t mod T``.
    """

    path: str
    name: ClassVar[str] = "trace"

    def __post_init__(self):
        if self.path is None:
            raise ValueError(
                "availability = 'trace' needs availability_trace = PATH (command line: "
                "--availability-trace PATH), the file of the clients' availability bits."
            )
        # Loaded once, checked as it loads; packed 8 rounds a byte, so the constant the
        # program holds is N·T/8 bytes.
        bits = load_trace(self.path)
        object.__setattr__(self, "_bits", bits)
        object.__setattr__(self, "_packed", np.packbits(bits, axis=1))
        # What the run replays, not only where it was read from: a run's identity holds
        # this repr, so resuming after the file changed is refused.
        digest = hashlib.sha256(np.ascontiguousarray(bits).tobytes() + str(bits.shape).encode())
        object.__setattr__(self, "_digest", digest.hexdigest()[:16])

    def __repr__(self) -> str:
        return f"Trace(path={self.path!r}, bits_sha256={self._digest!r})"

    @property
    def bits(self) -> np.ndarray:
        """The trace, bool ``[clients, rounds]``."""
        return self._bits

    def check(self, num_clients: int) -> None:
        if self._bits.shape[0] < num_clients:
            raise ValueError(
                f"the availability trace {self.path} has {self._bits.shape[0]} clients (rows) "
                f"but the run has N = {num_clients}: give a trace with a row for every client, "
                "or fewer clients."
            )
        # Rounds in which no client is available are a trace's nights (they run with 0
        # participants, as a round whose every client drops); no available round at all
        # is a run that never trains.
        if not self._bits[:num_clients].any():
            raise ValueError(
                f"the availability trace {self.path} makes no client available in any round "
                f"(every bit of its first {num_clients} rows, the run's N clients, is 0): "
                "every round would have 0 participants and the model would never train. Mark "
                "each client's available rounds with 1 (rounds with none available are fine)."
            )

    def init(self, num_clients: int):
        del num_clients
        return ()

    def step(self, state, key, round_index, num_clients):
        del key
        column = round_index % self._bits.shape[1]
        packed = jnp.asarray(self._packed[:num_clients])
        byte = jnp.take(packed, column // 8, axis=1)
        return state, ((byte >> (7 - column % 8).astype(jnp.uint8)) & 1).astype(bool)

    def rate(self, num_clients: int) -> np.ndarray:
        return self._bits[:num_clients].mean(axis=1)


def load_trace(path: str | Path) -> np.ndarray:
    """An availability trace as bool ``[clients, rounds]``.

    Formats:
      - ``.npy``: a 2-D array ``[clients, rounds]`` of 0/1 (bool or integers).
      - anything else, text: one line per client, its rounds as ``0``/``1``, written
        together (``0110``) or separated by spaces or commas (``0, 1, 1, 0``); blank lines
        and lines starting with ``#`` are skipped. Every client needs the same number of
        rounds.

    Raises:
      FileNotFoundError: no such file.
      IsADirectoryError: a directory.
      ValueError: the file is not such an array (the message names the file, what is
        wrong, and the formats).
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise IsADirectoryError(
            f"availability_trace = {str(path)!r} is a directory, not a file. Give the path "
            f"of a trace ({FORMATS})."
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"availability_trace = {str(path)!r}: no such file. Give the path of a trace "
            f"({FORMATS})."
        )
    where = f"{path}"
    if path.suffix == ".npy":
        array = _load_npy(path)
    else:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"the availability trace {path} is not text (its byte {err.start} is not "
                "UTF-8: a binary file?) and its name does not end in .npy. Give a text file "
                "of one line of 0/1 per client, or a [clients, rounds] array of 0/1 saved "
                "with numpy.save as NAME.npy."
            ) from None
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            tokens = line.replace(",", " ").split()
            if len(tokens) == 1:
                tokens = list(tokens[0])
            if any(t not in ("0", "1") for t in tokens):
                raise ValueError(
                    f"the availability trace {path}, line {number}, holds something other "
                    f"than 0/1: {line[:40]!r}. Write one line per client of 0/1 per round."
                )
            rows.append([t == "1" for t in tokens])
        if not rows:
            raise ValueError(
                f"the availability trace {path} holds no clients: it is empty, or only blank "
                "lines and # comments. Write one line per client of its rounds' 0/1 (0110, "
                "or 0 1 1 0), or save a [clients, rounds] array of 0/1 as NAME.npy."
            )
        if len({len(r) for r in rows}) > 1:
            lengths = sorted({len(r) for r in rows})
            raise ValueError(
                f"the availability trace {path} has clients with different numbers of rounds "
                f"({lengths[0]} to {lengths[-1]}): give every client the same rounds."
            )
        array = np.asarray(rows, bool).reshape(len(rows), -1)
    if array.ndim != 2 or 0 in array.shape:
        raise ValueError(
            f"the availability trace {where} has shape {array.shape}; it must be a non-empty "
            "[clients, rounds] array."
        )
    if not np.isin(array, (0, 1)).all():
        raise ValueError(f"the availability trace {where} holds values other than 0/1.")
    return array.astype(bool)


def _load_npy(path: Path) -> np.ndarray:
    """The array of a .npy trace; ValueError naming the file and what numpy could not read."""
    fix = (
        "Save a [clients, rounds] array of 0/1 with numpy.save, or give a text trace (one "
        "line of 0/1 per client) under a name that does not end in .npy."
    )
    with path.open("rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        raise ValueError(
            f"the availability trace {path} is not a .npy file (it does not start with "
            f"numpy's magic string \\x93NUMPY). {fix}"
        )
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, EOFError, OSError) as err:
        raise ValueError(
            f"the availability trace {path} is a damaged .npy file: numpy cannot read its "
            f"header or data ({str(err).rstrip('.')}). {fix}"
        ) from None


#: A trace file's formats, in words (:func:`load_trace`), for messages.
FORMATS = ".npy [clients, rounds] of 0/1, or text: one line of 0/1 per client"

GROUPINGS = ("contiguous", "interleaved")

AVAILABILITY: Registry[ModelSpec] = Registry("availability model")
AVAILABILITY.register("always", ModelSpec(None))
AVAILABILITY.register(
    "cyclic",
    ModelSpec(
        Cyclic,
        {
            "cycle_groups": Option(
                4, "cyclic availability: number of client groups (time zones) G", "int",
                low=1, argument="groups",
            ),
            "cycle_rounds": Option(
                None, "cyclic availability: rounds in a day, a multiple of G (default 5 G)",
                "int", low=1,
            ),
            "cycle_grouping": Option(
                "contiguous",
                "cyclic availability: client i's group, i*G//N (contiguous) or i mod G "
                "(interleaved)",
                "str", choices=GROUPINGS, argument="grouping",
            ),
        },
    ),
)  # fmt: skip
AVAILABILITY.register(
    "markov",
    ModelSpec(
        Markov,
        {
            "availability_rate": Option(
                0.5, "markov availability: stationary fraction of rounds a client is available",
                "float", low=0.0, high=1.0, strict=True, argument="rate_on",
            ),
            "mean_on_rounds": Option(
                5.0, "markov availability: mean length of an available spell, in rounds",
                "float", low=1.0,
            ),
        },
    ),
)  # fmt: skip
AVAILABILITY.register(
    "trace",
    ModelSpec(
        Trace,
        {
            "availability_trace": Option(
                None,
                "trace availability: file of per-client, per-round 0/1 (.npy [clients, "
                "rounds], or text: one line per client; docs/participation.md)",
                "str", argument="path",
            ),
        },
    ),
)  # fmt: skip
