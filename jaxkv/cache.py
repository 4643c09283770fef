"""The KV cache: a preallocated fixed-shape pytree, one slot per position of each row.

Encoder-decoder models also keep the cross-attention keys and values here: they depend on the
encoder output alone, so they are computed once, when the cache is made, and only read after.
"""

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv import checks


@struct.dataclass
class KVCache:
    """Per layer (separate arrays: see params.py), heads before slots, as attention reads them."""

    k: tuple  # L x [B, K, S, H]; slot s of row b holds the key of row b's position s
    v: tuple  # L x [B, K, S, H]
    cross_k: tuple | None = None  # L x [B, K, M, H]; encoder-decoder models only
    cross_v: tuple | None = None  # L x [B, K, M, H]
    cross_mask: jax.Array | None = None  # [B, M] bool; False at encoder padding

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


def init_cache(params, batch_size: int, max_len: int, dtype=None, *, encoder_inputs=None,
               encoder_lengths=None) -> KVCache:
    """An empty cache for batch_size rows of up to max_len positions (dtype: params' by default).

    It stores the K kv heads of grouped-query attention, not the N query heads. For an
    encoder-decoder model, encoder_inputs ([B, M] tokens with optional encoder_lengths [B], or
    [B, n_mels, frames] log-mel features) are encoded here and the cross-attention K/V of every
    layer are computed and stored, once.
    """
    from jaxkv import encoder

    c = params.config
    batch_size = checks.int_arg(batch_size, "init_cache: batch_size")
    max_len = checks.int_arg(max_len, "init_cache: max_len")
    if c.position == "learned" and max_len > c.max_seq_len:
        raise ValueError(f"init_cache: max_len={max_len} exceeds the model's {c.max_seq_len} "
                         "learned positions")
    dtype = checks.float_dtype(dtype or params.dtype, "init_cache: dtype")
    shape = (batch_size, c.n_kv_heads, max_len, c.head_dim)
    k, v = ([jnp.zeros(shape, dtype) for _ in range(c.n_layers)] for _ in "kv")
    cache = KVCache(k=tuple(k), v=tuple(v))
    if c.is_encoder_decoder or encoder_inputs is not None:  # (errors name what is missing)
        cross_k, cross_v, mask_BM = encoder.cross_cache(params, encoder_inputs, encoder_lengths,
                                                        batch_size)
        cache = cache.replace(cross_k=tuple(k.astype(dtype) for k in cross_k),
                              cross_v=tuple(v.astype(dtype) for v in cross_v),
                              cross_mask=mask_BM)
    return cache


def write(cache_BKSH, new_BTKH, slot_BT):
    """Stores new_BTKH[b, t] at slot slot_BT[b, t] of row b; slots outside [0, S) are dropped."""
    rows_B1 = jnp.arange(cache_BKSH.shape[0])[:, None]
    # Advanced indices around a slice: the indexed view is [B, T, K, H], like new_BTKH.
    return cache_BKSH.at[rows_B1, :, slot_BT].set(new_BTKH.astype(cache_BKSH.dtype), mode="drop")
