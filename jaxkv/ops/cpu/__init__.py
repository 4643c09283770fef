"""The CPU backend: C++ kernels for what a decode step is made of (products of a few rows,
attention over a cache), weights on 2 MiB pages, and the forms XLA:CPU computes fastest where
no kernel fits. Chosen on CPUs (JAXKV_OPS=cpu forces it); JAXKV_CPU_KERNELS=0 keeps its XLA
forms without the kernels. Measurements behind each choice: docs/performance.md. In use, it
warns before XLA:CPU's compiled programs use up the process's memory maps (maps.py)."""

import jax
import jax.numpy as jnp

from jaxkv.ops import xla
from jaxkv.ops.arrays import Int8, PagedKV, dequantize_rows, logical
from jaxkv.ops.cpu import kernels, maps, pages

# XLA:CPU stores into a 16-bit float array by converting the whole layer to float32 and back;
# a uint16 store writes only its slots, so half caches are kept as their bits (HalfKV).
HALF_KV_BITS = True
READS_PAGES = True  # the attention kernel reads a PagedKV's pools through its table
LOOP_ROWS = 16  # up to this many rows of int8 products run as one loop over w's rows each
# One row's prefill on the CPU: passes of ROW_CHUNK tokens while the kernels take its
# float32 or int8 products and the prompt is at most ROW_CHUNK_UP_TO tokens (less padding
# than xla.PREFILL_CHUNK's passes, for a few more of them); where one block of the kernels'
# float32 outer form takes fewer than ROW_CHUNK rows (AVX2 and narrower), XLA's 256-row
# products ran faster per token, and the short passes pay only up to ROW_CHUNK_UP_TO_BLOCKS.
ROW_CHUNK = 64
ROW_CHUNK_UP_TO = 2048
ROW_CHUNK_UP_TO_BLOCKS = 1024
maps.watch()


def matmul(x_BTI, w, b_O=None, dtype=None, costly_x=False):
    """jaxkv.ops.matmul: up to kernels.ROWS rows go to the kernels, which stream w once over
    every core. Otherwise XLA's forms: one row is written x @ w.T, which XLA:CPU fuses with the
    producers of x into one loop over w's rows, except in float32 where that loop would redo
    the work making x for every row of w (costly_x), or with a bias (fused into the product,
    w would be copied transposed); several rows go to an einsum with a float32 result."""
    if isinstance(w, Int8):
        return _int8_matmul(x_BTI, w, b_O, dtype)
    B, T, I = x_BTI.shape
    by_call = x_BTI.dtype == jnp.float32 and (b_O is not None or costly_x)
    if kernels.fits(B * T, w.dtype):
        y_BTO = kernels.product(x_BTI.reshape(B * T, I), w).reshape(B, T, -1)
    elif B * T == 1 and not by_call:
        y_BTO = (x_BTI.reshape(1, I) @ w.T).reshape(B, T, -1)
    else:
        y_BTO = jnp.einsum("BTI,OI->BTO", x_BTI, w, preferred_element_type=jnp.float32)
    y_BTO = y_BTO if b_O is None else y_BTO + b_O
    return y_BTO.astype(dtype or x_BTI.dtype)


def _int8_kernel_takes(rows: int, w: Int8) -> bool:
    return kernels.fits(rows, jnp.int8) and kernels.int8_fits(w.q, w.scale)


def _int8_matmul(x_BTI, w: Int8, b_O=None, dtype=None):
    """The kernel; else up to LOOP_ROWS rows each run one loop over w's rows that converts as
    it goes (XLA:CPU fuses the conversion into the loop: no float copy of w); else XLA's."""
    B, T, I = x_BTI.shape
    x_RI = x_BTI.reshape(B * T, I).astype(w.dtype)
    if _int8_kernel_takes(B * T, w):
        y_RO = kernels.product_int8(x_RI, w.q, w.scale)
    elif B * T == 1:
        y_RO = _row_product(x_RI[0], w)[None]
    elif B * T <= LOOP_ROWS:
        y_RO = jax.lax.map(lambda x_I: _row_product(x_I, w), x_RI)
    else:
        y_RO = xla.int8_product(x_RI, w)
    y_BTO = y_RO.reshape(B, T, -1)
    y_BTO = y_BTO if b_O is None else y_BTO + b_O
    return y_BTO.astype(dtype or x_BTI.dtype)


def _row_product(x_I, w: Int8):
    """One row times w.T: [O], accumulated in float32.

    The row and the weights pass a barrier together, so nothing that converts w is hoisted out
    of a loop of rows or steps; and x passes a conditional, since XLA fuses no producer across
    one: otherwise the work making x (attention, a gated activation) ran once per weight row."""
    x_I, w = jax.lax.optimization_barrier((x_I, w))
    x_I = jax.lax.cond(jnp.isnan(x_I[0]), lambda x: x * 1, lambda x: x, x_I)
    x_1I = x_I[None].astype(jnp.float32)
    if w.scale.shape[1] == 1:  # the scale leaves the loop: one multiply per output
        return (x_1I @ w.q.T.astype(jnp.float32))[0] * w.scale[:, 0].astype(jnp.float32)
    return (x_1I @ dequantize_rows(w.q, w.scale.astype(jnp.float32)).T)[0]


def experts(x_RD, w_in_EOD, w_out_EDF, expert_RK, weight_RK, activation: str):
    """jaxkv.ops.experts: the rows (each once per expert it chose) go to the kernels with the
    whole expert stacks and each row's expert: the chosen experts' weights are read where they
    lie, once for all the rows that chose them (in pieces of 96 rows), where XLA's forms copy
    each row's or tile's expert out and then read the copy."""
    R, K = expert_RK.shape
    if not _experts_take(w_in_EOD):
        return xla.experts(x_RD, w_in_EOD, w_out_EDF, expert_RK, weight_RK, activation)
    e_X = expert_RK.reshape(R * K).astype(jnp.int32)
    h_XO = _expert_product(jnp.repeat(x_RD, K, axis=0), w_in_EOD, e_X)
    a_XF = xla.expert_gated(h_XO, activation).astype(x_RD.dtype)
    y_XD = _expert_product(a_XF, w_out_EDF, e_X).astype(x_RD.dtype)
    return xla.weighted_sum(y_XD.reshape(R, K, -1), weight_RK)


def _experts_take(w_EOI) -> bool:
    """Whether the kernels read these expert stacks (for any number of rows)."""
    if isinstance(w_EOI, Int8):
        return kernels.fits(1, jnp.int8) and kernels.int8_fits(w_EOI.q[0], w_EOI.scale[0])
    return kernels.fits(1, w_EOI.dtype)


def _expert_product(x_XI, w_EOI, e_X):
    """Row j of x times expert e_X[j]'s matrix of w (float, or Int8 with x first rounded to
    its dtype as xla's int8 products round it), in float32."""
    if isinstance(w_EOI, Int8):
        return kernels.expert_product_int8(x_XI.astype(w_EOI.dtype), w_EOI.q, w_EOI.scale, e_X)
    return kernels.expert_product(x_XI, w_EOI, e_X)


def attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, bias_BNTS=None, kv_len=None,
              own=None, softcap=None, lengths=None):
    """jaxkv.ops.attention: queries with own keys and no bias (a decode step, a tree pass, a
    prefill chunk) over a float32, bfloat16 or Int8KV cache go to the attention kernel, the rest
    to XLA's (which also gives the kernel's derivatives). A PagedKV cache goes to the kernel as
    it is where the kernel reads its pages (kernels.reads_pages), else as its rows see it
    (arrays.logical)."""
    takes = (own is not None and bias_BNTS is None and own[3] is None
             and kernels.attend_fits(q_BTNH, k_BKSH))
    paged = isinstance(k_BKSH, PagedKV)
    if paged and not (takes and kernels.reads_pages(k_BKSH)):
        k_BKSH, v_BKSH, paged = logical(k_BKSH), logical(v_BKSH), False
    if not takes:
        return xla.attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, bias_BNTS, kv_len, own,
                             softcap)
    S, bounded = k_BKSH.shape[2], kv_len is not None
    own = xla.own_as_cache(k_BKSH.pool if paged else k_BKSH, own)

    def reference(q_BTNH, k_BKSH, v_BKSH, mask_BTS, k_BKUH, v_BKUH, mask_BTU, kv_len):
        if paged:
            k_BKSH, v_BKSH = logical(k_BKSH), logical(v_BKSH)
        return xla.attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, None,
                             kv_len if bounded else None, (k_BKUH, v_BKUH, mask_BTU, None),
                             softcap)
    return kernels.attend(reference, scale, softcap, q_BTNH, k_BKSH, v_BKSH, mask_BTS, *own[:3],
                          kv_len if bounded else S)


def placed(tree):
    """tree, its large arrays moved onto 2 MiB pages where the OS allows (jaxkv.ops.cpu.pages)."""
    return pages.huge_pages(tree)


def materialized(x):
    """x computed once, as arrays: left to fuse, XLA:CPU recomputed RoPE's cos and sin at every
    head of every layer's queries and keys."""
    return jax.lax.optimization_barrier(x)


def prefill_chunk(w_qkv, rows: int, tokens: int) -> int:
    """ROW_CHUNK tokens a pass for one row of up to ROW_CHUNK_UP_TO tokens (ROW_CHUNK_UP_TO_BLOCKS
    where the kernels' outer form takes ROW_CHUNK rows in several blocks) whose float32 or int8
    products the kernels take (not bfloat16: XLA's 256-row products beat the kernels' 64-row
    ones), else xla.PREFILL_CHUNK."""
    if isinstance(w_qkv, Int8):
        takes = _int8_kernel_takes(ROW_CHUNK, w_qkv)
    else:
        takes = w_qkv.dtype == jnp.float32 and kernels.fits(ROW_CHUNK, w_qkv.dtype)
    up_to = ROW_CHUNK_UP_TO if kernels.outer_block_rows() >= ROW_CHUNK else ROW_CHUNK_UP_TO_BLOCKS
    return ROW_CHUNK if rows == 1 and tokens <= up_to and takes else xla.PREFILL_CHUNK
