"""The cache's storage: 16-bit float layers held as their bits, stored in place."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.core.cache import write
from jaxkv.ops.arrays import HalfKV
from tests.conftest import random_tokens


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
