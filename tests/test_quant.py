"""int8 weights: the round trip is bounded per row, quantized models decode exactly as their own
uncached forward, and the compiled step reads the int8 matrices (no float copy of them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import ops
from jaxkv.core.quant import quantize_matrix
from jaxkv.ops import xla
from jaxkv.ops.arrays import Int8, dequantize_rows
from hlo import float_copies  # scripts/ (tests/conftest.py puts it on the path)
from tests.conftest import CONFIGS, assert_decode_equals_forward, random_tokens


def test_round_trip_error_is_at_most_half_a_step_per_row():
    w_OI = jax.random.normal(jax.random.key(0), (48, 40)) * jnp.arange(1, 49)[:, None]
    w_OI = w_OI.at[5].set(0.0)  # an all-zero row stays zero (no division by zero)
    q = quantize_matrix(w_OI)
    assert q.q.dtype == jnp.int8 and q.scale.shape == (48, 1)
    err_OI = jnp.abs(dequantize_rows(q.q, q.scale) - w_OI)
    assert bool(jnp.all(err_OI <= q.scale / 2 + 1e-6))
    assert float(jnp.abs(dequantize_rows(q.q, q.scale)[5]).max()) == 0.0


def test_round_trip_error_is_at_most_half_a_step_per_block():
    w_OI = jax.random.normal(jax.random.key(0), (8, 96)) * jnp.arange(1, 97)  # blocks differ
    w_OI = w_OI.at[3, 32:64].set(0.0)  # an all-zero block stays zero
    q = quantize_matrix(w_OI, block=32)
    assert q.q.dtype == jnp.int8 and q.scale.shape == (8, 3)
    err_OBK = jnp.abs(dequantize_rows(q.q, q.scale) - w_OI).reshape(8, 3, 32)
    assert bool(jnp.all(err_OBK <= q.scale[..., None] / 2 + 1e-6))
    assert float(jnp.abs(dequantize_rows(q.q, q.scale)[3, 32:64]).max()) == 0.0
    per_row = quantize_matrix(w_OI)  # one scale for inputs of sizes 1 to 96: a coarser step
    assert float(jnp.abs(dequantize_rows(per_row.q, per_row.scale) - w_OI).mean()) > \
        float(err_OBK.mean())


def test_per_block_scales_dequantize_block_by_block():
    q_OI = jnp.arange(-32, 32, dtype=jnp.int8).reshape(1, 64)
    scale_OB = jnp.array([[0.5, 2.0]])
    w_OI = dequantize_rows(q_OI, scale_OB)
    np.testing.assert_allclose(w_OI[0, :32], np.arange(-32, 0) * 0.5)
    np.testing.assert_allclose(w_OI[0, 32:], np.arange(0, 32) * 2.0)


@pytest.fixture(params=[("llama_mqa", None), ("gpt2", None), ("llama_gqa", 32)],
                ids=["llama_mqa", "gpt2", "llama_gqa_block32"])
def quantized(request):
    """Per-row scales (MQA with a tied int8 head, GPT-2 with biases), and one scale per 32
    inputs (GQA; GGUF Q8_0's layout)."""
    name, block = request.param
    return jaxkv.quantize(jaxkv.init_params(CONFIGS[name], jax.random.key(1)), block=block)


def test_quantize_makes_every_decoder_matrix_int8(quantized):
    b = quantized.blocks[0]
    assert all(isinstance(w, Int8) for w in (quantized.embed, b.wqkv, b.wo, b.w_in, b.w_out))
    assert quantized.dtype == jnp.float32
    assert jaxkv.cast(quantized, jnp.bfloat16).blocks[0].wo.q.dtype == jnp.int8


@pytest.mark.parametrize("batch", [1, 3])
def test_int8_decode_equals_int8_forward(quantized, batch):
    """Batch 1 and 3 (one int8 loop per row); the 12-token prefill runs 16-row buckets."""
    assert_decode_equals_forward(quantized, random_tokens(2, (batch, 20)), 12, 24)


def test_int8_prefill_of_many_rows_equals_forward(quantized):
    """Over 16 rows a product is one product of x and the converted weights."""
    tokens_BT = random_tokens(3, (2, 40))
    cache = jaxkv.init_cache(quantized, 2, 48)
    logits_BV, _ = jaxkv.prefill(quantized, cache, tokens_BT)
    np.testing.assert_allclose(logits_BV, jaxkv.forward(quantized, tokens_BT)[:, -1], atol=1e-5)


@pytest.mark.parametrize("block", [None, 8])
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_products_off_the_cpu_equal_the_float_product(monkeypatch, block, rows):
    """On a GPU or TPU (here: the platform reported as "gpu", so the XLA backend) every row
    count takes xla.int8_product, which equals x @ w.T of the dequantized weights (with blocks
    of 8 inputs: by partial sums per block for 1 and 5 rows, dequantized for 9)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert ops.backend_name() == "pallas" and ops.backend().matmul is xla.matmul
    w = quantize_matrix(jax.random.normal(jax.random.key(0), (24, 32)), block)
    x_BTI = jax.random.normal(jax.random.key(1), (1, rows, 32))
    want_BTO = x_BTI @ dequantize_rows(w.q, w.scale).T
    np.testing.assert_allclose(ops.matmul(x_BTI, w), want_BTO, rtol=1e-5, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(ops.matmul)(x_BTI, w))
    assert "cond" not in jaxpr and "while" not in jaxpr and "jaxkv" not in jaxpr


@pytest.mark.parametrize("batch", [1, 4])
def test_compiled_decode_loop_reads_int8(quantized, batch):
    """A lax.scan of 4 greedy decode steps: the weights enter as int8, and no float copy of
    any of them is made, in a step or hoisted before the loop."""
    if jax.default_backend() != "cpu":  # CI runs it on the CPU
        pytest.skip("XLA:GPU computes products of these tiny matrices as stored elementwise "
                    "products x * w and a reduction; scripts/check_int8_hlo.py checks real "
                    "shapes there")
    cache = jaxkv.init_cache(quantized, batch, 16)

    def loop(params, cache):
        def step(carry, t):
            cache, token_B = carry
            logits_BV, cache = jaxkv.decode_step(params, cache, token_B, jnp.full(batch, t))
            return (cache, jnp.argmax(logits_BV, -1).astype(jnp.int32)), None
        return jax.lax.scan(step, (cache, jnp.zeros(batch, jnp.int32)), jnp.arange(4))

    hlo = jax.jit(loop).lower(quantized, cache).compile().as_text()
    assert "s8[" in hlo
    assert float_copies(quantized, hlo) == []


def test_quantize_names_the_kinds_it_knows():
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(1))
    with pytest.raises(ValueError, match="kind must be 'int8', got 'int4'"):
        jaxkv.quantize(params, "int4")
    with pytest.raises(ValueError, match="block must be a positive int or None, got 0"):
        jaxkv.quantize(params, block=0)
    with pytest.raises(ValueError, match=r"block must divide .* got block 48 for a matrix of "
                                         r"shape \(\d+, 64\)"):
        jaxkv.quantize(params, block=48)


def test_quantize_says_what_it_takes():
    with pytest.raises(TypeError, match=r"quantize: params must be jaxkv Params \(jaxkv.load, "
                                        r"jaxkv.init_params\), got dict"):
        jaxkv.quantize({"embed": np.ones((4, 4), np.float32)})


def test_float_copies_sees_stored_copies_and_not_fused_values():
    """The check itself: stored [O, NB, 32] and [I, O] float arrays of an int8 matrix are
    found, in the computation that stores them; a fusion's own values are not."""
    w = quantize_matrix(jnp.ones((8, 64)), block=32)
    hlo = ("%fused_convert (p: s8[8,64]) -> f32[8,64] {\n  %c = f32[8,64]{1,0} convert(%p)\n}\n\n"
           "%body (s: s8[8,64]) -> f32[8] {\n  %t = bf16[64,8]{1,0} transpose(%w)\n"
           "  %f = f32[8]{0} fusion(%s), kind=kLoop, calls=%fused_convert\n}\n\n"
           "ENTRY %main {\n  %x = f32[8,2,32]{2,1,0} convert(%q)\n}")
    assert float_copies(w, hlo) == [((8, 64), "%body"), ((8, 64), "%main")]


def test_float_copies_sees_the_copy_xla_cpu_makes_for_a_converted_product():
    """The check against a real program: XLA:CPU converts w to float32 before the product of
    the XLA backend's int8 product (the reason the CPU backend keeps its own loops and
    kernels)."""
    if jax.default_backend() != "cpu":  # CI runs it on the CPU
        pytest.skip("a check of what XLA:CPU makes; XLA:GPU converts inside its product")
    w = quantize_matrix(jax.random.normal(jax.random.key(0), (24, 16)))
    hlo = jax.jit(xla.int8_product).lower(jnp.ones((40, 16)), w).compile().as_text()
    assert [shape for shape, _ in float_copies(w, hlo)] == [(24, 16)]
