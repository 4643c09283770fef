"""T5 (original and v1.1 / flan): config.json keys and defaults, and the name map of
T5ForConditionalGeneration."""

from jaxkv.core.config import Config
from jaxkv.models.common import special_ids, with_defaults
from jaxkv.models.maps import CheckpointError, Src, cross, feed_forward, linear_qkv, norm, out_proj

# transformers' T5Config defaults; T5 starts decoding from its pad id, 0
HF_DEFAULTS = dict(d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=None, num_heads=8,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128,
                   layer_norm_epsilon=1e-6, feed_forward_proj="relu", n_positions=512,
                   eos_token_id=1, decoder_start_token_id=0)


def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    """The head is tied unless the file holds lm_head.weight."""
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "d_model"), source)
    proj = hf["feed_forward_proj"]
    if proj not in ("relu", "gated-gelu"):
        raise CheckpointError(f"{source}: feed_forward_proj {proj!r} is not supported; expected "
                              "'relu' or 'gated-gelu'")
    tied = "lm_head.weight" not in tensor_names
    # transformers 5 ties T5's head always and keeps the rescale as scale_decoder_outputs;
    # older configs said both with tie_word_embeddings.
    rescale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    return Config.t5(
        vocab_size=hf["vocab_size"], d_model=hf["d_model"],
        n_layers=hf["num_decoder_layers"] or hf["num_layers"],
        n_encoder_layers=hf["num_layers"], n_heads=hf["num_heads"], head_dim=hf["d_kv"],
        d_ff=hf["d_ff"], gated=proj == "gated-gelu", tie_embeddings=tied,
        max_source_len=hf["n_positions"], rescale_logits=rescale,
        norm_eps=hf["layer_norm_epsilon"], relative_buckets=hf["relative_attention_num_buckets"],
        relative_max_distance=hf["relative_attention_max_distance"],
        **special_ids(hf, source, ("eos_token_id", "decoder_start_token_id")))


def hf_map(c: Config, tensor_names=()) -> dict:
    """T5ForConditionalGeneration."""
    R, N = c.relative_buckets, c.n_heads

    def stack(side, ours):
        b = f"{side}.block.{{i}}.layer."
        ff = 2 if side == "decoder" else 1
        dense = b + f"{ff}.DenseReluDense."
        a = b + "0.SelfAttention."
        return {**linear_qkv(c, ours, a + "q.weight", a + "k.weight", a + "v.weight", biases=""),
                **out_proj(c, ours, a + "o.weight", bias=False),
                **norm(c, f"{ours}.attn_norm", b + "0.layer_norm.weight"),
                **norm(c, f"{ours}.mlp_norm", b + f"{ff}.layer_norm.weight"),
                **(feed_forward(c, ours, dense + "wi_1.weight", dense + "wo.weight",
                                dense + "wi_0.weight") if c.gated_mlp else
                   feed_forward(c, ours, dense + "wi.weight", dense + "wo.weight"))}

    x = "decoder.block.{i}.layer.1.EncDecAttention."
    return {
        "embed": Src("shared.weight", (c.vocab_size, c.d_model)),
        "lm_head": Src("lm_head.weight", (c.vocab_size, c.d_model)),
        "rel_bias": Src("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                        (R, N)),
        "encoder.rel_bias": Src(
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", (R, N)),
        **stack("encoder", "encoder.blocks"), **stack("decoder", "blocks"),
        **cross(c, x + "q.weight", x + "k.weight", x + "v.weight", x + "o.weight", biases=""),
        **norm(c, "cross.norm", "decoder.block.{i}.layer.1.layer_norm.weight"),
        **norm(c, "encoder.final_norm", "encoder.final_layer_norm.weight"),
        **norm(c, "final_norm", "decoder.final_layer_norm.weight"),
    }
