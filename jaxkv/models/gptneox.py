"""GPT-NeoX (Pythia): config.json keys and defaults, and the name map of GPTNeoXForCausalLM.

What differs from Llama: attention and MLP read the same layer input and both join it
(use_parallel_residual), RoPE turns only the first rotary_pct of each head's dims, LayerNorms
with biases, a plain GELU MLP with biases, and Q/K/V fused per head ([N, 3, H] rows)."""

from jaxkv.core.config import Config
from jaxkv.models.common import activation, special_ids, with_defaults
from jaxkv.models.maps import CheckpointError, Src, feed_forward, norm, out_proj, qkv

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
    N, H, D = c.n_heads, c.head_dim, c.d_model
    h = "gpt_neox.layers.{i}."
    w, b = h + "attention.query_key_value.weight", h + "attention.query_key_value.bias"

    def part(j):  # rows [N, 3, H]: head n's q, k, v one after another
        return lambda x: x.reshape(N, 3, H, *x.shape[1:])[:, j].reshape(N * H, *x.shape[1:])
    return {
        "embed": Src("gpt_neox.embed_in.weight", (c.vocab_size, D)),
        "lm_head": Src("embed_out.weight", (c.vocab_size, D)),
        **norm(c, "blocks.attn_norm", h + "input_layernorm.weight"),
        **qkv(c, "blocks", *(Src(w, (3 * D, D), part(j)) for j in range(3)),
              *(Src(b if c.attn_bias else None, (3 * D,), part(j)) for j in range(3))),
        **out_proj(c, "blocks", h + "attention.dense.weight", bias=c.attn_out_bias),
        **norm(c, "blocks.mlp_norm", h + "post_attention_layernorm.weight"),
        **feed_forward(c, "blocks", h + "mlp.dense_h_to_4h.weight", h + "mlp.dense_4h_to_h.weight"),
        **norm(c, "final_norm", "gpt_neox.final_layer_norm.weight"),
    }
