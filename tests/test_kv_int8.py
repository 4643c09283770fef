"""int8 KV cache: keys and values stored as int8 with one float32 scale per token and kv head.

The reference is the uncached forward with every attention's keys and values quantized and
dequantized the same way (a fake-quantized forward): the int8 cache must give its logits to
float tolerance, whatever path filled the cache (decode steps, chunked prefill, ragged rows,
rings, forests, cross-attention). Next to the float32 cache's logits it is only close.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.core import blocks, decoder, encoder
from jaxkv.decoding import multidecode
from jaxkv.ops.arrays import Int8KV, dequantize_kv, quantize_kv
from tests.conftest import CONFIGS, ENCDEC_CONFIGS, encoder_inputs, random_tokens

# int8 cache vs the fake-quantized forward: float order (measured <= 3.1e-7), except where
# float order puts a key on the other side of an int8 rounding boundary: one step of its
# scale (3.3e-5 seen for GPT-2 once the forward's products moved to the CPU kernels).
EXACT = 1e-4
CLOSE = 1e-2  # int8 vs float32 cache, logits of size ~1 (measured <= 1.8e-3, tiny models)


def round_trip(x_XH):
    return dequantize_kv(quantize_kv(x_XH)).astype(x_XH.dtype)


@contextlib.contextmanager
def fake_quantized(params, enc_inputs=None):
    """Within it, forward's attention reads keys and values through the int8 round trip (the
    encoder's own self-attention excepted: its cross K/V are computed first, then round-tripped
    where the decoder reads them, as init_cache stores them)."""
    attend = blocks.attend
    cross = None if enc_inputs is None else encoder.cross_cache(params, enc_inputs, None,
                                                                enc_inputs.shape[0])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks, "attend", lambda q, k, v, *args, **kwargs: attend(
            q, round_trip(k), round_trip(v), *args, **kwargs))
        if cross is not None:
            mp.setattr(encoder, "cross_cache", lambda *args: cross)
        jax.clear_caches()  # forward's computation is jitted: traced anew under the patch
        try:
            yield
        finally:
            jax.clear_caches()  # and again without it


def reference(params, tokens_BT, enc_inputs=None):
    with fake_quantized(params, enc_inputs):
        return np.asarray(jaxkv.forward(params, tokens_BT, encoder_inputs=enc_inputs))


def decode_all(params, tokens_BT, prefill_len, capacity, dtype, enc_inputs=None):
    """Logits [B, T - prefill_len + 1, V] at positions prefill_len - 1 .. T - 1: a prefill,
    then decode steps."""
    B, T = tokens_BT.shape
    cache = jaxkv.init_cache(params, B, capacity, dtype, encoder_inputs=enc_inputs)
    logits_BV, cache = jaxkv.prefill(params, cache, tokens_BT[:, :prefill_len])
    out = [logits_BV]
    step = jax.jit(jaxkv.decode_step)
    for t in range(prefill_len, T):
        logits_BV, cache = step(params, cache, tokens_BT[:, t], jnp.full((B,), t))
        out.append(logits_BV)
    return np.stack(out, 1)


def assert_int8_decode(params, tokens_BT, prefill_len, capacity, enc_inputs=None):
    """int8 decode == fake-quantized forward (EXACT), and close to the float32 cache (CLOSE)."""
    ref_BTV = reference(params, tokens_BT, enc_inputs)[:, prefill_len - 1:]
    int8_BTV = decode_all(params, tokens_BT, prefill_len, capacity, jnp.int8, enc_inputs)
    fp32_BTV = decode_all(params, tokens_BT, prefill_len, capacity, jnp.float32, enc_inputs)
    np.testing.assert_allclose(int8_BTV, ref_BTV, atol=EXACT, rtol=0)
    np.testing.assert_allclose(int8_BTV, fp32_BTV, atol=CLOSE, rtol=0)
    assert np.abs(int8_BTV - fp32_BTV).max() > 10 * np.abs(int8_BTV - ref_BTV).max()


def test_round_trip_error_is_at_most_half_a_scale():
    x_BKSH = jax.random.normal(jax.random.key(0), (2, 3, 5, 64)) * jnp.array([1e-3, 1, 300])[
        None, :, None, None]
    x_BKSH = x_BKSH.at[0, 0, 0].set(0.0)  # an all-zero vector: scale 0, read back as 0
    x = quantize_kv(x_BKSH)
    assert (x.q.dtype, x.scale.dtype, x.scale.shape) == (jnp.int8, jnp.float32, (2, 3, 5))
    np.testing.assert_allclose(x.scale, np.abs(x_BKSH).max(-1) / 127, rtol=1e-6)
    assert np.abs(np.asarray(x.q, np.int32)).max(-1).min() == 127 or x.scale.min() == 0
    error_BKSH = np.abs(dequantize_kv(x) - x_BKSH)
    bound_BKSH = x.scale[..., None] / 2 + np.finfo(np.float32).eps * np.abs(x_BKSH)
    assert (error_BKSH <= bound_BKSH).all()
    assert (dequantize_kv(x)[0, 0, 0] == 0).all()


@pytest.mark.parametrize("name", ["gpt2", "llama_mqa"])
def test_decode_equals_fake_quantized_forward(name):
    params = jaxkv.init_params(CONFIGS[name], jax.random.key(0))
    assert_int8_decode(params, random_tokens(1, (2, 20)), 6, 32)


def test_one_pass_reads_its_own_tokens_quantized():
    """extend of a whole sequence into an empty int8 cache: every position's logits equal the
    fake-quantized forward (the call's own keys are read as the cache stores them), as
    scripts/bench_quality.py assumes for its int8-KV perplexity."""
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(1))
    tokens_BT = random_tokens(4, (2, 16))
    pos_BT = jnp.broadcast_to(jnp.arange(16), (2, 16))
    x_BTD, _ = jaxkv.extend(params, jaxkv.init_cache(params, 2, 16, jnp.int8), tokens_BT,
                            pos_BT, pos_BT, pos_BT[:, :, None] >= jnp.arange(16))
    np.testing.assert_allclose(decoder.logits(params, x_BTD), reference(params, tokens_BT),
                               atol=EXACT, rtol=0)


def test_ragged_rows():
    """Rows prefilled to different lengths, then decoded each at its own position."""
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(1))
    tokens_BT = random_tokens(2, (2, 24))
    lengths_B = np.array([4, 11])
    ref_BTV = reference(params, tokens_BT)
    cache = jaxkv.init_cache(params, 2, 32, jnp.int8)
    logits_BV, cache = jaxkv.prefill(params, cache, tokens_BT[:, :11], lengths_B)
    rows_B = np.arange(2)
    np.testing.assert_allclose(logits_BV, ref_BTV[rows_B, lengths_B - 1], atol=EXACT, rtol=0)
    for i in range(10):
        pos_B = lengths_B + i
        logits_BV, cache = jaxkv.decode_step(params, cache, tokens_BT[rows_B, pos_B], pos_B)
        np.testing.assert_allclose(logits_BV, ref_BTV[rows_B, pos_B], atol=EXACT, rtol=0)


def test_chunked_prefill_equals_decode():
    """A prompt prefilled in chunks of 8 (each chunk reads the ones before from the int8 cache,
    itself quantized the same way) == the fake-quantized forward at its last token, and the
    cache it leaves == the one decode steps leave."""
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(1))
    tokens_BT = random_tokens(3, (1, 29))
    cache = jaxkv.init_cache(params, 1, 32, jnp.int8)
    logits_BV, chunked = jax.jit(decoder.prefill_padded, static_argnames="chunk")(
        params, cache, tokens_BT, jnp.array([29]), jnp.array([0]), chunk=8)
    np.testing.assert_allclose(logits_BV, reference(params, tokens_BT)[:, -1], atol=EXACT,
                               rtol=0)
    _, stepped = jaxkv.prefill(params, cache, tokens_BT[:, :1])
    for t in range(1, 29):
        _, stepped = jaxkv.decode_step(params, stepped, tokens_BT[:, t], jnp.array([t]))
    for a, b in zip(chunked.k + chunked.v, stepped.k + stepped.v):
        assert isinstance(a, Int8KV)
        np.testing.assert_allclose(dequantize_kv(a), dequantize_kv(b), atol=1e-4, rtol=0)


def test_sliding_window_ring():
    config = jaxkv.Config.llama(vocab_size=97, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                                d_ff=96, max_seq_len=128, sliding_window=8, window_layers=(0, 2))
    params = jaxkv.init_params(config, jax.random.key(0))
    assert [k.shape[2] for k in jaxkv.init_cache(params, 2, 64, jnp.int8).k] == [8, 64, 8]
    assert_int8_decode(params, random_tokens(1, (2, 30)), 12, 64)  # 12 > the window


@pytest.mark.parametrize("name", ["t5_relu", "whisper"])
def test_encoder_decoder_cross_kv_quantized(name):
    params = jaxkv.init_params(ENCDEC_CONFIGS[name], jax.random.key(3))
    enc = encoder_inputs(params.config, 5, 2)
    cache = jaxkv.init_cache(params, 2, 16, jnp.int8, encoder_inputs=enc)
    assert all(isinstance(x, Int8KV) for x in cache.cross_k + cache.cross_v)
    assert_int8_decode(params, random_tokens(6, (2, 12)), 3, 16, enc)


def test_forest_over_an_int8_prefix():
    """forest_logits over an int8 prefix == each root-to-node path fake-quantized alone; the
    accepted path continues by decode_step as the path would."""
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(1))
    prompt = random_tokens(7, (9,)).tolist()
    tokens, parents = np.array([5, 8, 13, 21, 34]), np.array([-1, 0, 0, 2, -1])
    prefix = multidecode.make_prefix(params, prompt, kv_dtype=jnp.int8)
    assert prefix.cache.dtype == jnp.int8
    logits_NV, node_cache, forests = multidecode.forest_pass(params, [tokens], [parents], prefix)
    assert node_cache.dtype == jnp.int8
    for node in range(tokens.size):
        path = tokens[forests[0].path(node)]
        ref_TV = reference(params, np.array([prompt + path.tolist()]))[0]
        np.testing.assert_allclose(logits_NV[0, node], ref_TV[-1], atol=EXACT, rtol=0)
    cache, pos = multidecode.accept_node(params, prefix, node_cache, forests[0], 3, 32)
    assert cache.dtype == jnp.int8
    logits_1V, _ = jaxkv.decode_step(params, cache, np.array([3]), np.array([pos]))
    path = prompt + tokens[forests[0].path(3)].tolist() + [3]
    np.testing.assert_allclose(logits_1V[0], reference(params, np.array([path]))[0, -1],
                               atol=EXACT, rtol=0)


def test_generate_and_branches_take_kv_dtype():
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(1))
    prompt = random_tokens(8, (7,)).tolist()
    tokens, _ = jaxkv.generate(params, [prompt], 6, kv_dtype=jnp.int8)
    seq = list(prompt)  # greedy on the fake-quantized forward
    for _ in range(6):
        seq.append(int(np.argmax(reference(params, np.array([seq]))[0, -1])))
    assert tokens[0].tolist() == seq[7:]
    branches = jaxkv.generate_branches(params, prompt, 2, 4, kv_dtype=jnp.int8,
                                       key=jax.random.key(0))
    assert branches.shape == (2, 4)


def test_int8_cache_bytes():
    """head dim 64: 64 int8 + one float32 scale per token and head = 68 bytes, vs 256 (float32)
    and 128 (bfloat16). Shapes only (eval_shape), no arrays made."""
    config = jaxkv.Config.llama(vocab_size=97, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                                d_ff=96, max_seq_len=1024)
    params = jaxkv.init_params(config, jax.random.key(0))
    assert config.head_dim == 64

    def nbytes(dtype):
        shapes = jax.eval_shape(lambda: jaxkv.init_cache(params, 4, 1024, dtype))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((shapes.k, shapes.v)))

    assert nbytes(jnp.int8) / nbytes(jnp.float32) == pytest.approx(68 / 256)
    assert nbytes(jnp.int8) / nbytes(jnp.bfloat16) == pytest.approx(68 / 128)


@pytest.mark.parametrize("dtype", [jnp.int16, jnp.int32, jnp.uint8, "int4"])
def test_other_integer_dtypes_are_refused(dtype):
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(1))
    got = jnp.dtype(dtype).name
    with pytest.raises(ValueError, match=r"init_cache: dtype must be a float dtype \(float32, "
                                         rf"bfloat16, float16\) or int8, got {got}"):
        jaxkv.init_cache(params, 1, 8, dtype)
    with pytest.raises(ValueError, match=rf"kv_dtype must be .* or int8, got {got}"):
        jaxkv.generate(params, [[1, 2]], 2, kv_dtype=dtype)
