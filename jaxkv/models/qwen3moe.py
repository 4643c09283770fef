"""Qwen3-MoE: Qwen3 whose MLPs are mixtures of experts (moe_intermediate_size wide; the router
weights renormalized where norm_topk_prob), but in mlp_only_layers and the layers
decoder_sparse_step skips, which keep a dense MLP: config.json keys and the name map of
Qwen3MoeForCausalLM; llama.cpp's qwen3moe GGUFs."""

import dataclasses

from jaxkv.core.config import Config
from jaxkv.models import llama, qwen
from jaxkv.models.common import with_defaults
from jaxkv.models.maps import experts

# transformers' Qwen3MoeConfig defaults where they differ from Qwen3Config's
# (the expert count: num_experts in older files, num_local_experts in transformers 5's)
HF_DEFAULTS = {**qwen.QWEN3_DEFAULTS, "intermediate_size": 6144, "num_experts_per_tok": 8,
               "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1,
               "mlp_only_layers": []}


def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "hidden_size"), source)
    step, dense = hf["decoder_sparse_step"], set(hf["mlp_only_layers"])
    return dataclasses.replace(
        qwen.qwen3_config(hf, source),
        n_experts=hf.get("num_local_experts") or hf.get("num_experts") or 128,
        experts_per_token=hf["num_experts_per_tok"], expert_d_ff=hf["moe_intermediate_size"],
        norm_topk=hf["norm_topk_prob"],
        dense_layers=tuple(i for i in range(hf["num_hidden_layers"])
                           if i in dense or (i + 1) % step))


def hf_map(c: Config, tensor_names=()) -> dict:
    mlp = "model.layers.{i}.mlp."
    return {**llama.name_map(c, llama.HF_NAMES),
            **experts(c, mlp + "gate.weight", mlp + "experts.{e}.gate_proj.weight",
                      mlp + "experts.{e}.up_proj.weight", mlp + "experts.{e}.down_proj.weight")}


# ---- GGUF (llama.cpp's qwen3moe) --------------------------------------------------------------

def gguf_config(reader, source: str) -> Config:
    """Every layer a mixture (llama.cpp has no dense layers for qwen3moe) of experts
    expert_feed_forward_length wide (absent: feed_forward_length / expert_used_count, as
    llama.cpp); its runtime always renormalizes the top k router weights (norm_topk_prob is
    not written: Qwen3-MoE's checkpoints set it), so this does too."""
    config = qwen.qwen3_gguf_config(reader, source)
    moe = llama.gguf_moe_fields(reader, True)
    if moe and moe["expert_d_ff"] is None and moe["experts_per_token"]:
        moe["expert_d_ff"] = config.d_ff // moe["experts_per_token"]
    return dataclasses.replace(config, **moe)


def gguf_map(c: Config, tensor_names=()) -> dict:
    return {**qwen.gguf_map(c), **llama.gguf_experts(c)}
