"""OLMo 2: config.json keys and defaults, and the name map of Olmo2ForCausalLM.

Llama-shaped but for its norms: none on a sublayer's input, an RMSNorm on each sublayer's
output before it joins the stream (post_attention_layernorm, post_feedforward_layernorm), and
queries and keys normed over all their heads' dims at once (q_norm [N * H], k_norm [K * H])
before RoPE. From GGUF as llama.cpp's olmo2 writes it (Q/K rows not permuted)."""

from jaxkv.core.config import Config
from jaxkv.models import llama
from jaxkv.models.common import gguf_arch_field, with_defaults
from jaxkv.models.maps import CheckpointError, norm

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
    return _map(c, llama.HF_NAMES, layer + "post_attention_layernorm.weight",
                layer + "post_feedforward_layernorm.weight")


def _map(c: Config, names: dict, attn_out_norm: str, mlp_out_norm: str) -> dict:
    return {**llama.name_map(c, names),
            **qk_norms_all(c, names),
            **norm(c, "blocks.attn_out_norm", attn_out_norm),
            **norm(c, "blocks.mlp_out_norm", mlp_out_norm)}


def qk_norms_all(c: Config, names: dict) -> dict:
    """q_norm [N * H] and k_norm [K * H]: over all heads at once (OLMo 2, OLMoE)."""
    return {**norm(c, "blocks.q_norm", names["q_norm"], width=c.n_heads * c.head_dim),
            **norm(c, "blocks.k_norm", names["k_norm"], width=c.n_kv_heads * c.head_dim)}


# ---- GGUF (llama.cpp's olmo2) -----------------------------------------------------------------

def gguf_config(reader, source: str) -> Config:
    """Sliding-window layers (olmo2.attention.sliding_window: OLMo 3, which llama.cpp writes as
    olmo2) are refused: OLMo 3 is not one of jaxkv's families yet."""
    if gguf_arch_field(reader, "attention.sliding_window"):
        raise CheckpointError(f"{source}: olmo2 GGUF with sliding-window layers (OLMo 3) is not "
                              "supported")
    return Config.llama(**llama.gguf_decoder_fields(reader, source), qk_norm=True,
                        qk_norm_all=True, pre_norms=False, post_norms=True)


def gguf_map(c: Config, tensor_names=()) -> dict:
    return _map(c, llama.GGUF_NAMES, "blk.{i}.post_attention_norm.weight",
                "blk.{i}.post_ffw_norm.weight")
