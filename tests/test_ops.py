"""The door to the backends (jaxkv.ops): which backend runs, how caches are stored under each,
and every backend's products against the portable XLA reference (attention: test_kernels.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import ops
from jaxkv.core.quant import quantize_matrix
from jaxkv.ops import cpu as cpu_ops
from jaxkv.ops import xla
from jaxkv.ops.arrays import HalfKV, Int8KV, dequantize_rows
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


def _on_backend(monkeypatch, name):
    """JAXKV_OPS=name (pallas: its GPU kernels interpreted), traces made anew."""
    monkeypatch.setenv("JAXKV_OPS", name)
    monkeypatch.setenv("JAXKV_PALLAS_INTERPRET", "1")
    jax.clear_caches()


@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas"])
@pytest.mark.parametrize("rows", [2, 3])
def test_matmul_takes_a_norm_an_activation_and_a_residual(monkeypatch, backend, rows):
    """ops.matmul's norm, gated and residual, on every backend (the Pallas one in one kernel
    where its products take the rows: 2 here, not 3), as the norm, the product, act(gate) * up
    and the sum computed one by one."""
    keys = jax.random.split(jax.random.key(9), 6)
    x, scale, shift, b = (jax.random.normal(k, s) for k, s in zip(
        keys, [(1, rows, 64), (64,), (64,), (64,)]))
    w = jax.random.normal(keys[4], (64, 64)) / 8
    residual = jax.random.normal(keys[5], (1, rows, 32))
    norm = (1 + scale / 4, shift, "layernorm", 1e-5)
    h = xla.norm(x, *norm)
    y = jnp.einsum("BTI,OI->BTO", h, w, precision="highest") + b
    want = residual + xla.gated(y, "silu", 16)
    _on_backend(monkeypatch, backend)

    def fused(x, w, b, scale, shift, residual):
        return ops.matmul(x, w, b, norm=(scale, shift, "layernorm", 1e-5), gated=("silu", 16),
                          residual=residual)
    args = (x, w, b, norm[0], shift, residual)
    kernels = str(jax.make_jaxpr(fused)(*args)).count("name=jaxkv_fused_product")
    got = jax.jit(fused)(*args)
    jax.clear_caches()
    from jaxkv.ops.pallas import mosaic_gpu
    assert kernels == (backend == "pallas" and rows == 2 and not mosaic_gpu.AVAILABLE)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas"])
def test_attention_stores_its_own_keys_where_asked(monkeypatch, backend):
    """ops.attention(store_at=slots): the output as without it, and the cache with the step's
    own keys and values at each row's slot (one outside the cache dropped), as arrays.write
    stores them; on the Pallas backend the decode kernel's merge stores them."""
    from jaxkv.ops.arrays import write

    B, K, G, S, H = 3, 2, 2, 32, 16
    keys = jax.random.split(jax.random.key(4), 5)
    q = jax.random.normal(keys[0], (B, 1, K * G, H))
    k_cache, v_cache = (jax.random.normal(k, (B, K, S, H)) for k in keys[1:3])
    own_k, own_v = (jax.random.normal(k, (B, K, 1, H)) for k in keys[3:5])
    lengths = jnp.array([5, 17, 32])  # row 2's slot is past the cache: dropped
    mask = jnp.arange(S)[None, None] < lengths[:, None, None]
    own = (own_k, own_v, jnp.ones((B, 1, 1), bool), None)
    _on_backend(monkeypatch, backend)

    def storing(q, k_cache, v_cache, mask, lengths):
        return ops.attention(q, k_cache, v_cache, mask, 0.25, own=own, lengths=lengths,
                             store_at=lengths[:, None])
    args = (q, k_cache, v_cache, mask, lengths)
    writes = "scatter" in str(jax.make_jaxpr(storing)(*args))
    out, lse, k_new, v_new = jax.jit(storing)(*args)
    plain = jax.jit(lambda *a: ops.attention(*a[:4], 0.25, own=own, lengths=a[4]))(
        q, k_cache, v_cache, mask, lengths)
    jax.clear_caches()
    assert writes == (backend != "pallas")  # (the Pallas backend's merge kernel stores them)
    np.testing.assert_array_equal(out, plain[0])
    np.testing.assert_array_equal(lse, plain[1])
    for new, cache, mine in ((k_new, k_cache, own_k), (v_new, v_cache, own_v)):
        want = write(cache, jnp.swapaxes(mine, 1, 2), lengths[:, None])
        np.testing.assert_array_equal(np.asarray(new), np.asarray(want))


def expert_reference(x_RD, w_in_EOD, w_out_EDF, expert_RK, weight_RK):
    """Each row through each of its experts one by one, in numpy (float64)."""
    x, w_in, w_out = (np.asarray(a, np.float64) for a in (x_RD, w_in_EOD, w_out_EDF))
    F = w_in.shape[1] // 2
    y = np.zeros_like(x)
    for r, (experts, weights) in enumerate(zip(np.asarray(expert_RK), np.asarray(weight_RK))):
        for e, w in zip(experts, weights):
            h = w_in[e] @ x[r]
            y[r] += w * (w_out[e] @ (h[:F] / (1 + np.exp(-h[:F])) * h[F:]))
    return y


@pytest.mark.parametrize("backend", ["xla", "cpu"])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_experts_equal_each_row_through_its_experts(rows, backend, monkeypatch):
    """ops.experts equals each row run through its chosen experts alone: XLA's portable form,
    a decode step's few rows (weights gathered) and a prefill's many (tiles of one expert
    each), and the CPU backend's (the kernels)."""
    monkeypatch.setenv("JAXKV_OPS", backend)
    rng = np.random.default_rng(rows)
    E, D, F, K = 6, 16, 8, 2
    w_in, w_out = rng.normal(size=(E, 2 * F, D)), rng.normal(size=(E, D, F))
    x = rng.normal(size=(rows, D))
    expert_RK = np.stack([rng.choice(E, K, replace=False) for _ in range(rows)])
    weight_RK = rng.random(size=(rows, K))
    got = jax.jit(functools.partial(jaxkv.ops.experts, activation="silu"))(
        *(jnp.asarray(a, jnp.float32) for a in (x, w_in, w_out)), jnp.asarray(expert_RK),
        jnp.asarray(weight_RK, jnp.float32))
    np.testing.assert_allclose(got, expert_reference(x, w_in, w_out, expert_RK, weight_RK),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["xla", "cpu"])
@pytest.mark.parametrize("rows", [1, 40])
def test_int8_experts_equal_their_dequantized_weights(rows, backend, monkeypatch):
    """Experts quantized per expert and row (jaxkv.quantize's form) are read as int8 in both of
    XLA's forms and the CPU kernels, and give what their dequantized float weights give."""
    monkeypatch.setenv("JAXKV_OPS", backend)
    rng = np.random.default_rng(rows)
    E, D, F, K = 5, 16, 8, 2
    w_in, w_out = (quantize_matrix(rng.normal(size=s).astype(np.float32))
                   for s in ((E, 2 * F, D), (E, D, F)))
    assert w_in.q.shape == (E, 2 * F, D) and w_in.scale.shape == (E, 2 * F, 1)
    x = jnp.asarray(rng.normal(size=(rows, D)), jnp.float32)
    expert_RK = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(rows)]))
    weight_RK = jnp.asarray(rng.random(size=(rows, K)), jnp.float32)
    fn = jax.jit(functools.partial(jaxkv.ops.experts, activation="silu"))
    got = fn(x, w_in, w_out, expert_RK, weight_RK)
    floats = [dequantize_rows(w.q, w.scale) for w in (w_in, w_out)]
    np.testing.assert_allclose(got, fn(x, *floats, expert_RK, weight_RK), rtol=1e-5, atol=1e-4)


def test_experts_compute_and_read_only_the_chosen():
    """XLA's cost analysis of ops.experts over 64 experts: one row's 2 experts read under 8/64
    of the experts' weights (the analysis counts a slice's bytes twice, as the slice's output
    and as its product's input: 598 KB of 6.3 MB); 256 rows' products cost their tiles' flops,
    not every expert's."""
    E, D, F, K = 64, 64, 128, 2
    w_in, w_out = jnp.zeros((E, 2 * F, D)), jnp.zeros((E, D, F))
    weights = (w_in.size + w_out.size) * 4

    def cost(rows):
        args = (jnp.zeros((rows, D)), w_in, w_out, jnp.zeros((rows, K), jnp.int32),
                jnp.zeros((rows, K)))
        fn = jax.jit(functools.partial(jaxkv.ops.xla.experts, activation="silu"))
        analysis = fn.lower(*args).compile().cost_analysis()
        return analysis[0] if isinstance(analysis, list) else analysis
    assert cost(1)["bytes accessed"] < weights * 8 / E
    per_row = 2 * D * 3 * F  # one row through one expert
    tiles = (-(-256 * K // 16) + E) * 16  # rows the tiles hold, padding included
    assert cost(256)["flops"] < 1.5 * tiles * per_row < E * 256 * K * per_row / 4
