"""Running past one device with JAX's own SPMD machinery: a Mesh with a data axis (batch rows)
and a model axis (attention heads, MLP width, vocabulary), and NamedSharding for params and cache.

The code that computes is unchanged: XLA's partitioner inserts the collectives. A dimension is
split only where its size divides the mesh axis; otherwise it is replicated.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.core.params import path_name

DATA, MODEL = "data", "model"

# Which axis of each parameter (by leaf name) is split over the model axis, and which size
# must divide the model axis for the split to keep heads / units whole: fused Q/K/V rows are
# grouped by kv head, gate/up rows by MLP unit (see params.py).
_MODEL_AXIS = {
    "wqkv": (0, "n_kv_heads"), "bqkv": (0, "n_kv_heads"), "wkv": (0, "n_kv_heads"),
    "bkv": (0, "n_kv_heads"), "wq": (0, "n_heads"), "bq": (0, "n_heads"),
    "wo": (1, "n_heads"), "w_in": (0, "d_ff"), "b_in": (0, "d_ff"), "w_out": (1, "d_ff"),
    "embed": (0, "vocab_size"), "lm_head": (0, "vocab_size"),
}


def make_mesh(data: int, model: int, devices=None) -> Mesh:
    """A (data, model) mesh over the first data * model devices."""
    devices = np.asarray(devices if devices is not None else jax.devices())
    if data * model > devices.size:
        raise ValueError(f"a {data}x{model} mesh needs {data * model} devices, found "
                         f"{devices.size}")
    return Mesh(devices.reshape(-1)[: data * model].reshape(data, model), (DATA, MODEL))


def _spec(ndim: int, axis, name: str | None):
    spec = [None] * ndim
    if axis is not None:
        spec[axis] = name
    return P(*spec)


def param_shardings(params, mesh: Mesh):
    """NamedSharding for every parameter leaf (same pytree structure as params)."""
    c = params.config

    def one(path, leaf):
        axis, unit = _MODEL_AXIS.get(path_name(path).split(".")[-1], (None, None))
        whole = unit is not None and getattr(c, unit) % mesh.shape[MODEL] == 0
        return NamedSharding(mesh, _spec(leaf.ndim, axis if whole else None, MODEL))

    return jax.tree.map_with_path(one, params)


def cache_shardings(cache, mesh: Mesh):
    """Rows over the data axis; kv heads ([B, K, S, H] leaves) over the model axis."""
    def one(leaf):
        spec = [_batch(leaf.shape[0], mesh)] + [None] * (leaf.ndim - 1)
        if leaf.ndim == 4 and leaf.shape[1] % mesh.shape[MODEL] == 0:
            spec[1] = MODEL
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(one, cache)


def _batch(size: int, mesh: Mesh):
    return DATA if size % mesh.shape[DATA] == 0 else None


def shard_params(params, mesh: Mesh):
    """params placed on the mesh (heads / MLP width / vocabulary split over the model axis)."""
    return jax.device_put(params, param_shardings(params, mesh))


def shard_rows(x, mesh: Mesh):
    """An array whose leading axis is batch rows, split over the data axis."""
    return jax.device_put(x, NamedSharding(mesh, P(_batch(x.shape[0], mesh),
                                                   *[None] * (x.ndim - 1))))


def constrain_cache(cache, mesh: Mesh | None):
    """Inside jit: ask the partitioner to keep the cache split by rows and kv heads."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))
