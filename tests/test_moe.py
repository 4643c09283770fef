"""Mixtures of experts on tiny random Hugging Face checkpoints: Mixtral (mixtral.py: every MLP
a mixture, top k renormalized; a sliding window), Qwen3-MoE (qwen3moe.py: experts of their own
width, renormalized or not, dense layers where mlp_only_layers and decoder_sparse_step say) and
OLMoE (olmoe.py: router weights as they come or renormalized, q/k norms over all heads).
Loaded from save_pretrained's files, each must match transformers' logits and greedy tokens,
and run every decoding path. (The experts' products themselves: tests/test_ops.py.)"""

import json

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.ops.arrays import Int8
from tests.conftest import (HF_TINY, assert_decode_equals_forward, assert_logits_match_hf,
                            assert_paths_agree, assert_ragged_greedy_matches_hf,
                            random_tokens, save_tiny_models)

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, **HF_TINY)


def moe_configs():
    import transformers as tf

    return {
        "mixtral": (tf.MixtralConfig(num_hidden_layers=2, num_local_experts=4,
                                     num_experts_per_tok=2, **SMALL), tf.MixtralForCausalLM),
        "mixtral_window_top3_tied": (tf.MixtralConfig(
            num_hidden_layers=2, num_local_experts=5, num_experts_per_tok=3, sliding_window=8,
            tie_word_embeddings=True, **SMALL), tf.MixtralForCausalLM),
        "qwen3moe_dense_layer": (tf.Qwen3MoeConfig(
            num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            head_dim=16, mlp_only_layers=[1], **SMALL), tf.Qwen3MoeForCausalLM),
        "qwen3moe_sparse_step_normed": (tf.Qwen3MoeConfig(
            num_hidden_layers=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
            head_dim=16, norm_topk_prob=True, decoder_sparse_step=2, **SMALL),
            tf.Qwen3MoeForCausalLM),
        "olmoe": (tf.OlmoeConfig(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                 **SMALL), tf.OlmoeForCausalLM),
        "olmoe_top3_normed_tied": (tf.OlmoeConfig(
            num_hidden_layers=2, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True,
            tie_word_embeddings=True, **SMALL), tf.OlmoeForCausalLM),
    }


@pytest.fixture(scope="module")
def moes(tmp_path_factory):
    """{name: (torch model, directory written by save_pretrained)}; no download."""
    return save_tiny_models(moe_configs(), tmp_path_factory, seed=900, eager=True)


NAMES = sorted(moe_configs())


def test_configs_load_as_written(moes):
    c = {name: jaxkv.load(moes[name][1]).config for name in NAMES}
    assert (c["mixtral"].n_experts, c["mixtral"].experts_per_token, c["mixtral"].norm_topk) == (
        4, 2, True)
    assert c["mixtral_window_top3_tied"].sliding_window == 8
    q = c["qwen3moe_dense_layer"]
    assert (q.expert_d_ff, q.d_ff, q.dense_layers, q.norm_topk) == (32, 96, (1,), False)
    assert c["qwen3moe_sparse_step_normed"].dense_layers == (0,)
    assert c["olmoe"].qk_norm_all and not c["olmoe"].norm_topk
    assert c["olmoe_top3_normed_tied"].norm_topk


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hugging_face(moes, name):
    model, path = moes[name]
    diff = assert_logits_match_hf(model, jaxkv.load(path), random_tokens(3, (2, 40)))
    print(f"{name}: max |diff| {diff:.2e}")


@pytest.mark.parametrize("name", NAMES)
def test_ragged_greedy_matches_hugging_face_per_prompt(moes, name):
    model, path = moes[name]
    assert_ragged_greedy_matches_hf(model, jaxkv.load(path))


@pytest.mark.parametrize("name", ["mixtral", "qwen3moe_dense_layer", "olmoe"])
def test_decode_equals_forward_and_every_path_runs_it(moes, name):
    params = jaxkv.load(moes[name][1])
    assert_decode_equals_forward(params, np.asarray(random_tokens(5, (2, 20))), 5, 32)
    assert_paths_agree(params)


def test_int8_experts_on_load_and_from_quantize(moes):
    """load(int8=True) makes every expert int8 (scales per expert and row, as jaxkv.quantize),
    routers float; its logits stay near the float model's and its decode steps equal its own
    forward."""
    path = moes["qwen3moe_dense_layer"][1]
    floats, ints = jaxkv.load(path), jaxkv.load(path, int8=True)
    moe = ints.blocks[0]
    assert isinstance(moe.experts_in, Int8) and isinstance(moe.experts_out, Int8)
    assert moe.experts_in.scale.shape == (4, 64, 1) and moe.router.dtype == np.float32
    assert ints.blocks[1].experts_in is None  # the dense layer
    for a, b in zip(jax.tree.leaves(ints), jax.tree.leaves(jaxkv.quantize(floats))):
        np.testing.assert_array_equal(a, b)
    tokens_BT = random_tokens(6, (2, 20))
    np.testing.assert_allclose(jaxkv.forward(ints, tokens_BT), jaxkv.forward(floats, tokens_BT),
                               atol=0.05)
    assert_decode_equals_forward(ints, np.asarray(tokens_BT), 5, 32)


def test_the_jsonl_job_answers_as_generate(moes, tmp_path):
    """jaxkv's JSONL job (jsonl.answer_file, what `python -m jaxkv --input` runs) on a mixture
    of experts: each greedy completion is generate's."""
    from jaxkv.front import jsonl
    from tests.conftest import char_tokenizer

    params = jaxkv.load(moes["olmoe"][1])
    tokenizer = char_tokenizer(params.config.vocab_size)
    prompts = ["Hello there", "A", "The quick brown fox", "xyz"]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    encode = lambda text: tokenizer.encode(text).ids  # noqa: E731
    assert jsonl.answer_file(params, tokenizer, encode, str(source), str(tmp_path / "out.jsonl"),
                             6, batch_size=2, temperature=0.0) == 4
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for i, prompt in enumerate(prompts):
        tokens, _ = jaxkv.generate(params, [encode(prompt)], 6)
        assert rows[i + 1]["completion"] == tokenizer.decode(np.asarray(tokens[0]).tolist())
