"""Grouped-query attention over an explicit mask, split attention merged by log-sum-exp, and
T5's relative position bias."""

import functools
import math

import jax
import jax.numpy as jnp

from jaxkv import kernels
from jaxkv.cache import Int8KV, quantize_kv


BLOCK = 256  # key slots per block when attention is bounded by the filled length


def attend_parts(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, bias_BNTS=None, kv_len=None,
                 own=None, softcap=None):
    """Attention output [B, T, N, H] (float32) and its log-sum-exp [B, T, N].

    Keys and values are [B, K, S, H], of any float dtype (read in float32), or Int8KV: then the
    key scales multiply the scores and the value scales the softmax weights, so the cache is
    never dequantized (its int8 numbers are only converted for the products), and the own keys
    are quantized first, as the cache will hold them (a call reads its tokens as later calls
    will). G = N // K query heads share each kv head. mask_BTS[b, t, s] says whether query t
    of row b may read key s; bias_BNTS (optional, batch and T may be 1) is added to the
    scores. kv_len (optional, traced): no query reads a slot >= kv_len, so only the first
    ceil(kv_len / BLOCK) blocks of keys are visited (for a few queries, T * S <= BLOCK^2, all of
    them in one pass once kv_len passes a third of the slots; many queries never form scores
    wider than a block). own (optional): a second key set (k_BKUH, v_BKUH, mask_BTU, bias_BNTU
    or None), e.g. the call's own tokens, attended together with the first. A query with no
    visible key gets output 0 and lse -inf, never NaN. softcap (optional): scaled scores s
    become softcap * tanh(s / softcap). On the CPU, queries with own keys and no bias (a decode
    step, a tree pass, a prefill chunk) over a float32, bfloat16 or Int8KV cache go to
    jaxkv.kernels.attend.
    """
    if (own is not None and bias_BNTS is None and own[3] is None
            and kernels.attend_fits(q_BTNH, k_BKSH)):
        S, bounded = k_BKSH.shape[2], kv_len is not None
        own = _own_as_cache(k_BKSH, own)

        def xla(q_BTNH, k_BKSH, v_BKSH, mask_BTS, k_BKUH, v_BKUH, mask_BTU, kv_len):
            return _attend_parts_xla(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, None,
                                     kv_len if bounded else None,
                                     (k_BKUH, v_BKUH, mask_BTU, None), softcap)
        return kernels.attend(xla, scale, softcap, q_BTNH, k_BKSH, v_BKSH, mask_BTS, *own[:3],
                              kv_len if bounded else S)
    return _attend_parts_xla(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, bias_BNTS, kv_len, own,
                             softcap)


def _attend_parts_xla(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, bias_BNTS, kv_len, own, softcap):
    """attend_parts in XLA's operations."""
    own = _own_as_cache(k_BKSH, own)
    keys = [(k_BKSH, v_BKSH, mask_BTS, bias_BNTS)] + ([] if own is None else [own])
    S = k_BKSH.shape[2]
    if kv_len is None or bias_BNTS is not None or S <= BLOCK:
        return _attend_dense(q_BTNH, keys, scale, softcap)
    # Past a third of the capacity one pass over every slot is cheaper than the block loop
    # (each block is sliced out, a copy): SmolLM2 at capacity 8192, position 8000: 41 vs 75 ms.
    blocks = functools.partial(_attend_blocks, q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, kv_len, own,
                               softcap)
    if q_BTNH.shape[1] * S > BLOCK * BLOCK:  # many queries (a prefill chunk): scores [T, BLOCK]
        return blocks()
    dense = functools.partial(_attend_dense, q_BTNH, keys, scale, softcap)
    return jax.lax.cond(3 * kv_len > S, dense, blocks)


def _own_as_cache(k_BKSH, own):
    """The own keys and values as the cache will hold them: quantized where it is an Int8KV."""
    if own is None or not isinstance(k_BKSH, Int8KV) or isinstance(own[0], Int8KV):
        return own
    return (quantize_kv(own[0]), quantize_kv(own[1]), *own[2:])


def _attend_dense(q_BTNH, keys, scale, softcap=None):
    """One softmax over the union of key sets [(k_BKSH, v_BKSH, mask_BTS, bias_BNTS), ...]."""
    B, T, N, H = q_BTNH.shape
    K = keys[0][0].shape[1]
    # Scores and weighted sums in float32 (XLA:CPU has no bfloat16 x bfloat16 -> float32 dot).
    q_BTKGH = q_BTNH.astype(jnp.float32).reshape(B, T, K, N // K, H)
    scores = []
    for k_BKSH, _, mask_BTS, bias_BNTS in keys:
        scores_BKGTS = _key_scores(q_BTKGH, k_BKSH, _scores) * scale
        if softcap is not None:
            scores_BKGTS = softcap * jnp.tanh(scores_BKGTS / softcap)
        if bias_BNTS is not None:
            b, _, t, s = bias_BNTS.shape
            scores_BKGTS = scores_BKGTS + bias_BNTS.reshape(b, K, N // K, t, s)
        scores.append(jnp.where(mask_BTS[:, None, None], scores_BKGTS, -jnp.inf))
    scores_BKGTS = jnp.concatenate(scores, -1)
    max_BKGT1 = jnp.max(scores_BKGTS, axis=-1, keepdims=True)
    max_BKGT1 = jnp.where(jnp.isfinite(max_BKGT1), max_BKGT1, 0.0)
    weights_BKGTS = jnp.exp(scores_BKGTS - max_BKGT1)
    total_BKGT = weights_BKGTS.sum(-1)
    out_BTKGH, start = 0.0, 0
    for _, v_BKSH, _, _ in keys:
        S = v_BKSH.shape[2]
        out_BTKGH = out_BTKGH + _value_sum(weights_BKGTS[..., start: start + S], v_BKSH,
                                           _weighted)
        start += S
    total_BTKG = jnp.moveaxis(total_BKGT, 3, 1)
    out_BTKGH = out_BTKGH / jnp.maximum(total_BTKG, jnp.finfo(jnp.float32).tiny)[..., None]
    lse_BTKG = jnp.moveaxis(max_BKGT1[..., 0], 3, 1) + jnp.log(total_BTKG)
    return out_BTKGH.reshape(B, T, N, H), lse_BTKG.reshape(B, T, N)


def _key_scores(q_X, k_BKSH, product):
    """product(q_X, keys in float32) -> scores [B, K, G, T, S]; an Int8KV's scales [B, K, S]
    multiply the scores of its int8 keys."""
    if isinstance(k_BKSH, Int8KV):
        # XLA:CPU converts the int8 keys into a float32 temporary for the product (one layer's,
        # for this call). Written as a product summed over H, the conversion fuses and no
        # temporary is made, but a decode step ran 2.7x slower (30 layers, S = 4096, Intel
        # Xeon: 105 vs 39 ms; float32 keys 58 ms).
        return product(q_X, k_BKSH.q.astype(jnp.float32)) * k_BKSH.scale[:, :, None, None, :]
    return product(q_X, k_BKSH.astype(jnp.float32))


def _value_sum(w_BKGTS, v_BKSH, product):
    """product(weights, values in float32); an Int8KV's scales [B, K, S] multiply the weights
    of its int8 values."""
    if isinstance(v_BKSH, Int8KV):
        return product(w_BKGTS * v_BKSH.scale[:, :, None, None, :], v_BKSH.q.astype(jnp.float32))
    return product(w_BKGTS, v_BKSH.astype(jnp.float32))


def _scores(q_BTKGH, k_BKSH):
    """q . k for every query and key: [B, K, G, T, S]."""
    if k_BKSH.shape[2] == 1:  # one key (a decode step's own): elementwise, no GEMM call on CPU
        k_B1K1H = k_BKSH[:, :, 0][:, None, :, None, :]
        return jnp.moveaxis(jnp.sum(q_BTKGH * k_B1K1H, -1), 1, 3)[..., None]
    return jnp.einsum("BTKGH,BKSH->BKGTS", q_BTKGH, k_BKSH)


def _weighted(w_BKGTS, v_BKSH):
    """Sum of values by weight: [B, T, K, G, H]."""
    if w_BKGTS.shape[3] == 1 and v_BKSH.shape[2] > 1:
        # One query per row (a decode step): the size-1 T axis dropped first; kept in the
        # product, XLA:CPU lowered it 5-7x slower at batch 32 (B * K tiny GEMMs).
        return jnp.einsum("BKGS,BKSH->BKGH", w_BKGTS[:, :, :, 0], v_BKSH)[:, None]
    if v_BKSH.shape[2] == 1:
        return jnp.moveaxis(w_BKGTS[..., 0], 3, 1)[..., None] * v_BKSH[:, :, 0][:, None, :, None]
    return jnp.moveaxis(jnp.einsum("BKGTS,BKSH->BKGTH", w_BKGTS, v_BKSH), 3, 1)


def _attend_blocks(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, kv_len, own=None, softcap=None):
    """Online softmax over BLOCK-slot blocks [0, ceil(kv_len / BLOCK)) (and the own keys, as
    the starting state): shapes stay static, work follows the filled length, not the capacity,
    and no score tensor is wider than [T, max(BLOCK, own keys)]."""
    B, T, N, H = q_BTNH.shape
    K, S = k_BKSH.shape[1:3]
    # Heads before positions: each block is then one batched GEMM per kv head with G * T rows
    # (in the [B, T, K, G] order XLA:CPU transposed every score tensor: 5x slower at T = 512).
    q_BKGTH = jnp.transpose((q_BTNH.astype(jnp.float32) * scale).reshape(B, T, K, N // K, H),
                            (0, 2, 3, 1, 4))
    state = (jnp.full((B, K, N // K, T), -jnp.inf), jnp.zeros((B, K, N // K, T)),
             jnp.zeros((B, K, N // K, T, H)))
    if own is not None:
        state = _online_softmax(q_BKGTH, own[0], own[1], own[2], softcap, state)

    def block(i, state):
        # The last block may be shifted left to fit; its slots seen before are masked out.
        start = jnp.minimum(i * BLOCK, S - BLOCK)
        # (tree.map: an Int8KV's int8 numbers and scales alike)
        k_blk, v_blk = jax.tree.map(
            lambda x: jax.lax.dynamic_slice_in_dim(x, start, BLOCK, axis=2), (k_BKSH, v_BKSH))
        mask_blk = jax.lax.dynamic_slice_in_dim(mask_BTS, start, BLOCK, axis=2)
        mask_blk = mask_blk & (start + jnp.arange(BLOCK) >= i * BLOCK)
        return _online_softmax(q_BKGTH, k_blk, v_blk, mask_blk, softcap, state)

    n_blocks = (jnp.minimum(kv_len, S) + BLOCK - 1) // BLOCK
    max_BKGT, total_BKGT, acc_BKGTH = jax.lax.fori_loop(0, n_blocks, block, state)
    out_BKGTH = acc_BKGTH / jnp.maximum(total_BKGT, jnp.finfo(jnp.float32).tiny)[..., None]
    lse_BKGT = max_BKGT + jnp.log(total_BKGT)
    return (jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H),
            jnp.transpose(lse_BKGT, (0, 3, 1, 2)).reshape(B, T, N))


def _online_softmax(q_BKGTH, k_BKSH, v_BKSH, mask_BTS, softcap, state):
    """The softmax state (running max [B, K, G, T], sum of weights [B, K, G, T], weighted sum
    of values [B, K, G, T, H], both relative to the max) after one more key set; q is scaled."""
    max_BKGT, total_BKGT, acc_BKGTH = state
    scores_BKGTS = _key_scores(q_BKGTH, k_BKSH, functools.partial(jnp.einsum,
                                                                  "BKGTH,BKSH->BKGTS"))
    if softcap is not None:
        scores_BKGTS = softcap * jnp.tanh(scores_BKGTS / softcap)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, -jnp.inf)
    new_max_BKGT = jnp.maximum(max_BKGT, jnp.max(scores_BKGTS, -1))
    new_max_BKGT = jnp.where(jnp.isfinite(new_max_BKGT), new_max_BKGT, 0.0)  # no key seen yet
    weights_BKGTS = jnp.exp(scores_BKGTS - new_max_BKGT[..., None])
    old_BKGT = jnp.exp(max_BKGT - new_max_BKGT)
    acc_BKGTH = acc_BKGTH * old_BKGT[..., None] + _value_sum(
        weights_BKGTS, v_BKSH, functools.partial(jnp.einsum, "BKGTS,BKSH->BKGTH"))
    return new_max_BKGT, total_BKGT * old_BKGT + weights_BKGTS.sum(-1), acc_BKGTH


def attend(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, bias_BNTS=None, kv_len=None,
           softcap=None):
    """Softmax attention [B, T, N, H] in q's dtype (see attend_parts)."""
    out_BTNH, _ = attend_parts(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, bias_BNTS, kv_len,
                               softcap=softcap)
    return out_BTNH.astype(q_BTNH.dtype)


def attend_shared(q_BTNH, k_PKSH, v_PKSH, mask_PS, scale: float, kv_len=None, softcap=None):
    """attend_parts against keys shared by groups of rows: rows [r*R, (r+1)*R) read prefix row r
    of P = B / R rows. The shared keys are read once per group, not once per row."""
    B, T, N, H = q_BTNH.shape
    P, S = mask_PS.shape
    q_PRNH = q_BTNH.reshape(P, (B // P) * T, N, H)
    mask_PRS = jnp.broadcast_to(mask_PS[:, None, :], (P, (B // P) * T, S))
    out, lse = attend_parts(q_PRNH, k_PKSH, v_PKSH, mask_PRS, scale, kv_len=kv_len,
                            softcap=softcap)
    return out.reshape(B, T, N, H), lse.reshape(B, T, N)


def merge_parts(out1_BTNH, lse1_BTN, out2_BTNH, lse2_BTN):
    """Softmax attention over the union of two disjoint key sets, from each set's part:
    (output, log-sum-exp)."""
    top_BTN = jnp.maximum(lse1_BTN, lse2_BTN)
    top_BTN = jnp.where(jnp.isfinite(top_BTN), top_BTN, 0.0)
    w1_BTN, w2_BTN = jnp.exp(lse1_BTN - top_BTN), jnp.exp(lse2_BTN - top_BTN)
    total_BTN = w1_BTN + w2_BTN
    safe_BTN = jnp.maximum(total_BTN, jnp.finfo(jnp.float32).tiny)
    out_BTNH = (out1_BTNH * (w1_BTN / safe_BTN)[..., None] +
                out2_BTNH * (w2_BTN / safe_BTN)[..., None])
    return out_BTNH, top_BTN + jnp.log(total_BTN)


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
