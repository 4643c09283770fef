"""layers: RoPE against the rotation it stands for, and made once per pass."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.core.layers import rope, rope_frequencies, rope_turns


def test_rope_turns_each_pair_by_its_angle():
    """Pair (i, i + H/2) of every head turned by pos * inv_freq[i], as a complex product."""
    B, T, N, H = 2, 5, 3, 8
    x_BTNH = np.random.default_rng(0).standard_normal((B, T, N, H)).astype(np.float32)
    pos_BT = np.array([[0, 1, 2, 3, 4], [7, 9, 30, 31, 100]], np.int32)
    inv_freq_h = rope_frequencies(H, 10000.0)
    got = rope(jnp.asarray(x_BTNH), rope_turns(jnp.asarray(pos_BT), inv_freq_h))
    angle_BT1h = (pos_BT[..., None] * inv_freq_h)[:, :, None, :]
    turned = (x_BTNH[..., : H // 2] + 1j * x_BTNH[..., H // 2:]) * np.exp(1j * angle_BT1h)
    want = np.concatenate([turned.real, turned.imag], -1)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_a_pass_computes_cos_and_sin_once(llama):
    """Every layer reads one (cos, sin) pair: left to fuse, XLA:CPU recomputed both at every
    head of every layer (a 4 x 256-token prefill of SmolLM2: 8% of its time)."""
    cache = jaxkv.init_cache(llama, 2, 32)
    hlo = jax.jit(jaxkv.prefill).lower(llama, cache, jnp.ones((2, 16), jnp.int32)).compile()
    text = hlo.as_text()
    assert llama.config.n_layers > 1
    assert text.count(" cosine(") == 1 and text.count(" sine(") == 1
