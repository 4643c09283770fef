"""Mixtral: Mistral whose MLPs are mixtures of experts (each token's top 2 of 8, their router
weights renormalized): config.json keys and defaults, and the name map of
MixtralForCausalLM."""

from jaxkv.core.config import Config
from jaxkv.models import llama
from jaxkv.models.common import window, with_defaults
from jaxkv.models.maps import experts

# transformers' MixtralConfig defaults for keys a config.json may omit
HF_DEFAULTS = {**llama.HF_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
               "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
               "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2}


def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "hidden_size"), source)
    return llama.rope_decoder_config(
        hf, source, n_experts=hf["num_local_experts"],
        experts_per_token=hf["num_experts_per_tok"], norm_topk=True, **window(hf, 0))


def hf_map(c: Config, tensor_names=()) -> dict:
    moe = "model.layers.{i}.block_sparse_moe."
    return {**llama.name_map(c, llama.HF_NAMES),
            **experts(c, moe + "gate.weight", moe + "experts.{e}.w1.weight",
                      moe + "experts.{e}.w3.weight", moe + "experts.{e}.w2.weight")}
