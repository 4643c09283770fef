"""Sliding-window attention (Mistral; Qwen2 with use_sliding_window): in the windowed layers a
query at position p reads keys at positions > p - W. Exact against the uncached forward and
against transformers, prompts longer than the window included."""

import jax
import numpy as np
import pytest

import jaxkv
from tests.conftest import (HF_TINY, assert_decode_equals_forward, assert_logits_match_hf,
                            assert_ragged_greedy_matches_hf, random_tokens, save_tiny_models)

W = 8
TINY = dict(vocab_size=97, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96,
            max_seq_len=128)


@pytest.mark.parametrize("layers", [(), (0, 2)], ids=["every layer", "layers 0 and 2"])
def test_decode_equals_forward_past_the_window(layers):
    params = jaxkv.init_params(jaxkv.Config.llama(sliding_window=W, window_layers=layers, **TINY),
                               jax.random.key(0))
    assert_decode_equals_forward(params, random_tokens(1, (2, 30)), 12, 64)  # 12 > W


def test_window_matters_only_past_its_length():
    windowed = jaxkv.init_params(jaxkv.Config.llama(sliding_window=W, **TINY), jax.random.key(0))
    full = jaxkv.init_params(jaxkv.Config.llama(**TINY), jax.random.key(0))
    tokens_BT = random_tokens(2, (1, 20))
    a, b = jaxkv.forward(windowed, tokens_BT), jaxkv.forward(full, tokens_BT)
    np.testing.assert_allclose(a[:, :W], b[:, :W], atol=1e-5, rtol=0)
    assert np.abs(a[:, W:] - b[:, W:]).min() > 1e-4


@pytest.mark.parametrize("kwargs, match", [
    (dict(window_layers=(0,)), "window_layers needs Config.sliding_window"),
    (dict(sliding_window=0), "sliding_window must be a positive int"),
    (dict(sliding_window=4, window_layers=(3,)), r"distinct layer indices in \[0, 3\)"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.Config.llama(**TINY, **kwargs)


def windowed(layers=(0, 2)):
    return jaxkv.init_params(jaxkv.Config.llama(sliding_window=W, window_layers=layers, **TINY),
                             jax.random.key(0))


def test_window_layers_keep_only_the_window():
    params = windowed()
    cache = jaxkv.init_cache(params, 2, 64)
    assert [k.shape[2] for k in cache.k] == [W, 64, W]
    assert cache.ring_pos.shape == (2, W)
    assert [k.shape[2] for k in jaxkv.init_cache(params, 2, 5).k] == [5, 5, 5]


def test_gemma3_270m_cache_is_a_fifth_of_full_size():
    """n_global * C + n_local * W slots: 3 * 8192 + 15 * 512 of 18 * 8192 (no arrays made)."""
    config = jaxkv.Config.llama(vocab_size=64, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1,
                                head_dim=256, d_ff=64, max_seq_len=8192, sliding_window=512,
                                window_layers=[i for i in range(18) if (i + 1) % 6])
    params = jax.eval_shape(lambda: jaxkv.init_params(config, jax.random.key(0)))
    cache = jax.eval_shape(lambda: jaxkv.init_cache(params, 1, 8192))
    slots = sum(k.shape[2] for k in cache.k)
    assert slots == 3 * 8192 + 15 * 512
    assert slots / (18 * 8192) == pytest.approx(0.22, abs=0.005)


@pytest.mark.parametrize("xla", [False, True], ids=["kernels", "xla_backend"])
def test_ragged_prefill_in_pieces_then_decode_equals_forward(xla, request):
    """Prompts of 9 and 21 tokens prefilled in two calls (the second longer than the ring, so
    prefill splits it), then decoded one token at a time, three windows past the start; also
    as a GPU or TPU runs it (XLA's products and attention)."""
    if xla:
        request.getfixturevalue("xla_backend")
    params = windowed()
    tokens_BT = random_tokens(5, (2, 30))
    ref_BTV = jaxkv.forward(params, tokens_BT)
    lengths_B = np.array([9, 21])
    cache = jaxkv.init_cache(params, 2, 32)
    _, cache = jaxkv.prefill(params, cache, tokens_BT[:, :7])
    logits_BV, cache = jaxkv.prefill(params, cache, tokens_BT[:, 7:21], lengths_B - 7,
                                     np.array([7, 7]))
    np.testing.assert_allclose(logits_BV, ref_BTV[np.arange(2), lengths_B - 1], atol=1e-5)
    step = jax.jit(jaxkv.decode_step)
    for t in range(9):
        pos_B = lengths_B + t
        logits_BV, cache = step(params, cache, tokens_BT[np.arange(2), pos_B], pos_B)
        np.testing.assert_allclose(logits_BV, ref_BTV[np.arange(2), pos_B], atol=1e-5)


def test_a_row_may_go_back_one_position_past_the_window_and_no_more():
    params = windowed()
    tokens_BT = random_tokens(6, (1, 21))
    cache = jaxkv.init_cache(params, 1, 32)
    _, cache = jaxkv.prefill(params, cache, tokens_BT[:, :20])
    _, cache = jaxkv.decode_step(params, cache, tokens_BT[:, 20] + 1, np.array([20]))
    logits_BV, cache = jaxkv.decode_step(params, cache, tokens_BT[:, 20], np.array([20]))
    np.testing.assert_allclose(logits_BV, jaxkv.forward(params, tokens_BT)[:, 20], atol=1e-5)
    with pytest.raises(ValueError, match=r"missing from the window .*row\[0\] = 2 .*may go back at "
                                         r"most one position"):
        jaxkv.decode_step(params, cache, tokens_BT[:, 0], np.array([18]))


def test_ring_errors():
    params = windowed()
    cache = jaxkv.init_cache(params, 1, 32)
    tokens_BT = random_tokens(7, (1, W + 1))
    pos_BT = jax.numpy.arange(W + 1)[None]
    with pytest.raises(ValueError, match=f"9 tokens in one call, .* a ring of {W} slots"):
        jaxkv.extend(params, cache, tokens_BT, pos_BT, pos_BT, pos_BT[..., None] >= pos_BT[:, None])
    linear = jaxkv.init_cache(windowed(()).replace(config=jaxkv.Config.llama(**TINY)), 1, 32)
    with pytest.raises(ValueError, match=r"ring_pos has shape None; this model needs \(1, 8\)"):
        jaxkv.decode_step(params, linear.replace(k=cache.k, v=cache.v), tokens_BT[:, 0],
                          np.array([0]))


@pytest.mark.parametrize("call", [
    lambda p: jaxkv.forest_logits(p, tokens=[1, 2], parents=[-1, 0], prefix=[3, 4]),
    lambda p: jaxkv.generate_branches(p, [3, 4], 2, 4),
    lambda p: jaxkv.beam_search(p, [3, 4], 2, 4),
    lambda p: jaxkv.score_continuations(p, [3, 4], [[1], [2, 5]]),
], ids=["forest", "branches", "beam search", "scoring"])
def test_multidecode_says_windows_are_not_supported(call):
    params = jaxkv.init_params(jaxkv.Config.llama(sliding_window=W, **TINY), jax.random.key(0))
    with pytest.raises(ValueError, match=r"MultiDecode .* is not supported on sliding-window "
                                         r"models yet .*a window of 8 positions"):
        call(params)


def hf_windowed():
    import transformers as tf

    small = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 max_position_embeddings=128, **HF_TINY)
    return {
        "mistral_gqa": (tf.MistralConfig(num_hidden_layers=3, num_key_value_heads=2,
                                         sliding_window=W, **small), tf.MistralForCausalLM),
        "qwen2_upper_layers": (tf.Qwen2Config(num_hidden_layers=3, num_key_value_heads=1,
                                              use_sliding_window=True, sliding_window=W,
                                              max_window_layers=1, **small),
                               tf.Qwen2ForCausalLM),
    }


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory):
    return save_tiny_models(hf_windowed(), tmp_path_factory, seed=200)


@pytest.mark.parametrize("name", sorted(hf_windowed()))
def test_loads_the_window(windowed_models, name):
    c = jaxkv.load(windowed_models[name][1]).config
    assert c.sliding_window == W
    assert c.window_layers == ((0, 1, 2) if name == "mistral_gqa" else (1, 2))


@pytest.mark.parametrize("name", sorted(hf_windowed()))
def test_logits_match_hugging_face_past_the_window(windowed_models, name):
    model, path = windowed_models[name]
    assert_logits_match_hf(model, jaxkv.load(path), random_tokens(3, (2, 40)))


@pytest.mark.parametrize("name", sorted(hf_windowed()))
def test_ragged_greedy_matches_hugging_face(windowed_models, name):
    """Prompts of 5 and 19 tokens (one shorter, one longer than the window), 24 new tokens."""
    model, path = windowed_models[name]
    assert_ragged_greedy_matches_hf(model, jaxkv.load(path), lengths=(5, 19))


def test_config_round_trips_through_json():
    import json

    config = jaxkv.Config.llama(sliding_window=W, window_layers=[2, 0], **TINY)
    assert config.window_layers == (0, 2)
    assert jaxkv.Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
