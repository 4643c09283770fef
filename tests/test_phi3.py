"""Phi-3 on tiny random Hugging Face checkpoints (models/phi3.py): fused qkv_proj and
gate_up_proj, partial rotary (Phi-4-mini), a sliding window in every layer; LongRoPE refused.
Loaded from save_pretrained's files, it must match transformers' logits and greedy tokens."""

import numpy as np
import pytest

import jaxkv
from jaxkv.models.maps import CheckpointError
from tests.conftest import (HF_TINY, assert_decode_equals_forward, assert_logits_match_hf,
                            assert_paths_agree, assert_ragged_greedy_matches_hf, edited_copy,
                            random_tokens, save_tiny_models)

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
             max_position_embeddings=128, **HF_TINY)


def phi3_configs():
    import transformers as tf

    return {
        "phi3_gqa": (tf.Phi3Config(num_hidden_layers=3, num_key_value_heads=2, **SMALL),
                     tf.Phi3ForCausalLM),
        "phi4_mini_like_window": (tf.Phi3Config(
            num_hidden_layers=2, num_key_value_heads=1, sliding_window=8, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                 partial_rotary_factor=0.75), **SMALL), tf.Phi3ForCausalLM),
    }


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """{name: (torch model, directory written by save_pretrained)}; no download."""
    return save_tiny_models(phi3_configs(), tmp_path_factory, seed=800, eager=True)


NAMES = sorted(phi3_configs())


def test_configs_load_as_written(phi3):
    a, b = (jaxkv.load(phi3[name][1]).config for name in NAMES)
    assert a.rotary_dim is None and a.sliding_window is None and a.n_kv_heads == 2
    assert (b.rotary_dim, b.sliding_window, b.tie_embeddings) == (12, 8, True)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hugging_face(phi3, name):
    """40 positions: past the window of 8."""
    model, path = phi3[name]
    diff = assert_logits_match_hf(model, jaxkv.load(path), random_tokens(3, (2, 40)))
    print(f"{name}: max |diff| {diff:.2e}")


@pytest.mark.parametrize("name", NAMES)
def test_ragged_greedy_matches_hugging_face_per_prompt(phi3, name):
    model, path = phi3[name]
    assert_ragged_greedy_matches_hf(model, jaxkv.load(path))


def test_decode_equals_forward(phi3):
    params = jaxkv.load(phi3["phi4_mini_like_window"][1])
    assert_decode_equals_forward(params, np.asarray(random_tokens(5, (2, 20))), 5, 32)


def test_longrope_is_refused(phi3, tmp_path):
    path = edited_copy(phi3["phi3_gqa"][1], tmp_path, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8))
    with pytest.raises(CheckpointError, match="rope scaling .*longrope.* is not supported"):
        jaxkv.load(path)


def test_every_path_runs_it(phi3):
    assert_paths_agree(jaxkv.load(phi3["phi3_gqa"][1]))
