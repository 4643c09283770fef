"""Stateless building blocks: norms, rotary embeddings, the feed-forward network."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import kernels, quant
from jaxkv.config import Config
from jaxkv.params import Norm

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
    made once for every layer of a pass (see rope).

    The barrier keeps them one array each: left to fuse, XLA:CPU recomputed cos and sin at
    every head of every layer's queries and keys (SmolLM2, a 4 x 256-token prefill: 59 of
    710 ms)."""
    angle_BTh = pos_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_h, jnp.float32)
    cos_BTh, sin_BTh = jnp.cos(angle_BTh), jnp.sin(angle_BTh)
    return jax.lax.optimization_barrier((jnp.concatenate([cos_BTh, cos_BTh], -1),
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


def dense(x_BTI, w_OI, b_O=None, dtype=None, gemv=False):
    """x @ w.T (+ b) with w stored [out, in]: a matrix-vector product streams w's rows.

    Accumulates in float32; the result has x's dtype unless dtype is given. On the CPU, up to
    kernels.ROWS rows (decode steps, small trees) of float32 or bfloat16 w go to jaxkv.kernels,
    which stream w once over every core (SmolLM2 batch 1, 2-core Xeon: fp32 30.0 -> 21.3
    ms/token). Otherwise (other platforms, more rows, JAXKV_CPU_KERNELS=0 or no compiler) the
    form is chosen for XLA:CPU (other backends compile both to the same product; measured with
    scripts/profile_step.py):
    - a single row is written x @ w.T, which XLA:CPU fuses with the producers of x into one
      loop over w's rows, split over the cores: ~1.3x faster than its GEMV call in float32,
      ~20x faster in bfloat16, which has no fast call;
    - but a float32 row calls GEMV (einsum) where that loop goes wrong: with a bias (XLA fuses
      the add into the product and copies w transposed on every call), or when the caller
      passes gemv=True because the loop would redo the work that made x for every row of w:
      right after attention (3-6x slower) and after a gated activation (~5% of a step);
    - several rows go to an einsum with a float32 result (~6x faster than a bfloat16 one).
    """
    if isinstance(w_OI, quant.Int8):
        return quant.dense(x_BTI, w_OI, b_O, dtype)
    B, T, I = x_BTI.shape
    gemv_call = x_BTI.dtype == jnp.float32 and (b_O is not None or gemv)
    if kernels.fits(B * T, w_OI.dtype):
        y_BTO = kernels.dense(x_BTI.reshape(B * T, I), w_OI).reshape(B, T, -1)
    elif B * T == 1 and not gemv_call:
        y_BTO = (x_BTI.reshape(1, I) @ w_OI.T).reshape(B, T, -1)
    else:
        y_BTO = jnp.einsum("BTI,OI->BTO", x_BTI, w_OI, preferred_element_type=jnp.float32)
    y_BTO = y_BTO if b_O is None else y_BTO + b_O
    return y_BTO.astype(dtype or x_BTI.dtype)


def mlp(x_BTD, b, config: Config):
    """Feed-forward of one block b: act(x W_in) W_out, or act(gate) * up when gated."""
    act = ACTIVATIONS[config.activation]
    h_BTF = dense(x_BTD, b.w_in, b.b_in)
    if config.gated_mlp:
        gate_up_BTF2 = h_BTF.reshape(*h_BTF.shape[:-1], -1, 2)
        h_BTF = act(gate_up_BTF2[..., 0]) * gate_up_BTF2[..., 1]
    else:
        h_BTF = act(h_BTF)
    return dense(h_BTF, b.w_out, b.b_out, gemv=config.gated_mlp)
