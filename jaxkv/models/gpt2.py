"""GPT-2: config.json keys and defaults, and the name map of GPT2LMHeadModel."""

from jaxkv.core.config import Config
from jaxkv.models.common import activation, special_ids, with_defaults
from jaxkv.models.maps import CheckpointError, Src, norm, out_proj, qkv, rows, transpose

# transformers' GPT2Config defaults for keys a config.json may omit
HF_DEFAULTS = dict(n_positions=1024, n_layer=12, n_head=12, n_inner=None,
                   activation_function="gelu_new", layer_norm_epsilon=1e-5,
                   bos_token_id=50256, eos_token_id=50256)


def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "n_embd"), source)
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise CheckpointError(f"{source}: GPT-2 attention variants are not supported")
    return Config.gpt2(vocab_size=hf["vocab_size"], d_model=hf["n_embd"], n_layers=hf["n_layer"],
                       n_heads=hf["n_head"], max_seq_len=hf["n_positions"], d_ff=hf["n_inner"],
                       norm_eps=hf["layer_norm_epsilon"],
                       activation=activation(hf["activation_function"], source),
                       **special_ids(hf, source, ("bos_token_id", "eos_token_id")))


def hf_map(c: Config, tensor_names=()) -> dict:
    """Saved from GPT2LMHeadModel (names under 'transformer.') or GPT2Model (no prefix)."""
    return name_map(c, "transformer." if "transformer.wte.weight" in tensor_names else "")


def name_map(c: Config, prefix: str = "transformer.") -> dict:
    """GPT-2 map. Its Conv1D weights are stored [in, out]; c_attn fuses Q, K and V."""
    D, F = c.d_model, c.d_ff
    h = prefix + "h.{i}."
    w, b = h + "attn.c_attn.weight", h + "attn.c_attn.bias"
    return {
        "embed": Src(prefix + "wte.weight", (c.vocab_size, D)),
        "pos_embed": Src(prefix + "wpe.weight", (c.max_seq_len, D)),
        **norm(c, "blocks.attn_norm", h + "ln_1.weight"),
        **qkv(c, "blocks", *(Src(w, (D, 3 * D), lambda x, j=j: x.T[j * D:(j + 1) * D])
                             for j in range(3)),
              *(Src(b, (3 * D,), rows(j, D)) for j in range(3))),
        **out_proj(c, "blocks", h + "attn.c_proj.weight", to_ours=transpose),
        **norm(c, "blocks.mlp_norm", h + "ln_2.weight"),
        "blocks.w_in": Src(h + "mlp.c_fc.weight", (D, F), transpose),
        "blocks.b_in": Src(h + "mlp.c_fc.bias", (F,)),
        "blocks.w_out": Src(h + "mlp.c_proj.weight", (F, D), transpose),
        "blocks.b_out": Src(h + "mlp.c_proj.bias", (D,)),
        **norm(c, "final_norm", prefix + "ln_f.weight"),
    }
