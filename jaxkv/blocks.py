"""The sublayers every transformer here is built from: self-attention, cross-attention, MLP.

Each takes a pre-norm residual stream x_BTD and returns it updated. `b` is one layer's slice of
the stacked Blocks / Cross parameters.
"""

import jax.numpy as jnp

from jaxkv import cache as cache_lib
from jaxkv.attention import attend, attend_parts, attend_shared, merge_parts
from jaxkv.layers import mlp, norm, rope


def project_q(config, b, h_BTD, pos_BT=None):
    """Queries [B, T, N, H] of h_BTD; RoPE is applied when pos_BT is given."""
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, b.wq)
    if b.bq is not None:
        q_BTNH = q_BTNH + b.bq
    if pos_BT is not None and config.position == "rope":
        q_BTNH = rope(q_BTNH, pos_BT, config.rope_theta)
    return q_BTNH


def project_kv(config, b, h_BSD, pos_BS=None):
    """Keys and values [B, S, K, H] of h_BSD; RoPE is applied when pos_BS is given."""
    k_BSKH = jnp.einsum("BSD,DKH->BSKH", h_BSD, b.wk)
    v_BSKH = jnp.einsum("BSD,DKH->BSKH", h_BSD, b.wv)
    if b.bk is not None:
        k_BSKH, v_BSKH = k_BSKH + b.bk, v_BSKH + b.bv
    if pos_BS is not None and config.position == "rope":
        k_BSKH = rope(k_BSKH, pos_BS, config.rope_theta)
    return k_BSKH, v_BSKH


def project_out(b, o_BTNH):
    out_BTD = jnp.einsum("BTNH,NHD->BTD", o_BTNH, b.wo)
    return out_BTD if b.bo is None else out_BTD + b.bo


def self_attention(config, b, x_BTD, pos_BT, mask_BTS, bias_BNTS=None, kv=None, prefix=None):
    """Self-attention sublayer -> (x_BTD, (k_BSKH, v_BSKH)).

    kv is None when the keys are this call's tokens (uncached), or (k_BSKH, v_BSKH, slot_BT):
    this call's keys are written at slot_BT and the whole cache is attended (masked).
    prefix, optional, is (k_PSKH, v_PSKH, mask_PS): keys shared by groups of B / P rows (a common
    prompt), attended once per group and merged with the rows' own keys by log-sum-exp.
    """
    h_BTD = norm(x_BTD, b.attn_norm, config.norm, config.norm_eps)
    q_BTNH = project_q(config, b, h_BTD, pos_BT)
    k_BSKH, v_BSKH = project_kv(config, b, h_BTD, pos_BT)
    if kv is not None:
        k_cache_BSKH, v_cache_BSKH, slot_BT = kv
        k_BSKH = cache_lib.write(k_cache_BSKH, k_BSKH, slot_BT)
        v_BSKH = cache_lib.write(v_cache_BSKH, v_BSKH, slot_BT)
    k_own, v_own = k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype)
    if prefix is None:
        o_BTNH = attend(q_BTNH, k_own, v_own, mask_BTS, config.attn_scale, bias_BNTS)
    else:
        k_PSKH, v_PSKH, mask_PS = prefix
        shared = attend_shared(q_BTNH, k_PSKH.astype(q_BTNH.dtype), v_PSKH.astype(q_BTNH.dtype),
                               mask_PS, config.attn_scale)
        own = attend_parts(q_BTNH, k_own, v_own, mask_BTS, config.attn_scale, bias_BNTS)
        o_BTNH = merge_parts(*shared, *own).astype(q_BTNH.dtype)
    return x_BTD + project_out(b, o_BTNH), (k_BSKH, v_BSKH)


def cross_attention(config, c, x_BTD, k_BMKH, v_BMKH, mask_BM):
    """Cross-attention sublayer over precomputed encoder keys/values (no projection of them)."""
    h_BTD = norm(x_BTD, c.norm, config.norm, config.norm_eps)
    q_BTNH = project_q(config, c, h_BTD)
    T = x_BTD.shape[1]
    mask_BTM = jnp.broadcast_to(mask_BM[:, None, :], (mask_BM.shape[0], T, mask_BM.shape[1]))
    o_BTNH = attend(q_BTNH, k_BMKH.astype(q_BTNH.dtype), v_BMKH.astype(q_BTNH.dtype), mask_BTM,
                    config.attn_scale)
    return x_BTD + project_out(c, o_BTNH)


def feed_forward(config, b, x_BTD):
    """MLP sublayer."""
    return x_BTD + mlp(norm(x_BTD, b.mlp_norm, config.norm, config.norm_eps), b, config)
