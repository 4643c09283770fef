"""The Pallas backend: JAX's own Pallas kernels where one fits, jaxkv.ops.xla elsewhere.

JAXKV_OPS=pallas chooses it. On an NVIDIA GPU its kernels compile with Triton; on a CPU they run
in Pallas's interpret mode when JAXKV_PALLAS_INTERPRET=1 (how the suite checks them against the
XLA reference), and are refused otherwise. What takes a kernel today:

- a decode step's attention over a float cache (one query per row, the slots read a prefix
  [0, lengths) of a global layer, no bias, no soft-cap): the cache part goes to
  jax.experimental.pallas.ops.gpu.decode_attention (grouped-query, without repeating K/V,
  reading only the filled blocks, split over the sequence), the step's own key to XLA, the two
  merged by log-sum-exp.

Everything else (prefill chunks, tree passes, sliding-window rings, int8 caches, soft-capped
scores, the products) is XLA's for now; docs/design-notes.md says which kernel would take each.
"""

import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import decode_attention

from jaxkv.ops import xla
from jaxkv.ops.xla import materialized, merge_parts, placed, prefill_chunk  # noqa: F401

HALF_KV_BITS = False  # 16-bit float caches are arrays of their dtype, as the kernels read them
matmul = xla.matmul


def interpret() -> bool:
    """Whether the kernels run in Pallas's interpret mode: on a CPU, with
    JAXKV_PALLAS_INTERPRET=1; a CPU without it is an error naming the variable."""
    if os.environ.get("JAXKV_PALLAS_INTERPRET", "0") == "1":
        return True
    if jax.default_backend() == "cpu":
        raise ValueError("JAXKV_OPS=pallas on a CPU runs its kernels in Pallas's interpret mode: "
                         "set JAXKV_PALLAS_INTERPRET=1 too (or JAXKV_OPS=xla or cpu)")
    return False


def attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, bias_BNTS=None, kv_len=None,
              own=None, softcap=None, lengths=None):
    """jaxkv.ops.attention: a decode step over a float cache's prefix goes to JAX's decode
    kernel (see the module's docstring); the rest to the XLA reference."""
    split = _split(k_BKSH.shape[2])
    if (lengths is None or q_BTNH.shape[1] != 1 or bias_BNTS is not None or softcap is not None
            or own is None or own[3] is not None or not isinstance(k_BKSH, jax.Array)
            or split is None or jax.default_backend() == "tpu"):
        return xla.attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, bias_BNTS, kv_len, own,
                             softcap)
    out_BTNH, lse_BTN = _decode_cache(q_BTNH, k_BKSH, v_BKSH, scale, lengths, *split)
    own_out_BTNH, own_lse_BTN = xla.attention(q_BTNH, *own[:3], scale)
    return merge_parts(out_BTNH, lse_BTN, own_out_BTNH, own_lse_BTN)


def _split(S: int):
    """(k_splits, block_k) for a cache of S slots, as the decode kernel takes them (S split into
    parts of at least 16 slots, each a whole number of blocks of at least 16), or None."""
    for k_splits in (16, 8, 4, 2, 1):
        part = S // k_splits
        if S % k_splits == 0 and part >= 16:
            block = next((b for b in (128, 64, 32, 16) if part % b == 0), None)
            if block is not None:
                return k_splits, block
    return None


def _decode_cache(q_BTNH, k_BKSH, v_BKSH, scale: float, lengths_B, k_splits: int, block_k: int):
    """Attention of one query per row over cache slots [0, lengths_B): (out [B, 1, N, H], lse
    [B, 1, N]), float32; lse is -inf for a row that reads no slot."""
    dtype = k_BKSH.dtype
    out_BNH, (total_BN, max_BN) = decode_attention.gqa(
        q_BTNH[:, 0].astype(dtype), jnp.swapaxes(k_BKSH, 1, 2), jnp.swapaxes(v_BKSH, 1, 2),
        kv_seq_len=lengths_B, sm_scale=scale, block_k=block_k, k_splits=k_splits,
        interpret=interpret(), return_residuals=True)
    lse_BN = jnp.where(total_BN > 0, max_BN + jnp.log(jnp.maximum(total_BN, 1e-30)), -jnp.inf)
    return out_BNH.astype(jnp.float32)[:, None], lse_BN[:, None]
