"""The KV cache: a preallocated fixed-shape pytree, one slot per position of each row."""

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, H]; slot s of row b holds the key of row b's position s
    v: jax.Array  # [L, B, S, K, H]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def init_cache(params, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for batch_size rows of up to max_len positions (dtype: params' by default).

    It stores the K kv heads of grouped-query attention, not the N query heads.
    """
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
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def write(cache_BSKH, new_BTKH, slot_BT):
    """Stores new_BTKH[b, t] at slot slot_BT[b, t] of row b; slots outside [0, S) are dropped."""
    B = cache_BSKH.shape[0]
    rows_B1 = jnp.arange(B)[:, None]
    return cache_BSKH.at[rows_B1, slot_BT].set(new_BTKH.astype(cache_BSKH.dtype), mode="drop")
