"""Qwen3-MoE (qwen3moe.py): experts of their own width, renormalized or not, dense layers where mlp_only_layers and decoder_sparse_step say. Tiny random Hugging Face checkpoints loaded from save_pretrained's files must match
transformers' logits and greedy tokens, and run every decoding path."""

import numpy as np
import pytest

import jaxkv
from tests.conftest import (HF_TINY, assert_decode_equals_forward, assert_logits_match_hf,
                            assert_paths_agree, assert_ragged_greedy_matches_hf,
                            random_tokens, save_tiny_models)

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, **HF_TINY)


def configs():
    import transformers as tf

    return {
        "a": (tf.Qwen3MoeConfig(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, mlp_only_layers=[1], **SMALL), tf.Qwen3MoeForCausalLM),
        "b": (tf.Qwen3MoeConfig(num_hidden_layers=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16, norm_topk_prob=True, decoder_sparse_step=2, **SMALL), tf.Qwen3MoeForCausalLM),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (torch model, directory written by save_pretrained)}; no download."""
    return save_tiny_models(configs(), tmp_path_factory, seed=900, eager=True)


@pytest.mark.parametrize("name", ["a", "b"])
def test_logits_match_hugging_face(models, name):
    model, path = models[name]
    diff = assert_logits_match_hf(model, jaxkv.load(path), random_tokens(3, (2, 40)))
    print(f"{name}: max |diff| {diff:.2e}")


@pytest.mark.parametrize("name", ["a", "b"])
def test_ragged_greedy_matches_hugging_face_per_prompt(models, name):
    model, path = models[name]
    assert_ragged_greedy_matches_hf(model, jaxkv.load(path))


def test_decode_equals_forward_and_every_path_runs_it(models):
    params = jaxkv.load(models["a"][1])
    assert_decode_equals_forward(params, np.asarray(random_tokens(5, (2, 20))), 5, 32)
    assert_paths_agree(params)
