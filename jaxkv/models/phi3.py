"""Phi-3 (and Phi-4-mini): config.json keys and defaults, and the name map of Phi3ForCausalLM.

Llama-shaped, with Q/K/V fused in one qkv_proj ([N * H | K * H | K * H] rows) and gate and up
in one gate_up_proj ([F | F] rows); RoPE may turn part of each head (partial_rotary_factor,
Phi-4-mini's 0.75) and every layer may read a sliding window. LongRoPE ("longrope", the 128k
models' per-frequency factors) is refused with the rope types jaxkv reads. From GGUF as
llama.cpp's phi3 writes it (the same fused rows)."""

import dataclasses

from jaxkv.core.config import Config
from jaxkv.core.params import gate_up_rows
from jaxkv.models import llama
from jaxkv.models.common import gguf_arch_field, gguf_tensor_names, window, with_defaults
from jaxkv.models.maps import CheckpointError, Fused, Src, out_proj, qkv, rows

# transformers' Phi3Config defaults for keys a config.json may omit
HF_DEFAULTS = {**llama.HF_DEFAULTS, "intermediate_size": 8192, "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 32000,
               "sliding_window": None}


def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "hidden_size"), source)
    rope = dict(hf.get("rope_parameters") or {})
    fraction = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    head_dim = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
    config = llama.rope_decoder_config({**hf, "rope_parameters": rope}, source, **window(hf, 0))
    return config if fraction == 1.0 else dataclasses.replace(
        config, rotary_dim=int(head_dim * fraction))


def hf_map(c: Config, tensor_names=()) -> dict:
    layer = "model.layers.{i}."
    return _map(c, llama.HF_NAMES, layer + "self_attn.qkv_proj.weight",
                layer + "mlp.gate_up_proj.weight")


def _map(c: Config, names: dict, w: str, gate_up: str) -> dict:
    """The Llama map with Q/K/V from one [N * H | K * H | K * H] tensor w and gate and up
    from one [F | F] tensor gate_up."""
    D, F, NH, KH = c.d_model, c.d_ff, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim

    def span(start, n):
        return lambda x: x[start:start + n]
    m = llama.name_map(c, names)
    del m["blocks.w_in"], m["blocks.b_in"]
    return {
        **m,
        **qkv(c, "blocks", Src(w, (NH + 2 * KH, D), span(0, NH)),
              Src(w, (NH + 2 * KH, D), span(NH, KH)), Src(w, (NH + 2 * KH, D), span(NH + KH, KH)),
              Src(None, (NH,)), Src(None, (KH,)), Src(None, (KH,))),
        **out_proj(c, "blocks", names["o"], bias=False),
        "blocks.w_in": Fused((Src(gate_up, (2 * F, D), rows(0, F)),
                              Src(gate_up, (2 * F, D), rows(1, F))), gate_up_rows),
        "blocks.b_in": Fused((Src(None, (F,)), Src(None, (F,))), gate_up_rows),
    }


# ---- GGUF (llama.cpp's phi3) ------------------------------------------------------------------

def gguf_config(reader, source: str) -> Config:
    """rope.dimension_count: the rotary part of each head; attention.sliding_window (0: none,
    Phi-4-mini) read for every layer, as transformers does (llama.cpp's runtime ignores it:
    the two differ only past the window). LongRoPE (rope_factors_long / _short tensors, or a
    rope.scaling.attn_factor) is refused, as from Hugging Face."""
    longrope = {"rope_factors_long.weight", "rope_factors_short.weight"}
    if gguf_tensor_names(reader) & longrope or gguf_arch_field(reader, "rope.scaling.attn_factor",
                                                               1.0) != 1.0:
        raise CheckpointError(f"{source}: Phi-3 LongRoPE scaling (rope_factors_long / "
                              "rope_factors_short) is not supported")
    fields = llama.gguf_decoder_fields(reader, source)
    rotary = gguf_arch_field(reader, "rope.dimension_count", fields["head_dim"])
    size = gguf_arch_field(reader, "attention.sliding_window")
    windows = dict(sliding_window=size, window_layers=tuple(range(fields["n_layers"])))
    return Config.llama(**fields, rotary_dim=None if rotary == fields["head_dim"] else rotary,
                        **(windows if size else {}))


def gguf_map(c: Config, tensor_names=()) -> dict:
    return _map(c, llama.GGUF_NAMES, "blk.{i}.attn_qkv.weight", "blk.{i}.ffn_up.weight")
