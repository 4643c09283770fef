"""Gemma 2 and Gemma 3 (text) on tiny random Hugging Face checkpoints: embeddings scaled by
sqrt(width), (1 + w) RMSNorms before and after each sublayer, scores scaled by
query_pre_attn_scalar**-0.5, soft-capped scores and logits (Gemma 2), per-head q/k norms and a
local RoPE base (Gemma 3), local (sliding-window) and global layers. Each is loaded from
save_pretrained's files and must match transformers' logits and greedy tokens past the window."""

import json

import numpy as np
import pytest

import jaxkv
from jaxkv.models.maps import CheckpointError
from tests.conftest import (HF_TINY, assert_decode_equals_forward, assert_logits_match_hf,
                            assert_ragged_greedy_matches_hf, assert_save_load_round_trip,
                            edited_copy, random_tokens, save_tiny_models)

W = 8
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
             max_position_embeddings=128, sliding_window=W, **HF_TINY)


def gemma_configs():
    import transformers as tf

    return {
        # small caps, so that tanh bends the tiny model's scores and logits
        "gemma2_gqa": (tf.Gemma2Config(num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                       query_pre_attn_scalar=24, attn_logit_softcapping=0.05,
                                       final_logit_softcapping=0.5, **SMALL),
                       tf.Gemma2ForCausalLM),
        "gemma2_mqa_untied": (tf.Gemma2Config(num_hidden_layers=3, num_key_value_heads=1,
                                              head_dim=32, query_pre_attn_scalar=8,
                                              tie_word_embeddings=False, **SMALL),
                              tf.Gemma2ForCausalLM),
        "gemma3_gqa_linear": (tf.Gemma3TextConfig(
            num_hidden_layers=5, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
            sliding_window_pattern=3, rope_scaling=dict(rope_type="linear", factor=4.0),
            **SMALL), tf.Gemma3ForCausalLM),
        "gemma3_mqa_capped_old_style": (tf.Gemma3TextConfig(
            num_hidden_layers=3, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=8,
            sliding_window_pattern=2, final_logit_softcapping=0.5, tie_word_embeddings=False,
            **SMALL), tf.Gemma3ForCausalLM),
    }


def old_style_gemma3(path):
    """Rewrite config.json as transformers 4 wrote Gemma 3's: RoPE bases top-level, the layer
    pattern as sliding_window_pattern."""
    file = path / "config.json"
    hf = json.loads(file.read_text())
    rope = hf.pop("rope_parameters")
    hf["rope_theta"] = rope["full_attention"]["rope_theta"]
    hf["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    hf["sliding_window_pattern"] = hf["layer_types"].index("full_attention") + 1
    del hf["layer_types"]
    file.write_text(json.dumps(hf))


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory):
    """{name: (torch model, directory written by save_pretrained)}; no download."""
    models = save_tiny_models(gemma_configs(), tmp_path_factory, seed=300, eager=True)
    old_style_gemma3(models["gemma3_mqa_capped_old_style"][1])
    return models


NAMES = sorted(gemma_configs())


def test_gemmas_load_as_their_configs_say(gemmas):
    c = {name: jaxkv.load(gemmas[name][1]).config for name in NAMES}
    g2, g3 = c["gemma2_gqa"], c["gemma3_gqa_linear"]
    assert (g2.attn_softcap, g2.logit_softcap, g2.attn_scale_base) == (0.05, 0.5, 24)
    assert g2.window_layers == (0, 2) and g2.sliding_window == W and g2.tie_embeddings
    assert g2.scale_embeddings and g2.post_norms and g2.activation == "gelu_tanh"
    assert not c["gemma2_mqa_untied"].tie_embeddings
    assert g3.qk_norm and g3.attn_softcap is None and g3.logit_softcap is None
    assert g3.window_layers == (0, 1, 3, 4)
    assert (g3.rope_theta, g3.rope_scaling, g3.local_rope_theta) == (1e6, ("linear", 4.0), 1e4)
    old = c["gemma3_mqa_capped_old_style"]
    assert old.window_layers == (0, 2) and old.logit_softcap == 0.5
    assert (old.rope_theta, old.local_rope_theta) == (1e6, 1e4)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hugging_face_past_the_window(gemmas, name):
    model, path = gemmas[name]
    diff = assert_logits_match_hf(model, jaxkv.load(path), random_tokens(3, (2, 40)))
    print(f"{name}: max |diff| {diff:.2e}")


@pytest.mark.parametrize("name", NAMES)
def test_ragged_greedy_matches_hugging_face_per_prompt(gemmas, name):
    """Prompts of 5 and 19 tokens (one shorter, one longer than the window), 24 new tokens."""
    model, path = gemmas[name]
    assert_ragged_greedy_matches_hf(model, jaxkv.load(path), lengths=(5, 19))


@pytest.mark.parametrize("name, capacity", [("gemma2_gqa", 1024), ("gemma3_gqa_linear", 64)])
def test_decode_equals_forward_past_the_window(gemmas, name, capacity):
    """Capacity 1024: attention visits the filled blocks only (attention.BLOCK slots each),
    with the soft-cap in the block loop."""
    params = jaxkv.load(gemmas[name][1])
    assert_decode_equals_forward(params, random_tokens(1, (2, 30)), 12, capacity)  # 12 > W


def test_soft_caps_and_local_rope_matter(gemmas):
    """Each feature changes the logits of these tiny models (so the parity tests test it)."""
    tokens_BT = random_tokens(6, (1, 24))
    for name, change in [("gemma2_gqa", dict(attn_softcap=None)),
                         ("gemma2_gqa", dict(logit_softcap=None)),
                         ("gemma3_gqa_linear", dict(local_rope_theta=None))]:
        params = jaxkv.load(gemmas[name][1])
        other = params.replace(config=jaxkv.Config(**{**params.config.to_dict(), **change}))
        diff = np.abs(jaxkv.forward(params, tokens_BT) - jaxkv.forward(other, tokens_BT)).max()
        assert diff > 1e-3, (name, change)


def test_save_load_round_trip(gemmas, tmp_path):
    assert_save_load_round_trip(jaxkv.load(gemmas["gemma3_gqa_linear"][1]), tmp_path)


@pytest.mark.parametrize("name, changes, match", [
    ("gemma3_gqa_linear", dict(use_bidirectional_attention=True),
     r"bidirectional attention \(use_bidirectional_attention\) is not supported"),
    ("gemma2_gqa", dict(hidden_activation="relu"), "unsupported hidden_activation 'relu'"),
    ("gemma3_gqa_linear", dict(rope_parameters=dict(
        full_attention=dict(rope_type="default", rope_theta=1e6),
        sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
     "RoPE scaling in the sliding-window layers .* is not supported"),
])
def test_unsupported_configs_name_the_problem(gemmas, tmp_path, name, changes, match):
    path = edited_copy(gemmas[name][1], tmp_path, **changes)
    with pytest.raises(CheckpointError, match="config.json: " + match):
        jaxkv.load(path)


@pytest.mark.parametrize("field", ["attn_scale_base", "attn_softcap", "logit_softcap",
                                   "local_rope_theta"])
def test_config_checks_the_gemma_fields(field):
    with pytest.raises(ValueError, match=f"Config.{field} must be None or a number > 0, got 0"):
        jaxkv.Config.llama(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           d_ff=96, max_seq_len=64, **{field: 0})
