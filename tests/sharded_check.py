"""Run by tests/test_sharding.py in a fresh process with 8 host devices: sharded generate and
decode_step against unsharded, on (data x model) meshes. Prints one JSON line of results."""

import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"  # the host's devices, also on a machine with a GPU

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv.core.sharding import cache_shardings, make_mesh, shard_params  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.conftest import CONFIGS  # noqa: E402

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2], [11], [3, 3, 60, 12, 40], [1, 2], [90, 91, 92, 93],
           [17], [4, 4, 4, 4, 4, 4]]


# a mixture of experts (4 experts, layer 1 dense): its experts split over the model axis
MOE = dataclasses.replace(CONFIGS["llama_gqa"], n_experts=4, experts_per_token=2,
                          dense_layers=(1,))


def check(name, shape):
    params = jaxkv.init_params(MOE if name.startswith("moe") else CONFIGS[name],
                               jax.random.key(0))
    if name.endswith("int8"):
        params = jaxkv.quantize(params)
    mesh = make_mesh(*shape)
    out = {}
    for label, options in (("greedy", {}), ("sampled", dict(temperature=0.8, top_k=40,
                                                             key=jax.random.key(1)))):
        plain, plain_len = jaxkv.generate(params, PROMPTS, 12, **options)
        sharded, sharded_len = jaxkv.generate(params, PROMPTS, 12, mesh=mesh, **options)
        out[label] = bool((np.asarray(plain) == np.asarray(sharded)).all() and
                          (np.asarray(plain_len) == np.asarray(sharded_len)).all())
    # One decode step on sharded params and cache against the unsharded step.
    tokens = np.array([p + [0] * (8 - len(p)) for p in PROMPTS])
    lengths = np.array([len(p) for p in PROMPTS])
    cache = jaxkv.init_cache(params, 8, 16)
    _, cache = jaxkv.prefill(params, cache, tokens, lengths)
    step = jax.jit(jaxkv.decode_step)
    want, _ = step(params, cache, jnp.arange(8), jnp.asarray(lengths))
    sharded_params = shard_params(params, mesh)
    sharded_cache = jax.device_put(cache, cache_shardings(cache, mesh))
    got, new_cache = step(sharded_params, sharded_cache, jnp.arange(8), jnp.asarray(lengths))
    out["logit_error"] = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    dense = next(b for b in sharded_params.blocks if b.w_in is not None)
    spec = lambda w: str(getattr(w, "q", w).sharding.spec)  # noqa: E731 - an Int8's numbers'
    out["w_in_spec"] = spec(dense.w_in)
    moe = sharded_params.blocks[0].experts_in
    out["experts_spec"] = None if moe is None else spec(moe)
    out["wo_spec"] = spec(sharded_params.blocks[0].wo)
    out["cache_spec"] = str(sharded_cache.k[0].sharding.spec)
    out["devices"] = len(getattr(dense.w_in, "q", dense.w_in).sharding.device_set)
    return out


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    results = {f"{name} {d}x{m}": check(name, (d, m))  # rows alone over 8: one family's
               for name, d, m in (("llama_gqa", 2, 4), ("llama_gqa", 8, 1), ("gpt2", 2, 4),
                                  ("moe", 2, 4), ("moe_int8", 2, 4))}
    print(json.dumps(results))
