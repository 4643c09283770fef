"""The Pallas backend (JAXKV_OPS=pallas) in Pallas's interpret mode on the CPU, against the XLA
reference: the kernel is taken where it fits, its parts are exact, and whole models decode as
the reference does (greedy tokens equal, logits within 1e-5 in float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.ops import pallas, xla
from jaxkv.ops.arrays import PagedKV, logical, quantize_kv
from jaxkv.ops.pallas import decode
from tests.conftest import CONFIGS, TINY, random_tokens

# A GQA model with sliding-window layers and Gemma 3's parts (q/k norms, a local RoPE base,
# post-norms, scaled embeddings): its global layer takes JAX's kernel, its rings jaxkv's.
GEMMA3_LIKE = jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=96, sliding_window=16,
                                 window_layers=(0, 1), qk_norm=True, local_rope_theta=10000.0,
                                 post_norms=True, scale_embeddings=True, activation="gelu_tanh",
                                 rope_theta=1e6, **TINY)

# Gated units in blocks of 128 (gate_up_block), a vocabulary of whole blocks: every product of a
# decode step takes a fused kernel on a GPU.
FUSED = jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=128, **{**TINY, "vocab_size": 128})

# Soft-capped scores (Gemma 2's): every layer takes jaxkv's kernel.
CAPPED = jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=96, attn_softcap=2.0, **TINY)
MODELS = {"gemma3_like": GEMMA3_LIKE, "capped": CAPPED, "fused": FUSED, **CONFIGS}


@pytest.fixture(params=["gpu", "tpu"])
def pallas_backend(request, monkeypatch):
    """JAXKV_OPS=pallas, its GPU or TPU kernels interpreted on a CPU (on a GPU or TPU: its own,
    compiled). Yields the kernels' platform."""
    monkeypatch.setenv("JAXKV_OPS", "pallas")
    if jax.default_backend() == "cpu":
        monkeypatch.setenv("JAXKV_PALLAS_INTERPRET", request.param)
    jax.clear_caches()
    yield pallas.target()[0]
    monkeypatch.undo()
    jax.clear_caches()


def on(target: str) -> bool:
    """Whether the platform compiles the target's kernels (else they are interpreted)."""
    return jax.default_backend() == target or (target == "gpu" and jax.default_backend() == "cuda")


def kernel_calls(params, capacity, dtype=None, block_size=None) -> int:
    """How many of a decode step's attentions call jaxkv's decode kernel."""
    cache = jaxkv.init_cache(params, 2, capacity, dtype, block_size=block_size)
    jaxpr = str(jax.make_jaxpr(jaxkv.decode_step)(params, cache, jnp.array([1, 2]),
                                                  jnp.array([3, 9])))
    ours = jaxpr.count("name=jaxkv_decode_attention\n")
    assert ("name=jaxkv_decode" in jaxpr) == (ours > 0)
    return ours


def test_a_decode_step_takes_the_kernel_where_it_fits(pallas_backend):
    """Every layer's decode step over whole blocks of 16 slots (or pages of 16) takes jaxkv's
    kernel, on both forms: float, bfloat16, int8, rings, soft-capped, paged."""
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(0))
    assert kernel_calls(params, 32) == 3  # one per layer
    assert kernel_calls(params, 32, jnp.bfloat16) == 3
    assert kernel_calls(params, 32, jnp.int8) == 3
    assert kernel_calls(params, 20) == 0  # not whole blocks of 16 slots
    assert kernel_calls(jaxkv.init_params(GEMMA3_LIKE, jax.random.key(0)), 32) == 3
    assert kernel_calls(jaxkv.init_params(CAPPED, jax.random.key(0)), 32) == 3
    assert kernel_calls(params, 64, block_size=16) == 3  # pages
    assert kernel_calls(params, 64, block_size=8) == 0  # pages under 16 slots


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_jaxkvs_kernel_equals_the_reference(target, int8, softcap):
    """jaxkv's kernel over masked slots below a per-row bound, float or int8 caches, with and
    without a soft-cap: rows that read nothing, part of a block and several parts."""
    B, N, K, S, H = 3, 6, 2, 64, 16
    keys = jax.random.split(jax.random.key(1), 4)
    q_BTNH = jax.random.normal(keys[0], (B, 1, N, H))
    k_BKSH, v_BKSH = (jax.random.normal(k, (B, K, S, H)) for k in keys[1:3])
    if int8:
        k_BKSH, v_BKSH = quantize_kv(k_BKSH), quantize_kv(v_BKSH)
    bound_B = jnp.array([0, 7, 50])
    mask_BS = jax.random.bernoulli(keys[3], 0.7, (B, S))
    out_BKGH, lse_BKG = decode.attention(q_BTNH.reshape(B, K, N // K, H), k_BKSH, v_BKSH, 0.25,
                                         bound_B, mask_BS, softcap, target=target, block_k=16,
                                         k_splits=2, interpret=not on(target))
    seen_BTS = (mask_BS & (jnp.arange(S) < bound_B[:, None]))[:, None]
    want, want_lse = xla.attention(q_BTNH, k_BKSH, v_BKSH, seen_BTS, 0.25, softcap=softcap)
    np.testing.assert_allclose(out_BKGH.reshape(B, 1, N, H), want, atol=1e-6, rtol=1e-6)
    lse_BTN = lse_BKG.reshape(B, 1, N)
    np.testing.assert_allclose(lse_BTN[1:], want_lse[1:], atol=1e-6, rtol=1e-6)
    assert np.isneginf(lse_BTN[0]).all() and (out_BKGH[0] == 0).all()


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("int8", [False, True])
def test_jaxkvs_kernel_reads_pages_as_the_reference(target, int8):
    """Keys and values in pools of pages read through block tables (a row's pages out of order,
    a page two rows share, pages that are none past a row's bound), masked below per-row
    bounds: as the reference reads the same slots laid out in rows (arrays.logical)."""
    B, N, K, H, P, NB = 3, 6, 2, 16, 16, 9
    keys = jax.random.split(jax.random.key(5), 4)
    q_BTNH = jax.random.normal(keys[0], (B, 1, N, H))
    k_pool, v_pool = (jax.random.normal(k, (K, NB, P, H)) for k in keys[1:3])
    if int8:
        k_pool, v_pool = quantize_kv(k_pool), quantize_kv(v_pool)
    table_BM = jnp.array([[3, 0, 7, NB], [3, 8, 1, 2], [6, 4, NB, NB]])
    bound_B = jnp.array([40, 64, 20])
    S = table_BM.shape[1] * P
    mask_BS = jax.random.bernoulli(keys[3], 0.7, (B, S))
    out_BKGH, lse_BKG = decode.attention(q_BTNH.reshape(B, K, N // K, H), k_pool, v_pool, 0.25,
                                         bound_B, mask_BS, None, target=target, block_k=P,
                                         k_splits=2, interpret=not on(target), table_BM=table_BM)
    seen_BTS = (mask_BS & (jnp.arange(S) < bound_B[:, None]))[:, None]
    k_BKSH, v_BKSH = (logical(PagedKV(pool, table_BM)) for pool in (k_pool, v_pool))
    want, want_lse = xla.attention(q_BTNH, k_BKSH, v_BKSH, seen_BTS, 0.25)
    np.testing.assert_allclose(out_BKGH.reshape(B, 1, N, H), want, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(lse_BKG.reshape(B, 1, N), want_lse, atol=1e-6, rtol=1e-6)


def test_a_paged_batch_decodes_as_the_reference(monkeypatch):
    """Under the GPU kernels, interpreted, with sliding-window rings beside the pages (16
    slots): generate_many's paged cache and prefix cache give the reference's tokens and
    log-probabilities; a decode step over an int8 paged cache gives its logits."""
    params = jaxkv.init_params(GEMMA3_LIKE, jax.random.key(2))
    prompts = [random_tokens(i, (n,)).tolist() for i, n in enumerate([20, 5, 33, 9])]
    prompts += [prompts[2][:17] + [3, 1]]  # a full page the prefix cache shares

    def run():
        answers = jaxkv.generate_many(params, prompts, 12, batch_size=2, logprobs=1)
        cache = jaxkv.init_cache(params, 2, 48, jnp.int8, block_size=16)
        tokens_BT = np.array([prompts[0][:8], prompts[1] + [0] * 3])
        _, cache = jaxkv.prefill(params, cache, tokens_BT, [8, 5])
        step = jax.jit(jaxkv.decode_step)(params, cache, jnp.array([7, 8]), jnp.array([8, 5]))
        return answers, step[0]
    monkeypatch.setenv("JAXKV_OPS", "pallas")
    if jax.default_backend() == "cpu":
        monkeypatch.setenv("JAXKV_PALLAS_INTERPRET", "gpu")
    jax.clear_caches()
    ours, step = run()
    monkeypatch.setenv("JAXKV_OPS", "xla")
    jax.clear_caches()
    theirs, want = run()
    assert [a.ids for a in ours] == [a.ids for a in theirs]
    np.testing.assert_allclose(np.concatenate([a.logprobs for a in ours]),
                               np.concatenate([a.logprobs for a in theirs]), atol=1e-5)
    np.testing.assert_allclose(step, want, atol=1e-5)


@pytest.mark.parametrize("pallas_backend, name, kv_dtype", [
    ("gpu", "llama_gqa", jnp.float32), ("gpu", "gemma3_like", jnp.int8), ("gpu", "fused", None),
    ("gpu", "gpt2", None),
    ("gpu", "capped", jnp.float32), ("tpu", "gemma3_like", jnp.int8)],
    indirect=["pallas_backend"])
def test_models_decode_as_the_reference(pallas_backend, monkeypatch, name, kv_dtype):
    config = MODELS[name]
    params = jaxkv.init_params(config, jax.random.key(2))
    prompts = [random_tokens(3, (20,)).tolist(), random_tokens(4, (5,)).tolist()]
    ours = jaxkv.generate(params, prompts, 12, kv_dtype=kv_dtype)
    cache = jaxkv.init_cache(params, 2, 48, kv_dtype)
    tokens_BT = np.array([prompts[0][:8], prompts[1] + [0] * 3])
    _, cache = jaxkv.prefill(params, cache, tokens_BT, [8, 5])
    step = jax.jit(jaxkv.decode_step)(params, cache, jnp.array([7, 8]), jnp.array([8, 5]))[0]
    monkeypatch.setenv("JAXKV_OPS", "xla")
    jax.clear_caches()
    theirs = jaxkv.generate(params, prompts, 12, kv_dtype=kv_dtype)
    want = jax.jit(jaxkv.decode_step)(params, cache, jnp.array([7, 8]), jnp.array([8, 5]))[0]
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_allclose(step, want, atol=1e-5 if kv_dtype != jnp.bfloat16 else 1e-2)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a check of the CPU's refusal")
def test_a_cpu_without_interpret_mode_is_told_so(monkeypatch):
    monkeypatch.setenv("JAXKV_OPS", "pallas")
    monkeypatch.delenv("JAXKV_PALLAS_INTERPRET", raising=False)
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(0))
    with pytest.raises(ValueError, match="set JAXKV_PALLAS_INTERPRET=1"):
        kernel_calls(params, 32)


@pytest.mark.parametrize("form", ["float", "int8", "ring", "paged", "capped"])
def test_a_rows_attention_is_bitwise_the_same_alone_and_in_a_batch(pallas_backend, form):
    """The kernels' reduction order depends neither on the batch size nor on the other rows
    (fixed splits and blocks; a row reads only its own): row 3 of a batch of 8 of mixed
    lengths gets bitwise the output and log-sum-exp it gets alone."""
    B, K, G, S, H = 8, 2, 2, 64, 16
    keys = jax.random.split(jax.random.key(7), 4)
    q_BTNH = jax.random.normal(keys[0], (B, 1, K * G, H))
    k_BKSH, v_BKSH = (jax.random.normal(key, (B, K, S, H)) for key in keys[1:3])
    lengths_B = jax.random.randint(keys[3], (B,), 1, S)
    mask_BTS = (jnp.arange(S)[None, None] < lengths_B[:, None, None]) & (
        jnp.arange(S) % 3 != 1 if form == "ring" else True)
    if form == "int8":
        k_BKSH, v_BKSH = quantize_kv(k_BKSH), quantize_kv(v_BKSH)

    def attend(rows):
        k, v = jax.tree.map(lambda x: x[rows], (k_BKSH, v_BKSH))
        if form == "paged":  # row r's page m at r M + m of a pool
            R, M = len(rows), S // 16
            pool = lambda x: jnp.moveaxis(x.reshape(R, K, M, 16, H), 1, 0).reshape(  # noqa
                K, R * M, 16, H)
            table_RM = jnp.arange(R * M, dtype=jnp.int32).reshape(R, M)
            k, v = PagedKV(pool(k), table_RM), PagedKV(pool(v), table_RM)
        return jax.jit(lambda q, k, v, m, n: pallas.attention(
            q, k, v, m, 0.25, kv_len=jnp.max(n), lengths=None if form == "ring" else n,
            softcap=2.0 if form == "capped" else None))(
            q_BTNH[rows], k, v, mask_BTS[rows], lengths_B[rows])

    batch = attend(np.arange(B))
    alone = attend(np.array([3]))
    for x_batch, x_alone in zip(batch, alone):
        np.testing.assert_array_equal(np.asarray(x_batch)[3], np.asarray(x_alone)[0])


@pytest.mark.parametrize("form", ["dense", "paged", "capped", "ring"])
def test_bfloat16_caches_take_the_mosaic_gpu_form_where_jax_has_it(form):
    """A bfloat16 cache with heads of 64 and blocks of 64 slots takes the GPU kernel's Mosaic GPU
    form on jax 0.11 and newer (Triton's on jax 0.10): rows that read part of a block and
    several parts, dense or paged (pages out of order), soft-capped or not, masked slots (a
    ring's), and the step's own key (a row that does not read it), as the XLA reference reads
    them. The kernel rounds the weights to bfloat16 for the values' product (as the Triton form
    does): within 3e-3."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    B, K, G, H, S = 2, 2, 4, 64, 256
    keys = jax.random.split(jax.random.key(11), 6)
    q_BTNH = jax.random.normal(keys[0], (B, 1, K * G, H), jnp.bfloat16)
    k_BKSH, v_BKSH = (jax.random.normal(k, (B, K, S, H), jnp.bfloat16) for k in keys[1:3])
    own_k, own_v = (jax.random.normal(k, (B, K, H), jnp.bfloat16) for k in keys[3:5])
    own_seen_B, bound_B, softcap = jnp.array([True, False]), jnp.array([100, 256]), None
    k, v, table_BM = k_BKSH, v_BKSH, None
    if form == "paged":  # row r's page m at perm[r M + m] of a pool
        M = S // 64
        perm = jax.random.permutation(keys[5], B * M)
        pool = lambda x: jnp.zeros((K, B * M, 64, H), x.dtype).at[:, perm].set(  # noqa: E731
            jnp.moveaxis(x.reshape(B, K, M, 64, H), 1, 0).reshape(K, B * M, 64, H))
        k, v, table_BM = pool(k_BKSH), pool(v_BKSH), perm.reshape(B, M).astype(jnp.int32)
    if form == "capped":
        softcap = 2.0
    mask_BS = jax.random.bernoulli(keys[5], 0.7, (B, S)) if form == "ring" else None

    def attend(q, k, v, bound, own_k, own_v, seen, table):
        return decode.attention(q.reshape(B, K, G, H), k, v, 0.125, bound, mask_BS, softcap,
                                target="gpu", block_k=64, k_splits=2, interpret=not on("gpu"),
                                table_BM=table, own=(own_k, own_v, seen))

    args = (q_BTNH, k, v, bound_B, own_k, own_v, own_seen_B, table_BM)
    jaxpr = str(jax.make_jaxpr(attend)(*args))
    assert ("jaxkv_decode_attention_mosaic" in jaxpr) == hasattr(plgpu, "InterpretGPUParams")
    out_BKGH, lse_BKG = attend(*args)
    seen_BTS = ((jnp.arange(S) < bound_B[:, None]) & (True if mask_BS is None else mask_BS))[
        :, None]
    own = (own_k[:, :, None], own_v[:, :, None], own_seen_B[:, None, None], None)
    want, want_lse = xla.attention(q_BTNH, k_BKSH, v_BKSH, seen_BTS, 0.125, own=own,
                                   softcap=softcap)
    np.testing.assert_allclose(out_BKGH.reshape(B, 1, K * G, H), want, atol=3e-3, rtol=0)
    np.testing.assert_allclose(lse_BKG.reshape(B, 1, K * G), want_lse, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_products_equal_the_reference(rows, dtype):
    """A decode step's product in one kernel (jaxkv.ops.pallas.products) with a norm before it
    (RMSNorm, LayerNorm with a bias), a bias, a gated activation and a residual after, as the
    XLA reference computes them one by one: within float32's rounding, or 2 bfloat16 steps of
    the largest output (the gated activation is computed in float32 from rounded operands); a
    row's outputs bitwise the same alone as in the batch. Triton's form on jax 0.10, Mosaic
    GPU's (16-bit weights) on 0.11 and newer."""
    from jaxkv.ops.pallas import mosaic_gpu, products

    I, O = 256, 256
    keys = jax.random.split(jax.random.key(5), 6)
    x, w, b, scale, shift = (jax.random.normal(k, shape).astype(dtype) for k, shape in zip(
        keys, [(rows, I), (O, I), (O,), (I,), (I,)]))
    w = w / 16
    residual = jax.random.normal(keys[5], (rows, O)).astype(dtype)
    norms = [None, (1 + scale / 4, None, "rmsnorm", 1e-6), (scale, shift, "layernorm", 1e-5)]
    if not products.takes(x, w, None):  # Mosaic GPU's form takes 16-bit weights only
        assert mosaic_gpu.AVAILABLE and dtype == jnp.float32
        return
    for norm in norms:
        for gated in (None, ("silu", 64), ("gelu_tanh", 128)):
            r = None if gated is None else residual[:, :O // 2]
            got = products.product(x, w, b, dtype=dtype, norm=norm, gated=gated,
                                   residual_RO=r, interpret=True)
            y = xla.matmul((x if norm is None else xla.norm(x, *norm))[None], w, b)[0]
            y = y if gated is None else xla.gated(y, *gated)
            want = np.asarray((y if r is None else r + y).astype(jnp.float32))
            tolerance = 1e-6 if dtype == jnp.float32 else 2 ** -6
            np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=0,
                                       atol=tolerance * np.abs(want).max())
            alone = products.product(x[-1:], w, b, dtype=dtype, norm=norm, gated=gated,
                                     residual_RO=None if r is None else r[-1:], interpret=True)
            np.testing.assert_array_equal(np.asarray(alone), np.asarray(got)[-1:])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_gpu_decode_steps_layer_is_seven_kernels(monkeypatch, dtype):
    """On a GPU a decode step's layer is its four products with their norms, activation and
    residuals taken in, one XLA kernel making the queries and the step's own key and value, the
    decode kernel and its merge, which stores that key and value in the cache (no write of
    XLA's, no scatter) and writes the output in the model's dtype; the final norm goes into the
    head's product (on jax 0.11 and newer, whose Triton form is deprecated, the products take
    Mosaic GPU's form for 16-bit weights, XLA's otherwise). The step's logits and cache equal
    the XLA reference's (float32: 1e-5; bfloat16: 2e-2, the products summing in another
    order)."""
    from jaxkv.ops.pallas import mosaic_gpu

    monkeypatch.setenv("JAXKV_OPS", "pallas")
    monkeypatch.setenv("JAXKV_PALLAS_INTERPRET", "1")
    jax.clear_caches()
    params = jaxkv.cast(jaxkv.init_params(FUSED, jax.random.key(3)), dtype)
    cache = jaxkv.init_cache(params, 2, 32)
    _, cache = jaxkv.prefill(params, cache, random_tokens(6, (2, 9)), [9, 4])
    args = (params, cache, jnp.array([5, 6]), jnp.array([9, 4]))
    jaxpr = str(jax.make_jaxpr(jaxkv.decode_step)(*args))
    L = FUSED.n_layers
    fused = not mosaic_gpu.AVAILABLE or dtype == jnp.bfloat16
    assert jaxpr.count("name=jaxkv_fused_product") == (4 * L + 1 if fused else 0)
    assert jaxpr.count("name=jaxkv_decode_merge\n") == L
    assert "scatter" not in jaxpr and "dynamic_update_slice" not in jaxpr
    ours = jax.jit(jaxkv.decode_step)(*args)
    monkeypatch.setenv("JAXKV_OPS", "xla")
    jax.clear_caches()
    want = jax.jit(jaxkv.decode_step)(*args)
    jax.clear_caches()  # (traces made for the backends chosen above)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   atol=tolerance)
