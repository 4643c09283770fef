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


def test_multidecode_says_windows_are_not_supported():
    params = jaxkv.init_params(jaxkv.Config.llama(sliding_window=W, **TINY), jax.random.key(0))
    with pytest.raises(ValueError, match=r"MultiDecode .* is not supported on sliding-window "
                                         r"models yet .*a window of 8 positions"):
        jaxkv.forest_logits(params, tokens=[1, 2], parents=[-1, 0], prefix=[3, 4])


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
