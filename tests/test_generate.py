"""generate: one compiled scan that equals a Python loop of decode_step; compiled once;
batch-invariant sampling; clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.decoding.sampling import row_keys, sample, sampling_params
from tests.conftest import char_tokenizer

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2], [11], [3, 3, 60, 12, 40]]


def python_loop(params, prompt, n, sampling=None, key=None):
    """The same generation driven by a Python loop of jitted decode_step calls."""
    sampling = sampling or sampling_params(1)
    keys_B = row_keys(key, 1)
    V = params.config.vocab_size
    cache = jaxkv.init_cache(params, 1, 64)
    logits_BV, cache = jaxkv.prefill(params, cache, np.array([prompt]))
    seen_BV = jnp.zeros((1, V), bool).at[0, jnp.array(prompt)].set(True)
    step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
    out = []
    for t in range(n):
        token_B = jax.jit(sample)(logits_BV, sampling, keys_B, t, seen_BV)
        out.append(int(token_B[0]))
        seen_BV = seen_BV.at[0, token_B[0]].set(True)
        logits_BV, cache = step(params, cache, token_B, jnp.array([len(prompt) + t]))
    return out


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_scan_equals_python_loop(which, request):
    params = request.getfixturevalue(which)
    tokens, lengths = jaxkv.generate(params, PROMPTS, 12)
    assert tokens.shape == (4, 12) and lengths.tolist() == [12] * 4
    for b, prompt in enumerate(PROMPTS):
        assert tokens[b].tolist() == python_loop(params, prompt, 12)


def test_sampled_scan_equals_python_loop(llama):
    key = jax.random.key(7)
    options = dict(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.3)
    tokens, _ = jaxkv.generate(llama, [PROMPTS[1]], 10, key=key, **options)
    expected = python_loop(llama, PROMPTS[1], 10, sampling_params(1, **options), key)
    assert tokens[0].tolist() == expected


def test_eos_stops_a_row_and_pads(llama):
    tokens, _ = jaxkv.generate(llama, PROMPTS, 12)
    eos = int(tokens[1, 3])  # make row 1's fourth token the EOS
    first = {b: next((i for i, t in enumerate(tokens[b].tolist()) if t == eos), None)
             for b in range(4)}
    out, lengths = jaxkv.generate(llama, PROMPTS, 12, eos_id=eos, pad_id=0)
    for b in range(4):
        stop = first[b]
        if stop is None:
            assert lengths[b] == 12 and out[b].tolist() == tokens[b].tolist()
        else:
            assert lengths[b] == stop + 1
            assert out[b, : stop + 1].tolist() == tokens[b, : stop + 1].tolist()
            assert (out[b, stop + 1:] == 0).all()


def test_compiled_once(llama):
    """One trace across steps, sampling-parameter values, keys and prompt lengths in a bucket."""
    jax.clear_caches()  # (an earlier test may have compiled the same signatures)
    jaxkv.trace_counts.clear()
    settings = [dict(), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
                dict(temperature=0.5, min_p=0.1, repetition_penalty=1.2),
                dict(temperature=[0.0, 0.9], top_k=[0, 3], eos_id=4)]
    for i, options in enumerate(settings):
        length = 3 + 3 * i  # 3 .. 15: all in the 16-token bucket
        prompts = [list(range(1, length + 1)), [9] * (length // 2 + 1)]
        eos = options.pop("eos_id", 5)
        jaxkv.generate(llama, prompts, 8, key=jax.random.key(i), eos_id=eos, **options)
    assert dict(jaxkv.trace_counts) == {"generate": 1, "prefill": 1, "decode_step": 1}


def test_budgets_in_one_block_share_a_program(llama):
    """max_new_tokens 1 .. 16 compile one program (the cache's capacity rounds up to the same
    16 slots); each answer is the longest one's first tokens, [B, max_new_tokens]; 17 is a new
    block."""
    jax.clear_caches()
    jaxkv.trace_counts.clear()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    longest, lengths = jaxkv.generate(llama, prompts, 16)
    for n in (1, 5, 11):
        tokens, lengths_n = jaxkv.generate(llama, prompts, n)
        assert tokens.shape == (2, n)
        np.testing.assert_array_equal(tokens, longest[:, :n])
        np.testing.assert_array_equal(lengths_n, np.minimum(lengths, n))
    assert jaxkv.trace_counts["generate"] == 1
    assert jaxkv.generate(llama, prompts, 17)[0].shape == (2, 17)
    assert jaxkv.trace_counts["generate"] == 2


def test_jitted_decode_step_and_prefill_trace_once(llama):
    jax.clear_caches()  # (an earlier test may have compiled the same signatures)
    jaxkv.trace_counts.clear()
    step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
    for length in (4, 9, 13):  # one bucket
        cache = jaxkv.init_cache(llama, 1, 32)
        _, cache = jaxkv.prefill(llama, cache, np.arange(1, length + 1)[None])
        for pos in range(length, length + 3):
            _, cache = step(llama, cache, jnp.array([2]), jnp.array([pos]))
    assert jaxkv.trace_counts["decode_step"] == 1
    assert jaxkv.trace_counts["prefill"] == 1


def test_row_is_batch_invariant(llama):
    """A sampled row gives the same tokens alone and inside a batch of 4 different prompts."""
    key = jax.random.key(42)
    batch, _ = jaxkv.generate(llama, PROMPTS, 16, temperature=0.8, key=key)
    alone, _ = jaxkv.generate(llama, PROMPTS[:1], 16, temperature=0.8, key=key)
    assert batch[0].tolist() == alone[0].tolist()
    # Any row can be reproduced alone by passing its own key.
    keys = jax.random.split(key, 4)
    batch, _ = jaxkv.generate(llama, PROMPTS, 16, temperature=0.8, key=keys)
    for b in range(4):
        alone, _ = jaxkv.generate(llama, [PROMPTS[b]], 16, temperature=0.8, key=keys[b:b + 1])
        assert batch[b].tolist() == alone[0].tolist()


def test_generate_is_bitwise_reproducible(llama):
    """Two runs, each compiled afresh, give the same tokens (greedy and sampled) and the same
    logits bit for bit: what a GPU's reductions and scatters could break (issue 49)."""
    def run():
        jax.clear_caches()
        greedy, _ = jaxkv.generate(llama, PROMPTS, 12)
        sampled, _ = jaxkv.generate(llama, PROMPTS, 12, temperature=1.0, key=jax.random.key(3))
        cache = jaxkv.init_cache(llama, 4, 32)
        tokens_BT = np.array([p + [0] * (7 - len(p)) for p in PROMPTS])
        logits_BV, cache = jaxkv.prefill(llama, cache, tokens_BT, [len(p) for p in PROMPTS])
        step_BV, _ = jaxkv.decode_step(llama, cache, greedy[:, 0], jnp.array([3, 7, 1, 5]))
        return [np.asarray(x) for x in (greedy, sampled, logits_BV, step_BV)]

    for first, second in zip(run(), run()):
        assert first.tobytes() == second.tobytes()


def test_array_prompts_with_lengths(llama):
    tokens_BT = np.zeros((2, 7), np.int32)
    tokens_BT[0, :3], tokens_BT[1] = PROMPTS[0], PROMPTS[1]
    from_array, _ = jaxkv.generate(llama, tokens_BT, 6, lengths=[3, 7])
    from_lists, _ = jaxkv.generate(llama, PROMPTS[:2], 6)
    assert from_array.tolist() == from_lists.tolist()


@pytest.mark.parametrize("prompts, options, match", [
    ([[]], {}, r"prompts\[0\] is empty"),
    ([[1, 2], []], {}, r"prompts\[1\] is empty"),
    ([], {}, "prompts is empty"),
    ([[1, -1]], {}, r"prompts\[0\]\[1\] = -1 is not a token id"),
    ([[1, 97]], {}, r"prompts\[0\]\[1\] = 97 is not a token id"),
    ([[1, 2, 3, 4, 5]], dict(max_len=8), r"5 \+ 6 = 11 positions, over the cache capacity"),
    ([[1]], dict(temperature=-1.0), "temperature must be finite and >= 0"),
    ([[1]], dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ([[1]], dict(top_k=2.5), "top_k must be an int"),
    ([[1]], dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    ([[1]], dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    ([[1], [2]], dict(temperature=[0.1, 0.2, 0.3]),
     r"temperature must be a scalar or have shape \(2,\)"),
    ([[1]], dict(key=jax.random.split(jax.random.key(0), 3)), "key must be one key or 1 keys"),
])
def test_generate_rejects_bad_input(llama, prompts, options, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.generate(llama, prompts, 6, **options)


def test_generate_beyond_learned_positions_is_an_error(gpt2):
    with pytest.raises(ValueError, match=r"100 \+ 40 = 140 positions, more than the model's "
                                         r"max_seq_len \(128\)"):
        jaxkv.generate(gpt2, [[1] * 100], 40)


def test_max_new_tokens_must_be_positive(llama):
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        jaxkv.generate(llama, [[1]], 0)


def test_stop_strings_end_rows_where_their_text_first_holds_one(llama):
    """A stop string of two characters (two tokens of a character tokenizer): each row's
    length ends at the token completing its first occurrence, later tokens are pad_id."""
    tokenizer = char_tokenizer(llama.config.vocab_size)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    plain, _ = jaxkv.generate(llama, prompts, 16)
    text = tokenizer.decode(plain[0].tolist())
    stop = text[6:8]
    tokens, lengths = jaxkv.generate(llama, prompts, 16, stop=[stop], tokenizer=tokenizer,
                                     pad_id=0)
    for row, whole, n in zip(tokens.tolist(), plain.tolist(), lengths.tolist()):
        ends = [t for t in range(16) if stop in tokenizer.decode(whole[: t + 1])]
        assert n == (ends[0] + 1 if ends else 16)
        assert row[:n] == whole[:n] and row[n:] == [0] * (16 - n)
    assert lengths[0] <= 8
