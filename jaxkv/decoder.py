"""Decoder-only transformers (GPT-2, Llama): the uncached forward and the cached step."""

import jax
import jax.numpy as jnp

from jaxkv import cache as cache_lib
from jaxkv import checks
from jaxkv.attention import attend, causal_mask
from jaxkv.layers import mlp, norm, rope
from jaxkv.params import Blocks, Params
from jaxkv.tracecount import count_trace


def embed(params: Params, tokens_BT, pos_BT):
    """Token embeddings, plus learned position embeddings where the model has them."""
    x_BTD = params.embed[tokens_BT]
    if params.config.position == "learned":
        # Padding may sit past the table; clip so it stays finite (its result is never used).
        x_BTD = x_BTD + jnp.take(params.pos_embed, pos_BT, axis=0, mode="clip")
    return x_BTD


def logits(params: Params, x_BTD):
    """Final norm and output head, in float32: [B, T, V]."""
    c = params.config
    x_BTD = norm(x_BTD, params.final_norm, c.norm, c.norm_eps)
    if params.lm_head is None:
        return jnp.einsum("BTD,VD->BTV", x_BTD, params.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("BTD,DV->BTV", x_BTD, params.lm_head, preferred_element_type=jnp.float32)


def _qkv(config, b: Blocks, h_BTD, pos_BT):
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, b.wq)
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, b.wk)
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, b.wv)
    if b.bq is not None:
        q_BTNH, k_BTKH, v_BTKH = q_BTNH + b.bq, k_BTKH + b.bk, v_BTKH + b.bv
    if config.position == "rope":
        q_BTNH = rope(q_BTNH, pos_BT, config.rope_theta)
        k_BTKH = rope(k_BTKH, pos_BT, config.rope_theta)
    return q_BTNH, k_BTKH, v_BTKH


def _block(config, b: Blocks, x_BTD, pos_BT, mask_BTS, kv):
    """One transformer block (b holds one layer's slice of Blocks).

    kv is None for the uncached forward (keys are this call's tokens), or (k_BSKH, v_BSKH,
    slot_BT): this call's keys are written at slot_BT and every cached slot is attended.
    """
    h_BTD = norm(x_BTD, b.attn_norm, config.norm, config.norm_eps)
    q_BTNH, k_BTKH, v_BTKH = _qkv(config, b, h_BTD, pos_BT)
    if kv is None:
        k_BSKH, v_BSKH = k_BTKH, v_BTKH
    else:
        k_BSKH, v_BSKH, slot_BT = kv
        k_BSKH = cache_lib.write(k_BSKH, k_BTKH, slot_BT)
        v_BSKH = cache_lib.write(v_BSKH, v_BTKH, slot_BT)
    o_BTNH = attend(q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype), mask_BTS)
    attn_BTD = jnp.einsum("BTNH,NHD->BTD", o_BTNH, b.wo)
    if b.bo is not None:
        attn_BTD = attn_BTD + b.bo
    x_BTD = x_BTD + attn_BTD
    h_BTD = norm(x_BTD, b.mlp_norm, config.norm, config.norm_eps)
    x_BTD = x_BTD + mlp(h_BTD, b, config)
    return x_BTD, (k_BSKH, v_BSKH)


def forward(params: Params, tokens):
    """The plain uncached computation: logits [B, T, V] for tokens [B, T] at positions 0..T-1.

    This is the reference every cached path is tested against.
    """
    tokens_BT = checks.tokens_2d(params.config, tokens, "tokens")
    B, T = tokens_BT.shape
    pos_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    x_BTD = embed(params, tokens_BT, pos_BT)
    mask_BTS = causal_mask(pos_BT, T)

    def layer(x_BTD, b):
        x_BTD, _ = _block(params.config, b, x_BTD, pos_BT, mask_BTS, None)
        return x_BTD, None

    x_BTD, _ = jax.lax.scan(layer, x_BTD, params.blocks)
    return logits(params, x_BTD)


def extend(params: Params, cache, tokens_BT, pos_BT, slot_BT, mask_BTS):
    """The general cached pass: hidden states [B, T, D] and the updated cache.

    tokens_BT sit at positions pos_BT (what RoPE / learned positions see) and their K/V are
    stored at cache slots slot_BT; mask_BTS says which cache slots (after the write) each token
    reads. Linear decoding uses slot == pos and a causal mask; forests use other masks.
    """
    x_BTD = embed(params, tokens_BT, pos_BT)

    def layer(x_BTD, b_kv):
        b, k_BSKH, v_BSKH = b_kv
        return _block(params.config, b, x_BTD, pos_BT, mask_BTS, (k_BSKH, v_BSKH, slot_BT))

    x_BTD, (k, v) = jax.lax.scan(layer, x_BTD, (params.blocks, cache.k, cache.v))
    return x_BTD, cache_lib.KVCache(k=k, v=v)


def prefill_padded(params: Params, cache, tokens_BT, lengths_B, start_B):
    """prefill without validation or bucketing (for use inside compiled code)."""
    count_trace("prefill")
    B, T = tokens_BT.shape
    pos_BT = start_B[:, None] + jnp.arange(T)[None, :]
    mask_BTS = causal_mask(pos_BT, cache.capacity)
    x_BTD, cache = extend(params, cache, tokens_BT, pos_BT, pos_BT, mask_BTS)
    last_B1D = jnp.take_along_axis(x_BTD, (lengths_B - 1)[:, None, None], axis=1)
    return logits(params, last_B1D)[:, 0], cache


def prefill(params: Params, cache, tokens, lengths=None, start=None):
    """One parallel pass over right-padded prompts; returns (logits [B, V], cache).

    tokens [B, T] int32, lengths [B] the real lengths (default T); logits are at each row's
    last real token. start [B] (default 0) is where each row's prompt begins, so a prompt can be
    prefilled in several calls. T is padded up to a bucket, so a new T within a bucket does not
    recompile.
    """
    tokens_BT, lengths_B, start_B = checks.prefill_args(params.config, cache, tokens, lengths,
                                                        start)
    tokens_BT = checks.pad_to_bucket(tokens_BT)
    return _prefill_jit(params, cache, tokens_BT, lengths_B, start_B)


_prefill_jit = jax.jit(prefill_padded)


def decode_step(params: Params, cache, token, pos):
    """One token per row: token [B] at position pos [B] -> (logits [B, V], cache).

    Pure: usable under jax.jit(decode_step, donate_argnames="cache"), lax.scan and vmap.
    """
    count_trace("decode_step")
    token_B, pos_B = checks.decode_args(params.config, cache, token, pos)
    pos_BT = pos_B[:, None]
    x_BTD, cache = extend(params, cache, token_B[:, None], pos_BT, pos_BT,
                          causal_mask(pos_BT, cache.capacity))
    return logits(params, x_BTD)[:, 0], cache
