"""OLMoE: Llama-shaped with mixtures of experts (router weights renormalized where
norm_topk_prob) and queries and keys normed over all heads at once: config.json keys and
the name map of OlmoeForCausalLM; llama.cpp's olmoe GGUFs."""

from jaxkv.core.config import Config
from jaxkv.models import llama
from jaxkv.models.common import with_defaults
from jaxkv.models.maps import CheckpointError, experts
from jaxkv.models.olmo2 import qk_norms_all

# transformers' OlmoeConfig defaults where they differ from LlamaConfig's
HF_DEFAULTS = {**llama.HF_DEFAULTS, "intermediate_size": 1024, "num_hidden_layers": 16,
               "num_attention_heads": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
               "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
               "clip_qkv": None, "bos_token_id": None, "eos_token_id": 50279}


def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "hidden_size"), source)
    if hf["clip_qkv"] is not None:
        raise CheckpointError(f"{source}: OLMoE's clip_qkv ({hf['clip_qkv']}) is not supported")
    return llama.rope_decoder_config(
        hf, source, attn_bias=hf["attention_bias"], qk_norm=True, qk_norm_all=True,
        n_experts=hf["num_experts"], experts_per_token=hf["num_experts_per_tok"],
        norm_topk=hf["norm_topk_prob"])


def hf_map(c: Config, tensor_names=()) -> dict:
    layer = "model.layers.{i}."
    mlp = layer + "mlp."
    return {**llama.name_map(c, llama.HF_NAMES), **qk_norms_all(c, llama.HF_NAMES),
            **experts(c, mlp + "gate.weight", mlp + "experts.{e}.gate_proj.weight",
                      mlp + "experts.{e}.up_proj.weight", mlp + "experts.{e}.down_proj.weight")}


# ---- GGUF (llama.cpp's olmoe) -----------------------------------------------------------------

def gguf_config(reader, source: str) -> Config:
    """Experts of feed_forward_length units; llama.cpp's runtime never renormalizes the top k
    router weights (OLMoE's norm_topk_prob False), so neither does this."""
    return Config.llama(**llama.gguf_decoder_fields(reader, source), qk_norm=True,
                        qk_norm_all=True, **llama.gguf_moe_fields(reader, False))


def gguf_map(c: Config, tensor_names=()) -> dict:
    return {**llama.name_map(c, llama.GGUF_NAMES), **qk_norms_all(c, llama.GGUF_NAMES),
            **llama.gguf_experts(c)}
