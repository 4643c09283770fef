"""stream: the answer's text in pieces as the compiled loop draws it, equal to generate's."""

import threading
import time

import jax

import jaxkv
from jaxkv import stops
from tests.conftest import char_tokenizer


def test_pieces_join_to_generate_text(llama):
    tokenizer = char_tokenizer(llama.config.vocab_size)
    options = dict(temperature=0.7, key=jax.random.key(1))
    pieces = list(jaxkv.stream(llama, tokenizer, "Hello", 12, **options))
    tokens, _ = jaxkv.generate(llama, [tokenizer.encode("Hello").ids], 12, **options)
    whole = tokenizer.decode(tokens[0].tolist())
    assert "".join(pieces) == whole and len(pieces) > 3


def test_stops_before_a_stop_string(llama):
    tokenizer = char_tokenizer(llama.config.vocab_size)
    whole = "".join(jaxkv.stream(llama, tokenizer, "Hello", 16))
    stop = whole[4:6]
    assert "".join(jaxkv.stream(llama, tokenizer, "Hello", 16, stop=[stop])) == stops.cut(
        whole, [stop])


def test_leaving_early_ends_the_generation(llama):
    tokenizer = char_tokenizer(llama.config.vocab_size)
    before = threading.active_count()
    for _ in jaxkv.stream(llama, tokenizer, "Hello", 100):
        break
    deadline = time.time() + 30
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.1)
    assert threading.active_count() == before
