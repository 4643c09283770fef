"""The sublayers every transformer here is built from: self-attention, cross-attention, MLP.

Each takes a pre-norm residual stream x_BTD and returns it updated; `b` is one layer's Block
(or Cross) parameters.
"""

import functools

import jax.numpy as jnp

from jaxkv import ops
from jaxkv.core import cache as cache_lib
from jaxkv.core.attention import attend, attend_shared
from jaxkv.core.layers import mlp, moe, norm, normed, rope, rope_frequencies, rope_turns


def turns(config, pos_BT, local=False):
    """What self_attention needs of positions pos_BT: RoPE's (cos, sin) (a window layer's when
    local), made once for all the layers of a pass; None for other position kinds."""
    if config.position != "rope":
        return None
    return rope_turns(pos_BT, rope_frequencies(config.rope_dim, *config.rope(local)))


def project_qkv(config, b, x_BTD, turns_BT):
    """Queries [B, T, N, H], keys and values [B, T, K, H] from the fused wqkv of x normed by
    attn_norm (if any); then norms of queries and keys (config.qk_norm) and RoPE (turns_BT,
    from `turns`; None: none)."""
    B, T, _ = x_BTD.shape
    K, G, H = config.n_kv_heads, config.group_size, config.head_dim
    y_BTKJH = ops.matmul(x_BTD, b.wqkv, b.bqkv, norm=normed(config, b.attn_norm))
    y_BTKJH = y_BTKJH.reshape(B, T, K, G + 2, H)
    q_BTNH = y_BTKJH[:, :, :, :G].reshape(B, T, K * G, H)
    k_BTKH, v_BTKH = y_BTKJH[:, :, :, G], y_BTKJH[:, :, :, G + 1]
    if config.qk_norm:
        q_BTNH, k_BTKH = (head_norms(config, x, p) for x, p in ((q_BTNH, b.q_norm),
                                                                 (k_BTKH, b.k_norm)))
    if turns_BT is not None:
        q_BTNH, k_BTKH = rope(q_BTNH, turns_BT), rope(k_BTKH, turns_BT)
    return q_BTNH, k_BTKH, v_BTKH


def head_norms(config, x_BTXH, p):
    """RMSNorm of each head's vector, or of all X heads' at once (config.qk_norm_all)."""
    if not config.qk_norm_all:
        return norm(x_BTXH, p, "rmsnorm", config.norm_eps)
    B, T, X, H = x_BTXH.shape
    return norm(x_BTXH.reshape(B, T, X * H), p, "rmsnorm", config.norm_eps).reshape(B, T, X, H)


def project_out(b, o_BTNH, x_BTD=None):
    """The attention output [B, T, N, H] projected back to the stream [B, T, D] (+ x_BTD)."""
    B, T, N, H = o_BTNH.shape
    return ops.matmul(o_BTNH.reshape(B, T, N * H), b.wo, b.bo, costly_x=True, residual=x_BTD)


def add_out(config, b, x_BTD, o_BTNH, hook=None):
    """x + the attention output projected, normed by attn_out_norm first where the model norms
    sublayer outputs (post_norms); hook (optional) maps that output before it is added (and the
    addition is then not fused into the product)."""
    if not config.post_norms and hook is None:
        return project_out(b, o_BTNH, x_BTD)
    y_BTD = project_out(b, o_BTNH)
    if config.post_norms:
        y_BTD = norm(y_BTD, b.attn_out_norm, config.norm, config.norm_eps)
    return x_BTD + (y_BTD if hook is None else hook(y_BTD))


def self_attention(config, b, x_BTD, turns_BT, mask_BTS=None, bias_BNTS=None, kv=None,
                   prefix=None, write=True, hook=None, head_hook=None, probs=None):
    """Self-attention sublayer -> (x_BTD, (k_BKSH, v_BKSH)); turns_BT: the tokens' positions as
    RoPE needs them (`turns`: the layer's own, a window layer's when it has its own base).

    kv is None when the keys are this call's tokens (uncached: mask_BTS over them), or
    (k_BKSH, v_BKSH, view): this call's tokens read the cache as it was and each other, as the
    cache.View says, in one softmax; then their keys and values are written at view.slot_BT.
    prefix, optional, is (k_PKSH, v_PKSH, mask_PS, prefix_len): keys shared by groups of B / P
    rows (a common prompt), attended once per group and merged by log-sum-exp.
    write=False leaves the cache as it was and returns this call's keys and values [B, K, T, H]
    in place of the cache's, for the caller to store where it chooses. hook: see add_out;
    head_hook (optional) maps the heads' outputs [B, T, N, H] before their projection; probs
    (optional, hooks.Tap._record_probs) is given the attention's arguments to record its
    weights.
    """
    q_BTNH, k_BTKH, v_BTKH = project_qkv(config, b, x_BTD, turns_BT)
    k_BKTH, v_BKTH = jnp.swapaxes(k_BTKH, 1, 2), jnp.swapaxes(v_BTKH, 1, 2)
    scale, cap = config.attn_scale, config.attn_softcap
    if kv is None:
        if probs:
            probs(q_BTNH, k_BKTH, mask_BTS, scale, bias_BNTS, None, cap)
        o_BTNH = attend(q_BTNH, k_BKTH, v_BKTH, mask_BTS, scale, bias_BNTS, softcap=cap)
        o_BTNH = o_BTNH if head_hook is None else head_hook(o_BTNH)
        return add_out(config, b, x_BTD, o_BTNH, hook), (k_BKTH, v_BKTH)
    k_cache, v_cache, view = kv
    own = (k_BKTH, v_BKTH, view.own_mask_BTT,
           None if bias_BNTS is None else cache_lib.at_slots(bias_BNTS, view.slot_BT[:, None]))
    if probs:
        if prefix is not None:
            raise ValueError("hooks: attn_probs is not captured in passes over a shared prefix "
                             "(MultiDecode's); capture it in generate, prefill or decode_step")
        probs(q_BTNH, k_cache, view.cache_mask_BTS, scale, bias_BNTS,
              (own[0], *own[2:]), cap, view.key_pos_BS)
    dtype = x_BTD.dtype if prefix is None else None  # (merged with the prefix in float32)
    out_BTNH, lse_BTN, *written = ops.attention(
        q_BTNH, k_cache, v_cache, view.cache_mask_BTS, scale, bias_BNTS=bias_BNTS,
        kv_len=view.kv_len, own=own, softcap=cap, lengths=view.lengths_B, dtype=dtype,
        store_at=view.slot_BT if write else None)
    if prefix is not None:
        shared = attend_shared(q_BTNH, *prefix[:3], scale, prefix[3], cap)
        out_BTNH, _ = ops.merge_parts(out_BTNH, lse_BTN, *shared)
    out_BTNH = out_BTNH.astype(x_BTD.dtype)
    out_BTNH = out_BTNH if head_hook is None else head_hook(out_BTNH)
    out_BTD = add_out(config, b, x_BTD, out_BTNH, hook)
    return out_BTD, (tuple(written) if write else (k_BKTH, v_BKTH))


def cross_attention(config, c, x_BTD, k_BKMH, v_BKMH, mask_BM):
    """Cross-attention sublayer over precomputed encoder keys/values (no projection of them)."""
    B, T, _ = x_BTD.shape
    h_BTD = norm(x_BTD, c.norm, config.norm, config.norm_eps)
    q_BTNH = ops.matmul(h_BTD, c.wq, c.bq).reshape(B, T, config.n_heads, config.head_dim)
    mask_BTM = jnp.broadcast_to(mask_BM[:, None, :], (mask_BM.shape[0], T, mask_BM.shape[1]))
    o_BTNH = attend(q_BTNH, k_BKMH, v_BKMH, mask_BTM, config.attn_scale)
    return x_BTD + project_out(c, o_BTNH)


def cross_kv(config, c, states_BMD):
    """One layer's cross-attention keys and values [B, K, M, H] of the encoder states."""
    B, M, _ = states_BMD.shape
    y_BMK2H = ops.matmul(states_BMD, c.wkv, c.bkv).reshape(B, M, config.n_kv_heads, 2,
                                                      config.head_dim)
    return jnp.swapaxes(y_BMK2H[:, :, :, 0], 1, 2), jnp.swapaxes(y_BMK2H[:, :, :, 1], 1, 2)


def feed_forward(config, b, x_BTD, hook=None, residual_BTD=None, router_hook=None):
    """MLP (or mixture of experts) sublayer of x, added to residual_BTD (default x; the
    attention's output added to x where config.parallel_residual); hook (optional) maps its
    output before it joins the stream (see add_out), router_hook a mixture's router logits."""
    residual_BTD = x_BTD if residual_BTD is None else residual_BTD
    ffn = mlp if b.router is None else functools.partial(moe, router_hook=router_hook)
    if not config.post_norms and hook is None:
        return ffn(x_BTD, b, config, b.mlp_norm, residual_BTD)
    y_BTD = ffn(x_BTD, b, config, b.mlp_norm)
    if config.post_norms:
        y_BTD = norm(y_BTD, b.mlp_out_norm, config.norm, config.norm_eps)
    return residual_BTD + (y_BTD if hook is None else hook(y_BTD))
