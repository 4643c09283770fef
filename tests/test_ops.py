"""The door to the backends (jaxkv.ops): which backend runs, how caches are stored under each,
and every backend's products against the portable XLA reference (attention: test_kernels.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import ops
from jaxkv.core.quant import quantize_matrix
from jaxkv.ops import cpu as cpu_ops
from jaxkv.ops import xla
from jaxkv.ops.arrays import HalfKV, Int8KV
from tests.conftest import CONFIGS, random_tokens

on_the_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CI runs on the CPU")


@on_the_cpu
def test_the_platform_chooses_and_jaxkv_ops_forces(monkeypatch):
    assert ops.backend_name() == "cpu" and ops.backend() is cpu_ops
    monkeypatch.setenv("JAXKV_OPS", "xla")
    assert ops.backend_name() == "xla" and ops.backend() is xla
    monkeypatch.delenv("JAXKV_OPS")
    for platform in ("gpu", "tpu"):  # Pallas's kernels for decode steps, XLA's for the rest
        monkeypatch.setattr(jax, "default_backend", lambda: platform)
        assert ops.platform() == platform and ops.backend_name() == "pallas"


def test_the_backend_follows_the_target_not_the_host():
    """ops.on: a platform name, a device, a mesh or placed arrays choose the platform; inside it
    programs trace anew for it (jax.default_device is in JAX's trace keys), and a CPU-placed
    tree on a CPU host changes nothing."""
    cpu = jax.devices("cpu")[0]
    host = ops.platform()
    traced = []
    f = jax.jit(lambda x: traced.append(ops.backend_name()) or x + 1)
    sds = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(cpu))
    for where, platform in (("tpu", "tpu"), ("cuda", "gpu"), (cpu, "cpu"),
                            (jax.make_mesh((1,), ("x",)), host), ({"w": jnp.ones(2)}, host)):
        with ops.on(where):
            assert ops.platform() == platform
            f.lower(sds)
    with ops.on(np.ones(2)):  # not placed: nothing changes
        assert ops.platform() == host
    assert traced == ["pallas", "pallas", "cpu"]  # the mesh and arrays reused the CPU trace
    with pytest.raises(ValueError, match="platform must be one of cpu, gpu, tpu"):
        ops.platform_of("metal")


def test_an_unknown_backend_is_named(monkeypatch):
    monkeypatch.setenv("JAXKV_OPS", "cuda")
    with pytest.raises(ValueError, match=r"JAXKV_OPS must be one of xla, cpu, pallas "
                                         r"\(or unset\), got 'cuda'"):
        ops.matmul(jnp.ones((1, 1, 4)), jnp.ones((3, 4)))


@pytest.mark.parametrize("backend,half", [(cpu_ops, HalfKV), (xla, jax.Array)])
def test_each_backend_stores_caches_its_way(monkeypatch, backend, half):
    """int8: Int8KV everywhere; bfloat16: HalfKV (the bits) on the CPU backend, an array of
    bfloat16 on XLA's; float32: an array. The values read back are the same."""
    monkeypatch.setattr(ops, "backend", lambda: backend)
    x_BKSH = jax.random.normal(jax.random.key(0), (1, 2, 3, 8))
    stored = ops.kv_layer(x_BKSH, jnp.bfloat16)
    assert isinstance(stored, half) and stored.dtype == jnp.bfloat16
    np.testing.assert_array_equal(stored.astype(jnp.float32),
                                  x_BKSH.astype(jnp.bfloat16).astype(jnp.float32))
    assert isinstance(ops.kv_layer(x_BKSH, jnp.int8), Int8KV)
    assert ops.kv_layer(x_BKSH, jnp.float32).dtype == jnp.float32
    empty = ops.empty_kv_layer((1, 2, 3, 8), jnp.bfloat16)
    assert isinstance(empty, half) and empty.shape == (1, 2, 3, 8)


def weights(kind):
    w_OI = jax.random.normal(jax.random.key(1), (40, 64))
    if kind == "float32":
        return w_OI
    if kind == "bfloat16":
        return w_OI.astype(jnp.bfloat16)
    return quantize_matrix(w_OI, None if kind == "int8" else 16)


@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernels", "xla_cpu_forms"])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int8_blocks"])
@pytest.mark.parametrize("rows", [1, 5, 20, 120])
def test_cpu_products_equal_the_reference(monkeypatch, kernels_on, kind, rows):
    """Every form the CPU backend picks (the kernels up to their rows; one-row loops, GEMV
    calls, int8 row loops; XLA's product past them), with a bias and after costly work."""
    if not kernels_on:
        monkeypatch.setenv("JAXKV_CPU_KERNELS", "0")
    w = weights(kind)
    dtype = jnp.bfloat16 if kind == "bfloat16" else jnp.float32
    x_BTI = jax.random.normal(jax.random.key(2), (1, rows, 64)).astype(dtype)
    b_O = jax.random.normal(jax.random.key(3), (40,)).astype(dtype)
    tol = 2e-2 if kind == "bfloat16" else 1e-5
    for bias, costly in ((None, False), (b_O, False), (None, True)):
        want = xla.matmul(x_BTI, w, bias, jnp.float32, costly)
        got = jax.jit(cpu_ops.matmul, static_argnums=(3, 4))(x_BTI, w, bias, jnp.float32, costly)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_decoding_agrees_across_backends(xla_backend, monkeypatch, kv_dtype):
    """Greedy tokens of generate under the XLA backend equal the CPU backend's (float32
    weights; each cache dtype stored as its backend stores it)."""
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(5))
    prompts = [random_tokens(6, (7,)).tolist(), random_tokens(7, (4,)).tolist()]
    tokens_xla, lengths_xla = jaxkv.generate(params, prompts, 12, kv_dtype=kv_dtype)
    monkeypatch.setenv("JAXKV_OPS", "cpu")
    jax.clear_caches()
    tokens_cpu, lengths_cpu = jaxkv.generate(params, prompts, 12, kv_dtype=kv_dtype)
    np.testing.assert_array_equal(tokens_xla, tokens_cpu)
    np.testing.assert_array_equal(lengths_xla, lengths_cpu)
