"""OLMo 2 on tiny random Hugging Face checkpoints (models/olmo2.py): no norm on a sublayer's
input, one on its output, queries and keys normed over all heads at once. Loaded from
save_pretrained's files, it must match transformers' logits and greedy tokens."""

import numpy as np
import pytest

import jaxkv
from tests.conftest import (HF_TINY, assert_decode_equals_forward, assert_logits_match_hf,
                            assert_paths_agree, assert_ragged_greedy_matches_hf,
                            assert_save_load_round_trip, random_tokens, save_tiny_models)

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
             max_position_embeddings=128, **HF_TINY)


def olmo2_configs():
    import transformers as tf

    return {
        "olmo2_gqa": (tf.Olmo2Config(num_hidden_layers=3, num_key_value_heads=2, **SMALL),
                      tf.Olmo2ForCausalLM),
        "olmo2_mha_tied": (tf.Olmo2Config(num_hidden_layers=2, num_key_value_heads=4,
                                          tie_word_embeddings=True, rope_theta=500000.0,
                                          **SMALL), tf.Olmo2ForCausalLM),
    }


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    """{name: (torch model, directory written by save_pretrained)}; no download."""
    return save_tiny_models(olmo2_configs(), tmp_path_factory, seed=700)


NAMES = sorted(olmo2_configs())


def test_configs_load_as_written(olmo2):
    c = jaxkv.load(olmo2["olmo2_gqa"][1]).config
    assert (c.pre_norms, c.post_norms, c.qk_norm, c.qk_norm_all) == (False, True, True, True)
    params = jaxkv.load(olmo2["olmo2_gqa"][1])
    assert params.blocks[0].attn_norm is None and params.blocks[0].q_norm.scale.shape == (64,)
    assert params.blocks[0].k_norm.scale.shape == (32,)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hugging_face(olmo2, name):
    model, path = olmo2[name]
    diff = assert_logits_match_hf(model, jaxkv.load(path), random_tokens(3, (2, 40)))
    print(f"{name}: max |diff| {diff:.2e}")


@pytest.mark.parametrize("name", NAMES)
def test_ragged_greedy_matches_hugging_face_per_prompt(olmo2, name):
    model, path = olmo2[name]
    assert_ragged_greedy_matches_hf(model, jaxkv.load(path))


def test_decode_equals_forward_hooks_and_round_trip(olmo2, tmp_path):
    params = jaxkv.load(olmo2["olmo2_gqa"][1])
    assert_decode_equals_forward(params, np.asarray(random_tokens(5, (2, 12))), 5, 16)
    hooks = jaxkv.Hooks(capture=["resid_pre", "attn_out", "mlp_out", "resid_post"])
    _, acts = jaxkv.forward(params, random_tokens(6, (1, 9)), hooks=hooks)
    np.testing.assert_allclose(acts["resid_post"],
                               acts["resid_pre"] + acts["attn_out"] + acts["mlp_out"], atol=1e-5)
    assert_save_load_round_trip(params, tmp_path)


def test_every_path_runs_it(olmo2):
    assert_paths_agree(jaxkv.load(olmo2["olmo2_gqa"][1]))
