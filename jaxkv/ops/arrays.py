"""The stored forms that every backend reads: int8 weight matrices (Int8) and cache layers of
int8 (Int8KV) or 16-bit float bits (HalfKV), or paged through block tables (PagedKV). Pure data
and the arithmetic that defines it; no backend is named here."""

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # the dtypes HalfKV holds


@struct.dataclass
class Int8:
    """A weight matrix w ~= q * scale, row by row: q [O, I] int8, scale [O, NB] (NB blocks of
    I / NB inputs each: one per row from jaxkv.quantize, 32-input blocks from GGUF's Q8_0). A
    mixture of experts' stacked matrices lead with the expert: q [E, O, I], scale [E, O, NB]."""

    q: jax.Array  # [O, I] int8
    scale: jax.Array  # [O, NB], float32 (or the dtype the model computes in)

    @property
    def shape(self):
        return self.q.shape

    @property
    def dtype(self):
        """The float dtype this matrix stands for."""
        return self.scale.dtype

    def __getitem__(self, rows):
        """Rows dequantized (an embedding lookup): [..., I]."""
        return dequantize_rows(self.q[rows], self.scale[rows])


def dequantize_rows(q_RI, scale_RB):
    """q [..., I] int8 times its scales [..., NB] -> [..., I] in the scales' dtype."""
    *rows, I = q_RI.shape
    NB = scale_RB.shape[-1]
    blocks = q_RI.reshape(*rows, NB, I // NB).astype(scale_RB.dtype) * scale_RB[..., None]
    return blocks.reshape(*rows, I)


@struct.dataclass
class Int8KV:
    """One cache layer's keys or values, x ~= q * scale: one scale per token and kv head (max
    |x| over the head dim / 127, rounded to nearest).

    The scales are float32 whatever the params' dtype: attention computes in float32, so q *
    scale is exactly what is read, and the round trip error is at most scale / 2. At H = 64 a
    token and head costs 68 bytes: 0.27x float32, 0.53x bfloat16.
    """

    q: jax.Array  # [B, K, S, H] int8
    scale: jax.Array  # [B, K, S] float32

    @property
    def shape(self):
        return self.q.shape

    @property
    def dtype(self):
        return self.q.dtype


@struct.dataclass
class HalfKV:
    """One cache layer's keys or values in a 16-bit float dtype (bfloat16 or float16), held as
    their bits (uint16): a backend whose stores into 16-bit float arrays rewrite the whole layer
    stores uint16 in place (see jaxkv.ops.cpu). Readers see the numbers: shape, dtype and
    astype act as those of a dtype array."""

    bits: jax.Array  # [B, K, S, H] uint16
    dtype: jnp.dtype = struct.field(pytree_node=False)

    @property
    def shape(self):
        return self.bits.shape

    def astype(self, dtype):
        return jax.lax.bitcast_convert_type(self.bits, self.dtype).astype(dtype)


@struct.dataclass
class PagedKV:
    """One global cache layer's keys or values in blocks of P slots taken from a pool, each row
    reading its own through a block table: row b's slot s is slot s % P of block
    table[b, s // P]. Rows hold what their tables give them (not batch x capacity), and rows
    may share blocks (a common prompt). Readers see a [B, K, M * P, H] layer (see logical).
    The pool is laid out as JAX's paged-attention kernels read theirs: kv heads first."""

    pool: Any  # [K, NB, P, H]: an array, Int8KV or HalfKV
    table: jax.Array  # [B, M] int32: row b's m-th block; NB or more: none (not read, not written)

    @property
    def shape(self):
        K, _, P, H = self.pool.shape
        B, M = self.table.shape
        return (B, K, M * P, H)

    @property
    def dtype(self):
        return self.pool.dtype


def logical(x: PagedKV):
    """The layer as its rows read it, [B, K, M * P, H] (same stored form: array, Int8KV or
    HalfKV); a slot whose block is none reads 0."""
    B, M = x.table.shape

    def rows(leaf):  # [K, NB, P, ...] -> [B, K, M * P, ...]
        blocks = jnp.take(leaf, x.table, axis=1, mode="fill", fill_value=0)  # [K, B, M, P, ...]
        return jnp.moveaxis(blocks, 0, 1).reshape(B, leaf.shape[0], M * leaf.shape[2],
                                                   *leaf.shape[3:])
    return jax.tree.map(rows, x.pool)


def half_kv(x_XH, dtype) -> HalfKV:
    """HalfKV of keys or values rounded to dtype (bfloat16 or float16)."""
    return HalfKV(jax.lax.bitcast_convert_type(x_XH.astype(dtype), jnp.uint16), jnp.dtype(dtype))


def quantize_kv(x_XH) -> Int8KV:
    """Int8KV of keys or values [..., H]: one scale per vector of H (per token and head)."""
    x_XH = x_XH.astype(jnp.float32)
    scale_X = jnp.max(jnp.abs(x_XH), axis=-1) / 127
    safe_X1 = jnp.where(scale_X > 0, scale_X, 1.0)[..., None]
    q_XH = jnp.clip(jnp.round(x_XH / safe_X1), -127, 127).astype(jnp.int8)
    return Int8KV(q_XH, scale_X)


def dequantize_kv(x: Int8KV):
    """[..., H] float32: q * scale."""
    return x.q.astype(jnp.float32) * x.scale[..., None]


def write(cache_BKSH, new_BTKH, slot_BT):
    """Stores new_BTKH[b, t] at slot slot_BT[b, t] of row b; slots outside [0, S) are dropped.
    An Int8KV cache stores them quantized, and their scales [B, K, S] the same way; a HalfKV
    cache their bits; a PagedKV cache in the block its row's table names for the slot."""
    if isinstance(cache_BKSH, PagedKV):
        return _write_paged(cache_BKSH, new_BTKH, slot_BT)
    rows_B1 = jnp.arange(cache_BKSH.shape[0])[:, None]
    # Advanced indices around a slice: the indexed view is [B, T, K, ...], like the new values.
    return _stored_as(cache_BKSH, new_BTKH, lambda x, new: x.at[rows_B1, :, slot_BT].set(
        new.astype(x.dtype), mode="drop"))


def _write_paged(cache: PagedKV, new_BTKH, slot_BT) -> PagedKV:
    _, NB, P, _ = cache.pool.shape
    M = cache.table.shape[1]
    inside_BT = (slot_BT >= 0) & (slot_BT < M * P)
    block_BT = jnp.take_along_axis(cache.table, jnp.clip(slot_BT // P, 0, M - 1), axis=1)
    block_BT = jnp.where(inside_BT, block_BT, NB)  # NB: dropped
    # Advanced indices on adjacent axes: the indexed view is [K, B, T, ...].
    pool = _stored_as(cache.pool, new_BTKH, lambda x, new: x.at[:, block_BT, slot_BT % P].set(
        jnp.moveaxis(new, 2, 0).astype(x.dtype), mode="drop"))
    return cache.replace(pool=pool)


def _stored_as(layer, new_BTKH, put):
    """put(array, new values [B, T, K, ...]) applied to the arrays of the layer's stored form:
    an Int8KV's int8 numbers and scales (new_BTKH quantized), a HalfKV's bits, or the array."""
    if isinstance(layer, Int8KV):
        new = quantize_kv(new_BTKH)
        return Int8KV(put(layer.q, new.q), put(layer.scale, new.scale))
    if isinstance(layer, HalfKV):
        return layer.replace(bits=put(layer.bits, half_kv(new_BTKH, layer.dtype).bits))
    return put(layer, new_BTKH)
