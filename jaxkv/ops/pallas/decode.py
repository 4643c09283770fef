"""jaxkv's own decode-attention kernels, for every decode step of the Pallas backend.

JAX's GPU decode_attention (deprecated from jax 0.11) reads a per-row prefix [0, length) of
float keys; JAX's TPU paged_attention reads keys as bfloat16 and returns no log-sum-exp (which
merging a step's own key needs). A decode step reads float prefixes, and also sliding-window
rings (any subset of slots, given by a mask), int8 caches (an Int8KV: int8 numbers and one
scale per token and kv head, read as such) and soft-capped scores (Gemma 2). These kernels take
all of those: one query per row and query head, its kv head's slots read in blocks up to a
per-row bound (no block past it is read), masked per slot, an online softmax in float32
(jaxkv.ops.pallas.softmax). Three forms:

- gpu, Mosaic GPU's (jaxkv.ops.pallas.mosaic_gpu, Hopper and newer, from jax 0.11): 16-bit
  float caches, dense or paged, masked or not, heads and blocks of 64 or more; the parts
  merged in XLA.
- gpu, Triton's: everything else, and every GPU step on jax 0.10 (Triton's Pallas backend is
  deprecated from jax 0.11, and jax 0.10's GPU interpreter cannot check the Mosaic form);
  programs over (row, kv head, part of the sequence), each looping over its part's blocks, then
  one program per row and kv head merging the parts and the step's own key.
- tpu: Mosaic's; a grid over (row, kv head, block), the blocks visited in order with the
  softmax state in VMEM scratch, the bound prefetched so that blocks past it are not copied in.

All run in Pallas's interpret mode on a CPU (the TPU form under pltpu's TPU interpreter, the
Mosaic GPU form under Mosaic GPU's).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.ops.arrays import Int8KV
from jaxkv.ops.pallas import mosaic_gpu
from jaxkv.ops.pallas.softmax import merge, online_softmax, own_score
from jaxkv.ops.xla import softcapped

# Query rows per program: Triton's products take >= 16, a warpgroup's (Mosaic GPU's) 64.
MIN_ROWS = {"gpu": 16, "tpu": 8, "mosaic": mosaic_gpu.ROWS}


def stores(target: str, q, k, block_k: int) -> bool:
    """Whether attention takes `store` for this cache: the Triton form's (a GPU's, where the
    Mosaic form does not take it) over a dense float cache of q's dtype."""
    return (target == "gpu" and not isinstance(k, Int8KV) and k.dtype == q.dtype
            and not mosaic_gpu.fits(k, block_k))


def attention(q_BKGH, k_BKSH, v_BKSH, scale: float, bound_B, mask_BS=None, softcap=None, *,
              target: str, block_k: int, k_splits: int = 1, interpret: bool = False,
              table_BM=None, own=None, out_dtype=jnp.float32, store=None):
    """Softmax attention of one query per (row, query head) over the cache slots s < bound_B[b]
    with mask_BS[b, s] (all of them without a mask), and the step's own key where own = (k_BKH,
    v_BKH, seen_B) (float; seen_B: whether the row reads it): (out [B, K, G, H], lse [B, K, G]),
    float32 (out in out_dtype); a query that reads nothing gets 0 and -inf. With store = (k_BKSH,
    v_BKSH, slot_B) (where `stores` says), own's key and value are also stored at slot_B of
    their row (dropped outside [0, S)) and the caches returned after. Keys and values:
    [B, K, S, H] float
    arrays or Int8KV. target: "gpu" (S = k_splits parts of whole blocks of block_k slots, the
    parts and the own key merged after: the module's docstring says by what) or "tpu" (S whole
    blocks; the own key merged by XLA). table_BM: keys and values are pools of pages [K, NB,
    block_k, H] (a PagedKV's), row b's slot s in page table_BM[b, s // block_k] (S = M block_k;
    a page id of NB or more is none: its slots must be past the bound or masked)."""
    G = q_BKGH.shape[2]
    quantized = isinstance(k_BKSH, Int8KV)
    numbers = k_BKSH.q if quantized else k_BKSH
    form = "mosaic" if target == "gpu" and mosaic_gpu.fits(numbers, block_k) else target
    rows = max(MIN_ROWS[form], 1 << (G - 1).bit_length())
    # The products' operands share a dtype: the cache's, or q's where int8 numbers are read.
    dtype = q_BKGH.dtype if quantized else k_BKSH.dtype
    q_BKRH = jnp.pad(q_BKGH, ((0, 0), (0, 0), (0, rows - G), (0, 0)))
    bound_B = bound_B.astype(jnp.int32)
    if form == "mosaic":
        mask_BS = None if mask_BS is None else mask_BS.astype(jnp.int32)  # (4-byte loads)
        parts = mosaic_gpu.parts(bound_B, q_BKRH, k_BKSH, v_BKSH, mask_BS, scale=scale,
                                 softcap=softcap, block_k=block_k, k_splits=k_splits,
                                 interpret=interpret, table_BM=table_BM, queries=G)
        Q = parts[0].shape[3]
        out_BKRH, lse_BKR = _merge_own(parts, q_BKRH[:, :, :Q], own, scale, softcap)
        return out_BKRH[:, :, :G].astype(out_dtype), lse_BKR[:, :, :G]
    cache = [k_BKSH.q, k_BKSH.scale, v_BKSH.q, v_BKSH.scale] if quantized else [k_BKSH, v_BKSH]
    # (Mosaic TPU cannot take a row of int8 out of its tiles: the mask is int32 there)
    cache += [] if mask_BS is None else [mask_BS.astype(jnp.int8 if target == "gpu" else
                                                        jnp.int32)]
    block = functools.partial(_block, scale=scale, softcap=softcap, quantized=quantized,
                              masked=mask_BS is not None, dtype=dtype)
    if target == "tpu":
        out_BKRH, lse_BKR = _on_tpu(block, bound_B, q_BKRH.astype(dtype), cache,
                                    block_k=block_k, interpret=interpret, table_BM=table_BM)
        if own is not None:  # the kernel's whole as one part: its sum of weights is 1
            out_BKRH, lse_BKR = _merge_own((out_BKRH[:, :, None], lse_BKR[:, :, None],
                                            jnp.ones_like(lse_BKR)[:, :, None]), q_BKRH, own,
                                           scale, softcap)
    else:
        if own is not None and own[0].dtype == q_BKRH.dtype:
            # The own key and value as rows R and R + 1 after the queries: one XLA kernel
            # (RoPE's, where the model has it) makes what both of the form's kernels read.
            B, K, R, H = q_BKRH.shape
            q_BKRH = jnp.concatenate([q_BKRH, own[0][:, :, None], own[1][:, :, None],
                                      jnp.zeros((B, K, R - 2, H), q_BKRH.dtype)], axis=2)
            own = (None, None, own[2])
        parts = _on_gpu(block, bound_B, q_BKRH, cache, block_k=block_k, k_splits=k_splits,
                        interpret=interpret, table_BM=table_BM, rows=rows)
        out_BKQH, lse_BKQ, *stored = _merge_on_gpu(
            *parts, q_BKRH, own, G, scale=scale, softcap=softcap, interpret=interpret,
            dtype=out_dtype, store=store)
        return out_BKQH[:, :, :G], lse_BKQ[:, :, :G], *stored
    return out_BKRH[:, :, :G].astype(out_dtype), lse_BKR[:, :, :G]


def _merge_own(parts, q_BKRH, own, scale: float, softcap):
    """(out, lse) of parts ([B, K, J, R, H], [B, K, J, R] twice) and own's key, in XLA."""
    if own is None:
        return merge(*parts)
    k_BKH, v_BKH, seen_B = own
    return merge(*parts, own_score(q_BKRH, k_BKH, seen_B[:, None, None], scale, softcap), v_BKH)


def _block(state, q_RH, refs, at, first_slot, bound, *, scale, softcap, quantized, masked,
           dtype, mask_at=None):
    """The softmax state (max [R], sum of weights [R], weighted sum of values [R, H]) after the
    block of cache slots `at` (an index of refs: keys, values, their scales; a tuple (page,
    slots) in a pool), whose first slot is first_slot; the mask (refs[-1]) is read at mask_at
    (default `at`); the products' operands are of dtype."""
    max_R, total_R, acc_RH = state
    q_RH = q_RH.astype(dtype)
    k_ref, k_scale, v_ref, v_scale = refs[:4] if quantized else (refs[0], None, refs[1], None)
    at = at if isinstance(at, tuple) else (at,)
    k_CH = k_ref[(*at, slice(None))].astype(q_RH.dtype)
    scores_RC = _product(q_RH, k_CH, 1) * scale
    if quantized:
        scores_RC = scores_RC * k_scale[at][None, :]
    scores_RC = softcapped(scores_RC, softcap)
    seen_C = first_slot + jnp.arange(k_CH.shape[0]) < bound
    if masked:
        seen_C = seen_C & (refs[-1][at[-1] if mask_at is None else mask_at] != 0)
    scores_RC = jnp.where(seen_C[None, :], scores_RC, -jnp.inf)
    new_max_R, total_R, weights_RC, old_R = online_softmax(max_R, total_R, scores_RC)
    if quantized:
        weights_RC = weights_RC * v_scale[at][None, :]
    v_CH = v_ref[(*at, slice(None))].astype(q_RH.dtype)
    acc_RH = acc_RH * old_R[:, None] + _product(weights_RC.astype(v_CH.dtype), v_CH, 0)
    return new_max_R, total_R, acc_RH


def _product(a_RX, b_YX, contracted: int):
    """a @ b.T (contracted=1) or a @ b (0), accumulated in float32; float32 operands exactly
    (no TF32), 16-bit ones as they are."""
    # (said either way: a global "highest" would ask Mosaic for float32 passes over bfloat16)
    precision = (jax.lax.Precision.HIGHEST if a_RX.dtype == jnp.float32 else
                 jax.lax.Precision.DEFAULT)
    return jax.lax.dot_general(a_RX, b_YX, (((1,), (contracted,)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)


def _empty_state(rows: int, H: int):
    return (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, H), jnp.float32))


def _cache_specs(cache, length: int, index):
    """BlockSpecs of `length` slots of the cache arrays ([B, K, S, H] numbers, [B, K, S] scales,
    [B, S] mask) at the block index(b, k, *rest) says."""
    def spec(x):
        if x.ndim == 2:
            return pl.BlockSpec((None, length), lambda b, k, *r: (b, index(b, k, *r)))
        tail = x.shape[3:]
        return pl.BlockSpec((None, None, length, *tail),
                            lambda b, k, *r: (b, k, index(b, k, *r), *(0,) * len(tail)))
    return [spec(x) for x in cache]


def _pool_specs(cache, part: int):
    """BlockSpecs giving a GPU program its kv head's whole pools ([NB, P, H] numbers, [NB, P]
    scales) and its part of the row's mask."""
    def spec(x):
        if x.ndim == 2:
            return pl.BlockSpec((None, part), lambda b, k, j: (b, j))
        return pl.BlockSpec((None, *x.shape[1:]), lambda b, k, j: (k,) + (0,) * (x.ndim - 1))
    return [spec(x) for x in cache]


def _on_gpu(block, bound_B, q_BKPH, cache, *, block_k, k_splits, interpret, table_BM=None,
            rows: int):
    """Programs over (row, kv head, part); each loops over its part's blocks below the bound
    (with table_BM: pages of block_k slots, looked up in the row's table); the queries are the
    first `rows` of q_BKPH's P."""
    B, K, _, H = q_BKPH.shape
    paged = table_BM is not None
    part = (table_BM.shape[1] * block_k if paged else cache[0].shape[2]) // k_splits

    def kernel(bound_ref, q_ref, *refs):
        table_ref, refs = (refs[0], refs[1:]) if paged else (None, refs)
        cache_refs, (out_ref, max_ref, total_ref) = refs[:-3], refs[-3:]
        start = pl.program_id(2) * part
        bound = bound_ref[()]

        def step(i, state):
            slots = pl.ds(i * block_k, block_k)
            if not paged:
                return block(state, q_ref[...], cache_refs, slots, start + i * block_k, bound)
            page = jnp.minimum(table_ref[start // block_k + i], cache[0].shape[1] - 1)
            return block(state, q_ref[...], cache_refs, (page, pl.ds(0, block_k)),
                         start + i * block_k, bound, mask_at=slots)
        n_blocks = jnp.clip(pl.cdiv(bound - start, block_k), 0, part // block_k)
        out_ref[...], max_ref[...], total_ref[...] = _reorder(jax.lax.fori_loop(
            0, n_blocks, step, _empty_state(rows, H)))

    per_part = lambda *shape: pl.BlockSpec((None, None, None, *shape),
                                           lambda b, k, j: (b, k, j) + (0,) * len(shape))
    tables = [pl.BlockSpec((None, table_BM.shape[1]), lambda b, k, j: (b, 0))] if paged else []
    out_BKJRH, max_BKJR, total_BKJR = pl.pallas_call(
        kernel, grid=(B, K, k_splits),
        in_specs=[pl.BlockSpec((None,), lambda b, k, j: (b,)),
                  pl.BlockSpec((None, None, rows, H), lambda b, k, j: (b, k, 0, 0)), *tables,
                  *(_pool_specs(cache, part) if paged else
                    _cache_specs(cache, part, lambda b, k, j: j))],
        out_specs=[per_part(rows, H), per_part(rows), per_part(rows)],
        out_shape=[jax.ShapeDtypeStruct((B, K, k_splits, rows, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, k_splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, k_splits, rows), jnp.float32)],
        interpret=interpret, name="jaxkv_decode_attention", compiler_params=triton_params(),
    )(bound_B, q_BKPH, *([table_BM] if paged else []), *cache)
    return out_BKJRH, max_BKJR, total_BKJR


def triton_params():
    """Triton's compiler parameters: the GPU form is a Triton program (a pallas_call on a GPU
    lowers with Mosaic GPU unless told so, from jax 0.10)."""
    from jax.experimental.pallas import triton as pltriton  # (GPU programs alone)

    return pltriton.CompilerParams()


def _on_tpu(block, bound_B, q_BKRH, cache, *, block_k, interpret, table_BM=None):
    """A grid over (row, kv head, block), blocks in order; a block past the row's bound maps to
    the last one read (so it is not copied in again) and is skipped. With table_BM the blocks
    are pages of pools, the table prefetched beside the bounds and looked up as blocks are
    copied in. Mosaic takes blocks whose last two dimensions are whole or (8, 128)-tiled, so
    arrays of one number per slot (scales, the mask) and the log-sum-exp come with a unit
    dimension before their last: [..., blocks, 1, block_k] read a block at a time."""
    B, K, rows, H = q_BKRH.shape
    paged = table_BM is not None
    n_blocks = table_BM.shape[1] if paged else cache[0].shape[2] // block_k
    last = lambda b, bound_ref: jnp.maximum(pl.cdiv(bound_ref[b], block_k) - 1, 0)
    at = lambda b, k, i, bound_ref, *_: jnp.minimum(i, last(b, bound_ref))
    page = (lambda b, k, i, bound_ref, table_ref: jnp.minimum(
        table_ref[b, at(b, k, i, bound_ref)], cache[0].shape[1] - 1)) if paged else None
    prefetch = (bound_B, table_BM) if paged else (bound_B,)
    tiled = [x if x.ndim == 4 else x.reshape(*x.shape[:-1], x.shape[-1] // block_k, 1, block_k)
             for x in cache]

    def kernel(*refs):
        bound_ref, (q_ref, *refs) = refs[0], refs[len(prefetch):]
        cache_refs, (out_ref, lse_ref), state = refs[:-5], refs[-5:-3], refs[-3:]
        cache_refs = [r if x.ndim == 4 else r.at[0] for r, x in zip(cache_refs, cache)]
        b, i = pl.program_id(0), pl.program_id(2)

        @pl.when(i == 0)
        def _():
            for ref, empty in zip(state, _empty_state(rows, H)):
                ref[...] = empty

        @pl.when(i * block_k < bound_ref[b])
        def _():
            new = block(tuple(ref[...] for ref in state), q_ref[...], cache_refs,
                        pl.ds(0, block_k), i * block_k, bound_ref[b])
            for ref, value in zip(state, new):
                ref[...] = value

        @pl.when(i == n_blocks - 1)
        def _():
            max_R, total_R, acc_RH = (ref[...] for ref in state)
            out_ref[...] = acc_RH / jnp.maximum(total_R, jnp.finfo(jnp.float32).tiny)[:, None]
            lse_ref[0, :] = jnp.where(total_R > 0, max_R + jnp.log(total_R), -jnp.inf)

    per_row = lambda *shape: pl.BlockSpec((None, None, *shape),  # noqa: E731
                                          lambda b, k, i, *_: (b, k) + (0,) * len(shape))
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch), grid=(B, K, n_blocks),
        in_specs=[per_row(rows, H), *_tpu_cache_specs(tiled, block_k, at, page)],
        out_specs=[per_row(rows, H), per_row(1, rows)],
        scratch_shapes=[pltpu.VMEM((rows,), jnp.float32), pltpu.VMEM((rows,), jnp.float32),
                        pltpu.VMEM((rows, H), jnp.float32)])
    out_BKRH, lse_BK1R = pl.pallas_call(
        kernel, grid_spec=grid,
        out_shape=[jax.ShapeDtypeStruct((B, K, rows, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, 1, rows), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="jaxkv_decode_attention",
    )(*prefetch, q_BKRH, *tiled)
    return out_BKRH, lse_BK1R[:, :, 0]


def _tpu_cache_specs(tiled, block_k: int, index, page=None):
    """BlockSpecs of one block of the cache arrays as _on_tpu tiles them: numbers [B, K, S, H],
    scales [B, K, S / block_k, 1, block_k] and the mask [B, S / block_k, 1, block_k], at the
    block index(b, k, *rest) says; with page(b, k, *rest), numbers [K, NB, P, H] and scales
    [K, NB, 1, 1, P] are pools read at that page (the mask as before)."""
    def spec(x):
        if x.ndim == 4 and x.shape[2] == 1:  # the mask
            return pl.BlockSpec((None, None, 1, block_k),
                                lambda b, k, *r: (b, index(b, k, *r), 0, 0))
        block = (None, None, block_k, x.shape[3]) if x.ndim == 4 else (None, None, None, 1,
                                                                        block_k)
        zeros = (0,) * (x.ndim - 3)
        if page is None:
            return pl.BlockSpec(block, lambda b, k, *r: (b, k, index(b, k, *r), *zeros))
        return pl.BlockSpec(block, lambda b, k, *r: (k, page(b, k, *r), 0, *zeros))
    return [spec(x) for x in tiled]


def _reorder(state):
    """(max, total, acc) as the GPU kernel's outputs are ordered: (acc, max, total)."""
    return state[2], state[0], state[1]


def _merge_on_gpu(out_BKJRH, max_BKJR, total_BKJR, q_BKPH, own, G: int, *, scale, softcap,
                  interpret, dtype, store=None):
    """The GPU form's parts (and the own key, with own = (k_BKH, v_BKH, seen_B), or (None, None,
    seen_B) where they are rows R and R + 1 of q_BKPH) merged by one program per (row, kv
    head): (out [B, K, Q, H] in dtype, lse [B, K, Q]) of the first Q query rows (G where it is a
    power of 2, as Triton's blocks are, else all R); with store = (k_BKSH, v_BKSH, slot_B), the
    same programs store own's key and value at slot_B of their row, and the caches follow."""
    B, K, J, R, H = out_BKJRH.shape
    Q = G if G & (G - 1) == 0 else R
    packed = own is not None and own[0] is None

    def kernel(acc_ref, max_ref, total_ref, *refs):
        own_Q = k_H = v_H = None
        if own is not None:
            q_ref, *refs = refs
            if packed:
                kv_ref, seen_ref, *refs = refs
                k_H, v_H = kv_ref[0], kv_ref[1]
            else:
                k_ref, v_ref, seen_ref, *refs = refs
                k_H, v_H = k_ref[...], v_ref[...]
            own_Q = own_score(q_ref[...], k_H, seen_ref[()] != 0, scale, softcap)
        if store is not None:
            slot_ref, _, _, *refs = refs  # (the caches, aliased to the last two outputs)
        out_ref, lse_ref, *caches = refs
        out_QH, lse_ref[...] = merge(acc_ref[...], max_ref[...], total_ref[...], own_Q, v_H)
        out_ref[...] = out_QH.astype(out_ref.dtype)
        if store is not None:
            _store_at(caches, (k_H, v_H), slot_ref[()])

    each = lambda *shape: pl.BlockSpec((None, None, *shape),  # noqa: E731
                                       lambda b, k: (b, k) + (0,) * len(shape))
    by_row = pl.BlockSpec((None,), lambda b, k: (b,))
    inputs = [out_BKJRH, max_BKJR, total_BKJR]
    specs = [each(J, Q, H), each(J, Q), each(J, Q)]
    if packed:
        inputs += [q_BKPH, q_BKPH, own[2].astype(jnp.int32)]
        specs += [each(Q, H), pl.BlockSpec((None, None, 2, H), lambda b, k: (b, k, R // 2, 0)),
                  by_row]
    elif own is not None:
        inputs += [q_BKPH, own[0], own[1], own[2].astype(jnp.int32)]
        specs += [each(Q, H), each(H), each(H), by_row]
    outputs = [jax.ShapeDtypeStruct((B, K, Q, H), dtype),
               jax.ShapeDtypeStruct((B, K, Q), jnp.float32)]
    out_specs = [each(Q, H), each(Q)]
    aliases = {}
    if store is not None:
        S = store[0].shape[2]
        aliases = {len(inputs) + 1: 2, len(inputs) + 2: 3}
        inputs += [store[2].astype(jnp.int32), store[0], store[1]]
        specs += [by_row, each(S, H), each(S, H)]
        outputs += [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in store[:2]]
        out_specs += [each(S, H), each(S, H)]
    return pl.pallas_call(
        kernel, grid=(B, K), in_specs=specs, out_specs=out_specs, out_shape=outputs,
        input_output_aliases=aliases, interpret=interpret, name="jaxkv_decode_merge",
        compiler_params=triton_params(),
    )(*inputs)


def _store_at(caches, rows, slot):
    """rows [H] stored at slot of the [S, H] caches; nothing stored where slot is outside."""
    from jax.experimental.pallas import triton as pltriton  # (GPU programs alone)

    S, H = caches[0].shape
    inside = jnp.full((1, H), (slot >= 0) & (slot < S))
    at = (pl.ds(jnp.clip(slot, 0, S - 1), 1), slice(None))
    for cache_ref, x_H in zip(caches, rows):
        pltriton.store(cache_ref.at[at], x_H[None, :].astype(cache_ref.dtype), mask=inside)
