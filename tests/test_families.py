"""Modern decoder families on tiny random Hugging Face checkpoints: Llama 3 RoPE scaling
("llama3", "linear"), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, explicit head_dim;
q/k/v/o biases when attention_bias).
Each is loaded from save_pretrained's files and must match transformers' logits and greedy
tokens."""

import json

import numpy as np
import pytest

import jaxkv
from jaxkv.core.layers import rope_frequencies
from jaxkv.models.maps import CheckpointError
from tests.conftest import (HF_TINY, assert_logits_match_hf, assert_ragged_greedy_matches_hf,
                            assert_save_load_round_trip, edited_copy, random_tokens,
                            save_tiny_models)

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
             max_position_embeddings=128, **HF_TINY)
# head_dim 16, theta 1e4: wavelengths 2 pi 10^(i/2), i < 8 (6.3, 19.9, 62.8, 199, ...);
# an original context of 64 with factors 1 and 4 puts one below 16 (kept), two in [16, 64]
# (blended) and five above 64 (divided by 8)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64, rope_theta=10000.0)


def family_configs():
    import transformers as tf

    return {
        "llama3_gqa": (tf.LlamaConfig(num_hidden_layers=3, num_key_value_heads=2,
                                      rope_parameters=LLAMA3_ROPE, **SMALL),
                       tf.LlamaForCausalLM),
        "llama_linear_mqa": (tf.LlamaConfig(num_hidden_layers=2, num_key_value_heads=1,
                                            rope_parameters=dict(rope_type="linear", factor=4.0,
                                                                 rope_theta=10000.0), **SMALL),
                             tf.LlamaForCausalLM),
        "qwen2_gqa": (tf.Qwen2Config(num_hidden_layers=3, num_key_value_heads=2, **SMALL),
                      tf.Qwen2ForCausalLM),
        "qwen2_mqa_tied": (tf.Qwen2Config(num_hidden_layers=2, num_key_value_heads=1,
                                          tie_word_embeddings=True, **SMALL),
                           tf.Qwen2ForCausalLM),
        "qwen3_gqa": (tf.Qwen3Config(num_hidden_layers=3, num_key_value_heads=2, head_dim=32,
                                     **SMALL), tf.Qwen3ForCausalLM),
        "qwen3_mqa_bias_tied": (tf.Qwen3Config(num_hidden_layers=2, num_key_value_heads=1,
                                               head_dim=32, attention_bias=True,
                                               tie_word_embeddings=True, **SMALL),
                                tf.Qwen3ForCausalLM),
    }


def old_style_rope(path):
    """Rewrite config.json as transformers 4 did: rope_scaling with 'type', theta top-level."""
    file = path / "config.json"
    hf = json.loads(file.read_text())
    rope = hf.pop("rope_parameters")
    hf["rope_theta"] = rope.pop("rope_theta")
    hf["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    file.write_text(json.dumps(hf))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """{name: (torch model, directory written by save_pretrained)}; no download."""
    models = save_tiny_models(family_configs(), tmp_path_factory, seed=100)
    old_style_rope(models["llama_linear_mqa"][1])
    return models


NAMES = sorted(family_configs())


def test_families_load_as_their_configs_say(families):
    c = {name: jaxkv.load(families[name][1]).config for name in NAMES}
    assert c["llama3_gqa"].rope_scaling == ("llama3", 8.0, 1.0, 4.0, 64)
    assert c["llama_linear_mqa"].rope_scaling == ("linear", 4.0)
    assert c["qwen2_gqa"].attn_bias and not c["qwen2_gqa"].attn_out_bias
    assert c["qwen2_mqa_tied"].tie_embeddings and c["qwen2_mqa_tied"].n_kv_heads == 1
    assert c["qwen3_gqa"].qk_norm and c["qwen3_gqa"].head_dim == 32
    assert not c["qwen3_gqa"].attn_bias
    assert c["qwen3_mqa_bias_tied"].attn_bias and c["qwen3_mqa_bias_tied"].attn_out_bias


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hugging_face(families, name):
    """80 positions: past the llama3 model's original context (64) too."""
    model, path = families[name]
    diff = assert_logits_match_hf(model, jaxkv.load(path), random_tokens(3, (2, 80)))
    print(f"{name}: max |diff| {diff:.2e}")


@pytest.mark.parametrize("name", NAMES)
def test_ragged_greedy_matches_hugging_face_per_prompt(families, name):
    model, path = families[name]
    assert_ragged_greedy_matches_hf(model, jaxkv.load(path))


@pytest.mark.parametrize("scaling", [
    dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192, rope_theta=500000.0),  # Llama 3.2
    {**LLAMA3_ROPE, "head_dim": 16},
    dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
])
def test_rope_frequencies_match_transformers(scaling):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = scaling.pop("head_dim", 64)
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                                      rope_parameters=dict(scaling))
    theirs, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config)
    values = [scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings") if k in scaling]
    ours = rope_frequencies(head_dim, scaling["rope_theta"], (scaling["rope_type"], *values))
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=2e-6)
    plain = rope_frequencies(head_dim, scaling["rope_theta"])
    if scaling["rope_type"] == "llama3":  # every band present: kept, blended, divided
        kept, divided = ours == plain, np.isclose(ours, plain / scaling["factor"], rtol=1e-6)
        assert kept.any() and divided.any() and (~kept & ~divided).any()


@pytest.mark.parametrize("name", ["qwen2_gqa", "qwen3_gqa", "llama3_gqa"])
def test_save_load_round_trip(families, tmp_path, name):
    assert_save_load_round_trip(jaxkv.load(families[name][1]), tmp_path)


@pytest.mark.parametrize("name, changes, match", [
    ("llama3_gqa", dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)),
     "rope scaling .*'yarn'.* is not supported; supported rope_type values: default, linear, "
     "llama3"),
    ("llama3_gqa", dict(rope_parameters=dict(rope_type="llama3", factor=8.0, rope_theta=1e4)),
     "rope scaling 'llama3' lacks low_freq_factor, high_freq_factor"),
    ("llama3_gqa", dict(rope_parameters={**LLAMA3_ROPE, "low_freq_factor": 4.0}),
     "Config.rope_scaling .llama3. needs high_freq_factor > low_freq_factor"),
])
def test_unsupported_or_broken_configs_name_the_problem(families, tmp_path, name, changes,
                                                        match):
    path = edited_copy(families[name][1], tmp_path, **changes)
    with pytest.raises(CheckpointError, match="config.json: " + match):
        jaxkv.load(path)


def test_every_end_of_turn_id_stops_generation(families, tmp_path):
    """Instruct models list several eos ids (config.json, then generation_config.json): the
    first is eos_id, the rest stop_ids, and generate stops at any of them by default in the
    CLI (config.end_ids)."""
    path = edited_copy(families["llama3_gqa"][1], tmp_path, eos_token_id=[5, 7])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, 500]}))
    with pytest.warns(UserWarning, match="eos_token_id 500 is outside the vocabulary"):
        config = jaxkv.load(path).config
    assert (config.eos_id, config.stop_ids, config.end_ids) == (5, (7, 9), (5, 7, 9))
    assert jaxkv.Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_gguf_linear_rope_scaling_is_read(tmp_path):
    import gguf

    from tests.test_bad_checkpoints import write_tiny_gguf

    def linear(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    config = jaxkv.load(write_tiny_gguf(tmp_path / "linear.gguf", edit=linear)).config
    assert config.rope_scaling == ("linear", 4.0)


def test_gguf_with_llama3_rope_factors_is_refused(tmp_path):
    """llama.cpp keeps Llama 3.1's scaling as the tensor rope_freqs.weight; ignoring it would
    decode wrongly."""
    from tests.test_bad_checkpoints import write_tiny_gguf

    def factors(writer):
        writer.add_tensor("rope_freqs.weight", np.ones(8, np.float32))

    path = write_tiny_gguf(tmp_path / "llama31.gguf", edit=factors)
    with pytest.raises(CheckpointError, match="llama31.gguf: per-frequency RoPE factors "
                       r"\(rope_freqs.weight, Llama 3.1\+ scaling\) are not supported yet"):
        jaxkv.load(path)
