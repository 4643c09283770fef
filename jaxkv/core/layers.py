"""Stateless building blocks: norms, rotary embeddings, the feed-forward network."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import ops
from jaxkv.core.config import Config
from jaxkv.core.params import Norm, gate_up_block, split_gate_up

ACTIVATIONS = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


def norm(x_BTD, p: Norm, kind: str, eps: float):
    """LayerNorm or RMSNorm, computed in float32 and returned in x's dtype."""
    x = x_BTD.astype(jnp.float32)
    if kind == "layernorm":
        x = x - x.mean(-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)
    y = x * p.scale.astype(jnp.float32)
    if p.bias is not None:
        y = y + p.bias.astype(jnp.float32)
    return y.astype(x_BTD.dtype)


@functools.lru_cache(maxsize=64)
def rope_frequencies(head_dim: int, theta: float, scaling: tuple = ()) -> np.ndarray:
    """RoPE's inverse frequencies [H/2] (float32, read-only), scaled as Config.rope_scaling says.

    Computed in float64 once per (head_dim, theta, scaling), then rounded. "linear" divides
    every frequency by factor. "llama3" (Llama 3.1+) sorts them by wavelength 2 pi / f against
    the original context length C: shorter than C / high_freq_factor kept, longer than
    C / low_freq_factor divided by factor, and in between a blend of the two whose weight on
    the kept frequency, C / wavelength rescaled from [low, high] to [0, 1], grows linearly.
    """
    inv_freq_h = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind, values = (scaling[0], scaling[1:]) if scaling else ("default", ())
    if kind == "linear":
        inv_freq_h = inv_freq_h / values[0]
    elif kind == "llama3":
        factor, low, high, context = values
        wavelen_h = 2 * np.pi / inv_freq_h
        kept_h = (context / wavelen_h - low) / (high - low)  # the blend's weight on inv_freq
        blend_h = (1 - kept_h) * inv_freq_h / factor + kept_h * inv_freq_h
        inv_freq_h = np.where(wavelen_h < context / high, inv_freq_h,
                              np.where(wavelen_h > context / low, inv_freq_h / factor, blend_h))
    out_h = inv_freq_h.astype(np.float32)
    out_h.flags.writeable = False
    return out_h


def rope_turns(pos_BT, inv_freq_h):
    """RoPE at positions pos_BT as two [B, T, H] factors, (cos, cos) and (-sin, sin) by half,
    made once for every layer of a pass (see rope), and kept as arrays (ops.materialized)."""
    angle_BTh = pos_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_h, jnp.float32)
    cos_BTh, sin_BTh = jnp.cos(angle_BTh), jnp.sin(angle_BTh)
    return ops.materialized((jnp.concatenate([cos_BTh, cos_BTh], -1),
                             jnp.concatenate([-sin_BTh, sin_BTh], -1)))


def rope(x_BTNH, turns):
    """Rotary embedding, rotate-half layout (Hugging Face Llama): pairs (i, i + H/2), pair i
    turned by pos * inv_freq_h[i] (turns = rope_turns(pos_BT, inv_freq_h)): x cos + x' sin,
    x' the halves of x swapped (a reversal, where a concatenation of two halves made XLA:CPU
    choose between its operands at every element)."""
    *lead, H = x_BTNH.shape
    x = x_BTNH.astype(jnp.float32)
    swapped = x.reshape(*lead, 2, H // 2)[..., ::-1, :].reshape(*lead, H)
    out = x * turns[0][:, :, None] + swapped * turns[1][:, :, None]
    return out.astype(x_BTNH.dtype)


def mlp(x_BTD, b, config: Config):
    """Feed-forward of one block b: act(x W_in) W_out, or act(gate) * up when gated."""
    act = ACTIVATIONS[config.activation]
    h_BTF = ops.matmul(x_BTD, b.w_in, b.b_in)
    if config.gated_mlp:
        gate_BTF, up_BTF = split_gate_up(h_BTF, gate_up_block(config.d_ff))
        h_BTF = act(gate_BTF) * up_BTF
    else:
        h_BTF = act(h_BTF)
    return ops.matmul(h_BTF, b.w_out, b.b_out, costly_x=config.gated_mlp)
