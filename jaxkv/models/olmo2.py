"""OLMo 2: config.json keys and defaults, and the name map of Olmo2ForCausalLM.

Llama-shaped but for its norms: none on a sublayer's input, an RMSNorm on each sublayer's
output before it joins the stream (post_attention_layernorm, post_feedforward_layernorm), and
queries and keys normed over all their heads' dims at once (q_norm [N * H], k_norm [K * H])
before RoPE."""

from jaxkv.core.config import Config
from jaxkv.models import llama
from jaxkv.models.common import with_defaults
from jaxkv.models.maps import norm

# transformers' Olmo2Config defaults where they differ from LlamaConfig's
HF_DEFAULTS = {**llama.HF_DEFAULTS, "rms_norm_eps": 1e-5, "bos_token_id": None,
               "eos_token_id": 50279}


def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "hidden_size"), source)
    return llama.rope_decoder_config(hf, source, attn_bias=hf["attention_bias"],
                                     qk_norm=True, qk_norm_all=True, pre_norms=False,
                                     post_norms=True)


def hf_map(c: Config, tensor_names=()) -> dict:
    layer = "model.layers.{i}."
    return {**llama.name_map(c, llama.HF_NAMES),
            **norm(c, "blocks.q_norm", layer + "self_attn.q_norm.weight",
                   width=c.n_heads * c.head_dim),
            **norm(c, "blocks.k_norm", layer + "self_attn.k_norm.weight",
                   width=c.n_kv_heads * c.head_dim),
            **norm(c, "blocks.attn_out_norm", layer + "post_attention_layernorm.weight"),
            **norm(c, "blocks.mlp_out_norm", layer + "post_feedforward_layernorm.weight")}
