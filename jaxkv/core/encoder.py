"""Encoders of encoder-decoder models (T5's token encoder, Whisper's audio encoder) and the
cross-attention keys/values computed from their output, once per input."""

import jax
import jax.numpy as jnp

from jaxkv.core import blocks, checks
from jaxkv.core.attention import relative_bias
from jaxkv.core.layers import norm


def conv1d(x_BWC, w_KCO, b_O, stride: int):
    """1-D convolution, kernel K with padding K // 2 (Whisper's stem)."""
    pad = w_KCO.shape[0] // 2
    y_BWO = jax.lax.conv_general_dilated(x_BWC, w_KCO, (stride,), [(pad, pad)],
                                         dimension_numbers=("NWC", "WIO", "NWC"))
    return y_BWO + b_O


def audio_stem(enc, mel_BCF):
    """Log-mel [B, n_mels, frames] -> [B, frames / 2, D]: two GELU convolutions + positions."""
    x_BFC = jnp.swapaxes(mel_BCF, 1, 2).astype(enc.conv1_w.dtype)
    x_BFD = jax.nn.gelu(conv1d(x_BFC, enc.conv1_w, enc.conv1_b, 1), approximate=False)
    x_BMD = jax.nn.gelu(conv1d(x_BFD, enc.conv2_w, enc.conv2_b, 2), approximate=False)
    return x_BMD + enc.pos_embed[: x_BMD.shape[1]]


def encode(params, encoder_inputs, encoder_lengths=None):
    """Encoder states [B, M, D] of tokens [B, M] (encoder_lengths [B]: real lengths, the rest is
    padding) or of log-mel features [B, n_mels, frames]."""
    inputs, lengths_B = checks.encoder_args(params.config, encoder_inputs, encoder_lengths)
    return _encode(params, inputs, lengths_B)


def _encode(params, inputs, lengths_B):
    c, enc = params.config, params.encoder
    if c.encoder.input == "audio":
        x_BMD = audio_stem(enc, inputs)
    else:
        x_BMD = params.embed[inputs]
    B, M, _ = x_BMD.shape
    mask_BM = encoder_mask(lengths_B, M)
    mask_BMM = jnp.broadcast_to(mask_BM[:, None, :], (B, M, M))
    pos_BM = jnp.broadcast_to(jnp.arange(M), (B, M))
    bias_BNMM = None
    if enc.rel_bias is not None:
        bias_BNMM = relative_bias(enc.rel_bias, pos_BM[:1], pos_BM[:1], True,
                                  c.relative_max_distance)

    turns_BM = blocks.turns(c, pos_BM)
    for b in enc.blocks:
        x_BMD, _ = blocks.self_attention(c, b, x_BMD, turns_BM, mask_BMM, bias_BNMM)
        x_BMD = blocks.feed_forward(c, b, x_BMD)
    return norm(x_BMD, enc.final_norm, c.norm, c.norm_eps)


def encoder_mask(lengths_B, M: int):
    """mask_BM: True at real encoder positions (all of them when lengths_B is None)."""
    if lengths_B is None:
        return jnp.ones((1, M), bool)
    return jnp.arange(M)[None, :] < lengths_B[:, None]


@jax.jit
def _cross_cache(params, inputs, lengths_B):
    states_BMD = _encode(params, inputs, lengths_B)
    k, v = zip(*(blocks.cross_kv(params.config, c, states_BMD) for c in params.cross))
    B, M = states_BMD.shape[:2]
    return tuple(k), tuple(v), jnp.broadcast_to(encoder_mask(lengths_B, M), (B, M))


def cross_cache(params, encoder_inputs, encoder_lengths, batch_size: int):
    """(cross_k, cross_v per layer [B, K, M, H], cross_mask [B, M]) for decoder.init_cache:
    encode once, project once."""
    inputs, lengths_B = checks.encoder_args(params.config, encoder_inputs, encoder_lengths,
                                            batch_size)
    return _cross_cache(params, inputs, lengths_B)
