"""The KV cache: a preallocated fixed-shape pytree, one slot per position of each row.

Encoder-decoder models also keep the cross-attention keys and values here: they depend on the
encoder output alone, so they are computed once, when the cache is made, and only read after.
"""

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, H]; slot s of row b holds the key of row b's position s
    v: jax.Array  # [L, B, S, K, H]
    cross_k: jax.Array | None = None  # [L, B, M, K, H]; encoder-decoder models only
    cross_v: jax.Array | None = None  # [L, B, M, K, H]
    cross_mask: jax.Array | None = None  # [B, M] bool; False at encoder padding

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


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
    for name, value in (("batch_size", batch_size), ("max_len", max_len)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
    if c.position == "learned" and max_len > c.max_seq_len:
        raise ValueError(f"init_cache: max_len={max_len} exceeds the model's {c.max_seq_len} "
                         "learned positions")
    dtype = jnp.dtype(dtype or params.dtype)
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"init_cache: dtype must be float32, bfloat16 or float16, got {dtype}")
    shape = (c.n_layers, batch_size, max_len, c.n_kv_heads, c.head_dim)
    cache = KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    if c.is_encoder_decoder or encoder_inputs is not None:  # (errors name what is missing)
        cross_k, cross_v, mask_BM = encoder.cross_cache(params, encoder_inputs, encoder_lengths,
                                                        batch_size)
        cache = cache.replace(cross_k=cross_k.astype(dtype), cross_v=cross_v.astype(dtype),
                              cross_mask=mask_BM)
    return cache


def write(cache_BSKH, new_BTKH, slot_BT):
    """Stores new_BTKH[b, t] at slot slot_BT[b, t] of row b; slots outside [0, S) are dropped."""
    B = cache_BSKH.shape[0]
    rows_B1 = jnp.arange(B)[:, None]
    return cache_BSKH.at[rows_B1, slot_BT].set(new_BTKH.astype(cache_BSKH.dtype), mode="drop")
