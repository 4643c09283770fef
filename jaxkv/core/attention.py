"""Attention as the model uses it: the softmax over a cache (through jaxkv.ops.attention),
keys shared by groups of rows, causal masks and T5's relative position bias."""

import math

import jax.numpy as jnp

from jaxkv import ops


def attend(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, bias_BNTS=None, kv_len=None,
           softcap=None):
    """Softmax attention [B, T, N, H] in q's dtype (see jaxkv.ops.attention)."""
    out_BTNH, _ = ops.attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, bias_BNTS=bias_BNTS,
                                kv_len=kv_len, softcap=softcap)
    return out_BTNH.astype(q_BTNH.dtype)


def attend_shared(q_BTNH, k_PKSH, v_PKSH, mask_PS, scale: float, kv_len=None, softcap=None):
    """ops.attention against keys shared by groups of rows: rows [r*R, (r+1)*R) read prefix row r
    of P = B / R rows. The shared keys are read once per group, not once per row."""
    B, T, N, H = q_BTNH.shape
    P, S = mask_PS.shape
    q_PRNH = q_BTNH.reshape(P, (B // P) * T, N, H)
    mask_PRS = jnp.broadcast_to(mask_PS[:, None, :], (P, (B // P) * T, S))
    out, lse = ops.attention(q_PRNH, k_PKSH, v_PKSH, mask_PRS, scale, kv_len=kv_len,
                             softcap=softcap)
    return out.reshape(B, T, N, H), lse.reshape(B, T, N)


def causal_mask(pos_BT, num_slots: int):
    """mask_BTS for a linear cache: slot s holds position s, so query at p reads slots <= p."""
    return jnp.arange(num_slots)[None, None, :] <= pos_BT[:, :, None]


def relative_bucket(rel_pos, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's bucket of (key position - query position): exact near 0, logarithmic far away."""
    bucket = jnp.zeros_like(rel_pos)
    if bidirectional:
        num_buckets //= 2
        bucket = jnp.where(rel_pos > 0, num_buckets, 0)
        distance = jnp.abs(rel_pos)
    else:
        distance = -jnp.minimum(rel_pos, 0)
    max_exact = num_buckets // 2
    log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact) / math.log(
        max_distance / max_exact)
    far = max_exact + (log_ratio * (num_buckets - max_exact)).astype(rel_pos.dtype)
    far = jnp.minimum(far, num_buckets - 1)
    return bucket + jnp.where(distance < max_exact, distance, far)


def relative_bias(table_RN, q_pos_BT, k_pos_BS, bidirectional: bool, max_distance: int):
    """bias_BNTS from T5's learned table [num_buckets, N]."""
    rel_BTS = k_pos_BS[:, None, :] - q_pos_BT[:, :, None]
    bucket_BTS = relative_bucket(rel_BTS, bidirectional, table_RN.shape[0], max_distance)
    return jnp.moveaxis(table_RN[bucket_BTS], -1, 1).astype(jnp.float32)
