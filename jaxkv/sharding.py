"""Running past one device with JAX's own SPMD machinery: a Mesh with a data axis (batch rows)
and a model axis (attention heads, MLP width, vocabulary), and NamedSharding for params and cache.

The code that computes is unchanged: XLA's partitioner inserts the collectives. A dimension is
split only where its size divides the mesh axis; otherwise it is replicated.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.convert import path_name

DATA, MODEL = "data", "model"

# Which axis of each parameter (by name, after its leading L axis if stacked) is split over
# the model axis: heads for attention, F for the MLP, V for the vocabulary.
_MODEL_AXIS = {
    "wq": 1, "wk": 1, "wv": 1, "wo": 0, "bq": 0, "bk": 0, "bv": 0,
    "w_up": 1, "w_gate": 1, "w_down": 0, "b_up": 0, "b_gate": 0,
    "embed": 0, "lm_head": 1,
}


def make_mesh(data: int, model: int, devices=None) -> Mesh:
    """A (data, model) mesh over the first data * model devices."""
    devices = np.asarray(devices if devices is not None else jax.devices())
    if data * model > devices.size:
        raise ValueError(f"a {data}x{model} mesh needs {data * model} devices, found "
                         f"{devices.size}")
    return Mesh(devices.reshape(-1)[: data * model].reshape(data, model), (DATA, MODEL))


def _spec(shape, axis, mesh: Mesh, name: str):
    """PartitionSpec splitting dimension `axis` of shape over `name`, if it divides evenly."""
    spec = [None] * len(shape)
    if axis is not None and shape[axis] % mesh.shape[name] == 0:
        spec[axis] = name
    return P(*spec)


def param_shardings(params, mesh: Mesh):
    """NamedSharding for every parameter leaf (same pytree structure as params)."""
    def one(path, leaf):
        name = path_name(path)
        leaf_name = name.split(".")[-1]
        axis = _MODEL_AXIS.get(leaf_name)
        stacked = "blocks." in name or name.startswith("cross.")
        if axis is not None and stacked:
            axis += 1  # past the leading L axis
        return NamedSharding(mesh, _spec(leaf.shape, axis, mesh, MODEL))

    return jax.tree_util.tree_map_with_path(one, params)


def cache_shardings(cache, mesh: Mesh):
    """Rows over the data axis, kv heads over the model axis."""
    def one(path, leaf):
        if leaf.ndim == 5:  # [L, B, S, K, H]
            spec = _spec(leaf.shape, 3, mesh, MODEL)
            return NamedSharding(mesh, P(None, _batch(leaf.shape[1], mesh), None, *spec[3:]))
        return NamedSharding(mesh, P(_batch(leaf.shape[0], mesh), *[None] * (leaf.ndim - 1)))

    return jax.tree_util.tree_map_with_path(one, cache)


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
