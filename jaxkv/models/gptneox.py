"""GPT-NeoX (Pythia): config.json keys and defaults, and the name map of GPTNeoXForCausalLM.

What differs from Llama: attention and MLP read the same layer input and both join it
(use_parallel_residual), RoPE turns only the first rotary_pct of each head's dims, LayerNorms
with biases, a plain GELU MLP with biases, and Q/K/V fused per head ([N, 3, H] rows; llama.cpp's
gptneox GGUFs hold them [3, N, H])."""

from jaxkv.core.config import Config
from jaxkv.models import llama
from jaxkv.models.common import (activation, gguf_arch_field, gguf_arch_required, special_ids,
                                 with_defaults)
from jaxkv.models.maps import CheckpointError, Src, feed_forward, norm, out_proj, qkv, rows

# transformers' GPTNeoXConfig defaults for keys a config.json may omit (Pythia's files give
# rotary_pct / rotary_emb_base; transformers 5 writes them into rope_parameters)
HF_DEFAULTS = dict(num_hidden_layers=44, num_attention_heads=64, intermediate_size=24576,
                   hidden_act="gelu", rotary_pct=0.25, rotary_emb_base=10000,
                   max_position_embeddings=2048, layer_norm_eps=1e-5, use_parallel_residual=True,
                   tie_word_embeddings=False, attention_bias=True, bos_token_id=0,
                   eos_token_id=2)


def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "hidden_size"), source)
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{source}: GPT-NeoX rope scaling "
                              f"({hf.get('rope_scaling') or rope!r}) is not supported")
    n_heads, d_model = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = d_model // n_heads
    fraction = rope.get("partial_rotary_factor", hf["rotary_pct"])
    return Config(
        vocab_size=hf["vocab_size"], d_model=d_model, n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=n_heads, head_dim=head_dim, d_ff=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"], norm="layernorm",
        norm_eps=hf["layer_norm_eps"], activation=activation(hf["hidden_act"], source),
        gated_mlp=False, rope_theta=float(rope.get("rope_theta", hf["rotary_emb_base"])),
        rotary_dim=int(head_dim * fraction), parallel_residual=hf["use_parallel_residual"],
        attn_bias=hf["attention_bias"], mlp_bias=True, tie_embeddings=hf["tie_word_embeddings"],
        **special_ids(hf, source, ("bos_token_id", "eos_token_id")))


def hf_map(c: Config, tensor_names=()) -> dict:
    N, H = c.n_heads, c.head_dim
    h = "gpt_neox.layers.{i}."

    def part(j):  # rows [N, 3, H]: head n's q, k, v one after another
        return lambda x: x.reshape(N, 3, H, *x.shape[1:])[:, j].reshape(N * H, *x.shape[1:])
    return _map(c, part, dict(
        embed="gpt_neox.embed_in.weight", lm_head="embed_out.weight",
        attn_norm=h + "input_layernorm.weight", qkv=h + "attention.query_key_value.weight",
        o=h + "attention.dense.weight", mlp_norm=h + "post_attention_layernorm.weight",
        up=h + "mlp.dense_h_to_4h.weight", down=h + "mlp.dense_4h_to_h.weight",
        final_norm="gpt_neox.final_layer_norm.weight"))


def _map(c: Config, part, names: dict) -> dict:
    """The map of either format's names; part(j) takes Q (0), K (1) or V (2) of the fused
    rows."""
    D = c.d_model
    w, b = names["qkv"], names["qkv"].replace(".weight", ".bias")
    return {
        "embed": Src(names["embed"], (c.vocab_size, D)),
        "lm_head": Src(names["lm_head"], (c.vocab_size, D)),
        **norm(c, "blocks.attn_norm", names["attn_norm"]),
        **qkv(c, "blocks", *(Src(w, (3 * D, D), part(j)) for j in range(3)),
              *(Src(b if c.attn_bias else None, (3 * D,), part(j)) for j in range(3))),
        **out_proj(c, "blocks", names["o"], bias=c.attn_out_bias),
        **norm(c, "blocks.mlp_norm", names["mlp_norm"]),
        **feed_forward(c, "blocks", names["up"], names["down"]),
        **norm(c, "final_norm", names["final_norm"]),
    }


# ---- GGUF (llama.cpp's gptneox) ---------------------------------------------------------------

def gguf_config(reader, source: str) -> Config:
    """llama.cpp's converter writes neither RoPE's base (its runtime's default, 10000, is
    Pythia's) nor the kv head count; it reads use_parallel_residual and the LayerNorm epsilon
    as required. The MLP's GELU is the exact one, as Pythia was trained (llama.cpp computes
    the tanh approximation)."""
    fields = llama.gguf_decoder_fields(reader, source)
    return Config.llama(**{
        **fields, "norm": "layernorm", "activation": "gelu", "gated_mlp": False,
        "norm_eps": float(gguf_arch_required(reader, "attention.layer_norm_epsilon", source)),
        "rotary_dim": gguf_arch_field(reader, "rope.dimension_count", fields["head_dim"]),
        "parallel_residual": bool(gguf_arch_required(reader, "use_parallel_residual", source)),
        "attn_bias": True, "mlp_bias": True})


def gguf_map(c: Config, tensor_names=()) -> dict:
    """llama.cpp's names; its converter reorders the fused rows to [3, N, H]."""
    names = dict(llama.GGUF_NAMES, qkv="blk.{i}.attn_qkv.weight")
    return _map(c, lambda j: rows(j, c.n_heads * c.head_dim), names)
