"""The Pallas backend (JAXKV_OPS=pallas) in Pallas's interpret mode on the CPU, against the XLA
reference: the kernel is taken where it fits, its parts are exact, and whole models decode as
the reference does (greedy tokens equal, logits within 1e-5 in float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.ops import pallas, xla
from tests.conftest import CONFIGS, TINY, random_tokens

# A GQA model with sliding-window layers and Gemma 3's parts (q/k norms, a local RoPE base,
# post-norms, scaled embeddings): its global layers take the kernel, its rings XLA's attention.
GEMMA3_LIKE = jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=96, sliding_window=16,
                                 window_layers=(0, 1), qk_norm=True, local_rope_theta=10000.0,
                                 post_norms=True, scale_embeddings=True, activation="gelu_tanh",
                                 rope_theta=1e6, **TINY)


@pytest.fixture
def pallas_backend(monkeypatch):
    """JAXKV_OPS=pallas, its kernels interpreted on a CPU (compiled on a GPU)."""
    monkeypatch.setenv("JAXKV_OPS", "pallas")
    if jax.default_backend() == "cpu":
        monkeypatch.setenv("JAXKV_PALLAS_INTERPRET", "1")
    jax.clear_caches()
    yield
    monkeypatch.undo()
    jax.clear_caches()


def kernel_calls(params, capacity, dtype=None) -> int:
    """How many of a decode step's attentions call JAX's decode kernel (jitted as `gqa`, its
    Pallas kernel inside)."""
    cache = jaxkv.init_cache(params, 2, capacity, dtype)
    jaxpr = str(jax.make_jaxpr(jaxkv.decode_step)(params, cache, jnp.array([1, 2]),
                                                  jnp.array([3, 9])))
    assert ("pallas_call" in jaxpr) == ("jit[name=gqa" in jaxpr)
    return jaxpr.count("jit[name=gqa")


def test_a_decode_step_takes_the_kernel_where_it_fits(pallas_backend):
    params = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(0))
    assert kernel_calls(params, 32) == 3  # one per layer
    assert kernel_calls(params, 32, jnp.bfloat16) == 3
    assert kernel_calls(params, 32, jnp.int8) == 0  # no int8 kernel yet
    assert kernel_calls(params, 20) == 0  # not whole blocks of 16 slots
    window = jaxkv.init_params(GEMMA3_LIKE, jax.random.key(0))
    assert kernel_calls(window, 32) == 1  # layer 2: the global one


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_the_cache_part_equals_the_reference(pallas_backend, dtype, tol):
    """One query per row over slots [0, lengths): rows that read 0, a part of a block, and
    several split parts; a row that reads none gets output 0 and lse -inf."""
    B, N, K, S, H = 3, 6, 2, 64, 16
    keys = jax.random.split(jax.random.key(1), 3)
    q_BTNH = jax.random.normal(keys[0], (B, 1, N, H))
    k_BKSH, v_BKSH = (jax.random.normal(k, (B, K, S, H)).astype(dtype) for k in keys[1:])
    lengths_B = jnp.array([0, 7, 50])
    mask_BTS = (jnp.arange(S) < lengths_B[:, None])[:, None]
    out, lse = pallas._decode_cache(q_BTNH.astype(dtype), k_BKSH, v_BKSH, 0.25, lengths_B, 2, 16)
    want, want_lse = xla.attention(q_BTNH.astype(dtype), k_BKSH, v_BKSH, mask_BTS, 0.25)
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse[1:], want_lse[1:], atol=tol, rtol=tol)
    assert np.isneginf(lse[0]).all() and (out[0] == 0).all()


@pytest.mark.parametrize("name, kv_dtype", [("llama_gqa", jnp.float32),
                                            ("llama_gqa", jnp.bfloat16), ("llama_mqa", jnp.int8),
                                            ("gemma3_like", jnp.float32)])
def test_models_decode_as_the_reference(pallas_backend, monkeypatch, name, kv_dtype):
    config = GEMMA3_LIKE if name == "gemma3_like" else CONFIGS[name]
    params = jaxkv.init_params(config, jax.random.key(2))
    prompts = [random_tokens(3, (20,)).tolist(), random_tokens(4, (5,)).tolist()]
    ours = jaxkv.generate(params, prompts, 24, kv_dtype=kv_dtype)
    cache = jaxkv.init_cache(params, 2, 48, kv_dtype)
    tokens_BT = np.array([prompts[0][:8], prompts[1] + [0] * 3])
    _, cache = jaxkv.prefill(params, cache, tokens_BT, [8, 5])
    step = jax.jit(jaxkv.decode_step)(params, cache, jnp.array([7, 8]), jnp.array([8, 5]))[0]
    monkeypatch.setenv("JAXKV_OPS", "xla")
    jax.clear_caches()
    theirs = jaxkv.generate(params, prompts, 24, kv_dtype=kv_dtype)
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
