"""layers: RoPE against the rotation it stands for, and made once per pass."""

import dataclasses
import re

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


def rope_factor_ops(params) -> list:
    """[(shape, "sine" | "cosine")] of every sine and cosine in the compiled HLO of a prefill
    of 2 rows x 16 tokens."""
    cache = jaxkv.init_cache(params, 2, 32)
    hlo = jax.jit(jaxkv.prefill).lower(params, cache, jnp.ones((2, 16), jnp.int32)).compile()
    return sorted(re.findall(r"= (\w+\[[\d,]*\])(?:\{[^}]*\})? (sine|cosine)\(", hlo.as_text()))


def test_a_pass_computes_cos_and_sin_once(llama):
    """Every layer reads one (cos, sin) pair: left to fuse, XLA:CPU recomputed both at every
    head of every layer (a 4 x 256-token prefill of SmolLM2: 8% of its time). So a pass's sines
    and cosines are the same with twice the layers (none made per layer), each [B, T, H/2] (a
    value per position and frequency, none per head), and at most two of each, one per half of
    a factor, (cos, cos) and (-sin, sin): XLA may make the halves apart (jax 0.12's XLA:CPU
    makes -sin and sin from a sine each, 0.10's from one)."""
    config = llama.config
    assert config.n_layers > 1
    ops = rope_factor_ops(llama)
    deeper = jaxkv.init_params(dataclasses.replace(config, n_layers=2 * config.n_layers),
                               jax.random.key(1))
    assert rope_factor_ops(deeper) == ops, (rope_factor_ops(deeper), ops)
    assert {kind for _, kind in ops} == {"sine", "cosine"}
    assert all(shape == f"f32[2,16,{config.head_dim // 2}]" for shape, _ in ops), ops
    assert all(sum(k == kind for _, k in ops) <= 2 for kind in ("sine", "cosine")), ops


def test_gated_mlp_reads_gate_and_up_rows_in_blocks():
    """A gated w_in fuses gate and up in blocks of 128 units where d_ff allows (XLA:TPU reads
    those as stored) and unit by unit elsewhere: either way mlp is act(x gate^T) * (x up^T)
    down^T, and the rows of a model-axis share of whole blocks are the join of the same share of
    gate and of up (how a sharded load builds its share)."""
    from jaxkv.core.layers import mlp
    from jaxkv.core.params import Block, gate_up_block, gate_up_rows

    rng = np.random.default_rng(0)
    for F in (96, 512):
        c = jaxkv.Config.llama(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                               d_ff=F, max_seq_len=16)
        gate, up = (rng.standard_normal((F, 32)).astype(np.float32) for _ in range(2))
        down = rng.standard_normal((32, F)).astype(np.float32)
        x_BTD = rng.standard_normal((2, 3, 32)).astype(np.float32)
        b = Block(attn_norm=None, wqkv=None, wo=None, mlp_norm=None,
                  w_in=jnp.asarray(gate_up_rows(gate, up)), w_out=jnp.asarray(down))
        silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
        want = (silu(x_BTD @ gate.T) * (x_BTD @ up.T)) @ down.T
        np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x_BTD), b, c)), want, rtol=1e-4,
                                   atol=1e-4)
        t = gate_up_block(F)
        assert t == (128 if F == 512 else 1)
        half = F // 2  # two shares of whole blocks
        np.testing.assert_array_equal(gate_up_rows(gate, up)[:F],
                                      gate_up_rows(gate[:half], up[:half]))
