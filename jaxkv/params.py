"""Parameter pytrees: frozen dataclasses that carry their config as a static field."""

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.config import Config


@struct.dataclass
class Norm:
    scale: jax.Array  # [..., D]
    bias: jax.Array | None = None  # [..., D]; LayerNorm only


@struct.dataclass
class Blocks:
    """All transformer blocks; every leaf is stacked on a leading L axis."""

    attn_norm: Norm
    wq: jax.Array  # [L, D, N, H]
    wk: jax.Array  # [L, D, K, H]
    wv: jax.Array  # [L, D, K, H]
    wo: jax.Array  # [L, N, H, D]
    mlp_norm: Norm
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]
    w_gate: jax.Array | None = None  # [L, D, F]; gated MLPs (SwiGLU) only
    bq: jax.Array | None = None  # [L, N, H]
    bk: jax.Array | None = None  # [L, K, H]
    bv: jax.Array | None = None  # [L, K, H]
    bo: jax.Array | None = None  # [L, D]
    b_up: jax.Array | None = None  # [L, F]
    b_gate: jax.Array | None = None  # [L, F]; gated MLPs with biases only
    b_down: jax.Array | None = None  # [L, D]


@struct.dataclass
class Params:
    config: Config = struct.field(pytree_node=False)
    embed: jax.Array  # [V, D]
    blocks: Blocks
    final_norm: Norm
    pos_embed: jax.Array | None = None  # [P, D]; learned positions only
    lm_head: jax.Array | None = None  # [D, V]; untied head only

    @property
    def dtype(self):
        return self.embed.dtype


def init_params(config: Config, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters (normal(0, 0.02) weights, unit norms, zero biases)."""
    c = config
    L, D, N, K, H, F, V = (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff,
                           c.vocab_size)
    keys = iter(jax.random.split(key, 16))

    def normal(*shape):
        return (0.02 * jax.random.normal(next(keys), shape)).astype(dtype)

    def zeros(*shape, when=True):
        return jnp.zeros(shape, dtype) if when else None

    def norm(*lead):
        return Norm(jnp.ones((*lead, D), dtype), zeros(*lead, D, when=c.norm == "layernorm"))

    blocks = Blocks(
        attn_norm=norm(L), wq=normal(L, D, N, H), wk=normal(L, D, K, H), wv=normal(L, D, K, H),
        wo=normal(L, N, H, D), mlp_norm=norm(L), w_up=normal(L, D, F), w_down=normal(L, F, D),
        w_gate=normal(L, D, F) if c.gated_mlp else None,
        bq=zeros(L, N, H, when=c.attn_bias), bk=zeros(L, K, H, when=c.attn_bias),
        bv=zeros(L, K, H, when=c.attn_bias), bo=zeros(L, D, when=c.attn_bias),
        b_up=zeros(L, F, when=c.mlp_bias), b_gate=zeros(L, F, when=c.mlp_bias and c.gated_mlp),
        b_down=zeros(L, D, when=c.mlp_bias))
    return Params(
        config=c, embed=normal(V, D), blocks=blocks, final_norm=norm(),
        pos_embed=normal(c.max_seq_len, D) if c.position == "learned" else None,
        lm_head=None if c.tie_embeddings else normal(D, V))


def cast(params, dtype):
    """The same parameters with every floating leaf cast to dtype (e.g. jnp.bfloat16)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)
