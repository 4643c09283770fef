"""Grouped-query attention over an explicit mask, and T5's relative position bias."""

import math

import jax
import jax.numpy as jnp


def attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS, scale: float, bias_BNTS=None):
    """Softmax attention; G = N // K query heads share each kv head.

    mask_BTS[b, t, s] says whether query t of row b may read key s; bias_BNTS (optional) is
    added to the scores. A query with no visible key gets zeros, never NaN.
    """
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH,
                              preferred_element_type=jnp.float32) * scale
    if bias_BNTS is not None:
        b, _, t, s = bias_BNTS.shape  # b and t may be 1 (broadcast)
        scores_BKGTS = scores_BKGTS + bias_BNTS.reshape(b, K, N // K, t, s)
    mask_B11TS = mask_BTS[:, None, None]
    scores_BKGTS = jnp.where(mask_B11TS, scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1) * mask_B11TS
    out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS.astype(v_BSKH.dtype), v_BSKH)
    return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


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
