"""GGUF files of llama.cpp's qwen2, qwen3, gemma2 and gemma3 architectures, written from tiny
random Hugging Face models the way llama.cpp's converter writes them: tensor names from the gguf
package's own name map, <arch>.* metadata keys, Q/K rows as they are (llama.cpp permutes them for
its llama architecture only), Gemma's norm weights stored as 1 + w.

jaxkv's GGUF load must match the torch model the file came from (logits, ragged greedy tokens),
and transformers' GGUF loader must read the same file to the same logits, so the file is what
transformers takes such a GGUF to be."""

import dataclasses

import jax
import numpy as np
import pytest
import torch

import jaxkv
from tests.conftest import (HF_TINY, assert_logits_match_hf, assert_ragged_greedy_matches_hf,
                            finish_gguf, random_tokens, save_tiny_models)

W = 8  # the Gemmas' sliding window: the 40-position tests reach past it
SMALL = dict(hidden_size=64, intermediate_size=96, max_position_embeddings=128, **HF_TINY)


def tiny_configs():
    """Each shaped so that transformers' GGUF loader, which fills what the file does not say
    with its config class's defaults, builds the same model: Qwen3's head_dim 128, the Gemmas'
    head_dim 256 = query_pre_attn_scalar, Gemma 3's layer pattern 6 and local RoPE base 1e4."""
    import transformers as tf

    return {
        "qwen2": (tf.Qwen2Config(num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, rope_theta=1e5, **SMALL),
                  tf.Qwen2ForCausalLM),
        "qwen3_tied": (tf.Qwen3Config(num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=128,
                                      tie_word_embeddings=True, **SMALL), tf.Qwen3ForCausalLM),
        "gemma2": (tf.Gemma2Config(num_hidden_layers=3, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=256, sliding_window=W,
                                   **SMALL), tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig(num_hidden_layers=7, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=256, sliding_window=W,
                                       **SMALL), tf.Gemma3ForCausalLM),
    }


ARCHS = {"qwen2": "QWEN2", "qwen3_tied": "QWEN3", "gemma2": "GEMMA2", "gemma3": "GEMMA3"}


def write_gguf(model, arch: str, path, edit=None):
    """model's weights (float32) and config as llama.cpp's convert_hf_to_gguf.py writes them;
    edit(writer), if given, adds to it."""
    import gguf

    c, kind = model.config, getattr(gguf.MODEL_ARCH, arch)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[kind])
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if getattr(c, "head_dim", None):  # as llama.cpp: only where the config names one
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch.startswith("GEMMA"):
        writer.add_sliding_window(c.sliding_window)
    writer.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])  # the vocabulary's size
    names = gguf.get_tensor_name_map(kind, c.num_hidden_layers)
    for hf_name, w in model.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None or (hf_name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        w = w.numpy().astype(np.float32)
        if arch.startswith("GEMMA") and hf_name.endswith("norm.weight"):
            w = w + 1  # llama.cpp stores Gemma's (1 + w) RMSNorm scale
        writer.add_tensor(name, w)
    finish_gguf(writer, edit)
    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """{name: (torch model, .gguf path)}."""
    models = save_tiny_models(tiny_configs(), tmp_path_factory, seed=500, eager=True)
    folder = tmp_path_factory.mktemp("ggufs")
    return {name: (model, write_gguf(model, ARCHS[name], folder / f"{name}.gguf"))
            for name, (model, _) in models.items()}


NAMES = sorted(ARCHS)


def test_configs_read_from_gguf_metadata(ggufs):
    c = {name: jaxkv.load(ggufs[name][1]).config for name in NAMES}
    q2, q3, g2, g3 = c["qwen2"], c["qwen3_tied"], c["gemma2"], c["gemma3"]
    assert q2.attn_bias and not q2.attn_out_bias and q2.rope_theta == 1e5
    assert not q2.tie_embeddings and q2.sliding_window is None
    assert q3.qk_norm and q3.head_dim == 128 and q3.tie_embeddings and not q3.attn_bias
    assert (g2.window_layers, g2.sliding_window) == ((0, 2), W)
    assert (g2.attn_softcap, g2.logit_softcap, g2.attn_scale_base) == (50.0, 30.0, 256)
    assert g2.scale_embeddings and g2.post_norms and g2.activation == "gelu_tanh"
    assert (g3.window_layers, g3.sliding_window) == ((0, 1, 2, 3, 4, 6), W)
    assert (g3.rope_theta, g3.local_rope_theta, g3.attn_scale_base) == (1e6, 1e4, 256)
    assert g3.qk_norm and g3.logit_softcap is None and g3.attn_softcap is None
    for name in NAMES:  # as the same model loaded from its Hugging Face directory
        assert c[name].vocab_size == 97 and c[name].d_model == 64


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_torch_model(ggufs, name):
    """40 positions: past the Gemmas' window."""
    model, path = ggufs[name]
    diff = assert_logits_match_hf(model, jaxkv.load(path), random_tokens(3, (2, 40)))
    print(f"{name}: max |diff| {diff:.2e}")


@pytest.mark.parametrize("name", NAMES)
def test_transformers_reads_the_file_to_the_same_logits(ggufs, name):
    """transformers' GGUF loader (which subtracts 1 from Gemma norms and does not permute these
    architectures' Q/K) on the same file agrees with jaxkv: the file is a faithful GGUF."""
    from transformers import AutoModelForCausalLM

    _, path = ggufs[name]
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    diff = assert_logits_match_hf(theirs, jaxkv.load(path), random_tokens(4, (2, 40)))
    print(f"{name}: max |diff| vs transformers' GGUF load {diff:.2e}")


@pytest.mark.parametrize("name", NAMES)
def test_ragged_greedy_matches_the_torch_model(ggufs, name):
    """Prompts of 5 and 19 tokens (one shorter, one longer than the window), 12 new tokens."""
    model, path = ggufs[name]
    assert_ragged_greedy_matches_hf(model, jaxkv.load(path), lengths=(5, 19), new_tokens=12)


def test_gguf_and_hugging_face_loads_agree(ggufs, tmp_path):
    """The same Gemma 3 weights through both readers: the same Config (the GGUF's epsilon is
    a float32) and the same parameters (1 + w added before or after writing)."""
    model, path = ggufs["gemma3"]
    model.save_pretrained(tmp_path)
    from_hf, from_gguf = jaxkv.load(tmp_path), jaxkv.load(path)
    eps = float(np.float32(from_hf.config.norm_eps))
    assert dataclasses.replace(from_hf.config, norm_eps=eps) == from_gguf.config
    for ours, theirs in zip(jax.tree.leaves(from_hf), jax.tree.leaves(from_gguf), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_gemma3_without_a_window_has_none(ggufs, tmp_path):
    """llama.cpp reads no sliding window when gemma3.attention.sliding_window is absent, and
    reads the final soft-cap when the file has one."""
    model, _ = ggufs["gemma3"]

    def edit(writer):
        del writer.kv_data[0]["gemma3.attention.sliding_window"]
        writer.add_final_logit_softcapping(30.0)

    config = jaxkv.load(write_gguf(model, "GEMMA3", tmp_path / "g.gguf", edit)).config
    assert config.sliding_window is None and config.local_rope_theta is None
    assert config.logit_softcap == 30.0


def test_gemma3_linear_rope_scaling_is_read_for_the_global_layers(ggufs, tmp_path):
    """Gemma 3 4B and larger: llama.cpp's converter writes rope.scaling.type linear (factor 8),
    which llama.cpp applies to the global layers only (transformers' GGUF loader reads no
    scaling for gemma3)."""
    import gguf

    model, _ = ggufs["gemma3"]

    def edit(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(8.0)

    config = jaxkv.load(write_gguf(model, "GEMMA3", tmp_path / "g.gguf", edit)).config
    assert config.rope(local=False) == (1e6, ("linear", 8.0))
    assert config.rope(local=True) == (1e4, ())


def test_gemma2_soft_caps_come_from_the_file(ggufs, tmp_path):
    model, _ = ggufs["gemma2"]

    def edit(writer):
        writer.add_attn_logit_softcapping(20.0)
        writer.add_final_logit_softcapping(10.0)

    config = jaxkv.load(write_gguf(model, "GEMMA2", tmp_path / "g.gguf", edit)).config
    assert (config.attn_softcap, config.logit_softcap) == (20.0, 10.0)


def test_end_of_turn_ids_stop_generation(ggufs, tmp_path):
    """llama.cpp's eot / eom token ids become stop_ids (an instruct Gemma ends its turn with
    <end_of_turn>, not eos)."""
    model, _ = ggufs["gemma3"]

    def edit(writer):
        writer.add_eos_token_id(1)
        writer.add_eot_token_id(6)
        writer.add_eom_token_id(1)  # the same as eos: not repeated

    config = jaxkv.load(write_gguf(model, "GEMMA3", tmp_path / "g.gguf", edit)).config
    assert (config.eos_id, config.stop_ids, config.end_ids) == (1, (6,), (1, 6))
