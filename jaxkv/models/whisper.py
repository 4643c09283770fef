"""Whisper: config.json keys and defaults and the name map of WhisperForConditionalGeneration;
CTranslate2's WhisperSpec (its variables and config.json) and its names."""

import re

from jaxkv.core.config import Config
from jaxkv.models.maps import (CheckpointError, Src, cross, feed_forward, linear_qkv, norm,
                           out_proj, qkv, rows)
from jaxkv.models.common import activation, special_ids, with_defaults

# transformers' WhisperConfig defaults
HF_DEFAULTS = dict(num_mel_bins=80, encoder_layers=4, encoder_attention_heads=6,
                   decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536,
                   encoder_ffn_dim=1536, activation_function="gelu",
                   max_source_positions=1500, max_target_positions=448,
                   decoder_start_token_id=50257, eos_token_id=50256,
                   begin_suppress_tokens=[220, 50256])


# ---- Hugging Face -----------------------------------------------------------------------------

def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "d_model"), source)
    if hf.get("scale_embedding"):
        raise CheckpointError(f"{source}: Whisper with scale_embedding is not supported")
    if hf["encoder_attention_heads"] != hf["decoder_attention_heads"] or \
            hf["encoder_ffn_dim"] != hf["decoder_ffn_dim"]:
        raise CheckpointError(f"{source}: encoder and decoder must share heads and MLP width")
    generation = hf.get("generation", {})

    def ids(key):  # ids past the vocabulary (transformers' defaults) can never be sampled anyway
        return tuple(i for i in generation.get(key) or hf.get(key) or () if i < hf["vocab_size"])

    return Config.whisper(
        vocab_size=hf["vocab_size"], d_model=hf["d_model"], n_layers=hf["decoder_layers"],
        n_encoder_layers=hf["encoder_layers"], n_heads=hf["decoder_attention_heads"],
        d_ff=hf["decoder_ffn_dim"], n_mels=hf["num_mel_bins"],
        max_source_len=hf["max_source_positions"], max_seq_len=hf["max_target_positions"],
        activation=activation(hf["activation_function"], source),
        suppress_ids=ids("suppress_tokens"), begin_suppress_ids=ids("begin_suppress_tokens"),
        **special_ids(hf, source, ("eos_token_id", "decoder_start_token_id")))


def audio_stem(c: Config, conv1, conv2, positions) -> dict:
    """Whisper's convolutions ([out, in, width] -> [width, in, out]) and position table."""
    D, e = c.d_model, c.encoder
    conv = lambda w: w.transpose(2, 1, 0)  # noqa: E731
    return {"encoder.conv1_w": Src(conv1 + "weight", (D, e.n_mels, 3), conv),
            "encoder.conv1_b": Src(conv1 + "bias", (D,)),
            "encoder.conv2_w": Src(conv2 + "weight", (D, D, 3), conv),
            "encoder.conv2_b": Src(conv2 + "bias", (D,)),
            "encoder.pos_embed": Src(positions, (e.max_len, D))}


def hf_map(c: Config, tensor_names=()) -> dict:
    """WhisperForConditionalGeneration (its k_proj has no bias)."""
    def stack(side, ours):
        b = f"model.{side}.layers.{{i}}."
        return {**linear_qkv(c, ours, *(b + f"self_attn.{p}_proj.weight" for p in "qkv"),
                             biases="qv"),
                **out_proj(c, ours, b + "self_attn.out_proj.weight"),
                **norm(c, f"{ours}.attn_norm", b + "self_attn_layer_norm.weight"),
                **feed_forward(c, ours, b + "fc1.weight", b + "fc2.weight"),
                **norm(c, f"{ours}.mlp_norm", b + "final_layer_norm.weight")}

    x = "model.decoder.layers.{i}.encoder_attn."
    return {
        "embed": Src("model.decoder.embed_tokens.weight", (c.vocab_size, c.d_model)),
        "pos_embed": Src("model.decoder.embed_positions.weight", (c.max_seq_len, c.d_model)),
        **audio_stem(c, "model.encoder.conv1.", "model.encoder.conv2.",
                     "model.encoder.embed_positions.weight"),
        **stack("encoder", "encoder.blocks"), **stack("decoder", "blocks"),
        **cross(c, *(x + f"{p}_proj.weight" for p in "qkv"), x + "out_proj.weight"),
        **norm(c, "cross.norm", "model.decoder.layers.{i}.encoder_attn_layer_norm.weight"),
        **norm(c, "encoder.final_norm", "model.encoder.layer_norm.weight"),
        **norm(c, "final_norm", "model.decoder.layer_norm.weight"),
    }


# ---- CTranslate2 ------------------------------------------------------------------------------

def ct2_config(variables: dict, ct2_config: dict, tokenizer, source: str) -> Config:
    """Sizes from the variables' shapes, special ids from the tokenizer, suppressed ids from
    CTranslate2's config.json."""
    def var(name):
        if name not in variables:
            raise CheckpointError(f"{source}: missing variable {name!r}")
        return variables[name]

    vocab, d_model = var("decoder/embeddings/weight").shape
    layers = lambda side: len({m.group(1) for k in variables  # noqa: E731
                               if (m := re.match(rf"{side}/layer_(\d+)/", k))})
    return Config.whisper(
        vocab_size=vocab, d_model=d_model, n_layers=layers("decoder"),
        n_encoder_layers=layers("encoder"), n_heads=int(var("decoder/num_heads")),
        d_ff=var("decoder/layer_0/ffn/linear_0/weight").shape[0],
        n_mels=var("encoder/conv1/weight").shape[1],
        max_source_len=var("encoder/position_encodings/encodings").shape[0],
        max_seq_len=var("decoder/position_encodings/encodings").shape[0],
        decoder_start_id=tokenizer.token_to_id("<|startoftranscript|>"),
        eos_id=tokenizer.token_to_id("<|endoftext|>"),
        suppress_ids=tuple(ct2_config.get("suppress_ids", ())),
        begin_suppress_ids=tuple(ct2_config.get("suppress_ids_begin", ())))


def ct2_map(c: Config, tensor_names=()) -> dict:
    """CTranslate2's WhisperSpec: self-attention Q/K/V fused in linear_0 ([3D, D]); cross
    attention Q in linear_0 and K/V fused in linear_1 ([2D, D]); norms are gamma/beta."""
    D = c.d_model

    def ln(ours, name):
        return norm(c, ours, name + "/gamma", name + "/beta")

    def parts(name, n):
        """The n [D, D] blocks of a fused [n * D, D] weight, then of its bias."""
        return (*(Src(name + "/weight", (n * D, D), rows(j, D)) for j in range(n)),
                *(Src(name + "/bias", (n * D,), rows(j, D)) for j in range(n)))

    def stack(side, ours):
        b = f"{side}/layer_{{i}}/"
        return {**qkv(c, ours, *parts(b + "self_attention/linear_0", 3)),
                **out_proj(c, ours, b + "self_attention/linear_1/weight"),
                **ln(f"{ours}.attn_norm", b + "self_attention/layer_norm"),
                **feed_forward(c, ours, b + "ffn/linear_0/weight", b + "ffn/linear_1/weight"),
                **ln(f"{ours}.mlp_norm", b + "ffn/layer_norm")}

    x = "decoder/layer_{i}/attention/"
    k, v, kb, vb = parts(x + "linear_1", 2)
    return {
        "embed": Src("decoder/embeddings/weight", (c.vocab_size, D)),
        "pos_embed": Src("decoder/position_encodings/encodings", (c.max_seq_len, D)),
        **audio_stem(c, "encoder/conv1/", "encoder/conv2/", "encoder/position_encodings/encodings"),
        **stack("encoder", "encoder.blocks"), **stack("decoder", "blocks"),
        **cross(c, x + "linear_0/weight", None, None, x + "linear_2/weight", kv=(k, v, kb, vb)),
        **ln("cross.norm", x + "layer_norm"),
        **ln("encoder.final_norm", "encoder/layer_norm"), **ln("final_norm", "decoder/layer_norm"),
    }
