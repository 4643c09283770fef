"""The softmax arithmetic every form of the decode kernel shares (jaxkv.ops.pallas.decode,
jaxkv.ops.pallas.mosaic_gpu), inside a kernel or around one: a block's online update, a step's
own key, and the merge of parts by their maxima and sums of weights."""

import jax
import jax.numpy as jnp

from jaxkv.ops.xla import softcapped


def online_softmax(max_R, total_R, scores_RC):
    """One block of an online softmax: (its new max, sum of weights, the block's weights
    [R, C], the factor the sums so far take)."""
    new_max_R = jnp.maximum(max_R, scores_RC.max(axis=1))
    base_R = jnp.where(new_max_R == -jnp.inf, 0.0, new_max_R)
    weights_RC = jnp.exp(scores_RC - jax.lax.broadcast_in_dim(base_R, scores_RC.shape, [0]))
    old_R = jnp.exp(max_R - base_R)
    return new_max_R, total_R * old_R + weights_RC.sum(axis=1), weights_RC, old_R


def own_score(q_RH, k_H, seen, scale: float, softcap):
    """The scores [..., R] of the step's own key k [..., H] (-inf where not seen), in float32:
    elementwise, as the XLA backend scores one key."""
    scores_R = jnp.sum(q_RH.astype(jnp.float32) * k_H.astype(jnp.float32)[..., None, :],
                       axis=-1) * scale
    return jnp.where(seen, softcapped(scores_R, softcap), -jnp.inf)


def merge(acc_JRH, max_JR, total_JR, own_R=None, v_H=None):
    """(out [..., R, H], lse [..., R]) of parts' unnormalized outputs, maxima and sums of weights
    ([..., J, R(, H)]) and, with own_R, one more key of scores own_R and value v_H [..., H]."""
    top_R = jnp.max(max_JR, axis=-2)
    if own_R is not None:
        top_R = jnp.maximum(top_R, own_R)
    top_R = jnp.where(top_R == -jnp.inf, 0.0, top_R)
    w_JR = jnp.exp(max_JR - top_R[..., None, :])
    total_R = jnp.sum(total_JR * w_JR, axis=-2)
    acc_RH = jnp.sum(acc_JRH * w_JR[..., None], axis=-3)
    if own_R is not None:
        w_R = jnp.exp(own_R - top_R)
        total_R = total_R + w_R
        acc_RH = acc_RH + w_R[..., None] * v_H.astype(jnp.float32)[..., None, :]
    out_RH = acc_RH / jnp.maximum(total_R, jnp.finfo(jnp.float32).tiny)[..., None]
    return out_RH, jnp.where(total_R > 0, top_R + jnp.log(total_R), -jnp.inf)
