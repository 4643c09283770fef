"""The decode-attention kernel's Mosaic GPU form (Hopper and newer): what the GPU form of
jaxkv.ops.pallas.decode computes, in the Pallas backend that is not deprecated from jax 0.11.

One program (a warpgroup) per (row, kv head, part of the sequence): its queries (padded to the
64 rows of a warpgroup's product) in shared memory, then the part's blocks below the row's bound,
each copied in by the TMA (through the row's page table for a paged cache) and taken by two
products on the tensor cores: scores, then the weighted values (the weights rounded to the
cache's dtype, as the Triton form's product takes them). It takes 16-bit float caches, dense or
paged, masked or not (a sliding window's ring), with head sizes and blocks of a multiple of 64,
soft-capped or not; the Triton form takes the rest (int8 and float32 caches, heads or caches
too small) and everything on jax 0.10, whose GPU interpreter cannot run this form.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.ops.pallas.softmax import online_softmax
from jaxkv.ops.xla import softcapped

# Whether this jax has Mosaic GPU's interpreter, from 0.11: the jax whose Triton form is deprecated
AVAILABLE = hasattr(plgpu, "InterpretGPUParams")
ROWS = 64  # a warpgroup's product takes 64 rows
BLOCK = 64  # slots: a block is a product's operand too
WGMMA = plgpu.Layout.WGMMA


def takes(k) -> bool:
    """Whether this form takes a cache (read in blocks of BLOCK slots or a multiple): 16-bit
    float numbers [..., H], H a multiple of 64, on a jax whose Pallas has Mosaic GPU's
    interpreter (0.11 and newer)."""
    return (jnp.dtype(k.dtype) in (jnp.bfloat16, jnp.float16) and k.shape[-1] % 64 == 0
            and AVAILABLE)


def fits(k, block_k: int) -> bool:
    """Whether this form takes a cache read in blocks of block_k slots."""
    return block_k % BLOCK == 0 and takes(k)


def parts(bound_B, q_BKRH, k, v, mask_BS=None, *, scale: float, softcap, block_k: int,
          k_splits: int, interpret: bool = False, table_BM=None, queries: int | None = None):
    """Each part's unnormalized output, max and sum of weights ([B, K, J, R, H], [B, K, J, R]
    twice, float32) of one query per (row, query head, padded to R = 64) over the slots below
    bound_B where mask_BS (int32, S slots) is not 0: keys and values [B, K, S, H], or pools of
    pages [K, NB, block_k, H] read through table_BM [B, M]. queries: the rows that are queries
    (the rest padding): only those, rounded up to 4 (a copy out moves 16 bytes or more), are
    written out, so the parts are [B, K, J, Q, H] and [B, K, J, Q]."""
    B, K, R, H = q_BKRH.shape
    Q = min(R, -(-(queries or R) // 4) * 4)
    paged = table_BM is not None
    part = (table_BM.shape[1] * block_k if paged else k.shape[2]) // k_splits
    dtype = k.dtype
    bits = jnp.finfo(dtype).bits
    swizzle = plgpu.find_swizzle(H * bits)
    tiles = (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))

    masked = mask_BS is not None

    def jaxkv_decode_attention_mosaic(bound_ref, q_ref, k_ref, v_ref, *refs):
        mask_ref, refs = (refs[0], refs[1:]) if masked else (None, refs)
        table_ref, (acc_out, max_out, total_out) = (refs[0], refs[1:]) if paged else (None, refs)
        b, kh, j = jax.lax.axis_index("b"), jax.lax.axis_index("k"), jax.lax.axis_index("j")
        start, bound = j * part, bound_ref[b]
        n_blocks = jnp.clip(jax.lax.div(bound - start + block_k - 1, block_k), 0,
                            part // block_k)

        def block_of(ref, i):
            if not paged:
                return ref.at[b, kh, pl.ds(start + i * block_k, block_k)]
            page = jnp.minimum(table_ref[b, start // block_k + i], k.shape[1] - 1)
            return ref.at[kh, page]

        def scoped(q_smem, k_smem, v_smem, p_smem, out_smem, stats_smem, barriers):
            plgpu.copy_gmem_to_smem(q_ref.at[b, kh], q_smem, barriers.at[0])
            plgpu.barrier_wait(barriers.at[0])

            def step(i, state):
                max_R, total_R, acc_RH = state
                plgpu.copy_gmem_to_smem(block_of(k_ref, i), k_smem, barriers.at[1])
                plgpu.copy_gmem_to_smem(block_of(v_ref, i), v_smem, barriers.at[2])
                plgpu.barrier_wait(barriers.at[1])
                scores_RC = softcapped(
                    _product(q_smem, k_smem.transpose((1, 0)), (R, block_k)) * scale, softcap)
                slot_RC = plgpu.broadcasted_iota(jnp.int32, (R, block_k), 1, layout=WGMMA)
                seen_RC = start + i * block_k + slot_RC < bound
                if masked:
                    mask_C = plgpu.load(mask_ref.at[b, pl.ds(start + i * block_k, block_k)],
                                        layout=WGMMA.reduce(0))
                    seen_RC = seen_RC & jax.lax.broadcast_in_dim(mask_C != 0, seen_RC.shape, [1])
                scores_RC = jnp.where(seen_RC, scores_RC, -jnp.inf)
                max_R, total_R, weights_RC, old_R = online_softmax(max_R, total_R, scores_RC)
                p_smem[...] = weights_RC.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_wait(barriers.at[2])
                acc_RH = (acc_RH * jax.lax.broadcast_in_dim(old_R, acc_RH.shape, [0])
                          + _product(p_smem, v_smem, (R, H)))
                return max_R, total_R, acc_RH

            empty = (plgpu.layout_cast(jnp.full((R,), -jnp.inf, jnp.float32), WGMMA.reduce(1)),
                     plgpu.layout_cast(jnp.zeros((R,), jnp.float32), WGMMA.reduce(1)),
                     plgpu.layout_cast(jnp.zeros((R, H), jnp.float32), WGMMA))
            max_R, total_R, acc_RH = jax.lax.fori_loop(0, n_blocks, step, empty)
            out_smem[...] = acc_RH
            stats_smem[0] = max_R
            stats_smem[1] = total_R
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, Q)], acc_out.at[b, kh, j])
            plgpu.copy_smem_to_gmem(stats_smem.at[0, pl.ds(0, Q)], max_out.at[b, kh, j])
            plgpu.copy_smem_to_gmem(stats_smem.at[1, pl.ds(0, Q)], total_out.at[b, kh, j])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((R, H), dtype, transforms=tiles),
                      plgpu.SMEM((block_k, H), dtype, transforms=tiles),
                      plgpu.SMEM((block_k, H), dtype, transforms=tiles),
                      plgpu.SMEM((R, block_k), dtype, transforms=tiles),
                      plgpu.SMEM((R, H), jnp.float32), plgpu.SMEM((2, R), jnp.float32),
                      plgpu.Barrier(num_barriers=3))

    each = lambda *shape: jax.ShapeDtypeStruct((B, K, k_splits, *shape), jnp.float32)  # noqa: E731
    kernel = plgpu.kernel(jaxkv_decode_attention_mosaic,
                          out_type=[each(Q, H), each(Q), each(Q)],
                          grid=(B, K, k_splits), grid_names=("b", "k", "j"),
                          interpret=plgpu.InterpretGPUParams() if interpret else None)
    return kernel(bound_B, q_BKRH.astype(dtype), k, v, *([mask_BS] if masked else []),
                  *([table_BM] if paged else []))


def _product(a_smem, b_smem, shape):
    """a @ b of two shared-memory operands, accumulated in float32 on the tensor cores."""
    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem)
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))
