"""Stop strings on token ids: the compiled check stops exactly where the text first holds a
stop string, however the tokens cut it."""

import jax.numpy as jnp
import numpy as np

from jaxkv.decoding import stops

PIECES = ["", "a", "b", "\n", "\n\n", "a\n", "\nb", "ab", "ba", "END", "E", "N", "D", "xEN",
          "D\n", "b\n\na"]


class Pieces:
    """A tokenizer whose token v decodes to PIECES[v] (0: a special token, no text)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids)


def first_stop(tokens, texts):
    """Brute force: the index of the token after which the text first holds a stop string."""
    text = ""
    for t, v in enumerate(tokens):
        text += PIECES[v]
        if any(s in text for s in texts):
            return t
    return None


def test_matches_brute_force_on_random_texts():
    texts = ["\n\n", "END", "ab"]
    tables = stops.stop_strings(Pieces(), texts, len(PIECES))
    rng = np.random.default_rng(0)
    tokens_BT = rng.integers(0, len(PIECES), (400, 12))
    ends_BM = jnp.zeros((400, tables.completes.shape[1]), bool)
    stopped_at = np.full(400, -1)
    for t in range(12):
        stopped_B, ends_BM = stops.step(tables, ends_BM, jnp.asarray(tokens_BT[:, t]))
        stopped_at = np.where((stopped_at < 0) & np.asarray(stopped_B), t, stopped_at)
    expected = [first_stop(row, texts) for row in tokens_BT]
    assert stopped_at.tolist() == [-1 if e is None else e for e in expected]
    assert len({e for e in expected if e is not None}) > 5  # stops at many places


def test_no_stop_strings_never_stop():
    tables = stops.no_stop_strings(len(PIECES))
    stopped_B, _ = stops.step(tables, jnp.zeros((3, 0), bool), jnp.array([4, 9, 1]))
    assert not stopped_B.any()


def test_cut_before_the_first_stop():
    assert stops.cut("one\n\ntwo END", ["END", "\n\n"]) == "one"
    assert stops.cut("no stop", ["END"]) == "no stop"


def test_a_string_is_one_stop():
    """stop="END" is the stop "END", not the stops "E", "N", "D", wherever stop strings are
    taken (the tables, the text shown, the JSONL answers)."""
    assert stops.texts_of("END") == ["END"] and stops.texts_of(None) == []
    assert stops.stop_strings(Pieces(), "END", len(PIECES)).texts == ("END",)
    tokens = [PIECES.index("E"), PIECES.index("a"), PIECES.index("END")]
    tables = stops.stop_strings(Pieces(), "END", len(PIECES))
    ends_BM = jnp.zeros((1, tables.completes.shape[1]), bool)
    stopped = []
    for v in tokens:
        stopped_B, ends_BM = stops.step(tables, ends_BM, jnp.array([v]))
        stopped.append(bool(stopped_B[0]))
    assert stopped == [False, False, True]


def test_bad_stop_strings():
    import pytest

    for bad, error, match in (([""], ValueError, "stop strings must not be empty"),
                              ("", ValueError, "stop strings must not be empty"),
                              ([3], TypeError, "stop must be a string or a list of strings"),
                              (7, TypeError, "stop must be a string or a list of strings")):
        with pytest.raises(error, match=match):
            stops.stop_strings(Pieces(), bad, len(PIECES))


def test_tables_of_another_vocabulary_are_refused():
    import pytest

    from jaxkv.core.config import Config

    tables = stops.stop_strings(Pieces(), ["END"], len(PIECES))
    config = Config.llama(vocab_size=97, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=8,
                          max_seq_len=16)
    with pytest.raises(ValueError, match=r"built for a vocabulary of 16 tokens; the model has 97"):
        stops.tables(config, tables)
