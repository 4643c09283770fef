"""The cache's storage: 16-bit float layers held as their bits, stored in place; paged layers
(PagedKV: blocks of a pool through per-row tables) answering as unpaged ones."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.core.cache import readable, with_table, write
from jaxkv.ops.arrays import HalfKV, PagedKV
from tests.conftest import TINY, random_tokens


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_cache_holds_the_rounded_numbers(dtype):
    """A stored key reads back as the key rounded to dtype; other slots and rows stay."""
    new_BTKH = jax.random.normal(jax.random.key(0), (2, 1, 3, 8)) * 100
    empty = HalfKV(jnp.zeros((2, 3, 5, 8), jnp.uint16), jnp.dtype(dtype))
    layer = write(empty, new_BTKH, jnp.array([[4], [5]]))  # row 1's slot 5 is dropped
    assert layer.dtype == dtype and layer.shape == (2, 3, 5, 8)
    got_BKSH = np.asarray(layer.astype(jnp.float32))
    expect_KH = np.asarray(new_BTKH[0, 0].astype(dtype).astype(jnp.float32))
    np.testing.assert_array_equal(got_BKSH[0, :, 4], expect_KH)
    assert not got_BKSH[0, :, :4].any() and not got_BKSH[1].any()


def test_dropped_slots_touch_no_other_row():
    """Slots at or past S are dropped, not stored in the next row: row b's slot S + t flattened
    as b * S + slot is row b + 1's slot t. (Padded prompt tokens and rejected tree nodes go to
    such slots; XLA:GPU's deterministic scatter has mixed flattened indices up before.)"""
    B, K, S, H = 3, 2, 5, 4
    new_BTKH = jax.random.normal(jax.random.key(0), (B, 3, K, H))
    slot_BT = np.array([[S, S + 1, 4], [0, 1, S], [S + 2, 2, 3]])
    got_BKSH = jax.jit(write)(jnp.full((B, K, S, H), -1.0), new_BTKH, jnp.asarray(slot_BT))
    want_BKSH = np.full((B, K, S, H), -1.0, np.float32)
    for b, t in zip(*np.nonzero(slot_BT < S)):
        want_BKSH[b, :, slot_BT[b, t]] = new_BTKH[b, t]
    np.testing.assert_array_equal(got_BKSH, want_BKSH)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_cache_decodes_like_float32(llama, dtype):
    cache = jaxkv.init_cache(llama, 2, 24, dtype=dtype)
    assert isinstance(cache.k[0], HalfKV) and cache.dtype == dtype
    tokens_BT = random_tokens(1, (2, 9))
    ref_BV = jaxkv.forward(llama, tokens_BT)[:, -1]
    _, cache = jaxkv.prefill(llama, cache, tokens_BT[:, :8])
    logits_BV, _ = jaxkv.decode_step(llama, cache, tokens_BT[:, 8], jnp.full((2,), 8))
    np.testing.assert_allclose(logits_BV, ref_BV, atol=2e-2, rtol=0)


def test_bfloat16_step_stores_in_place(llama):
    """A bfloat16 step writes only its slots: no whole layer is converted or copied. XLA:CPU
    computed a store into bfloat16 arrays in float32 and then copied every layer."""
    half = jaxkv.cast(llama, jnp.bfloat16)
    cache = jaxkv.init_cache(half, 1, 40)
    step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
    hlo = step.lower(half, cache, jnp.array([3]), jnp.array([7])).compile().as_text()
    layer = r"\[1,2,40,16\]\{[\d,]+\}"  # one layer's keys or values
    assert not re.findall(rf"= \w+{layer} copy\(", hlo)  # a copy of a layer
    # a loop that makes a whole layer by converting one (reads convert into float32 alone)
    assert not re.findall(rf"ROOT %[\w.-]+ = (?:bf16|u16){layer} (?:bitcast-)?convert\(", hlo)


def decode_all(params, cache, tokens_BT, prompt_len):
    """Logits of a prefill of prompt_len tokens, then of every decode step after it."""
    logits_BV, cache = jaxkv.prefill(params, cache, tokens_BT[:, :prompt_len])
    out, step = [logits_BV], jax.jit(jaxkv.decode_step)
    for t in range(prompt_len, tokens_BT.shape[1]):
        logits_BV, cache = step(params, cache, tokens_BT[:, t], jnp.full((2,), t))
        out.append(logits_BV)
    return np.stack(out)


WINDOWED = jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=96, sliding_window=8,
                              window_layers=(0, 2), **TINY)


# Per block size: (capacity, blocks in the pool, the rows' tables: shuffled, some blocks no row
# owns, and of 16 slots a block of "none" past what row 0 writes).
TABLES = {8: (32, 11, [[7, 2, 10, 4], [0, 5, 1, 8]]), 16: (48, 6, [[4, 1, 6], [0, 5, 2]])}


@pytest.mark.parametrize("backend, name, dtype, block_size", [
    ("default", "llama", jnp.float32, 8), ("default", "llama", jnp.int8, 8),
    ("default", "windowed", jnp.float32, 8), ("xla", "llama", jnp.bfloat16, 8),
    ("default", "llama", jnp.float32, 16), ("default", "llama", jnp.bfloat16, 16),
    ("default", "llama", jnp.int8, 16)])
def test_paged_layers_answer_as_unpaged_ones(request, backend, name, dtype, block_size):
    """Blocks of 8 or 16 slots in a shuffled order, with blocks no row owns: every logit of a
    prefill and 10 decode steps equals the unpaged cache's; window layers keep their rings. On
    the CPU, blocks of 16 are read through the table by the attention kernel, 8 gathered."""
    if backend == "xla":
        request.getfixturevalue("xla_backend")
    params = (request.getfixturevalue("llama") if name == "llama"
              else jaxkv.init_params(WINDOWED, jax.random.key(5)))
    tokens_BT = np.asarray(random_tokens(3, (2, 22)))
    capacity, blocks, table = TABLES[block_size]
    paged = jaxkv.init_cache(params, 2, capacity, dtype, block_size=block_size, blocks=blocks)
    paged = with_table(paged, jnp.array(table, jnp.int32))
    assert [isinstance(x, PagedKV) for x in readable(paged)[0]] == [
        i not in params.config.window_layers for i in range(3)]
    want = decode_all(params, jaxkv.init_cache(params, 2, capacity, dtype), tokens_BT, 12)
    np.testing.assert_array_equal(decode_all(params, paged, tokens_BT, 12), want)


def test_rows_can_share_a_prompts_blocks(llama):
    """Row 1's table names row 0's first block, which holds the same 8 prompt tokens: row 1
    prefilled from position 8 on answers as if it had computed them itself."""
    tokens_BT = np.array(random_tokens(4, (2, 14)))
    tokens_BT[1, :8] = tokens_BT[0, :8]
    cache = jaxkv.init_cache(llama, 2, 16, block_size=8, blocks=3)
    assert (cache.table == 3).all()  # fewer blocks than rows x max_len: none given
    cache = with_table(cache, jnp.array([[0, 1], [3, 3]], jnp.int32))  # row 1: none yet
    _, cache = jaxkv.prefill(llama, cache, tokens_BT[:1, :8].repeat(2, 0), [8, 1])
    cache = with_table(cache, jnp.array([[0, 1], [0, 2]], jnp.int32))
    logits_BV, _ = jaxkv.prefill(llama, cache, tokens_BT[:, 8:], start=[8, 8])
    want_BV, _ = jaxkv.prefill(llama, jaxkv.init_cache(llama, 2, 16), tokens_BT)
    np.testing.assert_allclose(logits_BV, want_BV, atol=1e-5, rtol=0)


def test_bad_paging_is_named(llama):
    with pytest.raises(ValueError, match=r"max_len \(30\) must be a whole number of blocks of "
                                         r"block_size \(8\)"):
        jaxkv.init_cache(llama, 2, 30, block_size=8)
    with pytest.raises(ValueError, match="blocks needs block_size"):
        jaxkv.init_cache(llama, 2, 32, blocks=4)
    cache = with_table(jaxkv.init_cache(llama, 2, 32, block_size=8),
                       jnp.zeros((2, 4), jnp.float32))
    with pytest.raises(TypeError, match=r"cache.table must be int32"):
        jaxkv.decode_step(llama, cache, jnp.array([1, 2]), jnp.array([0, 0]))
