"""The CPU product kernels: exact against a float64 product for every weight format, shape tail
and row count they take; differentiable and vmappable; lowered as the plain einsum on other
platforms; decoding with them off (XLA's products) still equals the forward."""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.core import decoder
from jaxkv.core.quant import quantize_matrix
from jaxkv.ops import cpu as cpu_ops
from jaxkv.ops import xla
from jaxkv.ops.arrays import PagedKV, dequantize_rows, half_kv, logical, quantize_kv
from jaxkv.ops.cpu import kernels
from tests.conftest import CONFIGS, assert_decode_equals_forward, random_tokens


# The kernels serve processes whose default backend is the CPU; CI runs these there.
on_the_cpu = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="the CPU kernels are not used where JAX computes elsewhere")


def reference(x_RI, w_OI):
    return np.asarray(x_RI, np.float64) @ np.asarray(w_OI, np.float64).T


@pytest.mark.parametrize("R,I,O", [(1, 64, 96), (3, 576, 200), (16, 96, 4096), (5, 37, 13),
                                   (2, 77, 13), (36, 77, 29), (45, 40, 53),
                                   (75, 40, 29), (96, 33, 17)],
                         ids=["one_row", "several_rows", "sixteen_rows", "tails", "tails_two_rows",
                              "outer_form_dot_rest", "outer_form_padded", "five_vectors_padded",
                              "six_vectors"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_float_product_equals_float64(R, I, O, dtype):
    """Rows not a multiple of the 4-row tile, inputs not a multiple of 16 lanes, many chunks."""
    x_RI = jax.random.normal(jax.random.key(0), (R, I))
    w_OI = jax.random.normal(jax.random.key(1), (O, I)).astype(dtype)
    y_RO = jax.jit(kernels.product)(x_RI, w_OI)
    assert y_RO.dtype == jnp.float32 and y_RO.shape == (R, O)
    np.testing.assert_allclose(y_RO, reference(x_RI, w_OI.astype(jnp.float32)), atol=2e-5 * I)


@pytest.mark.parametrize("R,I,x_dtype", [(1, 64, jnp.float32), (1, 77, jnp.float32),
                                         (1, 77, jnp.bfloat16), (1, 300, jnp.bfloat16),
                                         (4, 77, jnp.bfloat16),
                                         (9, 64, jnp.bfloat16)])
def test_bfloat16_product_of_bfloat16_rows_equals_float64(R, I, x_dtype):
    """x holding bfloat16 numbers (a bfloat16 model's activations), given as float32 (the
    float32 forms) or as bfloat16, which goes to the kernel as it is: one row takes the pairs
    form, vdpbf16ps where the CPU has it (300 inputs with AVX-512: two steps of 4 x 32, one of
    32, 12 finished one by one), more rows are widened first."""
    x_RI = jax.random.normal(jax.random.key(0), (R, I)).astype(jnp.bfloat16).astype(x_dtype)
    w_OI = jax.random.normal(jax.random.key(1), (203, I)).astype(jnp.bfloat16)
    lowered = jax.jit(kernels.product).lower(x_RI, w_OI).as_text()
    x_type = "bf16" if x_dtype == jnp.bfloat16 else "f32"
    assert f"(tensor<{R}x{I}x{x_type}>, tensor<203x{I}xbf16>) -> tensor<{R}x203xf32>" in lowered
    y_RO = jax.jit(kernels.product)(x_RI, w_OI)
    want = reference(x_RI.astype(jnp.float32), w_OI.astype(jnp.float32))
    np.testing.assert_allclose(y_RO, want, atol=2e-5 * I)


def assert_int8_product_exact(x_RI, q_OI, scale_OB):
    """dense_int8 against a float64 product of the dequantized weights."""
    y_RO = jax.jit(kernels.product_int8)(x_RI, q_OI, scale_OB)
    w_OI = dequantize_rows(q_OI, scale_OB.astype(jnp.float32))
    np.testing.assert_allclose(y_RO, reference(x_RI, w_OI), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("block", [None, 16, 32])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("R", [1, 6, 20])  # 20: the outer-product form
def test_int8_product_equals_float64_of_the_dequantized_weights(block, scale_dtype, R):
    x_RI = jax.random.normal(jax.random.key(0), (R, 128))
    w = quantize_matrix(jax.random.normal(jax.random.key(1), (300, 128)), block)
    scale_OB = w.scale.astype(scale_dtype)
    assert kernels.int8_fits(w.q, scale_OB)
    assert_int8_product_exact(x_RI, w.q, scale_OB)


@pytest.mark.parametrize("I,O,block", [(77, 13, None), (48, 13, 16), (48, 30, None),
                                     (96, 13, 32), (128, 30, 64)])
def test_int8_one_row_tails_equal_float64(I, O, block):
    """One row of x takes each 32 inputs in two chains: inputs past the last 32 are finished one
    by one, rows past the last 4-row tile one at a time, 16-input blocks straddle a pair, and
    blocks of 32 or more are scaled once a step."""
    x_RI = jax.random.normal(jax.random.key(0), (1, I))
    w = quantize_matrix(jax.random.normal(jax.random.key(1), (O, I)), block)
    assert_int8_product_exact(x_RI, w.q, w.scale)


def test_int8_blocks_it_does_not_take_are_named():
    """Blocks of 48 inputs (not a power of two) stay with XLA: int8_fits says so."""
    w = quantize_matrix(jnp.ones((4, 96)), block=48)
    assert not kernels.int8_fits(w.q, w.scale)


def test_gradients_and_vmap_equal_the_plain_product():
    x_RI = jax.random.normal(jax.random.key(0), (2, 64))
    w_OI = jax.random.normal(jax.random.key(1), (32, 64))
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))  # noqa: E731
    grad = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x_RI, w_OI)  # noqa: E731
    grads, expected = grad(kernels.product), grad(lambda x, w: x @ w.T)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    batched = jax.vmap(kernels.product, (0, None))(x_RI[:, None], w_OI)[:, 0]
    np.testing.assert_allclose(batched, x_RI @ w_OI.T, atol=1e-4, rtol=1e-5)


@on_the_cpu
def test_calls_in_flight_together_are_each_exact_and_repeat_bitwise():
    """Independent products, which XLA may run at once on its pool's threads, called back to
    back, so that a pool task waiting for the next call's work (common.h, Linger) takes some of
    them while others are posted or withdrawn: every one exact, every run the same bits."""
    xs = [jax.random.normal(jax.random.key(i), (1 + i % 3, 96)) for i in range(8)]
    ws = [jax.random.normal(jax.random.key(100 + i), (300, 96)).astype(jnp.bfloat16)
          for i in range(8)]
    products = jax.jit(lambda xs, ws: [kernels.product(x, w) for x, w in zip(xs, ws)])
    first = [np.asarray(y) for y in products(xs, ws)]
    for x, w, y in zip(xs, ws, first):
        np.testing.assert_allclose(y, reference(x, w.astype(jnp.float32)), atol=2e-5 * 96)
    for _ in range(50):
        for y, again in zip(first, products(xs, ws)):
            np.testing.assert_array_equal(y, again)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_other_platforms_lower_the_plain_product(platform):
    """The same function lowered for a GPU or TPU holds no call to the CPU kernels."""
    x_RI, w_OI = jnp.ones((1, 64)), jnp.ones((32, 64), jnp.bfloat16)
    traced = jax.jit(kernels.product).trace(x_RI, w_OI)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert "jaxkv_dense" not in text and "dot_general" in text
    assert "@jaxkv_dense(" in traced.lower(lowering_platforms=("cpu",)).as_text()


@on_the_cpu
def test_decode_step_calls_the_kernels_on_the_cpu():
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(0))
    cache = jaxkv.init_cache(params, 1, 16)
    step = jax.jit(jaxkv.decode_step).lower(params, cache, jnp.zeros(1, jnp.int32),
                                            jnp.zeros(1, jnp.int32))
    # 3 layers x (wqkv, wo, w_in, w_out) + the head
    assert step.as_text().count("@jaxkv_dense(") == 13


@on_the_cpu
@pytest.mark.parametrize("block_size,layer,table", [(16, "2x4x16x16", "2x2"),
                                                    (8, "2x2x32x16", "2x0")])
def test_paged_steps_attend_over_the_pools_in_the_kernel(block_size, layer, table):
    """A decode step over a paged cache of blocks of 16 slots hands every layer's pools [K, NB,
    P, H] and the table [B, M] to the attention kernel; blocks of 8 are gathered into [B, K, S,
    H] first (the table it gets is empty: [B, 0])."""
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(0))
    cache = jaxkv.init_cache(params, 2, 32, block_size=block_size)
    step = jax.jit(jaxkv.decode_step).lower(params, cache, jnp.zeros(2, jnp.int32),
                                            jnp.zeros(2, jnp.int32))
    calls = [line for line in step.as_text().splitlines() if "@jaxkv_attend(" in line]
    assert len(calls) == 3 and all(f"tensor<{layer}xf32>, tensor<{layer}xf32>" in line and
                                   f"tensor<{table}xi32>)" in line for line in calls)


@on_the_cpu
def test_prefill_chunks_attend_in_the_kernel_on_the_cpu():
    """A chunk of more queries than a tile holds (here 100 tokens x G query heads) goes to the
    attention kernel at every layer, and the result is forward's."""
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(0))
    tokens_BT = jax.random.randint(jax.random.key(1), (2, 100), 0, params.config.vocab_size)
    lengths_B = jnp.array([100, 61])
    cache = jaxkv.init_cache(params, 2, 128)
    run = jax.jit(lambda c, t: decoder.prefill_padded(params, c, t, lengths_B,
                                                      jnp.zeros(2, jnp.int32), chunk=100))
    assert run.lower(cache, tokens_BT).as_text().count("@jaxkv_attend(") == 3  # 3 layers
    logits_BV, _ = run(cache, tokens_BT)
    want_BTV = jaxkv.forward(params, tokens_BT)
    np.testing.assert_allclose(logits_BV, want_BTV[jnp.arange(2), lengths_B - 1], atol=1e-4)


@pytest.mark.parametrize("name,block", [("llama_gqa", "float"), ("gpt2", None),
                                        ("llama_mqa", 32)])
def test_decoding_with_xla_backend_equals_forward(xla_backend, name, block):
    params = jaxkv.init_params(CONFIGS[name], jax.random.key(1))
    if block != "float":
        params = jaxkv.quantize(params, block=block)
    assert jaxkv.ops.backend_name() == "xla"
    assert_decode_equals_forward(params, random_tokens(2, (2, 12)), 8, 20)


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        kernels._build()


def test_a_failed_build_names_the_compilers_complaint(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXKV_CPU_MARCH", "no-such-cpu")
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="-march=no-such-cpu failed on the kernels: .*no-such"):
        kernels._build()


def test_outer_block_rows_equals_the_builds_vectors():
    """One block of the float32 outer form holds 3/4 of the vector registers' sums over 4
    outputs: 6 vectors of 16 rows with AVX-512, 3 of 8 with AVX2, 6 of 4 with NEON's 32
    registers, 3 of 4 with SSE2 (what one row's prefill passes are chosen by)."""
    march = os.environ.get("JAXKV_CPU_MARCH", "native")
    flags = kernels._cpu_features().split()
    widest = {"x86-64-v4": "avx512f", "x86-64-v3": "avx2", "x86-64": ""}.get(
        march, "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "")
    if platform.machine() == "aarch64":
        widest = "neon"
    assert kernels.outer_block_rows() == {"avx512f": 96, "avx2": 24, "neon": 24, "": 12}[widest]


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="no ARM cross-compiler (CI installs g++-aarch64-linux-gnu)")
def test_the_kernels_build_for_arm(monkeypatch, tmp_path):
    """The plain-loop paths also build for aarch64 (GCC's __fp16 where x86 has _Float16)."""
    monkeypatch.setenv("CXX", "aarch64-linux-gnu-g++")
    monkeypatch.setenv("JAXKV_CPU_MARCH", "armv8.2-a")
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path))
    header = kernels._build().read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # aarch64


# The tests a narrower build runs: every product's forms and tails; attention's decode and
# prefill paths (float, bfloat16, int8 cache, soft cap, paged caches) and key splits.
NARROW = ("product_equals or rows_equals or tails or in_flight or splits or 3_tiles_3_blocks or "
          "decode_4_queries_bfloat16_softcap or (int8_cache and (3_queries or 2_tiles)) or "
          "(paged_cache and (decode_3_queries or int8))")


# ---- a mixture's experts ------------------------------------------------------------------

EXPERT_FORMATS = {  # name: (x dtype, weights of a stack [E, O, I] from float32 ones)
    "float32": (jnp.float32, lambda w: w),
    "bfloat16": (jnp.float32, lambda w: w.astype(jnp.bfloat16)),
    "bfloat16_rows": (jnp.bfloat16, lambda w: w.astype(jnp.bfloat16)),
    "int8": (jnp.float32, lambda w: quantize_matrix(w)),
    "int8_blocks": (jnp.float32, lambda w: quantize_matrix(w, 16)),
}


def expert_product(x_XI, w_EOI, e_X):
    """The kernels' product of each row with its own expert's matrix, float or Int8."""
    if isinstance(w_EOI, jaxkv.ops.Int8):
        return jax.jit(kernels.expert_product_int8)(x_XI, w_EOI.q, w_EOI.scale, e_X)
    return jax.jit(kernels.expert_product)(x_XI, w_EOI, e_X)


@pytest.mark.parametrize("form", list(EXPERT_FORMATS))
@pytest.mark.parametrize("X", [1, 5, 24, 150])
def test_expert_product_equals_float64(form, X):
    """Row j times expert e[j]'s matrix of the stack, in every weight format the product
    kernels take: rows that chose the same expert are gathered for one read of it (5 rows over
    3 experts, 24 over 3 with 4 in the stack, expert 1 never chosen), and each comes back to its
    own place; 150 rows, 120 of them expert 3's: pieces of 96 rows and 24, in the outer form
    for float32; 37 outputs and 80 inputs leave tails."""
    x_dtype, make = EXPERT_FORMATS[form]
    E, O, I = 4, 37, 80
    x_XI = jax.random.normal(jax.random.key(0), (X, I)).astype(x_dtype)
    w_EOI = make(jax.random.normal(jax.random.key(1), (E, O, I)))
    e_X = np.random.default_rng(X).choice([0, 2, 3], X)
    if X == 150:
        e_X[np.random.default_rng(0).permutation(X)[:120]] = 3
    e_X = jnp.asarray(e_X, jnp.int32)
    y_XO = expert_product(x_XI, w_EOI, e_X)
    w = (dequantize_rows(w_EOI.q, w_EOI.scale) if isinstance(w_EOI, jaxkv.ops.Int8)
         else w_EOI.astype(jnp.float32))
    want = np.stack([reference(x_XI[j:j + 1].astype(jnp.float32), w[e])[0]
                     for j, e in enumerate(np.asarray(e_X))])
    assert y_XO.dtype == jnp.float32 and y_XO.shape == (X, O)
    np.testing.assert_allclose(y_XO, want, atol=2e-5 * I, rtol=1e-5)


@on_the_cpu
def test_an_expert_out_of_the_stack_is_refused():
    """The kernel names an index past the stack rather than read outside it."""
    with pytest.raises(Exception, match="expert index is out of range"):
        expert_product(jnp.ones((2, 16)), jnp.ones((3, 8, 16)), jnp.asarray([0, 3], jnp.int32))


def test_expert_product_gradients_and_other_platforms():
    """Derivatives are the plain per-row products' (x and a float stack; x for int8); a GPU or
    TPU lowers the plain products, with no call to the kernels."""
    x_XI = jax.random.normal(jax.random.key(0), (3, 32))
    w_EOI = jax.random.normal(jax.random.key(1), (4, 16, 32))
    e_X = jnp.asarray([2, 0, 2], jnp.int32)
    plain = lambda x, w: jnp.einsum("XI,XOI->XO", x, w[e_X])  # noqa: E731
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))  # noqa: E731
    grad = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x_XI, w_EOI)  # noqa: E731
    for got, want in zip(grad(lambda x, w: kernels.expert_product(x, w, e_X)), grad(plain)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    w8 = quantize_matrix(w_EOI)
    dx = jax.grad(lambda x: jnp.sum(jnp.sin(kernels.expert_product_int8(x, w8.q, w8.scale,
                                                                        e_X))))(x_XI)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(plain(x, dequantize_rows(w8.q, w8.scale)))))(x_XI)
    np.testing.assert_allclose(dx, want, atol=1e-4, rtol=1e-5)
    traced = jax.jit(kernels.expert_product).trace(x_XI, w_EOI, e_X)
    for platform_name in ("cuda", "tpu"):
        assert "jaxkv_dense" not in traced.lower(lowering_platforms=(platform_name,)).as_text()


@on_the_cpu
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_mixtures_decode_step_reads_its_experts_in_the_kernel(dtype):
    """A MoE decode step hands each layer's expert stacks whole to the kernel (two calls a
    layer, no slice of them), and still equals the forward."""
    config = jaxkv.Config.llama(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                d_ff=16, n_experts=4, experts_per_token=2, max_seq_len=32)
    params = jaxkv.init_params(config, jax.random.key(0))
    params = jaxkv.quantize(params) if dtype == "int8" else params
    cache = jaxkv.init_cache(params, 2, 16)
    step = jax.jit(jaxkv.decode_step).lower(params, cache, jnp.zeros(2, jnp.int32),
                                            jnp.zeros(2, jnp.int32)).as_text()
    assert step.count("_experts(") == 2 * config.n_layers
    assert_decode_equals_forward(params, random_tokens(0, (2, 9), 64), 4, 16, atol=1e-4)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the narrower builds named are x86's")
@pytest.mark.parametrize("march", os.environ.get("JAXKV_TEST_MARCHES", "x86-64").split(","))
def test_narrower_builds_are_exact(march):
    """The kernels' plain loops (SSE2, and ARM's generic vectors) pass the product and attention
    tests, in a process built for them. (x86-64-v4, AVX-512 without its bfloat16 dot product,
    and x86-64-v3, AVX2, pass too: JAXKV_TEST_MARCHES=x86-64-v4,x86-64-v3 pytest
    tests/test_kernels.py -k narrower; left out of the suite for its time.)"""
    env = {**os.environ, "JAXKV_CPU_MARCH": march}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                          NARROW, __file__], env=env, cwd=Path(__file__).parents[1],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


# ---- attention ----------------------------------------------------------------------------

def attention_case(H, dtype, key=0, T=3, N=4, S=37):
    """Queries of 2 rows x T tokens x N heads over 2 kv heads, a cache of S slots (some rows
    read none of them) and 3 own keys."""
    B, K, U = 2, 2, 3
    k = jax.random.split(jax.random.key(key), 7)
    q_BTNH = jax.random.normal(k[0], (B, T, N, H))
    kv = [jax.random.normal(k[i], shape).astype(dtype) for i, shape in
          ((1, (B, K, S, H)), (2, (B, K, S, H)), (3, (B, K, U, H)), (4, (B, K, U, H)))]
    mask_BTS = jax.random.bernoulli(k[5], 0.6, (B, T, S)).at[1, 0].set(False)
    mask_BTU = jax.random.bernoulli(k[6], 0.5, (B, T, U)).at[1, 0].set(False)
    return q_BTNH, kv, mask_BTS, mask_BTU


def assert_kernel_attention_equals_xla(target, q_BTNH, k, v, mask_BTS, kv_len, own, softcap):
    """The CPU backend's attention calls the kernel entry `target` (a PagedKV cache: with its
    pools, no gather of its rows), and its output and log-sum-exp equal XLA's attention (over a
    PagedKV as its rows see it); a query that sees no key (row 1's first token in
    attention_case) gets 0 and -inf. The cache is an argument, as a step passes it: XLA:CPU
    folded a constant bfloat16 pool's gather (arrays.logical) to wrong numbers."""
    def call(f, k, v):
        attend = jax.jit(lambda q, k, v: f(q, k, v, mask_BTS, 0.3, None, kv_len, own, softcap))
        return attend.lower(q_BTNH, k, v), attend(q_BTNH, k, v)
    lowered, (out, lse) = call(cpu_ops.attention, k, v)
    assert f"@{target}(" in lowered.as_text()
    if isinstance(k, PagedKV):
        assert "gather" not in lowered.as_text()
        k, v = logical(k), logical(v)
    _, (want, want_lse) = call(xla.attention, k, v)
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-6, rtol=2e-5)
    assert np.isneginf(lse[1, 0]).all() and (out[1, 0] == 0).all()


@pytest.mark.parametrize("H,dtype,softcap,kv_len,T,N,S", [
    (16, jnp.float32, None, None, 3, 4, 37), (20, jnp.float32, 5.0, 30, 3, 4, 37),
    (32, jnp.bfloat16, None, 21, 3, 4, 37), (20, jnp.float32, None, 30, 9, 6, 37),
    (16, jnp.bfloat16, 5.0, None, 11, 8, 37), (24, jnp.float32, None, None, 16, 8, 37),
    (24, jnp.float32, None, None, 50, 6, 777), (16, jnp.bfloat16, 5.0, None, 70, 2, 300),
    (64, jnp.float32, None, None, 1, 6, 300), (64, jnp.bfloat16, 5.0, None, 2, 4, 77),
    (128, jnp.float32, None, None, 1, 2, 40), (32, jnp.bfloat16, None, 180, 1, 8, 200),
    (64, jnp.bfloat16, None, None, 1, 14, 150), (32, jnp.float32, 5.0, None, 2, 8, 90)],
    ids=["float32", "tail_softcap_kv_len", "bfloat16", "27_queries", "44_queries", "64_queries",
         "3_tiles_3_blocks", "2_tiles_2_blocks_bfloat16", "decode_3_queries",
         "decode_4_queries_bfloat16_softcap", "decode_1_query_128", "decode_4_queries_bfloat16",
         "decode_7_queries_bfloat16", "decode_8_queries_softcap"])
@on_the_cpu
def test_attention_kernel_equals_xla(H, dtype, softcap, kv_len, T, N, S):
    """Output and log-sum-exp against XLA's attention (a query that sees no key: 0 and -inf),
    with head sizes that are not a whole vector, soft-capping, a kv_len bound, bfloat16 keys,
    6 to 64 queries per kv head (1 to 4 vectors of them), and more queries than a tile holds
    (64: a prefill chunk) over more keys than a block (256) holds; and a decode step's path (at
    most 8 queries per kv head, whole vectors of head size: keys across lanes) for 1 to 8
    queries, over keys that end inside a vector and a block; its derivative is XLA's."""
    q_BTNH, (k, v, k_own, v_own), mask_BTS, mask_BTU = attention_case(H, dtype, T=T, N=N, S=S)
    if kv_len is not None:
        mask_BTS = mask_BTS & (jnp.arange(mask_BTS.shape[2]) < kv_len)
    own = (k_own, v_own, mask_BTU, None)
    assert kernels.attend_fits(q_BTNH, k)
    assert_kernel_attention_equals_xla("jaxkv_attend", q_BTNH, k, v, mask_BTS, kv_len, own,
                                       softcap)
    loss = lambda f: lambda q: jnp.sum(jnp.sin(f(q, k, v, mask_BTS, 0.3, None, kv_len, own,  # noqa
                                                 softcap)[0]))
    grad = lambda f: jax.jit(jax.grad(loss(f)))(q_BTNH)  # noqa: E731 (one compile, not one a step)
    np.testing.assert_allclose(grad(cpu_ops.attention), grad(xla.attention), atol=1e-5)


@pytest.mark.parametrize("H,softcap,kv_len,T,N,S", [
    (64, None, None, 1, 6, 150), (32, 5.0, 100, 2, 8, 130), (16, None, None, 1, 16, 40),
    (20, None, None, 3, 4, 37), (16, 5.0, None, 70, 2, 300)],
    ids=["3_queries", "8_queries_softcap_kv_len", "8_queries_head_16", "6_queries_head_20",
         "2_tiles_2_blocks_softcap"])
@on_the_cpu
def test_attention_kernel_reads_an_int8_cache(H, softcap, kv_len, T, N, S):
    """Queries over an Int8KV cache go to the kernel's int8 entry (the scales multiply the
    scores and the weights; the own keys are quantized as the cache will hold them), equal to
    XLA's attention over the same int8 numbers; a query that sees no key gets 0 and -inf. A
    decode step's path (at most 8 queries per kv head, whole vectors of head size) and the
    general one (a prefill chunk's tiles and blocks)."""
    q_BTNH, (k, v, k_own, v_own), mask_BTS, mask_BTU = attention_case(H, jnp.float32, T=T, N=N,
                                                                      S=S)
    if kv_len is not None:
        mask_BTS = mask_BTS & (jnp.arange(S) < kv_len)
    own = (k_own, v_own, mask_BTU, None)
    assert_kernel_attention_equals_xla("jaxkv_attend_int8", q_BTNH, quantize_kv(k), quantize_kv(v),
                                       mask_BTS, kv_len, own, softcap)


def paged_case(H, dtype, T, N, P, M, key=0):
    """attention_case's queries, mask and own keys over a paged cache of M pages of P slots a
    row: pools [2, NB, P, H] of random keys and values (as dtype stores them: HalfKV for
    bfloat16, Int8KV for int8) with a page no row reads, the rows' tables out of order and
    sharing a page (row 1's second is row 0's first), each with a page of "none" (NB or more,
    row 0's between pages it reads) whose slots the mask hides."""
    q_BTNH, (_, _, k_own, v_own), mask_BTS, mask_BTU = attention_case(
        H, jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32, key, T, N, S=M * P)
    NB = 2 * M + 1
    table_BM = np.random.default_rng(key).permutation(NB)[:2 * M].reshape(2, M)
    table_BM[1, 1] = table_BM[0, 0]
    table_BM[0, 1], table_BM[1, M - 1] = NB, NB + 5
    mask_BTS = mask_BTS & ~np.repeat(table_BM >= NB, P, axis=1)[:, None]
    form = {jnp.float32: lambda x: x, jnp.bfloat16: lambda x: half_kv(x, jnp.bfloat16),
            jnp.int8: quantize_kv}[dtype]
    k, v = (PagedKV(form(jax.random.normal(key, (2, NB, P, H))), jnp.asarray(table_BM))
            for key in jax.random.split(jax.random.key(key + 9)))
    return q_BTNH, k, v, mask_BTS, (k_own, v_own, mask_BTU, None)


@pytest.mark.parametrize("H,dtype,kv_len,T,N,P,M", [
    (64, jnp.float32, None, 1, 6, 16, 5), (64, jnp.bfloat16, 70, 2, 8, 32, 4),
    (32, jnp.int8, None, 1, 16, 16, 6), (24, jnp.float32, None, 50, 6, 16, 19),
    (16, jnp.bfloat16, 250, 70, 2, 16, 18), (20, jnp.int8, 300, 40, 4, 128, 3)],
    ids=["decode_3_queries", "decode_4_queries_bfloat16_kv_len", "decode_8_queries_int8",
         "3_tiles_3_blocks", "2_tiles_bfloat16_kv_len", "2_tiles_int8_pages_of_128"])
@on_the_cpu
def test_attention_kernel_reads_a_paged_cache(H, dtype, kv_len, T, N, P, M):
    """A PagedKV cache of pages of 16 to 128 slots goes to the kernel as its pools and table
    (no gather), float32, bfloat16 (HalfKV) and int8 (Int8KV), equal to XLA's attention over the
    cache as its rows see it (arrays.logical): a decode step's path and the general one (tiles
    of tokens, blocks of 128 keys across pages), with shared, out-of-order and "none" pages and
    a kv_len bound; its derivative is XLA's. (Pages of 8 slots are gathered: test_cache.py.)"""
    q_BTNH, k, v, mask_BTS, own = paged_case(H, dtype, T, N, P, M)
    if kv_len is not None:
        mask_BTS = mask_BTS & (jnp.arange(M * P) < kv_len)
    target = "jaxkv_attend_int8" if dtype == jnp.int8 else "jaxkv_attend"
    assert_kernel_attention_equals_xla(target, q_BTNH, k, v, mask_BTS, kv_len, own, None)
    dq_BTNH = jax.random.normal(jax.random.key(7), q_BTNH.shape)

    def tangent(f, k, v):  # forward mode: XLA's loop over kv_len's blocks has no reverse mode
        attend = lambda q, k, v: f(q, k, v, mask_BTS, 0.3, None, kv_len, own, None)[0]  # noqa
        return jax.jit(lambda dq, k, v: jax.jvp(lambda q: attend(q, k, v), (q_BTNH,), (dq,))[1])(
            dq_BTNH, k, v)
    np.testing.assert_allclose(tangent(cpu_ops.attention, k, v),
                               tangent(xla.attention, logical(k), logical(v)), atol=1e-5)


@pytest.mark.parametrize("dtype,seen,H,paged", [
    (jnp.float32, "gap", 20, False), (jnp.bfloat16, "gap", 20, False),
    (jnp.float32, "own only", 20, False), (jnp.float32, "gap", 64, False),
    (jnp.bfloat16, "own only", 64, False), (jnp.float32, "gap", 64, True),
    (jnp.bfloat16, "gap", 20, True)])
def test_attention_kernel_splits_a_decode_steps_keys(dtype, seen, H, paged):
    """One row, one kv head, one token (a decode step: fewer tasks than threads) over 2,000
    cached keys, 1,900 filled: the keys are split into parts whose results are merged. Keys
    300-1,700 hidden (parts that see no key), or every cached key (only the last part's own key
    is seen). Head size 64 takes the decode path (keys across lanes), 20 the general one. Paged:
    the same keys in 125 pages of 16 slots in a shuffled pool, read through the row's table."""
    B, K, S, U = 1, 1, 2000, 1
    k = jax.random.split(jax.random.key(4), 5)
    q_BTNH = jax.random.normal(k[0], (B, 1, 3, H))
    kv = [jax.random.normal(k[i], shape).astype(dtype) for i, shape in
          ((1, (B, K, S, H)), (2, (B, K, S, H)), (3, (B, K, U, H)), (4, (B, K, U, H)))]
    s_S = jnp.arange(S)
    mask_S = ((s_S < 300) | (s_S >= 1700) if seen == "gap" else s_S < 0) & (s_S < 1900)
    own = (kv[2], kv[3], jnp.ones((B, 1, U), bool), None)
    cache = kv[:2]
    if paged:  # page table[0, m] holds slots [16 m, 16 m + 16)
        table_BM = jnp.asarray(np.random.default_rng(0).permutation(S // 16)[None], jnp.int32)
        pools = [jnp.zeros((K, S // 16, 16, H), dtype).at[:, table_BM[0]].set(
            x[0].reshape(K, S // 16, 16, H)) for x in kv[:2]]
        cache = [PagedKV(x, table_BM) for x in pools]
    run = lambda f, k, v: jax.jit(lambda q: f(q, k, v, mask_S[None, None], 0.3,  # noqa: E731
                                              None, 1900, own, None))(q_BTNH)
    (out, lse), (want, want_lse) = run(cpu_ops.attention, *cache), run(xla.attention, *kv[:2])
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-6, rtol=2e-5)
