"""Parameter pytrees: frozen dataclasses that carry their config as a static field.

Layout, decided by measurement on XLA:CPU (docs/design-notes.md): every matrix is stored
[out, in] (like torch.nn.Linear), and each layer's weights are separate arrays, run by an
unrolled loop. A layer slice of stacked [L, ...] weights under lax.scan is copied before every
matmul (XLA's dot cannot read a dynamic slice in place), and [in, out] matrices or matrices
with two output axes get transposed; either way a step reads the weights two or three times.
Q, K and V share one matrix, grouped by kv head: rows [K, G + 2, H] hold each kv head's G query
heads, then its key, then its value, so splitting rows over devices keeps a group together.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv import ops
from jaxkv.core import checks
from jaxkv.core.config import Config


@struct.dataclass
class Norm:
    scale: jax.Array  # [D] ([H] for Block.q_norm / k_norm)
    bias: jax.Array | None = None  # [D]; LayerNorm only


@struct.dataclass
class Block:
    """One self-attention + MLP layer."""

    attn_norm: Norm | None  # None without config.pre_norms
    wqkv: jax.Array  # [K * (G + 2) * H, D]: per kv head, G query heads, its key, its value
    wo: jax.Array  # [D, N * H]
    mlp_norm: Norm | None
    w_in: jax.Array | None  # [F, D], or [2 * F, D] gated: gate and up rows in blocks
    # (gate_up_rows); None in a mixture-of-experts layer
    w_out: jax.Array | None  # [D, F]
    bqkv: jax.Array | None = None  # [K * (G + 2) * H]
    bo: jax.Array | None = None  # [D]
    b_in: jax.Array | None = None  # [F] or [2 * F]
    b_out: jax.Array | None = None  # [D]
    q_norm: Norm | None = None  # scale [H], shared by every query head ([N * H] with
    # config.qk_norm_all); config.qk_norm only
    k_norm: Norm | None = None  # scale [H], shared by every kv head
    attn_out_norm: Norm | None = None  # of the attention output; config.post_norms only
    mlp_out_norm: Norm | None = None  # of the MLP output
    router: jax.Array | None = None  # [E, D]: a mixture-of-experts layer's (config.is_moe)
    experts_in: jax.Array | None = None  # [E, 2 * F', D]: each expert's gate rows, then up rows
    experts_out: jax.Array | None = None  # [E, D, F']


@struct.dataclass
class Cross:
    """One decoder layer's cross-attention over the encoder states."""

    norm: Norm
    wq: jax.Array  # [N * H, D]
    wkv: jax.Array  # [K * 2 * H, D]: per kv head, key then value; applied once per input
    wo: jax.Array  # [D, N * H]
    bq: jax.Array | None = None  # [N * H]
    bkv: jax.Array | None = None  # [K * 2 * H]
    bo: jax.Array | None = None  # [D]


@struct.dataclass
class Encoder:
    blocks: tuple  # of Block, one per encoder layer
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
    blocks: tuple  # of Block, one per decoder layer
    final_norm: Norm
    pos_embed: jax.Array | None = None  # [P, D]; learned positions only
    rel_bias: jax.Array | None = None  # [R, N]; T5's causal relative position bias
    lm_head: jax.Array | None = None  # [V, D]; untied head only
    cross: tuple | None = None  # of Cross, one per decoder layer (encoder-decoder models)
    encoder: Encoder | None = None  # encoder-decoder models only

    @property
    def dtype(self):
        return self.embed.dtype


def qkv_rows(config: Config, q, k, v):
    """Fuse Q [N * H, ...], K and V [K * H, ...] (rows = heads x H) into wqkv's row order (of
    any whole number of kv heads: a model-axis share)."""
    G, H = config.group_size, config.head_dim
    K = k.shape[0] // H
    rest = q.shape[1:]
    parts = [q.reshape(K, G, H, *rest), k.reshape(K, 1, H, *rest), v.reshape(K, 1, H, *rest)]
    return np.concatenate(parts, axis=1).reshape(-1, *rest)


def kv_rows(config: Config, k, v):
    """Fuse K and V [K * H, ...] into wkv's row order (per kv head: key, value)."""
    H = config.head_dim
    K = k.shape[0] // H
    rest = k.shape[1:]
    return np.stack([k.reshape(K, H, *rest), v.reshape(K, H, *rest)], axis=1).reshape(-1, *rest)


GATE_UP_BLOCK = 128  # a TPU's lane width


def gate_up_block(d_ff: int) -> int:
    """Rows of each block of a gated w_in: GATE_UP_BLOCK where d_ff is a multiple of it, else 1.
    (XLA:TPU reads blocks of 128 rows as the matrix is stored; interleaved row by row, it laid the
    whole matrix out anew every step, docs/performance.md.)"""
    return GATE_UP_BLOCK if d_ff % GATE_UP_BLOCK == 0 else 1


def gate_up_rows(gate, up):
    """Fuse gate and up [F, ...] into w_in's row order: per block of t = gate_up_block(F) units,
    their t gate rows, then their t up rows (a model-axis share of whole blocks holds the units'
    gate and up alike)."""
    F, rest = gate.shape[0], gate.shape[1:]
    t = gate_up_block(F)
    return np.stack([gate.reshape(F // t, t, *rest), up.reshape(F // t, t, *rest)],
                    axis=1).reshape(-1, *rest)


def regroup_gate_up(params, t_was: int):
    """params whose gated w_in / b_in rows are in blocks of t_was (jaxkv.save before 2026-11
    wrote blocks of 1), in today's blocks of gate_up_block(d_ff)."""
    c = params.config
    t = gate_up_block(c.d_ff)
    if not c.gated_mlp or t == t_was:
        return params

    def regroup(path, x):
        if not {"w_in", "b_in"} & set(path_name(path).split(".")):
            return x
        F, rest = c.d_ff, x.shape[1:]
        gate_up = jnp.swapaxes(x.reshape(F // t_was, 2, t_was, *rest), 0, 1)  # [2, F/t', t', .]
        return jnp.swapaxes(gate_up.reshape(2, F // t, t, *rest), 0, 1).reshape(2 * F, *rest)
    return jax.tree_util.tree_map_with_path(regroup, params)


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

    def norm(self):
        D = self.c.d_model
        return Norm(jnp.ones((D,), self.dtype), self.zeros(D, when=self.c.norm == "layernorm"))

    def head_norm(self, heads: int):
        """The q or k RMSNorm of `heads` heads: scale [H] per head, [heads * H] with
        config.qk_norm_all; None without config.qk_norm."""
        c = self.c
        width = c.head_dim * (heads if c.qk_norm_all else 1)
        return Norm(jnp.ones((width,), self.dtype)) if c.qk_norm else None

    def block(self, layer: int | None = None):
        """Layer `layer`'s (None: an encoder layer)."""
        c = self.c
        D, F = c.d_model, c.d_ff
        qkv = c.n_kv_heads * (c.group_size + 2) * c.head_dim
        NH = c.n_heads * c.head_dim
        F_in = 2 * F if c.gated_mlp else F
        if layer is not None and c.is_moe(layer):
            E, FE = c.n_experts, c.expert_d_ff or F
            return self.block().replace(
                w_in=None, w_out=None, b_in=None, b_out=None,
                router=self.normal(E, D), experts_in=self.normal(E, 2 * FE, D),
                experts_out=self.normal(E, D, FE))
        return Block(
            attn_norm=self.norm() if c.pre_norms else None, wqkv=self.normal(qkv, D),
            wo=self.normal(D, NH), mlp_norm=self.norm() if c.pre_norms else None,
            w_in=self.normal(F_in, D), w_out=self.normal(D, F),
            bqkv=self.zeros(qkv, when=c.attn_bias), bo=self.zeros(D, when=c.attn_out_bias),
            b_in=self.zeros(F_in, when=c.mlp_bias), b_out=self.zeros(D, when=c.mlp_bias),
            q_norm=self.head_norm(c.n_heads), k_norm=self.head_norm(c.n_kv_heads),
            attn_out_norm=self.norm() if c.post_norms else None,
            mlp_out_norm=self.norm() if c.post_norms else None)

    def cross(self):
        c = self.c
        D, NH, KH2 = c.d_model, c.n_heads * c.head_dim, 2 * c.n_kv_heads * c.head_dim
        return Cross(norm=self.norm(), wq=self.normal(NH, D), wkv=self.normal(KH2, D),
                     wo=self.normal(D, NH), bq=self.zeros(NH, when=c.attn_bias),
                     bkv=self.zeros(KH2, when=c.attn_bias), bo=self.zeros(D, when=c.attn_out_bias))

    def rel_bias(self):
        return self.normal(self.c.relative_buckets, self.c.n_heads) \
            if self.c.position == "relative" else None

    def encoder(self):
        c, e = self.c, self.c.encoder
        audio = e.input == "audio"
        return Encoder(
            blocks=tuple(self.block() for _ in range(e.n_layers)), final_norm=self.norm(),
            rel_bias=None if audio else self.rel_bias(),
            pos_embed=jnp.asarray(sinusoids(e.max_len, c.d_model), self.dtype) if audio else None,
            conv1_w=self.normal(3, e.n_mels, c.d_model) if audio else None,
            conv1_b=self.zeros(c.d_model, when=audio),
            conv2_w=self.normal(3, c.d_model, c.d_model) if audio else None,
            conv2_b=self.zeros(c.d_model, when=audio))


def skeleton(config: Config, dtype=jnp.float32) -> Params:
    """The params' shapes and dtypes (jax.ShapeDtypeStruct leaves), nothing computed."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype))


def init_params(config: Config, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters (normal(0, 0.02) weights, unit norms, zero biases)."""
    c, init = config, _Init(config, key, dtype)
    encdec = c.is_encoder_decoder
    return Params(
        config=c, embed=init.normal(c.vocab_size, c.d_model),
        blocks=tuple(init.block(i) for i in range(c.n_layers)), final_norm=init.norm(),
        pos_embed=init.normal(c.max_seq_len, c.d_model) if c.position == "learned" else None,
        rel_bias=init.rel_bias(),
        lm_head=None if c.tie_embeddings else init.normal(c.vocab_size, c.d_model),
        cross=tuple(init.cross() for _ in range(c.n_layers)) if encdec else None,
        encoder=init.encoder() if encdec else None)


def cast(params, dtype):
    """The same parameters with every floating leaf cast to dtype (e.g. jnp.bfloat16)."""
    dtype = checks.float_dtype(dtype, "cast: dtype")
    return ops.placed(jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params))


def path_name(path) -> str:
    """A pytree path as a dotted name: 'blocks.3.wqkv' (what save files and name maps use)."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
                    for k in path)
