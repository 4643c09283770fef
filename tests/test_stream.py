"""stream: the answer's text in pieces as the compiled loop draws it, equal to generate's."""

import jax

import jaxkv
from jaxkv.decoding import stops
from tests.conftest import char_tokenizer


def test_pieces_join_to_generate_text(llama):
    tokenizer = char_tokenizer(llama.config.vocab_size)
    options = dict(temperature=0.7, key=jax.random.key(1))
    pieces = list(jaxkv.stream(llama, tokenizer, "Hello", 12, **options))
    tokens, _ = jaxkv.generate(llama, [tokenizer.encode("Hello").ids], 12, **options)
    whole = tokenizer.decode(tokens[0].tolist())
    assert "".join(pieces) == whole and len(pieces) > 3
    assert len(list(jaxkv.stream(llama, tokenizer, "Hello", 12, steps=4, **options))) <= 3


def test_stops_before_a_stop_string(llama):
    tokenizer = char_tokenizer(llama.config.vocab_size)
    whole = "".join(jaxkv.stream(llama, tokenizer, "Hello", 16))
    stop = whole[4:6]
    assert "".join(jaxkv.stream(llama, tokenizer, "Hello", 16, stop=[stop])) == stops.cut(
        whole, [stop])


def test_stops_at_an_end_id(llama):
    tokenizer = char_tokenizer(llama.config.vocab_size)
    whole = "".join(jaxkv.stream(llama, tokenizer, "Hello", 16))
    k = next(k for k in range(1, len(whole)) if whole[k] not in whole[:k])  # its first time
    end = tokenizer.token_to_id(whole[k])
    assert "".join(jaxkv.stream(llama, tokenizer, "Hello", 16, eos_id=end)) == whole[:k]
