"""Stateless building blocks: norms, rotary embeddings, the feed-forward network."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import ops
from jaxkv.core.config import Config
from jaxkv.core.params import Norm, gate_up_block


def norm(x_BTD, p: Norm, kind: str, eps: float):
    """LayerNorm or RMSNorm, computed in float32 and returned in x's dtype (jaxkv.ops.norm)."""
    return ops.norm(x_BTD, p.scale, p.bias, kind, eps)


def normed(config: Config, p: Norm | None) -> tuple | None:
    """What ops.matmul's `norm` takes of a norm's parameters p: x normed as `norm` would (None
    for no norm)."""
    return None if p is None else (p.scale, p.bias, config.norm, config.norm_eps)


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
    choose between its operands at every element). Turns narrower than H (GPT-NeoX's partial
    rotary) turn the first dims and pass the rest."""
    R = turns[0].shape[-1]
    if R < x_BTNH.shape[-1]:
        return jnp.concatenate([rope(x_BTNH[..., :R], turns), x_BTNH[..., R:]], -1)
    *lead, H = x_BTNH.shape
    x = x_BTNH.astype(jnp.float32)
    swapped = x.reshape(*lead, 2, H // 2)[..., ::-1, :].reshape(*lead, H)
    out = x * turns[0][:, :, None] + swapped * turns[1][:, :, None]
    return out.astype(x_BTNH.dtype)


def mlp(x_BTD, b, config: Config, norm_p: Norm | None = None, residual_BTD=None):
    """Feed-forward of one block b: act(x W_in) W_out, or act(gate) * up when gated; x normed by
    norm_p first and residual_BTD added after, where given (in the products: see ops.matmul)."""
    norm_x = None if norm_p is None else normed(config, norm_p)
    if config.gated_mlp:
        h_BTF = ops.matmul(x_BTD, b.w_in, b.b_in, norm=norm_x,
                           gated=(config.activation, gate_up_block(config.d_ff)))
    else:
        h_BTF = ops.ACTIVATIONS[config.activation](ops.matmul(x_BTD, b.w_in, b.b_in, norm=norm_x))
    return ops.matmul(h_BTF, b.w_out, b.b_out, costly_x=config.gated_mlp,
                      residual=residual_BTD)


def moe(x_BTD, b, config: Config, norm_p: Norm | None = None, residual_BTD=None,
        router_hook=None):
    """Mixture-of-experts feed-forward of one block b (config.is_moe): x normed by norm_p, the
    router's softmax over the experts in float32 (its logits through router_hook, where given:
    hooks' site "router"), each token's top experts_per_token (renormalized to sum 1 where
    config.norm_topk, then in x's dtype, as transformers rounds them), their MLPs' weighted sum
    (ops.experts); residual_BTD added after, where given."""
    B, T, D = x_BTD.shape
    h_BTD = x_BTD if norm_p is None else ops.norm(x_BTD, *normed(config, norm_p))
    logits_BTE = ops.matmul(h_BTD, b.router, dtype=jnp.float32)
    logits_BTE = logits_BTE if router_hook is None else router_hook(logits_BTE)
    top_BTK, expert_BTK = jax.lax.top_k(jax.nn.softmax(logits_BTE, -1), config.experts_per_token)
    if config.norm_topk:
        top_BTK = top_BTK / top_BTK.sum(-1, keepdims=True)
    weight_RK = top_BTK.astype(x_BTD.dtype).reshape(B * T, -1)
    y_RD = ops.experts(h_BTD.reshape(B * T, D), b.experts_in, b.experts_out,
                       expert_BTK.reshape(B * T, -1), weight_RK, activation=config.activation)
    y_BTD = y_RD.reshape(B, T, D)
    return y_BTD if residual_BTD is None else residual_BTD + y_BTD
