"""The Pallas backend: jaxkv's Pallas kernels where one fits, jaxkv.ops.xla elsewhere.

The default on a GPU or TPU (jaxkv.ops.target); JAXKV_OPS=pallas chooses it anywhere. On an
NVIDIA GPU its kernels compile with Mosaic GPU (16-bit caches, jax 0.11 and newer) or Triton, on
a TPU with Mosaic; on a CPU they run in Pallas's interpret mode, the GPU ones with
JAXKV_PALLAS_INTERPRET=1 (or gpu), the TPU ones with =tpu (how the suite checks them against the
XLA reference), and are refused without it.

What takes a kernel today is a decode step's attention (one query per row, no bias) over a
cache of whole blocks of 16 slots: its cache part (the step's own key is XLA's, the two merged
by log-sum-exp) goes to jaxkv.ops.pallas.decode, in its GPU or TPU form: float caches read over
[0, lengths) (a decode step's), sliding-window rings (a mask of slots), int8 caches read as int8
with their scales, soft-capped scores, and paged caches (PagedKV, pages of 16 to 128 slots: each
row's pages read through its block table). JAX's own kernels do not fit: its GPU
decode_attention (Triton) is deprecated from jax 0.11 and reads only float prefixes; its
paged_attention kernels, GPU and TPU, return no log-sum-exp, which merging the step's own key
needs.

Prefill chunks, tree passes and the products are XLA's for now (docs/design-notes.md says which
kernel would take each).
"""

import os

import jax.numpy as jnp

from jaxkv.ops import xla
from jaxkv.ops.arrays import Int8KV, PagedKV, dequantize_kv, logical
from jaxkv.ops.pallas import decode, mosaic_gpu, products
from jaxkv.ops.target import platform as target_platform
from jaxkv.ops.xla import materialized, merge_parts, placed, prefill_chunk  # noqa: F401

INTERPRET = {"1": "gpu", "gpu": "gpu", "tpu": "tpu"}  # JAXKV_PALLAS_INTERPRET -> kernels
HALF_KV_BITS = False  # 16-bit float caches are arrays of their dtype, as the kernels read them
READS_PAGES = True  # a decode step's kernel reads a PagedKV's pages through its table
matmul = xla.matmul


def fused_matmul(x_BTI, w, b_O, dtype, norm, gated, residual_BTO):
    """jaxkv.ops.matmul with its norm, gated activation and residual in one kernel, for a decode
    step's few rows on a GPU (jaxkv.ops.pallas.products says which); None where none fits."""
    B, T, I = x_BTI.shape
    x_RI = x_BTI.reshape(B * T, I)
    if target_platform() == "tpu" or not products.takes(x_RI, w, gated):
        return None
    platform, interpret = target()
    if platform != "gpu":
        return None
    residual_RO = None if residual_BTO is None else residual_BTO.reshape(B * T, -1)
    y_RO = products.product(x_RI, w, b_O, dtype=dtype or x_BTI.dtype, norm=norm, gated=gated,
                            residual_RO=residual_RO, interpret=interpret)
    return y_RO.reshape(B, T, -1)


def target() -> tuple[str, bool]:
    """(the kernels' platform, "gpu" or "tpu"; whether they run in Pallas's interpret mode): a
    GPU's or TPU's own, compiled; on a CPU, JAXKV_PALLAS_INTERPRET=1 (or gpu) interprets the GPU
    kernels, =tpu the TPU ones; a CPU without it is an error naming the variable."""
    platform = target_platform()
    if platform != "cpu":
        return ("tpu" if platform == "tpu" else "gpu"), False
    chosen = os.environ.get("JAXKV_PALLAS_INTERPRET", "")
    if chosen not in INTERPRET:
        raise ValueError(f"JAXKV_OPS=pallas on a CPU runs its kernels in Pallas's interpret mode: "
                         f"set JAXKV_PALLAS_INTERPRET=1 (or gpu: the GPU kernels) or tpu (the TPU "
                         f"ones), got {chosen!r} (or choose JAXKV_OPS=xla or cpu)")
    return INTERPRET[chosen], True


def attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, bias_BNTS=None, kv_len=None,
              own=None, softcap=None, lengths=None):
    """jaxkv.ops.attention: a decode step (its cache and its own key) goes to a kernel (see the
    module's docstring); the rest to the XLA reference (a PagedKV cache as its rows see it)."""
    split = _kernel_split(q_BTNH, k_BKSH, bias_BNTS, own)
    if split is None:
        if isinstance(k_BKSH, PagedKV):
            k_BKSH, v_BKSH = logical(k_BKSH), logical(v_BKSH)
        return xla.attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, bias_BNTS, kv_len, own,
                             softcap)
    return _decode_masked(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, kv_len, softcap, lengths,
                          _own(k_BKSH, own), *split)


def attention_storing(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, bias_BNTS, kv_len, own,
                      softcap, lengths, dtype, slot_BT):
    """jaxkv.ops.attention with store_at = slot_BT, where the Triton form of the decode kernel
    takes the step over a dense cache of q's float dtype read to `lengths`: its merge kernel
    stores the step's own key and value and writes the output in dtype (no kernels of their
    own for either); None elsewhere."""
    split = _kernel_split(q_BTNH, k_BKSH, bias_BNTS, own)
    if (split is None or lengths is None or own is None or isinstance(k_BKSH, PagedKV)
            or not decode.stores(target()[0], q_BTNH, k_BKSH, split[1])):
        return None
    return _decode_masked(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, kv_len, softcap, lengths,
                          _own(k_BKSH, own), *split, dtype=dtype,
                          store=(k_BKSH, v_BKSH, slot_BT[:, 0]))


def _kernel_split(q_BTNH, k_BKSH, bias_BNTS, own):
    """(k_splits, block_k) where a decode kernel takes this attention (one query per row, no
    bias, a cache it reads), else None."""
    paged = isinstance(k_BKSH, PagedKV)
    split = _paged_split(k_BKSH) if paged else _split(k_BKSH.shape[2])
    platform = None if split is None else target()[0]
    if platform == "gpu" and not paged and mosaic_gpu.takes(k_BKSH):
        # (the Mosaic GPU form's blocks: 64 slots or more)
        split = _split(k_BKSH.shape[2], mosaic_gpu.BLOCK) or split
    if platform == "tpu":
        split = _tpu_block(k_BKSH, split)
    if (q_BTNH.shape[1] != 1 or bias_BNTS is not None or (own is not None and own[3] is not None)
            or split is None):
        return None
    return split


def _own(k_BKSH, own):
    """The step's own key and value as the cache will hold them and the kernels read them:
    (k_BKH, v_BKH, seen_B), or None."""
    if own is None:
        return None
    k_BK1H, v_BK1H, seen_B11 = xla.own_as_cache(k_BKSH.pool if isinstance(k_BKSH, PagedKV)
                                                else k_BKSH, own)[:3]
    return _read(k_BK1H)[:, :, 0], _read(v_BK1H)[:, :, 0], seen_B11[:, 0, 0]


def _read(x):
    """A cache's numbers as the kernels read them: an Int8KV's dequantized."""
    return dequantize_kv(x) if isinstance(x, Int8KV) else x


def _split(S: int, smallest: int = 16):
    """(k_splits, block_k) for a cache of S slots, as the decode kernel takes them (S split into
    parts of at least `smallest` slots, each a whole number of blocks of at least `smallest`),
    or None."""
    for k_splits in (16, 8, 4, 2, 1):
        part = S // k_splits
        if S % k_splits == 0 and part >= smallest:
            block = next((b for b in (128, 64, 32, 16) if part % b == 0 and b >= smallest),
                         None)
            if block is not None:
                return k_splits, block
    return None


def _tpu_block(k, split):
    """The TPU form visits blocks in order (no splits): the largest block of up to 512 slots
    (a whole page when paged), at least the rows of one of Mosaic's tiles of the cache's numbers
    (8 float32, 16 bfloat16, 32 int8); None where the pages are smaller."""
    numbers = k.pool if isinstance(k, PagedKV) else k
    numbers = numbers.q if isinstance(numbers, Int8KV) else numbers
    tile = 32 // jnp.dtype(numbers.dtype).itemsize
    if isinstance(k, PagedKV):
        return split if split[1] >= tile else None
    S = k.shape[2]
    block = next((b for b in (512, 256, 128, 64, 32, 16, 8) if S % b == 0 and b >= tile), None)
    return None if block is None else (1, block)


def _paged_split(k: PagedKV):
    """(k_splits, block_k) for a decode step over pages of P slots: block_k = P (16, 32, 64 or
    128), the row's M pages split into up to 16 parts of whole pages; None if P is not one of
    those."""
    P, M = k.pool.shape[2], k.table.shape[1]
    if P not in (16, 32, 64, 128):
        return None
    return next(n for n in (16, 8, 4, 2, 1) if M % n == 0), P


def _decode_masked(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, kv_len, softcap, lengths_B,
                   own, k_splits: int, block_k: int, dtype=None, store=None):
    """jaxkv's kernels: one query per row over the cache slots mask_BTS allows (below lengths_B,
    which then replaces the mask, else below kv_len) and own = (k_BKH, v_BKH, seen_B), the
    step's own key, any cache form and soft-cap: (out [B, 1, N, H] in dtype (default float32),
    lse [B, 1, N] float32); with store = (k_BKSH, v_BKSH, slot_B), the keys and values with
    own's stored at slot_B after them (decode.attention says where)."""
    B, _, N, H = q_BTNH.shape
    K, S = k_BKSH.shape[1:3]
    if lengths_B is None:
        bound_B = jnp.full((B,), S if kv_len is None else kv_len, jnp.int32)
        mask_BS = mask_BTS[:, 0]
    else:
        bound_B, mask_BS = lengths_B, None
    platform, interpret = target()
    table_BM = None
    if isinstance(k_BKSH, PagedKV):
        k_BKSH, v_BKSH, table_BM = k_BKSH.pool, v_BKSH.pool, k_BKSH.table
    out_BKGH, lse_BKG, *stored = decode.attention(
        q_BTNH.reshape(B, K, N // K, H), k_BKSH, v_BKSH, scale, bound_B, mask_BS, softcap,
        target=platform, block_k=block_k, k_splits=k_splits, interpret=interpret,
        table_BM=table_BM, own=own, out_dtype=dtype or jnp.float32, store=store)
    return out_BKGH.reshape(B, 1, N, H), lse_BKG.reshape(B, 1, N), *stored
