"""The KV cache: a preallocated fixed-shape pytree. A global layer keeps one slot per position of
each row; a sliding-window layer keeps a ring of the last R = min(window, capacity) positions.

Encoder-decoder models also keep the cross-attention keys and values here: they depend on the
encoder output alone, so they are computed once, when the cache is made (decoder.init_cache),
and only read after.

A layer's keys and values are stored as jaxkv.ops.kv_layer says: an array of the cache's dtype,
Int8KV for an int8 cache (int8 numbers, one float32 scale per row, kv head and slot), or HalfKV
(the bits of bfloat16 / float16) where the backend stores them so.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv import ops
from jaxkv.ops.arrays import PagedKV, write


@struct.dataclass
class KVCache:
    """Per layer (separate arrays: see params.py), heads before slots, as attention reads them.

    A global layer's slot s holds row b's position s. A window layer (config.window_layers) holds
    position p at slot p mod R, R = ring_size(config, capacity); ring_pos says which position each
    ring slot holds, so the ring costs R slots however long the row grows. A paged cache's global
    layers are pools of blocks [K, NB, P, H] that every row reads and writes through its row of
    one block table (readable() gives them as jaxkv.ops.PagedKV).
    """

    k: tuple  # L x [B, K, S, H] (Int8KV, HalfKV); S = capacity in a global layer, R in a ring
    v: tuple  # L x [B, K, S, H] (Int8KV, HalfKV)
    ring_pos: jax.Array | None = None  # [B, R] int32: position held by each ring slot, -1: none
    cross_k: tuple | None = None  # L x [B, K, M, H] (Int8KV, HalfKV); encoder-decoder only
    cross_v: tuple | None = None  # L x [B, K, M, H] (Int8KV, HalfKV)
    cross_mask: jax.Array | None = None  # [B, M] bool; False at encoder padding
    capacity: int = struct.field(pytree_node=False, default=None)  # positions a row may hold
    table: jax.Array | None = None  # [B, M] int32, paged only: row b's m-th block (NB+: none)
    paged: tuple = struct.field(pytree_node=False, default=())  # per layer: a pool?

    @property
    def batch_size(self) -> int:
        return (self.table if self.table is not None else self.k[0]).shape[0]

    @property
    def dtype(self):
        """What the keys and values are stored as: a float dtype or int8."""
        return self.k[0].dtype


def _pools(cache: KVCache) -> tuple:
    """Per layer: whether it is a pool of a paged cache (a cache made unpaged has none)."""
    return cache.paged or (False,) * len(cache.k)


def readable(cache: KVCache) -> tuple[tuple, tuple]:
    """(k, v) layers as attention and writes take them: a paged layer as a PagedKV."""
    read = lambda xs: tuple(PagedKV(x, cache.table) if pool else x  # noqa: E731
                            for x, pool in zip(xs, _pools(cache)))
    return read(cache.k), read(cache.v)


def stored(cache: KVCache, k, v) -> KVCache:
    """cache holding the (k, v) layers readable() gave, as written: a PagedKV's pool."""
    keep = lambda xs: tuple(x.pool if isinstance(x, PagedKV) else x for x in xs)  # noqa: E731
    return cache.replace(k=keep(k), v=keep(v))


def ring_size(config, capacity: int) -> int | None:
    """Slots of a window layer's ring: the window, or the capacity if that is smaller."""
    return None if config.sliding_window is None else min(config.sliding_window, capacity)


def slots(config, layer: int, capacity: int) -> int:
    """Slots of one layer's cache."""
    return ring_size(config, capacity) if layer in config.window_layers else capacity


def empty(config, batch_size: int, capacity: int, dtype, block_size: int | None = None,
          blocks: int | None = None) -> KVCache:
    """An empty cache of batch_size rows of capacity positions, stored as dtype (arguments
    checked by the caller: see decoder.init_cache). block_size: global layers are pools of
    `blocks` blocks of block_size slots (default: batch_size x capacity / block_size, each row
    given its own in order); with fewer, the table starts empty (with_table fills it)."""
    B, K, H = batch_size, config.n_kv_heads, config.head_dim
    paged = tuple(block_size is not None and i not in config.window_layers
                  for i in range(config.n_layers))
    table, NB = None, None
    if block_size is not None:
        M = capacity // block_size
        NB = blocks or B * M
        table = (jnp.arange(B * M, dtype=jnp.int32).reshape(B, M) if NB >= B * M
                 else jnp.full((B, M), NB, jnp.int32))

    def layers():
        return tuple(ops.empty_kv_layer((K, NB, block_size, H) if paged[i] else
                                        (B, K, slots(config, i, capacity), H), dtype)
                     for i in range(config.n_layers))
    R = ring_size(config, capacity)
    ring_pos = None if R is None else jnp.full((batch_size, R), -1, jnp.int32)
    return KVCache(k=layers(), v=layers(), ring_pos=ring_pos, capacity=capacity, table=table,
                   paged=paged if block_size is not None else ())


def with_table(cache: KVCache, table_BM) -> KVCache:
    """cache with its paged layers read and written through table_BM [B, M] (block ids of the
    pools; their block count or more: none)."""
    return cache.replace(table=table_BM)


def row_of(cache: KVCache, row) -> KVCache:
    """Row `row` (traced) of the cache as a cache of one row; a paged layer keeps the whole pool
    (the row's writes land in it), the table its row."""
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1)  # noqa: E731
    return _per_row(cache, lambda x: jax.tree.map(take, x))


def with_row(cache: KVCache, row_cache: KVCache, row) -> KVCache:
    """cache with row `row` replaced by row_cache (from row_of, then written): its pools whole."""
    put = lambda x, x_1: jax.lax.dynamic_update_slice_in_dim(x, x_1, row, 0)  # noqa: E731
    layers = lambda mine, theirs: tuple(  # noqa: E731
        y if pool else jax.tree.map(put, x, y) for x, y, pool in zip(mine, theirs, _pools(cache)))
    rows = lambda x, y: None if x is None else put(x, y)  # noqa: E731
    return cache.replace(k=layers(cache.k, row_cache.k), v=layers(cache.v, row_cache.v),
                         ring_pos=rows(cache.ring_pos, row_cache.ring_pos),
                         table=rows(cache.table, row_cache.table))


def _per_row(cache, rows):
    """cache with rows() applied to everything held per row (not the pools)."""
    layers = lambda xs: tuple(x if pool else rows(x)  # noqa: E731
                              for x, pool in zip(xs, _pools(cache)))
    return cache.replace(k=layers(cache.k), v=layers(cache.v),
                         ring_pos=None if cache.ring_pos is None else rows(cache.ring_pos),
                         table=None if cache.table is None else rows(cache.table))


def with_blocks(cache: KVCache, blocks: int) -> KVCache:
    """cache with its pools grown to `blocks` blocks (the new ones empty; the table's "none",
    the old count, becomes the new count)."""
    old = next(x for x, pool in zip(cache.k, _pools(cache)) if pool).shape[1]
    pad = lambda leaf: jnp.pad(leaf, [(0, 0), (0, blocks - old)] +  # noqa: E731
                               [(0, 0)] * (leaf.ndim - 2))
    grown = lambda xs: tuple(jax.tree.map(pad, x) if pool else x  # noqa: E731
                             for x, pool in zip(xs, _pools(cache)))
    return cache.replace(k=grown(cache.k), v=grown(cache.v),
                         table=jnp.where(cache.table >= old, blocks, cache.table))


def with_cross(cache: KVCache, cross_k, cross_v, mask_BM, dtype) -> KVCache:
    """cache holding the encoder's cross-attention keys and values (per layer [B, K, M, H]),
    stored as dtype, and the mask of real encoder positions [B, M]."""
    return cache.replace(cross_k=tuple(ops.kv_layer(k, dtype) for k in cross_k),
                         cross_v=tuple(ops.kv_layer(v, dtype) for v in cross_v),
                         cross_mask=mask_BM)


class View(NamedTuple):
    """How one call's T tokens read and write one kind of layer's cache (S slots)."""

    slot_BT: jax.Array  # where each token's K/V go; a slot outside [0, S) is not stored
    cache_mask_BTS: jax.Array  # which slots of the cache as it was (before the writes) it reads
    own_mask_BTT: jax.Array  # which of this call's tokens it reads
    kv_len: jax.Array | None  # no token reads a slot >= kv_len (attention skips them)
    lengths_B: jax.Array | None = None  # [B]: the slots read are exactly [0, lengths_B)
    key_pos_BS: jax.Array | None = None  # position held by each slot read (None: slot s, s)


def linear_view(mask_BTS, slot_BT, kv_len=None, lengths_B=None) -> View:
    """A global layer's: mask_BTS over its slots; the slots this call writes hold none of its
    tokens yet, so they are read only through the call's own keys. lengths_B: the caller knows
    the slots read to be exactly [0, lengths_B) (a decode step's)."""
    written_BS = (jnp.arange(mask_BTS.shape[2]) == slot_BT[:, :, None]).any(1)
    return View(slot_BT, mask_BTS & ~written_BS[:, None, :], at_slots(mask_BTS, slot_BT), kv_len,
                lengths_B)


def ring_view(ring_pos_BR, window: int, mask_BTS, pos_BT, slot_BT, kv_len=None):
    """A window layer's (View, ring_pos after the writes): the token at position p goes to ring
    slot p mod R (if its global slot is in [0, S)), and reads the positions mask_BTS allows that
    are > p - window. A ring slot holding a position this call writes again is not read."""
    B, R = ring_pos_BR.shape
    S = mask_BTS.shape[2]
    stored_BT = (slot_BT >= 0) & (slot_BT < S)
    ring_slot_BT = jnp.where(stored_BT, pos_BT % R, R)
    held_BTR = jnp.broadcast_to(jnp.where(ring_pos_BR >= 0, ring_pos_BR, S)[:, None, :],
                                (B, pos_BT.shape[1], R))
    allowed_BTR = jnp.take_along_axis(mask_BTS, held_BTR, axis=2, mode="fill", fill_value=False)
    rewritten_BR = ((ring_pos_BR[:, None, :] == pos_BT[:, :, None]) & stored_BT[:, :, None]).any(1)
    near = lambda key_pos_BX: key_pos_BX[:, None, :] > pos_BT[:, :, None] - window  # noqa: E731
    cache_mask_BTR = allowed_BTR & near(ring_pos_BR) & ~rewritten_BR[:, None, :]
    own_mask_BTT = at_slots(mask_BTS, slot_BT) & near(pos_BT)
    view = View(ring_slot_BT, cache_mask_BTR, own_mask_BTT,
                None if kv_len is None else jnp.minimum(kv_len, R), key_pos_BS=ring_pos_BR)
    rows_B1 = jnp.arange(B)[:, None]
    return view, ring_pos_BR.at[rows_B1, ring_slot_BT].set(pos_BT, mode="drop")


def at_slots(x_BXTS, slot_BT):
    """x_BXTS (a mask or bias, X any middle axes) at the slots this call's tokens write:
    [..., T, T]; False / 0 where a slot is outside [0, S) (such a token is not stored)."""
    index = jnp.broadcast_to(slot_BT[..., None, :], (*x_BXTS.shape[:-1], slot_BT.shape[-1]))
    return jnp.take_along_axis(x_BXTS, index, axis=-1, mode="fill", fill_value=0)


def store(cache: KVCache, kv, slot_BT) -> KVCache:
    """cache with a pass's own keys and values kv = (k, v), L x [B, K, T, H] (as
    decoder.cached_pass returns them with write=False), stored at slot_BT [B, T] of every layer;
    slots outside [0, S) are dropped."""
    put = lambda layer, new_BKTH: write(layer, jnp.swapaxes(new_BKTH, 1, 2), slot_BT)  # noqa
    k, v = readable(cache)
    return stored(cache, tuple(map(put, k, kv[0])), tuple(map(put, v, kv[1])))
