"""Parameter pytrees: frozen dataclasses that carry their config as a static field."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.config import Config


@struct.dataclass
class Norm:
    scale: jax.Array  # [..., D]
    bias: jax.Array | None = None  # [..., D]; LayerNorm only


@struct.dataclass
class Blocks:
    """Self-attention + MLP blocks; every leaf is stacked on a leading L axis."""

    attn_norm: Norm
    wq: jax.Array  # [L, D, N, H]
    wk: jax.Array  # [L, D, K, H]
    wv: jax.Array  # [L, D, K, H]
    wo: jax.Array  # [L, N, H, D]
    mlp_norm: Norm
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]
    w_gate: jax.Array | None = None  # [L, D, F]; gated MLPs (SwiGLU, gated-GELU) only
    bq: jax.Array | None = None  # [L, N, H]
    bk: jax.Array | None = None  # [L, K, H]
    bv: jax.Array | None = None  # [L, K, H]
    bo: jax.Array | None = None  # [L, D]
    b_up: jax.Array | None = None  # [L, F]
    b_gate: jax.Array | None = None  # [L, F]; gated MLPs with biases only
    b_down: jax.Array | None = None  # [L, D]


@struct.dataclass
class Cross:
    """Decoder cross-attention over the encoder states; stacked on L like Blocks."""

    norm: Norm
    wq: jax.Array  # [L, D, N, H]
    wk: jax.Array  # [L, D, K, H]; applied once per input, when the cache is filled
    wv: jax.Array  # [L, D, K, H]
    wo: jax.Array  # [L, N, H, D]
    bq: jax.Array | None = None  # [L, N, H]
    bk: jax.Array | None = None  # [L, K, H]
    bv: jax.Array | None = None  # [L, K, H]
    bo: jax.Array | None = None  # [L, D]


@struct.dataclass
class Encoder:
    blocks: Blocks  # stacked on the encoder's own L
    final_norm: Norm
    rel_bias: jax.Array | None = None  # [R, N]; T5's bidirectional relative position bias
    pos_embed: jax.Array | None = None  # [M, D]; audio encoders' position table
    conv1_w: jax.Array | None = None  # [3, n_mels, D]; audio encoders only
    conv1_b: jax.Array | None = None  # [D]
    conv2_w: jax.Array | None = None  # [3, D, D]; stride 2
    conv2_b: jax.Array | None = None  # [D]


@struct.dataclass
class Params:
    config: Config = struct.field(pytree_node=False)
    embed: jax.Array  # [V, D]; T5 shares it with the encoder
    blocks: Blocks
    final_norm: Norm
    pos_embed: jax.Array | None = None  # [P, D]; learned positions only
    rel_bias: jax.Array | None = None  # [R, N]; T5's causal relative position bias
    lm_head: jax.Array | None = None  # [D, V]; untied head only
    cross: Cross | None = None  # encoder-decoder models only
    encoder: Encoder | None = None  # encoder-decoder models only

    @property
    def dtype(self):
        return self.embed.dtype


def sinusoids(length: int, dim: int, max_timescale: float = 10000.0):
    """Whisper's encoder position table [length, dim]: sines then cosines."""
    log_step = np.log(max_timescale) / (dim // 2 - 1)
    inv_timescales = np.exp(-log_step * np.arange(dim // 2))
    angle = np.arange(length)[:, None] * inv_timescales[None, :]
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=1).astype(np.float32)


class _Init:
    """Random leaves of one dtype: normal(0, 0.02) weights, unit norm scales, zero biases."""

    def __init__(self, config: Config, key, dtype):
        self.c, self.key, self.dtype, self.count = config, key, dtype, 0

    def normal(self, *shape):
        self.count += 1
        key = jax.random.fold_in(self.key, self.count)
        return (0.02 * jax.random.normal(key, shape)).astype(self.dtype)

    def zeros(self, *shape, when=True):
        return jnp.zeros(shape, self.dtype) if when else None

    def norm(self, *lead):
        D = self.c.d_model
        return Norm(jnp.ones((*lead, D), self.dtype),
                    self.zeros(*lead, D, when=self.c.norm == "layernorm"))

    def attention(self, L, bias):
        c = self.c
        D, N, K, H = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        return dict(wq=self.normal(L, D, N, H), wk=self.normal(L, D, K, H),
                    wv=self.normal(L, D, K, H), wo=self.normal(L, N, H, D),
                    bq=self.zeros(L, N, H, when=bias), bk=self.zeros(L, K, H, when=bias),
                    bv=self.zeros(L, K, H, when=bias), bo=self.zeros(L, D, when=bias))

    def blocks(self, L):
        c = self.c
        D, F = c.d_model, c.d_ff
        return Blocks(
            attn_norm=self.norm(L), **self.attention(L, c.attn_bias), mlp_norm=self.norm(L),
            w_up=self.normal(L, D, F), w_down=self.normal(L, F, D),
            w_gate=self.normal(L, D, F) if c.gated_mlp else None,
            b_up=self.zeros(L, F, when=c.mlp_bias),
            b_gate=self.zeros(L, F, when=c.mlp_bias and c.gated_mlp),
            b_down=self.zeros(L, D, when=c.mlp_bias))

    def rel_bias(self):
        return self.normal(self.c.relative_buckets, self.c.n_heads) \
            if self.c.position == "relative" else None

    def encoder(self):
        c, e = self.c, self.c.encoder
        audio = e.input == "audio"
        return Encoder(
            blocks=self.blocks(e.n_layers), final_norm=self.norm(),
            rel_bias=None if audio else self.rel_bias(),
            pos_embed=jnp.asarray(sinusoids(e.max_len, c.d_model), self.dtype) if audio else None,
            conv1_w=self.normal(3, e.n_mels, c.d_model) if audio else None,
            conv1_b=self.zeros(c.d_model, when=audio),
            conv2_w=self.normal(3, c.d_model, c.d_model) if audio else None,
            conv2_b=self.zeros(c.d_model, when=audio))


def init_params(config: Config, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters (normal(0, 0.02) weights, unit norms, zero biases)."""
    c, init = config, _Init(config, key, dtype)
    L, D, V = c.n_layers, c.d_model, c.vocab_size
    cross = None
    if c.is_encoder_decoder:
        cross = Cross(norm=init.norm(L), **init.attention(L, c.attn_bias))
    return Params(
        config=c, embed=init.normal(V, D), blocks=init.blocks(L), final_norm=init.norm(),
        pos_embed=init.normal(c.max_seq_len, D) if c.position == "learned" else None,
        rel_bias=init.rel_bias(), lm_head=None if c.tie_embeddings else init.normal(D, V),
        cross=cross, encoder=init.encoder() if c.is_encoder_decoder else None)


def cast(params, dtype):
    """The same parameters with every floating leaf cast to dtype (e.g. jnp.bfloat16)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)
