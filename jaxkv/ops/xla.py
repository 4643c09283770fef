"""The portable backend: XLA's own operations, on any platform. Every other backend is tested
against it; JAXKV_OPS=xla forces it."""

import functools

import jax
import jax.numpy as jnp

from jaxkv.ops.arrays import Int8, Int8KV, PagedKV, dequantize_rows, logical, quantize_kv
from jaxkv.ops.target import platform

ACTIVATIONS = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}
BLOCK = 256  # key slots per block when attention is bounded by the filled length
PREFILL_CHUNK = 256  # prompt tokens per prefill pass
HALF_KV_BITS = False  # 16-bit float caches are arrays of their dtype
READS_PAGES = False  # a PagedKV cache comes as arrays.logical gives it


def matmul(x_BTI, w, b_O=None, dtype=None, costly_x=False):
    """x @ w.T (+ b) with w [O, I] (float, or Int8 read as int8), accumulated in float32; the
    result in dtype (default x's). costly_x: a hint for backends that fuse the work making x into
    the product (see jaxkv.ops.matmul); unused here."""
    B, T, I = x_BTI.shape
    if isinstance(w, Int8):
        y_RO = int8_product(x_BTI.reshape(B * T, I).astype(w.dtype), w)
        y_BTO = y_RO.reshape(B, T, -1)
    else:
        y_BTO = jnp.einsum("BTI,OI->BTO", x_BTI, w, preferred_element_type=jnp.float32)
    y_BTO = y_BTO if b_O is None else y_BTO + b_O
    return y_BTO.astype(dtype or x_BTI.dtype)


def norm(x_XD, scale_D, bias_D, kind: str, eps: float):
    """LayerNorm ("layernorm") or RMSNorm ("rmsnorm") of x's last axis, computed in float32 and
    returned in x's dtype."""
    x = x_XD.astype(jnp.float32)
    if kind == "layernorm":
        x = x - x.mean(-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)
    y = x * scale_D.astype(jnp.float32)
    if bias_D is not None:
        y = y + bias_D.astype(jnp.float32)
    return y.astype(x_XD.dtype)


def gated(h_XF2, activation: str, t: int):
    """act(gate) * up [..., F] of h [..., 2 F] in a gated w_in's row order: per block of t units,
    their t gate outputs, then their t up outputs."""
    blocks = h_XF2.reshape(*h_XF2.shape[:-1], -1, 2, t)
    gate = blocks[..., 0, :].reshape(*h_XF2.shape[:-1], -1)
    up = blocks[..., 1, :].reshape(*h_XF2.shape[:-1], -1)
    return ACTIVATIONS[activation](gate) * up


def int8_product(x_RI, w: Int8):
    """x @ w.T, accumulated in float32, with w's int8 numbers converted to x's dtype as the
    product's operand (a GPU's product kernels convert them as they read, so no float copy of w
    is made). One scale per row multiplies the outputs. Per-block scales: for fewer rows than a
    block has inputs, one product per block ([NB, R, O] partial sums, fewer values than w),
    each block's scale applied as they are summed; else w is dequantized first."""
    R, I = x_RI.shape
    O, NB = w.scale.shape
    if NB == 1:
        y_RO = jnp.einsum("RI,OI->RO", x_RI, w.q.astype(x_RI.dtype),
                          preferred_element_type=jnp.float32)
        return y_RO * w.scale[:, 0].astype(jnp.float32)
    if R < I // NB:
        y_BRO = jnp.einsum("RBK,OBK->BRO", x_RI.reshape(R, NB, -1),
                           w.q.reshape(O, NB, -1).astype(x_RI.dtype),
                           preferred_element_type=jnp.float32)
        return jnp.einsum("BRO,OB->RO", y_BRO, w.scale.astype(jnp.float32))
    return jnp.einsum("RI,OI->RO", x_RI, dequantize_rows(w.q, w.scale),
                      preferred_element_type=jnp.float32)


def placed(tree):
    """Weights where this backend reads them best: as they are."""
    return tree


def materialized(x):
    """x as computed: XLA's fusion decides where it is recomputed."""
    return x


def prefill_chunk(w_qkv, rows: int, tokens: int) -> int:
    """Prompt tokens per prefill pass."""
    return PREFILL_CHUNK


# ---- mixture of experts ---------------------------------------------------------------------

EXPERT_TILE = 16  # rows a tile of experts' products holds (each tile one expert's)


def experts(x_RD, w_in_EOD, w_out_EDF, expert_RK, weight_RK, activation: str):
    """Each row's sum over k of weight_RK[r, k] times expert expert_RK[r, k]'s gated MLP of it:
    down(act(gate x) * up x), w_in_EOD [E, 2F, D] (gate rows, then up rows), w_out_EDF [E, D, F],
    float or Int8 (jaxkv.quantize: scales per expert and row, read as int8); products
    accumulated in float32, the result in x's dtype. Only the experts rows chose are computed:
    few rows (a decode step) slice out their experts' weights; many sort the rows by expert
    into tiles of EXPERT_TILE rows, each one expert's (grouped products; XLA:CPU's ragged_dot
    computes every expert for every row)."""
    R, K = expert_RK.shape
    D = x_RD.shape[1]
    e_X = expert_RK.reshape(R * K)
    x_XD = jnp.repeat(x_RD, K, axis=0)  # row r once for each of its experts
    if R * K <= EXPERT_TILE:  # each row's expert sliced out: only those weights are read
        take = lambda w, j: _expert(w, e_X[j])  # noqa: E731
        y_XD = jnp.concatenate([_expert_mlp(x_XD[j:j + 1], take(w_in_EOD, j),
                                            take(w_out_EDF, j), activation)
                                for j in range(R * K)])
    else:
        y_XD = _expert_tiles(x_XD, e_X, w_in_EOD, w_out_EDF, activation)
    return weighted_sum(y_XD.reshape(R, K, D), weight_RK)


def weighted_sum(y_RKD, weight_RK):
    """Each row's experts' outputs [R, K, D] summed with the router's weights: [R, D]."""
    return (y_RKD * weight_RK[..., None].astype(y_RKD.dtype)).sum(1)


def expert_gated(h_XO, activation: str):
    """act(gate) * up [X, F] of an expert's first product [X, 2F] (its F gate rows, then up)."""
    return gated(h_XO, activation, h_XO.shape[-1] // 2)


def _expert(w_EOI, e):
    """Expert e's matrix [O, I] of the stacked [E, O, I] (an Int8's numbers and scales alike:
    it stays int8)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=False), w_EOI)


def _product(x_XI, w_OI):
    """x @ w.T accumulated in float32, w float or Int8."""
    if isinstance(w_OI, Int8):
        return int8_product(x_XI.astype(w_OI.dtype), w_OI)
    return jnp.einsum("XI,OI->XO", x_XI, w_OI, preferred_element_type=jnp.float32)


def _expert_mlp(x_XD, w_in_OD, w_out_DF, activation):
    """Rows x through one expert's gated MLP (its weights float or Int8)."""
    a_XF = expert_gated(_product(x_XD, w_in_OD), activation).astype(x_XD.dtype)
    return _product(a_XF, w_out_DF).astype(x_XD.dtype)


def _expert_tiles(x_XD, e_X, w_in_EOD, w_out_EDF, activation):
    """_expert_mlp of rows sorted by expert, each expert's rows padded to whole tiles, the tiles
    run one after another against their one expert's weights (static shapes: at most X / tile
    + E tiles, those past the last row empty)."""
    X, D = x_XD.shape
    E, t = w_in_EOD.shape[0], EXPERT_TILE
    order_X = jnp.argsort(e_X, stable=True)
    e_sorted_X = e_X[order_X]
    count_E = jnp.bincount(e_X, length=E)
    padded_E = -(-count_E // t) * t
    first_E = jnp.cumsum(count_E) - count_E  # an expert's first row, sorted
    start_E = jnp.cumsum(padded_E) - padded_E  # and where its tiles begin
    at_X = start_E[e_sorted_X] + jnp.arange(X) - first_E[e_sorted_X]
    n = -(-X // t) + E
    tiles_NtD = jnp.zeros((n * t, D), x_XD.dtype).at[at_X].set(x_XD[order_X]).reshape(n, t, D)
    expert_N = jnp.clip(jnp.searchsorted(start_E + padded_E, jnp.arange(n) * t, side="right"),
                        0, E - 1)
    y_NtD = jax.lax.map(lambda a: _expert_mlp(a[0], _expert(w_in_EOD, a[1]),
                                              _expert(w_out_EDF, a[1]), activation),
                        (tiles_NtD, expert_N))
    return jnp.zeros_like(x_XD).at[order_X].set(y_NtD.reshape(n * t, D)[at_X])


# ---- attention ------------------------------------------------------------------------------

def attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, bias_BNTS=None, kv_len=None,
              own=None, softcap=None, lengths=None):
    """Grouped-query attention: output [B, T, N, H] and its log-sum-exp [B, T, N], float32.
    (The contract every backend keeps: see jaxkv.ops.attention.)

    With kv_len (traced), only the first ceil(kv_len / BLOCK) blocks of cache slots are visited
    in an online softmax; a few queries (T * S <= BLOCK^2) read every slot in one pass once
    kv_len passes a third of the slots, where that is cheaper than slicing out blocks. On a GPU,
    which waits on the host for a cond's predicate and a loop's trip count, neither is traced:
    a few queries read every slot, many visit every block (those past kv_len masked)."""
    own = own_as_cache(k_BKSH, own)
    keys = [(k_BKSH, v_BKSH, mask_BTS, bias_BNTS)] + ([] if own is None else [own])
    S = k_BKSH.shape[2]
    few, gpu = q_BTNH.shape[1] * S <= BLOCK * BLOCK, platform() == "gpu"
    if kv_len is None or bias_BNTS is not None or S <= BLOCK or (few and gpu):
        return _attend_dense(q_BTNH, keys, scale, softcap)
    blocks = functools.partial(_attend_blocks, q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, kv_len,
                               own, softcap, every=gpu)
    if not few:  # many queries (a prefill chunk): scores [T, BLOCK]
        return blocks()
    dense = functools.partial(_attend_dense, q_BTNH, keys, scale, softcap)
    return jax.lax.cond(3 * kv_len > S, dense, blocks)


def own_as_cache(k_BKSH, own):
    """The own keys and values as the cache will hold them: quantized where it is an Int8KV, so
    a call reads its tokens as later calls will."""
    if own is None or not isinstance(k_BKSH, Int8KV) or isinstance(own[0], Int8KV):
        return own
    return (quantize_kv(own[0]), quantize_kv(own[1]), *own[2:])


def softcapped(scores, softcap):
    """Scores soft-capped (Gemma 2's softcap * tanh(scores / softcap)), or as they are."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _dense_scores(q_BTNH, keys, scale, softcap=None):
    """Scores [B, K, G, T, S1 + S2 + ...] of every query against the union of key sets
    [(k_BKSH, v_BKSH, mask_BTS, bias_BNTS), ...], -inf where masked, and their max over the
    keys [B, K, G, T, 1] (0 where a query sees none)."""
    B, T, N, H = q_BTNH.shape
    K = keys[0][0].shape[1]
    # Scores and weighted sums in float32 (XLA:CPU has no bfloat16 x bfloat16 -> float32 dot).
    q_BTKGH = q_BTNH.astype(jnp.float32).reshape(B, T, K, N // K, H)
    scores = []
    for k_BKSH, _, mask_BTS, bias_BNTS in keys:
        scores_BKGTS = softcapped(_key_scores(q_BTKGH, k_BKSH, _scores) * scale, softcap)
        if bias_BNTS is not None:
            b, _, t, s = bias_BNTS.shape
            scores_BKGTS = scores_BKGTS + bias_BNTS.reshape(b, K, N // K, t, s)
        scores.append(jnp.where(mask_BTS[:, None, None], scores_BKGTS, -jnp.inf))
    scores_BKGTS = jnp.concatenate(scores, -1)
    max_BKGT1 = jnp.max(scores_BKGTS, axis=-1, keepdims=True)
    return scores_BKGTS, jnp.where(jnp.isfinite(max_BKGT1), max_BKGT1, 0.0)


def attention_weights(q_BTNH, k_BKSH, mask_BTS, scale: float, bias_BNTS=None, own=None,
                      softcap=None):
    """The softmax weights, float32, of `attention` with the same arguments: [B, N, T, S] over
    the cache's keys and, with own (k_BKUH, mask_BTU, bias_BNTU), [B, N, T, U] over those
    (read as attention reads them; 0 where a query sees no key)."""
    k_BKSH = logical(k_BKSH) if isinstance(k_BKSH, PagedKV) else k_BKSH
    keys = [(k_BKSH, None, mask_BTS, bias_BNTS)]
    if own is not None:
        k_BKUH = own[0]
        if isinstance(k_BKSH, Int8KV) and not isinstance(k_BKUH, Int8KV):
            k_BKUH = quantize_kv(k_BKUH)  # (as own_as_cache: read as the cache will hold it)
        keys.append((k_BKUH, None, *own[1:]))
    scores_BKGTS, max_BKGT1 = _dense_scores(q_BTNH, keys, scale, softcap)
    weights_BKGTS = jnp.exp(scores_BKGTS - max_BKGT1)
    total_BKGT1 = jnp.maximum(weights_BKGTS.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    B, K, G, T, _ = weights_BKGTS.shape
    w_BNTX = (weights_BKGTS / total_BKGT1).reshape(B, K * G, T, -1)
    S = mask_BTS.shape[2]
    return w_BNTX if own is None else (w_BNTX[..., :S], w_BNTX[..., S:])


def _attend_dense(q_BTNH, keys, scale, softcap=None):
    """One softmax over the union of key sets [(k_BKSH, v_BKSH, mask_BTS, bias_BNTS), ...]."""
    B, T, N, H = q_BTNH.shape
    scores_BKGTS, max_BKGT1 = _dense_scores(q_BTNH, keys, scale, softcap)
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
    multiply the scores of its int8 keys (converted whole for the product: written as a product
    summed over H, the conversion fused but the product ran slower on XLA:CPU)."""
    if isinstance(k_BKSH, Int8KV):
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
    if k_BKSH.shape[2] == 1:  # one key (a decode step's own): elementwise, no product call
        k_B1K1H = k_BKSH[:, :, 0][:, None, :, None, :]
        return jnp.moveaxis(jnp.sum(q_BTKGH * k_B1K1H, -1), 1, 3)[..., None]
    return jnp.einsum("BTKGH,BKSH->BKGTS", q_BTKGH, k_BKSH)


def _weighted(w_BKGTS, v_BKSH):
    """Sum of values by weight: [B, T, K, G, H]."""
    if w_BKGTS.shape[3] == 1 and v_BKSH.shape[2] > 1:
        # One query per row (a decode step): the size-1 T axis is dropped first, which XLA:CPU
        # lowers to one product per row and head rather than B * K tiny ones.
        return jnp.einsum("BKGS,BKSH->BKGH", w_BKGTS[:, :, :, 0], v_BKSH)[:, None]
    if v_BKSH.shape[2] == 1:
        return jnp.moveaxis(w_BKGTS[..., 0], 3, 1)[..., None] * v_BKSH[:, :, 0][:, None, :, None]
    return jnp.moveaxis(jnp.einsum("BKGTS,BKSH->BKGTH", w_BKGTS, v_BKSH), 3, 1)


def _attend_blocks(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, kv_len, own=None, softcap=None,
                   every=False):
    """Online softmax over BLOCK-slot blocks [0, ceil(kv_len / BLOCK)) (and the own keys, as
    the starting state): shapes stay static, work follows the filled length, not the capacity,
    and no score tensor is wider than [T, max(BLOCK, own keys)]. every: all blocks, a loop of
    static length, the slots from kv_len on masked."""
    B, T, N, H = q_BTNH.shape
    K, S = k_BKSH.shape[1:3]
    # Heads before positions: each block is one batched product per kv head with G * T rows.
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
        slot = start + jnp.arange(BLOCK)
        mask_blk = mask_blk & (slot >= i * BLOCK) & ((slot < kv_len) if every else True)
        return _online_softmax(q_BKGTH, k_blk, v_blk, mask_blk, softcap, state)

    n_blocks = -(-S // BLOCK) if every else (jnp.minimum(kv_len, S) + BLOCK - 1) // BLOCK
    max_BKGT, total_BKGT, acc_BKGTH = jax.lax.fori_loop(0, n_blocks, block, state)
    out_BKGTH = acc_BKGTH / jnp.maximum(total_BKGT, jnp.finfo(jnp.float32).tiny)[..., None]
    lse_BKGT = max_BKGT + jnp.log(total_BKGT)
    return (jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H),
            jnp.transpose(lse_BKGT, (0, 3, 1, 2)).reshape(B, T, N))


def _online_softmax(q_BKGTH, k_BKSH, v_BKSH, mask_BTS, softcap, state):
    """The softmax state (running max [B, K, G, T], sum of weights [B, K, G, T], weighted sum
    of values [B, K, G, T, H], both relative to the max) after one more key set; q is scaled."""
    max_BKGT, total_BKGT, acc_BKGTH = state
    scores_BKGTS = softcapped(_key_scores(q_BKGTH, k_BKSH, functools.partial(
        jnp.einsum, "BKGTH,BKSH->BKGTS")), softcap)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, -jnp.inf)
    new_max_BKGT = jnp.maximum(max_BKGT, jnp.max(scores_BKGTS, -1))
    new_max_BKGT = jnp.where(jnp.isfinite(new_max_BKGT), new_max_BKGT, 0.0)  # no key seen yet
    weights_BKGTS = jnp.exp(scores_BKGTS - new_max_BKGT[..., None])
    old_BKGT = jnp.exp(max_BKGT - new_max_BKGT)
    acc_BKGTH = acc_BKGTH * old_BKGT[..., None] + _value_sum(
        weights_BKGTS, v_BKSH, functools.partial(jnp.einsum, "BKGTS,BKSH->BKGTH"))
    return new_max_BKGT, total_BKGT * old_BKGT + weights_BKGTS.sum(-1), acc_BKGTH


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
