"""Grouped-query attention over an explicit mask."""

import jax
import jax.numpy as jnp


def attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS):
    """Softmax attention; G = N // K query heads share each kv head.

    mask_BTS[b, t, s] says whether query t of row b may read key s. A query with no visible
    key gets zeros, never NaN.
    """
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH,
                              preferred_element_type=jnp.float32) * H ** -0.5
    mask_B11TS = mask_BTS[:, None, None]
    scores_BKGTS = jnp.where(mask_B11TS, scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1) * mask_B11TS
    out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS.astype(v_BSKH.dtype), v_BSKH)
    return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def causal_mask(pos_BT, num_slots: int):
    """mask_BTS for a linear cache: slot s holds position s, so query at p reads slots <= p."""
    return jnp.arange(num_slots)[None, None, :] <= pos_BT[:, :, None]
