"""Encoder-decoder models: cached decoding equals the teacher-forced forward, and the
cross-attention K/V are computed once (at init_cache) and never again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from tests.conftest import ENCDEC_CONFIGS, encoder_inputs, random_tokens

TOL = 1e-4


def cached_logits(params, tokens_BT, prefix, enc, enc_lengths=None):
    """Prefill tokens[:, :prefix], then decode the rest one token at a time: logits [B, T-prefix+1, V]."""
    B, T = tokens_BT.shape
    cache = jaxkv.init_cache(params, B, 32, encoder_inputs=enc, encoder_lengths=enc_lengths)
    logits_BV, cache = jaxkv.prefill(params, cache, tokens_BT[:, :prefix])
    out = [logits_BV]
    step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
    for t in range(prefix, T):
        logits_BV, cache = step(params, cache, tokens_BT[:, t], jnp.full((B,), t))
        out.append(logits_BV)
    return np.stack(out, axis=1)


def test_cached_decoding_equals_teacher_forced_forward(encdec):
    enc = encoder_inputs(encdec.config, 0, 2)
    tokens_BT = random_tokens(1, (2, 12))
    ref_BTV = jaxkv.forward(encdec, tokens_BT, encoder_inputs=enc)
    got = cached_logits(encdec, tokens_BT, 4, enc)
    np.testing.assert_allclose(got, ref_BTV[:, 3:], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["t5_relu", "t5_gated_untied"])
def test_ragged_encoder_lengths(name):
    """Rows whose encoder inputs have different lengths decode together as they do alone."""
    params = jaxkv.init_params(ENCDEC_CONFIGS[name], jax.random.key(4))
    enc_BM = np.asarray(random_tokens(2, (3, 20)))
    enc_lengths = np.array([20, 7, 13])
    tokens_BT = random_tokens(3, (3, 10))
    batched = cached_logits(params, tokens_BT, 3, enc_BM, enc_lengths)
    for b in range(3):
        alone_enc = enc_BM[b:b + 1, : enc_lengths[b]]
        ref = jaxkv.forward(params, tokens_BT[b:b + 1], encoder_inputs=alone_enc)
        np.testing.assert_allclose(batched[b], ref[0, 2:], atol=TOL, rtol=0)


def test_whisper_batch_of_clips_of_different_lengths():
    """Whisper pads every clip to 30 s; each row of a batch equals the row alone."""
    config = ENCDEC_CONFIGS["whisper"]
    params = jaxkv.init_params(config, jax.random.key(5))
    enc = np.array(encoder_inputs(config, 6, 2))
    enc[1, :, 60:] = enc[1, :, 60:].min()  # a shorter clip: silence after frame 60
    tokens_BT = random_tokens(7, (2, 8))
    batched = cached_logits(params, tokens_BT, 2, enc)
    for b in range(2):
        alone = cached_logits(params, tokens_BT[b:b + 1], 2, enc[b:b + 1])
        np.testing.assert_allclose(batched[b], alone[0], atol=1e-5, rtol=0)


def test_generate_equals_a_loop_of_decode_step(encdec):
    enc = encoder_inputs(encdec.config, 8, 2)
    start = encdec.config.decoder_start_id or 0
    tokens, _ = jaxkv.generate(encdec, [[start], [start, 5, 9]], 10, encoder_inputs=enc)
    for b, prompt in enumerate([[start], [start, 5, 9]]):
        cache = jaxkv.init_cache(encdec, 1, 32, encoder_inputs=enc[b:b + 1])
        logits, cache = jaxkv.prefill(encdec, cache, np.array([prompt]))
        step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
        expected = []
        for t in range(10):
            token = jnp.argmax(logits, -1)
            expected.append(int(token[0]))
            logits, cache = step(encdec, cache, token, jnp.array([len(prompt) + t]))
        assert tokens[b].tolist() == expected


def step_flops(params, encoder_len):
    """FLOPs XLA counts for one compiled decode_step with encoder length encoder_len."""
    c = params.config
    B, S = 2, 32
    layers = lambda *shape: tuple(jnp.zeros(shape) for _ in range(c.n_layers))  # noqa: E731
    self_kv = (B, c.n_kv_heads, S, c.head_dim)
    cross = (B, c.n_kv_heads, encoder_len, c.head_dim)
    cache = jaxkv.KVCache(k=layers(*self_kv), v=layers(*self_kv), cross_k=layers(*cross),
                          cross_v=layers(*cross), cross_mask=jnp.ones((B, encoder_len), bool),
                          capacity=S)
    args = (params, cache, jnp.zeros((B,), jnp.int32), jnp.full((B,), 3))
    cost = jax.jit(jaxkv.decode_step).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"], B


def test_decode_step_work_grows_only_by_attention_terms():
    """From the compiled cost analysis: doubling the encoder length m adds O(m d) per layer
    (scores and weighted sum), not O(m d^2) (what projecting encoder states would cost)."""
    params = jaxkv.init_params(ENCDEC_CONFIGS["t5_relu"], jax.random.key(0))
    c = params.config
    m = 48
    small, B = step_flops(params, m)
    large, _ = step_flops(params, 2 * m)
    growth = large - small
    N, H, D, L = c.n_heads, c.head_dim, c.d_model, c.n_layers
    attention_terms = L * B * m * N * 2 * (2 * H)  # q.k and p.v: 2 flops per multiply-add
    projection_terms = L * B * m * 2 * (2 * D * N * H)  # K and V of m encoder states
    assert growth <= 2 * attention_terms, (growth, attention_terms)
    assert growth < projection_terms / 8, (growth, projection_terms)


def test_decode_step_program_never_touches_cross_weights():
    """The step's jaxpr reads no cross-attention K/V weights: they were used once, at init_cache."""
    params = jaxkv.init_params(ENCDEC_CONFIGS["whisper"], jax.random.key(0))
    enc = encoder_inputs(params.config, 0, 1)
    cache = jaxkv.init_cache(params, 1, 16, encoder_inputs=enc)
    closed = jax.make_jaxpr(jaxkv.decode_step)(params, cache, jnp.array([1]), jnp.array([0]))
    leaves = jax.tree_util.tree_flatten_with_path((params, cache))[0]
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    used = {v for eqn in closed.jaxpr.eqns for v in eqn.invars if not hasattr(v, "val")}
    unused = {n for n, var in zip(names, closed.jaxpr.invars) if var not in used}
    cross_kv_weights = {n for n in names if n.startswith("[0].cross[") and "kv" in n}
    assert len(cross_kv_weights) == 2 * params.config.n_layers  # wkv and bkv of each layer
    assert cross_kv_weights <= unused
    assert not any(n.startswith("[0].encoder") for n in set(names) - unused)


def test_cross_kv_are_bitwise_unchanged_by_decode_steps(encdec):
    enc = encoder_inputs(encdec.config, 9, 2)
    cache = jaxkv.init_cache(encdec, 2, 16, encoder_inputs=enc)
    before = jax.tree.map(np.array, (cache.cross_k, cache.cross_v, cache.cross_mask))
    _, cache = jaxkv.prefill(encdec, cache, np.array([[1, 2], [3, 4]]))
    step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
    for t in range(2, 6):
        _, cache = step(encdec, cache, jnp.array([5, 6]), jnp.array([t, t]))
    after = (cache.cross_k, cache.cross_v, cache.cross_mask)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_encode_shapes(encdec):
    enc = encoder_inputs(encdec.config, 10, 2)
    states = jaxkv.encode(encdec, enc)
    M = encdec.config.encoder.max_len if encdec.config.encoder.input == "audio" else 24
    assert states.shape == (2, M, encdec.config.d_model)


@pytest.mark.parametrize("call, match", [
    (lambda p, enc: jaxkv.generate(p, [[0]], 4), "needs encoder_inputs"),
    (lambda p, enc: jaxkv.init_cache(p, 1, 8), "needs encoder_inputs"),
    (lambda p, enc: jaxkv.forward(p, np.array([[0, 1]])), "needs encoder_inputs"),
    (lambda p, enc: jaxkv.generate(p, [[0]], 4, encoder_inputs=np.zeros((1, 65), int)),
     "encoder_inputs has 65 tokens; the encoder takes 1 to 64"),
    (lambda p, enc: jaxkv.generate(p, [[0]], 4, encoder_inputs=np.zeros((2, 5), int)),
     "encoder_inputs has 2 rows, expected 1"),
    (lambda p, enc: jaxkv.init_cache(p, 1, 8, encoder_inputs=np.zeros((1, 5), int),
                                     encoder_lengths=[0]),
     r"encoder_lengths\[0\] = 0 is not an encoder input length"),
    (lambda p, enc: jaxkv.generate(p, [[0]], 4, encoder_inputs=np.array([[1, 200]])),
     "not a token id"),
])
def test_t5_bad_input(call, match):
    params = jaxkv.init_params(ENCDEC_CONFIGS["t5_relu"], jax.random.key(0))
    with pytest.raises(ValueError, match=match):
        call(params, None)


@pytest.mark.parametrize("shape, match", [
    ((1, 16, 101), r"must be log-mel features \[B, 16, 100\]"),
    ((16, 100), r"must be log-mel features \[B, 16, 100\]"),
])
def test_whisper_bad_features(shape, match):
    params = jaxkv.init_params(ENCDEC_CONFIGS["whisper"], jax.random.key(0))
    with pytest.raises(ValueError, match=match):
        jaxkv.generate(params, [[1]], 4, encoder_inputs=np.zeros(shape, np.float32))


def test_decoder_only_rejects_encoder_inputs(llama):
    with pytest.raises(ValueError, match="decoder-only model"):
        jaxkv.generate(llama, [[1]], 4, encoder_inputs=np.zeros((1, 4), int))
