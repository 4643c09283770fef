"""Chunked prefill: the prompt run in passes of `chunk` tokens equals the one-pass forward,
its memory grows with the chunk, not with the prompt, and no pass runs past the longest row."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.core import decoder
from jaxkv.ops import cpu as cpu_ops
from jaxkv.ops.cpu import kernels
from jaxkv.ops.xla import PREFILL_CHUNK as CHUNK
from tests.conftest import random_tokens

TOL = 1e-4
CONFIG = dict(vocab_size=97, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96,
              max_seq_len=8192)
MODELS = {
    "gqa": jaxkv.Config.llama(**CONFIG),
    # Layers 0 and 2 keep rings of 40 slots: chunks above 40 are cut to the ring.
    "window": jaxkv.Config.llama(sliding_window=40, window_layers=(0, 2), **CONFIG),
}


def prefill_in_chunks(params, cache, tokens_BT, lengths_B, start_B, chunk):
    fn = jax.jit(functools.partial(decoder.prefill_padded, chunk=chunk))
    return fn(params, cache, tokens_BT, jnp.asarray(lengths_B), jnp.asarray(start_B))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("chunk", [24, 512])
def test_chunked_prefill_equals_forward(name, chunk):
    """Ragged rows whose prompts start at different positions (3, 10, 1: the first part
    prefilled in one pass), then 90 more tokens in chunks (24: four passes, the last
    one short, and under the window's ring of 40; 512: one pass), then a decode step:
    logits at each row's last token and after the step == forward (max |diff| ~1e-6)."""
    params = jaxkv.init_params(MODELS[name], jax.random.key(4))
    tokens_BT = random_tokens(7, (3, 101))
    start_B, lengths_B = np.array([3, 10, 1]), np.array([90, 57, 71])
    cache = jaxkv.init_cache(params, 3, 128)
    _, cache = jaxkv.prefill(params, cache, tokens_BT[:, :10], start_B)
    rest_BT = jnp.stack([tokens_BT[b, s: s + 90] for b, s in enumerate(start_B)])
    logits_BV, cache = prefill_in_chunks(params, cache, rest_BT, lengths_B, start_B, chunk)
    end_B = start_B + lengths_B  # each row's next position
    ref_BTV = jaxkv.forward(params, tokens_BT)
    rows_B = np.arange(3)
    np.testing.assert_allclose(logits_BV, ref_BTV[rows_B, end_B - 1], atol=TOL, rtol=0)
    step_BV, _ = jaxkv.decode_step(params, cache, tokens_BT[rows_B, end_B], end_B)
    np.testing.assert_allclose(step_BV, ref_BTV[rows_B, end_B], atol=TOL, rtol=0)


def test_chunked_prefill_writes_the_one_pass_cache():
    """Every filled slot holds the same keys and values whichever the chunk (to 1e-5)."""
    params = jaxkv.init_params(MODELS["gqa"], jax.random.key(5))
    tokens_BT = random_tokens(8, (2, 64))
    lengths_B, start_B = np.array([64, 37]), np.array([0, 0])
    empty = jaxkv.init_cache(params, 2, 80)
    _, one = prefill_in_chunks(params, empty, tokens_BT, lengths_B, start_B, 64)
    _, chunked = prefill_in_chunks(params, empty, tokens_BT, lengths_B, start_B, 16)
    for k_one, k_chunked in zip(one.k + one.v, chunked.k + chunked.v):
        for b, n in enumerate(lengths_B):
            np.testing.assert_allclose(k_chunked[b, :, :n], k_one[b, :, :n], atol=1e-5, rtol=0)


def test_chunks_past_the_longest_prompt_are_not_run(monkeypatch):
    """Rows of 30 and 9 tokens in a 64-token bucket, chunks of 16: two passes run, not four
    (the loop stops at the longest row), and the logits still equal forward's."""
    passes = []
    real_pass = decoder.cached_pass

    def counted_pass(*args, **kwargs):
        jax.debug.callback(lambda: passes.append(1))
        return real_pass(*args, **kwargs)

    monkeypatch.setattr(decoder, "cached_pass", counted_pass)
    params = jaxkv.init_params(MODELS["gqa"], jax.random.key(9))
    tokens_BT = random_tokens(10, (2, 64))
    lengths_B = np.array([30, 9])
    cache = jaxkv.init_cache(params, 2, 64)
    logits_BV, _ = prefill_in_chunks(params, cache, tokens_BT, lengths_B, [0, 0], 16)
    jax.block_until_ready(logits_BV)
    assert len(passes) == 2
    ref_BTV = jaxkv.forward(params, tokens_BT)
    np.testing.assert_allclose(logits_BV, ref_BTV[np.arange(2), lengths_B - 1], atol=TOL, rtol=0)


def test_one_row_on_the_cpu_takes_the_kernels_chunk():
    """Batch 1 up to ROW_CHUNK_UP_TO tokens (ROW_CHUNK_UP_TO_BLOCKS on AVX2), float32 or int8
    weights: ROW_CHUNK tokens a pass (the CPU kernels take them); longer prompts, larger batches, bfloat16 weights and int8
    blocks the kernel does not take (8 inputs): CHUNK. A 200-token prompt (four passes of 64 in
    the 256 bucket) still equals forward."""
    params = jaxkv.init_params(MODELS["gqa"], jax.random.key(11))
    kernel_chunk = cpu_ops.ROW_CHUNK if kernels.enabled() else CHUNK
    chunk = lambda p, rows, tokens: cpu_ops.prefill_chunk(p.blocks[0].wqkv, rows, tokens)  # noqa
    assert chunk(params, 1, 256) == kernel_chunk
    assert chunk(jaxkv.quantize(params), 1, 256) == kernel_chunk
    assert chunk(jaxkv.quantize(params, block=8), 1, 256) == CHUNK
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert chunk(half, 1, 256) == CHUNK
    assert chunk(params, 1, 4096) == CHUNK
    one_block = kernels.outer_block_rows() >= cpu_ops.ROW_CHUNK  # AVX-512; AVX2 takes blocks
    assert chunk(params, 1, 2048) == (kernel_chunk if one_block else CHUNK)
    assert chunk(params, 1, 1024) == kernel_chunk
    assert chunk(params, 4, 256) == CHUNK
    tokens_BT = random_tokens(12, (1, 200))
    logits_BV, _ = jaxkv.prefill(params, jaxkv.init_cache(params, 1, 256), tokens_BT)
    np.testing.assert_allclose(logits_BV[0], jaxkv.forward(params, tokens_BT)[0, -1], atol=TOL,
                               rtol=0)


def prefill_temp_bytes(params, length, chunk):
    """XLA's temporary bytes for prefill of one `length`-token prompt into `length` slots."""
    cache = jax.eval_shape(lambda: jaxkv.init_cache(params, 1, length))
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    one = jax.ShapeDtypeStruct((1,), jnp.int32)
    compiled = jax.jit(decoder.prefill_padded, static_argnames="chunk").lower(
        params, cache, tokens, one, one, chunk=chunk).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_prefill_memory_grows_with_chunk_not_prompt():
    """8192 tokens in chunks of 256: XLA's temporaries stay below one head's [T, T] float32
    score tensor (256 MiB) and grow at most linearly from 2048 tokens (the cache-wide masks
    [chunk, S]), where a full score tensor would grow 16x."""
    params = jaxkv.init_params(MODELS["gqa"], jax.random.key(6))
    short, long = (prefill_temp_bytes(params, n, 256) for n in (2048, 8192))
    assert long < 8192 * 8192 * 4
    assert long < 4 * short, (short, long)
