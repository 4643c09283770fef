"""Gemma 2 and Gemma 3 (text): config.json keys and defaults, GGUF metadata (llama.cpp's gemma2,
gemma3), and the name maps: Llama's, plus a norm after each sublayer.

Gemma's RMSNorms scale by (1 + weight). Hugging Face stores the weight, so its map adds 1 at
load; llama.cpp's converter stores the sum already (its Gemma models add 1 to every
*norm.weight), so the GGUF map reads the scale as it is.
"""

import dataclasses

import numpy as np

from jaxkv.core.config import Config
from jaxkv.models import llama
from jaxkv.models.common import activation, gguf_arch_field, special_ids, window, with_defaults
from jaxkv.models.maps import CheckpointError, norm

# transformers' Gemma2Config defaults
GEMMA2_DEFAULTS = dict(intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                       max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
                       attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                       layer_types=None, final_logit_softcapping=30.0,
                       attn_logit_softcapping=50.0, tie_word_embeddings=True, bos_token_id=2,
                       eos_token_id=1)
# Gemma3TextConfig: older configs give the RoPE bases top-level and the local/global layer
# pattern as sliding_window_pattern; transformers 5 writes rope_parameters per layer type and
# layer_types
GEMMA3_DEFAULTS = {**GEMMA2_DEFAULTS, "max_position_embeddings": 131072, "rope_theta": 1e6,
                   "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
                   "final_logit_softcapping": None, "attn_logit_softcapping": None}

# What every Gemma is, whichever file it comes from: gated GELU-tanh, embeddings scaled by
# sqrt(width), each sublayer's output normed too
GEMMA_FIELDS = dict(activation="gelu_tanh", scale_embeddings=True, post_norms=True)


# ---- Hugging Face config.json -----------------------------------------------------------------

def gemma2_config(hf: dict, source: str, tensor_names=()) -> Config:
    """Gemma 2: local (even) and global (odd) layers; scores and logits soft-capped."""
    hf = with_defaults(hf, GEMMA2_DEFAULTS, ("vocab_size", "hidden_size"), source)
    theta, scaling = llama.rope_scaling(hf, source)
    return _hf_gemma_config(hf, source, 2, rope_theta=theta, rope_scaling=scaling,
                            attn_softcap=hf["attn_logit_softcapping"])


def gemma3_config(hf: dict, source: str, tensor_names=()) -> Config:
    """Gemma 3 (text): five local layers to one global by default; per-head q/k norms; the
    local layers' RoPE base is their own. Its attention never soft-caps scores (transformers'
    Gemma3Attention ignores attn_logit_softcapping), so neither do we."""
    hf = with_defaults(hf, GEMMA3_DEFAULTS, ("vocab_size", "hidden_size"), source)
    theta, scaling, local_theta = _gemma3_rope(hf, source)
    return _hf_gemma_config(hf, source, hf["sliding_window_pattern"], qk_norm=True,
                            rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)


def _gemma3_rope(hf: dict, source: str) -> tuple:
    """(theta, scaling) of the global layers and the local layers' theta, from rope_parameters
    per layer type (transformers 5) or rope_theta, rope_scaling and rope_local_base_freq."""
    rope = hf.get("rope_parameters") or {}
    if not {"full_attention", "sliding_attention"} & set(rope):
        return (*llama.rope_scaling(hf, source), hf["rope_local_base_freq"])
    full = rope.get("full_attention") or {"rope_type": "default"}
    local = rope.get("sliding_attention") or {}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise CheckpointError(f"{source}: RoPE scaling in the sliding-window layers ({local!r}) "
                              "is not supported")
    theta, scaling = llama.rope_scaling({**hf, "rope_parameters": full}, source)
    return theta, scaling, local.get("rope_theta", hf["rope_local_base_freq"])


def _hf_gemma_config(hf: dict, source: str, pattern: int, **family) -> Config:
    """What Gemma 2 and 3 share: gated GELU-tanh, embeddings scaled by sqrt(width), sublayer
    outputs normed, scores scaled by query_pre_attn_scalar**-0.5, logits soft-capped where
    final_logit_softcapping says; layer_types (else every pattern-th layer global) picks the
    sliding-window layers."""
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: bidirectional attention (use_bidirectional_attention) "
                              "is not supported")
    if activation(hf["hidden_activation"], source) != "gelu_tanh":
        raise CheckpointError(f"{source}: unsupported hidden_activation "
                              f"{hf['hidden_activation']!r}")
    L, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    types = hf["layer_types"] or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(L)]
    return Config.llama(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=L, n_heads=n_heads,
        n_kv_heads=hf["num_key_value_heads"] or n_heads, head_dim=hf["head_dim"],
        d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf["rms_norm_eps"], attn_bias=hf["attention_bias"],
        tie_embeddings=hf["tie_word_embeddings"], attn_scale_base=hf["query_pre_attn_scalar"],
        logit_softcap=hf["final_logit_softcapping"],
        **window({**hf, "layer_types": types}, 0), **GEMMA_FIELDS, **family,
        **special_ids(hf, source, ("bos_token_id", "eos_token_id")))



# ---- GGUF (llama.cpp's gemma2 / gemma3) -------------------------------------------------------

# llama.cpp's fixed hyperparameters for what its Gemma GGUFs do not store (llama-model.cpp):
# which layers are local (every layer but each pattern-th), the local layers' RoPE base
# (Gemma 3), the soft-caps' defaults (Gemma 2), and the layer count of the 27B models, whose
# scores are scaled by (d_model / n_heads)**-0.5 instead of head_dim**-0.5
GGUF_GEMMA2 = dict(pattern=2, window=4096, attn_softcap=50.0, logit_softcap=30.0, n_layers_27b=46)
GGUF_GEMMA3 = dict(pattern=6, local_rope_theta=10000.0, n_layers_27b=62)


def gemma2_gguf_config(reader, source: str) -> Config:
    """Even layers windowed (gemma2.attention.sliding_window, else 4096); soft-caps from
    gemma2.attn_logit_softcapping / final_logit_softcapping, else 50 and 30."""
    fields = llama.gguf_decoder_fields(reader, source)
    get = lambda key, default: gguf_arch_field(reader, key, default)  # noqa: E731
    return Config.llama(
        **fields, **GEMMA_FIELDS,
        **_gguf_windows(fields["n_layers"], GGUF_GEMMA2["pattern"],
                        get("attention.sliding_window", GGUF_GEMMA2["window"])),
        attn_scale_base=_gguf_scale_base(fields, GGUF_GEMMA2["n_layers_27b"]),
        attn_softcap=float(get("attn_logit_softcapping", GGUF_GEMMA2["attn_softcap"])),
        logit_softcap=float(get("final_logit_softcapping", GGUF_GEMMA2["logit_softcap"])))


def gemma3_gguf_config(reader, source: str) -> Config:
    """Windows only where gemma3.attention.sliding_window is set (llama.cpp: none otherwise);
    the global layers' RoPE (freq_base, linear scaling) from the file, the local layers'
    base fixed at 10000; logits soft-capped only if final_logit_softcapping is set."""
    fields = llama.gguf_decoder_fields(reader, source)
    size = gguf_arch_field(reader, "attention.sliding_window")
    windows = _gguf_windows(fields["n_layers"], GGUF_GEMMA3["pattern"], size)
    cap = gguf_arch_field(reader, "final_logit_softcapping")
    return Config.llama(
        **fields, **GEMMA_FIELDS, **windows, qk_norm=True,
        local_rope_theta=GGUF_GEMMA3["local_rope_theta"] if windows else None,
        attn_scale_base=_gguf_scale_base(fields, GGUF_GEMMA3["n_layers_27b"]),
        logit_softcap=float(cap) if cap else None)


def _gguf_windows(n_layers: int, pattern: int, size) -> dict:
    """Every layer but each pattern-th windowed to size (none if size is absent or 0)."""
    if not size:
        return {}
    return dict(sliding_window=int(size),
                window_layers=tuple(i for i in range(n_layers) if (i + 1) % pattern))


def _gguf_scale_base(fields: dict, n_layers_27b: int) -> int:
    if fields["n_layers"] == n_layers_27b:
        return fields["d_model"] // fields["n_heads"]
    return fields["head_dim"]


# ---- name maps --------------------------------------------------------------------------------

def one_plus(w):
    """Gemma's norms scale by 1 + weight: stored as that sum, made in float32 as transformers
    makes it on every call (so exact in float32; rounded once when loaded in a narrower
    dtype)."""
    return np.float32(1) + w


def hf_map(c: Config, tensor_names=()) -> dict:
    """Gemma2ForCausalLM / Gemma3ForCausalLM: the Llama map with each sublayer's output normed too
    (post_attention_layernorm, post_feedforward_layernorm; the MLP's input norm is
    pre_feedforward_layernorm), every norm scaling by 1 + weight."""
    layer = "model.layers.{i}."
    names = {**llama.HF_NAMES, "mlp_norm": layer + "pre_feedforward_layernorm.weight"}
    m = _with_post_norms(c, names, layer + "post_attention_layernorm.weight",
                         layer + "post_feedforward_layernorm.weight")
    return {ours: dataclasses.replace(src, to_ours=one_plus) if ours.endswith("norm.scale")
            else src for ours, src in m.items()}


def gguf_map(c: Config, tensor_names=()) -> dict:
    """llama.cpp's names (ffn_norm before the MLP, post_attention_norm and post_ffw_norm after
    the sublayers); norm scales stored as 1 + weight already, Q/K rows not permuted."""
    return _with_post_norms(c, llama.GGUF_NAMES, "blk.{i}.post_attention_norm.weight",
                            "blk.{i}.post_ffw_norm.weight")


def _with_post_norms(c: Config, names: dict, attn_out: str, mlp_out: str) -> dict:
    return {**llama.name_map(c, names), **norm(c, "blocks.attn_out_norm", attn_out),
            **norm(c, "blocks.mlp_out_norm", mlp_out)}
