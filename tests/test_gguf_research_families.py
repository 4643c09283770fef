"""GGUF files of llama.cpp's gptneox, olmo2, phi3, qwen3moe and olmoe architectures, and Mixtral
as llama.cpp writes it (llama with experts), made from tiny random Hugging Face checkpoints the
way llama.cpp's convert_hf_to_gguf.py makes them (docs/models.md names what it does per
architecture): tensors read from the saved safetensors, GPT-NeoX's fused rows reordered from
[N, 3, H] to [3, N, H], Mixtral's Q/K rows permuted (llama only), every expert's matrices
stacked into ffn_{gate,up,down}_exps, only the metadata keys the converter writes.

jaxkv's GGUF load must match the torch model the file came from (logits, ragged greedy
tokens); for phi3 and qwen3moe, which transformers' GGUF loader reads, the file must read to
the same logits there too. Each tiny model keeps to what llama.cpp's runtime computes for its
architecture (qwen3moe renormalizes the top k router weights, olmoe does not; olmoe's k_norm
needs as many kv heads as heads). llama.cpp itself reads these files in
scripts/check_gguf_llamacpp.py (llama-cpp-python, the bench extra: not a test dependency)."""

import dataclasses
import os

import jax
import numpy as np
import pytest
import torch

import jaxkv
from jaxkv.models.maps import CheckpointError
from jaxkv.ops.arrays import Int8
from tests.conftest import (HF_TINY, assert_logits_match_hf, assert_ragged_greedy_matches_hf,
                            finish_gguf, random_tokens, save_tiny_models)

SMALL = dict(hidden_size=64, intermediate_size=96, max_position_embeddings=128, **HF_TINY)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)


def tiny_configs():
    import transformers as tf

    moe = dict(num_experts_per_tok=2, **SMALL)
    return {
        "gptneox": (tf.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25,
                                     **SMALL), tf.GPTNeoXForCausalLM),
        "gptneox_sequential": (tf.GPTNeoXConfig(
            num_hidden_layers=2, num_attention_heads=4, use_parallel_residual=False, **SMALL),
            tf.GPTNeoXForCausalLM),
        "olmo2": (tf.Olmo2Config(num_hidden_layers=2, **HEADS, **SMALL), tf.Olmo2ForCausalLM),
        "phi3": (tf.Phi3Config(num_hidden_layers=2, **HEADS, **SMALL), tf.Phi3ForCausalLM),
        "phi3_window": (tf.Phi3Config(num_hidden_layers=2, partial_rotary_factor=0.5,
                                      sliding_window=8, **HEADS, **SMALL), tf.Phi3ForCausalLM),
        "qwen3moe": (tf.Qwen3MoeConfig(num_hidden_layers=2, num_experts=4,
                                       moe_intermediate_size=32, head_dim=16, norm_topk_prob=True,
                                       **HEADS, **moe), tf.Qwen3MoeForCausalLM),
        "olmoe": (tf.OlmoeConfig(num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, num_experts=4, **moe),
                  tf.OlmoeForCausalLM),
        "mixtral": (tf.MixtralConfig(num_hidden_layers=2, num_local_experts=4, **HEADS, **moe),
                    tf.MixtralForCausalLM),
    }


ARCHS = {"gptneox": "GPTNEOX", "gptneox_sequential": "GPTNEOX", "olmo2": "OLMO2",
         "phi3": "PHI3", "phi3_window": "PHI3", "qwen3moe": "QWEN3MOE", "olmoe": "OLMOE",
         "mixtral": "LLAMA"}


def write_metadata(writer, c, arch: str):
    """The keys convert_hf_to_gguf.py writes for arch (GPT-NeoX and Phi-3 have their own lists;
    the others the common one, experts' counts where the config has them)."""
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    head_dim = c.hidden_size // c.num_attention_heads
    rotary = c.rope_parameters.get("partial_rotary_factor", 1.0)  # transformers 5's place
    if arch == "GPTNEOX":  # no rope base, no kv head count
        writer.add_rope_dimension_count(int(rotary * head_dim))
        writer.add_parallel_residual(c.use_parallel_residual)
        writer.add_layer_norm_eps(c.layer_norm_eps)
        return
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if arch == "PHI3":
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        writer.add_rope_dimension_count(int(rotary * c.hidden_size) // c.num_attention_heads)
        writer.add_sliding_window(c.sliding_window or 0)
        return
    if getattr(c, "head_dim", None):
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if arch == "LLAMA":
        writer.add_vocab_size(c.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    if arch == "QWEN3MOE":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)


def gguf_tensors(state: dict, c, arch: str, names) -> dict:
    """{GGUF name: float32 array} of the saved tensors, as the converter transforms them."""
    import gguf

    out, experts = {}, {}
    for hf_name, w in state.items():
        w = w.astype(np.float32)
        parts = hf_name.split(".")
        if "experts" in parts:  # model.layers.{i}.<mlp>.experts.{e}.<which>.weight
            i, e, which = int(parts[2]), int(parts[-3]), parts[-2]
            experts.setdefault((i, which), {})[e] = w
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if arch == "GPTNEOX" and "query_key_value" in hf_name:  # [N, 3, H] -> [3, N, H] rows
            n = c.num_attention_heads
            w = w.reshape(n, 3, -1, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
        if arch == "LLAMA" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            n = c.num_attention_heads if "q_proj" in hf_name else c.num_key_value_heads
            w = w.reshape(n, 2, w.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(w.shape)
        out[name] = w
    kinds = {"gate_proj": "GATE", "w1": "GATE", "up_proj": "UP", "w3": "UP", "down_proj": "DOWN",
             "w2": "DOWN"}
    for (i, which), per_expert in experts.items():
        kind = getattr(gguf.MODEL_TENSOR, f"FFN_{kinds[which]}_EXP")
        name = gguf.TENSOR_NAMES[kind].format(bid=i) + ".weight"
        out[name] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def write_gguf(directory, arch: str, path, edit=None):
    """The checkpoint save_pretrained wrote in directory, as llama.cpp's converter writes it
    (float32); edit(writer), if given, adds to it."""
    import gguf
    import safetensors.numpy
    import transformers

    c = transformers.AutoConfig.from_pretrained(directory)
    state = safetensors.numpy.load_file(os.path.join(directory, "model.safetensors"))
    kind = getattr(gguf.MODEL_ARCH, arch)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[kind])
    write_metadata(writer, c, arch)
    writer.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])  # the vocabulary's size
    writer.add_pad_token_id(0)  # (transformers' Phi3Config default, 32000, is past it)
    names = gguf.get_tensor_name_map(kind, c.num_hidden_layers)
    for name, w in gguf_tensors(state, c, arch, names).items():
        writer.add_tensor(name, w)
    finish_gguf(writer, edit)
    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """{name: (torch model, .gguf path, Hugging Face directory)}."""
    models = save_tiny_models(tiny_configs(), tmp_path_factory, seed=700, eager=True)
    folder = tmp_path_factory.mktemp("ggufs")
    return {name: (model, write_gguf(directory, ARCHS[name], folder / f"{name}.gguf"), directory)
            for name, (model, directory) in models.items()}


NAMES = sorted(ARCHS)


@pytest.mark.parametrize("name", NAMES)
def test_config_and_weights_equal_the_hugging_face_load(ggufs, name):
    """The same Config as from config.json (where the file says what llama.cpp's runtime
    fixes: the norms' epsilon as float32) and the same parameters."""
    _, path, directory = ggufs[name]
    from_gguf, from_hf = jaxkv.load(path), jaxkv.load(directory)
    eps = float(np.float32(from_hf.config.norm_eps))
    assert from_gguf.config == dataclasses.replace(from_hf.config, norm_eps=eps)
    for ours, theirs in zip(jax.tree.leaves(from_gguf), jax.tree.leaves(from_hf), strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_torch_model(ggufs, name):
    """40 positions: past Phi-3's window."""
    model, path, _ = ggufs[name]
    diff = assert_logits_match_hf(model, jaxkv.load(path), random_tokens(3, (2, 40)))
    print(f"{name}: max |diff| {diff:.2e}")


def test_transformers_reads_the_file_to_the_same_logits(ggufs):
    """transformers' GGUF loader reads the same Phi-3 file to the same model: the fused Q/K/V
    and gate/up rows are where llama.cpp puts them. (Its loader reads neither phi3's
    rope.dimension_count nor the window, and for qwen3moe neither the experts' width nor
    llama.cpp's renormalized router weights: those files are not compared.)"""
    from transformers import AutoModelForCausalLM

    _, path, _ = ggufs["phi3"]
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    diff = assert_logits_match_hf(theirs, jaxkv.load(path), random_tokens(4, (2, 40)))
    print(f"max |diff| vs transformers' GGUF load {diff:.2e}")


@pytest.mark.parametrize("name", ["gptneox", "phi3_window", "mixtral", "olmoe"])
def test_ragged_greedy_matches_the_torch_model(ggufs, name):
    model, path, _ = ggufs[name]
    assert_ragged_greedy_matches_hf(model, jaxkv.load(path), lengths=(5, 19), new_tokens=12)


def test_int8_load_makes_experts_int8(ggufs):
    """A float GGUF's experts quantized per expert and row on load, as from Hugging Face."""
    _, path, directory = ggufs["qwen3moe"]
    ours, theirs = jaxkv.load(path, int8=True), jaxkv.load(directory, int8=True)
    assert isinstance(ours.blocks[0].experts_in, Int8)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)


def test_phi3_longrope_and_olmo3_windows_are_refused(ggufs, tmp_path):
    _, _, phi3 = ggufs["phi3_window"]

    def longrope(writer):
        writer.add_tensor("rope_factors_long.weight", np.ones(4, np.float32))
        writer.add_tensor("rope_factors_short.weight", np.ones(4, np.float32))
    with pytest.raises(CheckpointError, match="LongRoPE"):
        jaxkv.load(write_gguf(phi3, "PHI3", tmp_path / "p.gguf", longrope))
    _, _, olmo2 = ggufs["olmo2"]
    path = write_gguf(olmo2, "OLMO2", tmp_path / "o.gguf",
                      lambda writer: writer.add_sliding_window(4096))
    with pytest.raises(CheckpointError, match="OLMo 3"):
        jaxkv.load(path)
