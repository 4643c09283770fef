"""Cached decoding (prefill + decode_step) equals the plain uncached forward."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.core.attention import causal_mask
from jaxkv.core.cache import store
from jaxkv.core.decoder import cached_pass
from tests.conftest import random_tokens

TOL = 1e-4


def decode_teacher_forced(params, tokens_BT, lengths_B, capacity=48):
    """Prefill each row's first lengths[b] tokens, then feed the rest one by one.

    Returns logits [B, T, V] at positions >= lengths[b]-1 (earlier entries are NaN).
    """
    B, T = tokens_BT.shape
    out = np.full((B, T, params.config.vocab_size), np.nan, np.float32)
    cache = jaxkv.init_cache(params, B, capacity)
    logits_BV, cache = jaxkv.prefill(params, cache, tokens_BT, lengths_B)
    step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
    pos_B = np.array(lengths_B)
    out[np.arange(B), pos_B - 1] = logits_BV
    while pos_B.min() < T:
        token_B = tokens_BT[np.arange(B), np.minimum(pos_B, T - 1)]
        logits_BV, cache = step(params, cache, token_B, jnp.asarray(pos_B))
        live = pos_B < T
        out[np.arange(B)[live], pos_B[live]] = np.asarray(logits_BV)[live]
        pos_B = pos_B + 1
    return out


def test_decode_loop_equals_forward(model):
    tokens_BT = random_tokens(0, (2, 20))
    ref_BTV = np.asarray(jaxkv.forward(model, tokens_BT))
    got_BTV = decode_teacher_forced(model, tokens_BT, jnp.array([7, 7]))
    np.testing.assert_allclose(got_BTV[:, 6:], ref_BTV[:, 6:], atol=TOL, rtol=0)


def test_ragged_batch_rows_match_rows_alone(model):
    """Rows with different prompt lengths decode together, each at its own position."""
    tokens_BT = np.asarray(random_tokens(1, (3, 20)))
    lengths_B = np.array([3, 11, 6])
    batched_BTV = decode_teacher_forced(model, tokens_BT, lengths_B)
    for b in range(3):
        alone_TV = decode_teacher_forced(model, tokens_BT[b:b + 1], lengths_B[b:b + 1])[0]
        ref_TV = np.asarray(jaxkv.forward(model, tokens_BT[b:b + 1]))[0]
        start = lengths_B[b] - 1
        np.testing.assert_allclose(batched_BTV[b, start:], alone_TV[start:], atol=1e-5, rtol=0)
        np.testing.assert_allclose(batched_BTV[b, start:], ref_TV[start:], atol=TOL, rtol=0)


def test_prefill_in_several_calls(llama):
    tokens_BT = random_tokens(2, (2, 12))
    ref_BV = jaxkv.forward(llama, tokens_BT)[:, -1]
    cache = jaxkv.init_cache(llama, 2, 32)
    _, cache = jaxkv.prefill(llama, cache, tokens_BT[:, :5])
    logits_BV, cache = jaxkv.prefill(llama, cache, tokens_BT[:, 5:], start=jnp.array([5, 5]))
    np.testing.assert_allclose(logits_BV, ref_BV, atol=TOL, rtol=0)


def test_decode_step_under_vmap(llama):
    """decode_step vmaps over a stack of independent caches."""
    tokens_XBT = random_tokens(3, (2, 2, 6))
    caches = [jaxkv.prefill(llama, jaxkv.init_cache(llama, 2, 16), t)[1] for t in tokens_XBT]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *caches)
    token_XB, pos_XB = jnp.array([[1, 2], [3, 4]]), jnp.full((2, 2), 6)
    logits_XBV, _ = jax.vmap(jaxkv.decode_step, in_axes=(None, 0, 0, 0))(
        llama, stacked, token_XB, pos_XB)
    for x in range(2):
        logits_BV, _ = jaxkv.decode_step(llama, caches[x], token_XB[x], pos_XB[x])
        np.testing.assert_allclose(logits_XBV[x], logits_BV, atol=1e-6, rtol=0)


def test_decode_step_under_lax_scan_gives_generates_tokens(llama):
    """decode_step driven by lax.scan (greedy) picks the tokens generate picks."""
    prompts_BT = random_tokens(5, (2, 6))
    expect_BT, _ = jaxkv.generate(llama, prompts_BT, 8)
    logits_BV, cache = jaxkv.prefill(llama, jaxkv.init_cache(llama, 2, 16), prompts_BT)

    def step(carry, _):
        logits_BV, cache, pos_B = carry
        token_B = jnp.argmax(logits_BV, -1).astype(jnp.int32)
        logits_BV, cache = jaxkv.decode_step(llama, cache, token_B, pos_B)
        return (logits_BV, cache, pos_B + 1), token_B

    _, tokens_TB = jax.jit(lambda c: jax.lax.scan(step, c, None, length=8))(
        (logits_BV, cache, jnp.full((2,), 6)))
    np.testing.assert_array_equal(tokens_TB.T, expect_BT)


def test_bfloat16_cache_stays_close(llama):
    tokens_BT = random_tokens(4, (1, 10))
    ref_BV = jaxkv.forward(llama, tokens_BT)[:, -1]
    cache = jaxkv.init_cache(llama, 1, 16, dtype=jnp.bfloat16)
    assert len(cache.k) == 3  # layers
    assert cache.k[0].dtype == jnp.bfloat16 and cache.k[0].shape == (1, 2, 16, 16)  # [B, K, S, H]
    logits_BV, _ = jaxkv.prefill(llama, cache, tokens_BT)
    np.testing.assert_allclose(logits_BV, ref_BV, atol=2e-2, rtol=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_bfloat16_params_decode_close_to_float32(llama, batch):
    """bf16 weights, activations and cache: batch-1 and batched products both run (XLA:CPU has
    no bf16 x bf16 -> f32 product: see layers.dense) and stay near the float32 logits."""
    tokens_BT = random_tokens(5, (batch, 8))
    ref_BV = jaxkv.forward(llama, tokens_BT)[:, -1]
    half = jaxkv.cast(llama, jnp.bfloat16)
    cache = jaxkv.init_cache(half, batch, 300)  # > one attention block
    _, cache = jaxkv.prefill(half, cache, tokens_BT[:, :7])
    logits_BV, _ = jax.jit(jaxkv.decode_step)(half, cache, tokens_BT[:, 7],
                                              jnp.full((batch,), 7))
    assert logits_BV.dtype == jnp.float32
    np.testing.assert_allclose(logits_BV, ref_BV, atol=5e-2, rtol=0)


def test_bfloat16_loop_converts_no_whole_table(llama):
    """A loop of bfloat16 steps reads only the embedding rows it needs. XLA:CPU computes a
    bfloat16 lookup in float32 and hoisted that conversion of the whole table out of the loop,
    once per call (Gemma 3 270M: 671 MB and 160 ms before the first token)."""
    half = jaxkv.cast(llama, jnp.bfloat16)

    def run(params, cache):
        def step(carry, _):
            cache, token_B = carry
            logits_BV, cache = jaxkv.decode_step(params, cache, token_B, jnp.array([3]))
            return (cache, logits_BV.argmax(-1).astype(jnp.int32)), None
        return jax.lax.scan(step, (cache, jnp.array([1], jnp.int32)), None, length=4)[0][1]

    hlo = jax.jit(run).lower(half, jaxkv.init_cache(half, 1, 8)).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    assert not re.findall(r"= \w+\[97,64\]\{1,0\} (?:fusion|convert|copy)\(", entry)


@pytest.mark.parametrize("bad, match", [
    (dict(tokens=np.zeros((1, 20), np.int32)), "the prompt is longer than the cache"),
    (dict(tokens=np.zeros((1, 0), np.int32)), "tokens is empty"),
    (dict(tokens=np.array([[1, 97]])), r"tokens\[0, 1\] = 97 is not a token id"),
    (dict(tokens=np.array([[1, -3]])), r"tokens\[0, 1\] = -3 is not a token id"),
    (dict(tokens=np.array([[1, 2]]), lengths=np.array([0])), "empty prompts"),
    (dict(tokens=np.array([1, 2])), "tokens must have 2 dimension"),
    (dict(tokens=np.array([[1.0, 2.0]])), "integer"),
])
def test_prefill_rejects_bad_input(llama, bad, match):
    cache = jaxkv.init_cache(llama, 1, 16)
    with pytest.raises((ValueError, TypeError), match=match):
        jaxkv.prefill(llama, cache, bad["tokens"], bad.get("lengths"))


@pytest.mark.parametrize("token, pos, match", [
    ([97], [0], "not a token id"),
    ([-1], [0], "not a token id"),
    ([1], [16], r"pos\[0\] = 16 is outside the cache"),
    ([1, 2], [0, 0], r"shape \(1,\)"),
])
def test_decode_step_rejects_bad_input(llama, token, pos, match):
    cache = jaxkv.init_cache(llama, 1, 16)
    with pytest.raises(ValueError, match=match):
        jaxkv.decode_step(llama, cache, np.array(token), np.array(pos))


@pytest.mark.parametrize("length", [300, 600])
def test_decode_step_over_attention_blocks_equals_forward(length):
    """Capacity 1600: at position 300 attention loops over 2 filled blocks of 256 slots; at 600
    (past a third of the capacity) it makes one pass over every slot. Both equal forward."""
    config = jaxkv.Config.llama(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                d_ff=96, max_seq_len=1600)
    params = jaxkv.init_params(config, jax.random.key(3))
    tokens_BT = random_tokens(6, (1, length + 1))
    ref_BV = jaxkv.forward(params, tokens_BT)[:, -1]
    cache = jaxkv.init_cache(params, 1, 1600)
    _, cache = jaxkv.prefill(params, cache, tokens_BT[:, :length])
    logits_BV, _ = jax.jit(jaxkv.decode_step)(params, cache, tokens_BT[:, length],
                                              jnp.array([length]))
    np.testing.assert_allclose(logits_BV, ref_BV, atol=TOL, rtol=0)


def test_a_pass_that_does_not_write_returns_what_a_writing_pass_stores(llama):
    cache = jaxkv.init_cache(llama, 2, 16)
    _, cache = jaxkv.prefill(llama, cache, [[1, 2, 3, 4], [5, 6, 7, 8]])
    tokens_BT, pos_BT = jnp.array([[9, 10], [11, 12]]), jnp.array([[4, 5], [4, 5]])
    mask_BTS = causal_mask(pos_BT, 16)
    x_written, written = cached_pass(llama, cache, tokens_BT, pos_BT, pos_BT, mask_BTS)
    x_read, kv = cached_pass(llama, cache, tokens_BT, pos_BT, pos_BT, mask_BTS, write=False)
    np.testing.assert_allclose(x_read, x_written, atol=1e-6)
    assert kv[0][0].shape == (2, llama.config.n_kv_heads, 2, llama.config.head_dim)
    for got, want in zip(jax.tree.leaves(store(cache, kv, pos_BT)), jax.tree.leaves(written)):
        np.testing.assert_allclose(got, want, atol=1e-6)
