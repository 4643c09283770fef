"""The decoder stack of every model here: the cache it reads, the uncached forward and the
cached passes (prefill, decode_step, extend).

Decoder-only models (GPT-2, Llama) and the decoders of encoder-decoder models (T5, Whisper) run
the same code; the latter add a cross-attention sublayer reading K/V the cache already holds.
"""

import jax
import jax.numpy as jnp

from jaxkv import ops
from jaxkv.core import blocks, checks, encoder
from jaxkv.core import hooks as hooks_lib
from jaxkv.core import cache as cache_lib
from jaxkv.core.attention import causal_mask, relative_bias
from jaxkv.core.cache import KVCache
from jaxkv.core.layers import norm, normed
from jaxkv.core.params import Params
from jaxkv.core.tracecount import count_trace


def init_cache(params: Params, batch_size: int, max_len: int, dtype=None, *,
               block_size: int | None = None, blocks: int | None = None,
               encoder_inputs=None, encoder_lengths=None) -> KVCache:
    """An empty cache for batch_size rows of up to max_len positions (dtype: params' by default).

    It stores the K kv heads of grouped-query attention, not the N query heads; sliding-window
    layers keep only their window (a ring). dtype: float32, bfloat16, float16 or int8; an int8
    cache holds keys and values (cross-attention ones too) as Int8KV, 0.53x the bytes of
    bfloat16 at head dim 64. For an encoder-decoder model, encoder_inputs ([B, M] tokens with
    optional encoder_lengths [B], or [B, n_mels, frames] log-mel features) are encoded here and
    the cross-attention K/V of every layer are computed and stored, once.

    block_size (a divisor of max_len): the global layers are paged (jaxkv.ops.PagedKV): a pool of
    `blocks` blocks of block_size slots, each row reading and writing its own through a block
    table (default: batch_size x max_len / block_size blocks, row b given its own in order, so
    the cache answers as an unpaged one; with fewer, the tables start empty and
    jaxkv.core.cache.with_table assigns them). Window layers keep their rings.
    """
    c = params.config
    batch_size = checks.int_arg(batch_size, "init_cache: batch_size")
    max_len = checks.int_arg(max_len, "init_cache: max_len")
    if c.position == "learned" and max_len > c.max_seq_len:
        raise ValueError(f"init_cache: max_len={max_len} exceeds the model's {c.max_seq_len} "
                         "learned positions")
    dtype = checks.kv_dtype(dtype or params.dtype, "init_cache: dtype")
    if block_size is not None:
        block_size = checks.int_arg(block_size, "init_cache: block_size")
        if max_len % block_size:
            raise ValueError(f"init_cache: max_len ({max_len}) must be a whole number of blocks "
                             f"of block_size ({block_size})")
    if blocks is not None:
        if block_size is None:
            raise ValueError("init_cache: blocks needs block_size (the slots of each block)")
        blocks = checks.int_arg(blocks, "init_cache: blocks")
    cache = cache_lib.empty(c, batch_size, max_len, dtype, block_size, blocks)
    if c.is_encoder_decoder or encoder_inputs is not None:  # (errors name what is missing)
        cross = encoder.cross_cache(params, encoder_inputs, encoder_lengths, batch_size)
        cache = cache_lib.with_cross(cache, *cross, dtype)
    return cache


def embed(params: Params, tokens_BT, pos_BT):
    """Token embeddings (times sqrt(d_model) in their dtype where config.scale_embeddings),
    plus learned position embeddings where the model has them."""
    tokens_BT, table = per_call(tokens_BT, params.embed)
    x_BTD = table[tokens_BT]
    if params.config.scale_embeddings:
        x_BTD = x_BTD * jnp.asarray(params.config.d_model ** 0.5, x_BTD.dtype)
    if params.config.position == "learned":
        # Padding may sit past the table; clip so it stays finite (its result is never used).
        x_BTD = x_BTD + jnp.take(params.pos_embed, pos_BT, axis=0, mode="clip")
    return x_BTD


def logits(params: Params, x_BTD, tap=None):
    """Final norm and output head, in float32: [B, T, V] (soft-capped: config.logit_softcap).
    tap (optional, a hooks.Tap): the final norm's output is its site "final"."""
    c = params.config
    head_VD = params.embed if params.lm_head is None else params.lm_head
    final = tap and tap.at("final", None)
    if c.rescale_logits or final:
        x_BTD = norm(x_BTD, params.final_norm, c.norm, c.norm_eps)
        x_BTD = final(x_BTD) if final else x_BTD
        x_BTD = x_BTD * c.d_model ** -0.5 if c.rescale_logits else x_BTD
        logits_BTV = ops.matmul(x_BTD, head_VD, dtype=jnp.float32)
    else:
        logits_BTV = ops.matmul(x_BTD, head_VD, dtype=jnp.float32,
                                norm=normed(c, params.final_norm))
    if c.logit_softcap is not None:
        logits_BTV = c.logit_softcap * jnp.tanh(logits_BTV / c.logit_softcap)
    return logits_BTV


def self_bias(params: Params, pos_BT, key_pos_BS):
    """T5's causal relative position bias [B, N, T, S]; None for other models."""
    if params.rel_bias is None:
        return None
    return relative_bias(params.rel_bias, pos_BT, key_pos_BS, False,
                         params.config.relative_max_distance)


def window_mask(config, mask_BTS, pos_BT):
    """An uncached mask_BTS (key s at position s) narrowed to the sliding window: a query at p
    reads keys at positions > p - sliding_window."""
    key_pos_S = jnp.arange(mask_BTS.shape[2])
    return mask_BTS & (key_pos_S[None, None, :] > pos_BT[:, :, None] - config.sliding_window)


def layers(params: Params, x_BTD, pos_BT, mask_BTS, bias_BNTS, self_kv=None, cross=None,
           prefix=None, write=True, tap=None):
    """All decoder layers (an unrolled loop: see params.py) -> (x_BTD, (k, v)): per layer
    [B, K, S, H] keys and values after this call's writes.

    self_kv: None (uncached: keys are this call's tokens, read through mask_BTS, narrowed to the
    window in config.window_layers) or (k, v per layer, global View, window View): see cache.View.
    cross: None or (k, v per layer [B, K, M, H], mask_BM), the encoder's precomputed keys/values.
    prefix: None or (k, v per layer [P, K, S', H], mask_PS', kv_len'): keys shared by groups
    of rows.
    write=False: the cache is only read, and (k, v) are this call's own, [B, K, T, H] per layer.
    tap (optional, a hooks.Tap): each layer's sites resid_pre, attn_probs, head_out, attn_out,
    router (a mixture's), mlp_out and resid_post.
    """
    c = params.config
    local_BTS = c.window_layers and self_kv is None and window_mask(c, mask_BTS, pos_BT)
    new_k, new_v = [], []
    turns = {local: blocks.turns(c, pos_BT, local)
             for local in {layer in c.window_layers for layer in range(c.n_layers)}}
    for layer, b in enumerate(params.blocks):
        x_BTD = tap("resid_pre", layer, x_BTD) if tap else x_BTD
        layer_in_BTD = x_BTD
        local = layer in c.window_layers
        kv = None if self_kv is None else (self_kv[0][layer], self_kv[1][layer],
                                           self_kv[3 if local else 2])
        shared = None if prefix is None else (prefix[0][layer], prefix[1][layer], *prefix[2:])
        x_BTD, (k_BKSH, v_BKSH) = blocks.self_attention(
            c, b, x_BTD, turns[local], local_BTS if local else mask_BTS, bias_BNTS, kv, shared,
            write, tap and tap.at("attn_out", layer), tap and tap.at("head_out", layer),
            tap and tap.probs(layer))
        if cross is not None:
            x_BTD = blocks.cross_attention(c, params.cross[layer], x_BTD, cross[0][layer],
                                           cross[1][layer], cross[2])
        mlp_in_BTD = layer_in_BTD if c.parallel_residual else x_BTD
        x_BTD = blocks.feed_forward(c, b, mlp_in_BTD, tap and tap.at("mlp_out", layer), x_BTD,
                                    tap and tap.at("router", layer))
        if tap and b.router is None:  # a mixture's dense layer: zeros for its router
            tap.absent("router", layer, jnp.zeros((*x_BTD.shape[:2], c.n_experts), jnp.float32))
        x_BTD = tap("resid_post", layer, x_BTD) if tap else x_BTD
        new_k.append(k_BKSH)
        new_v.append(v_BKSH)
    return x_BTD, (tuple(new_k), tuple(new_v))


def forward(params: Params, tokens, encoder_inputs=None, encoder_lengths=None, hooks=None):
    """The plain uncached computation: logits [B, T, V] for tokens [B, T] at positions 0..T-1;
    with hooks (a jaxkv.Hooks), (logits, acts): the captures of its sites (see core.hooks).

    This is the reference every cached path is tested against. Encoder-decoder models also take
    encoder_inputs (and encoder_lengths for padded token inputs); the encoder runs here too.
    The arguments are checked here; the computation is compiled once per shape (called op by
    op it would compile each operation of every layer for each new length).
    """
    tokens_BT = checks.tokens_2d(params.config, tokens, "tokens")
    cross = None
    if params.config.is_encoder_decoder or encoder_inputs is not None:
        cross = encoder.cross_cache(params, encoder_inputs, encoder_lengths, tokens_BT.shape[0])
    hooks_lib.tap_for(hooks, None, params.config)  # (checks hooks)
    return _forward(params, tokens_BT, cross, hooks)


@jax.jit
def _forward(params: Params, tokens_BT, cross, hooks):
    B, T = tokens_BT.shape
    pos_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    tap = hooks_lib.tap_for(hooks, pos_BT, params.config, n_keys=T)
    x_BTD = embed(params, tokens_BT, pos_BT)
    x_BTD = tap("embed", None, x_BTD) if tap else x_BTD
    bias = self_bias(params, pos_BT, pos_BT)
    x_BTD, _ = layers(params, x_BTD, pos_BT, causal_mask(pos_BT, T), bias, cross=cross, tap=tap)
    logits_BTV = logits(params, x_BTD, tap)
    return logits_BTV if tap is None else (logits_BTV, tap.captured())


def per_call(x, tree):
    """(x, tree) through an optimization barrier: tied to each call's input, nothing computed
    from tree alone (a conversion of the weights, say) can be hoisted out of a loop of calls
    (generate's, or a caller's lax.scan), where it would make a copy of the weights that every
    step reads instead."""
    return jax.lax.optimization_barrier((x, tree))


def extend(params: Params, cache: KVCache, tokens_BT, pos_BT, slot_BT, mask_BTS, prefix=None,
           kv_len=None, tap=None):
    """The general cached pass: hidden states [B, T, D] and the updated cache.

    tokens_BT sit at positions pos_BT (what RoPE / learned positions see) and their K/V are
    stored at cache slots slot_BT; mask_BTS says which cache slots (after the write) each token
    reads. Linear decoding uses slot == pos and a causal mask; forests use other masks. A slot
    >= the capacity is not stored (how prefill's padding is written nowhere); a negative slot or
    position, or a token id outside the vocabulary, is an error.
    kv_len (optional, traced): a bound on the slots any token reads, besides those this call
    writes; attention visits only the blocks below it, so a step costs what is filled, not the
    capacity.
    prefix: optional (prefix cache with P rows, mask_PS of its valid slots, their kv_len): keys
    every group of B / P consecutive rows also reads, stored once (see jaxkv.multidecode).
    Window layers (config.window_layers) keep a token at slot pos mod R of their ring (if its
    slot_BT is stored at all) and read the positions mask_BTS allows (slot s = position s) that
    are inside the window. They assume rows are written in position order: at most R tokens
    per call, and a row past its window may go back one position, not more (both are errors).
    tap (optional, a hooks.Tap): as cached_pass's.
    """
    tokens_BT = checks.token_ids(params.config, tokens_BT, "tokens", 2)
    pos_BT = checks.int_array(pos_BT, "pos", 2, (0, checks.INT32_MAX), "is not a position")
    slot_BT = checks.int_array(slot_BT, "slot", 2, (0, checks.INT32_MAX), "is not a cache slot")
    return cached_pass(params, cache, tokens_BT, pos_BT, slot_BT, mask_BTS, prefix, kv_len,
                       tap=tap)


def cached_pass(params: Params, cache: KVCache, tokens_BT, pos_BT, slot_BT, mask_BTS,
                prefix=None, kv_len=None, write=True, lengths_B=None, tap=None):
    """extend for arguments whose values the caller has checked (the cache's layout is checked
    here: it is static).

    write=False (linear caches only) reads the cache as if the tokens were at slot_BT but stores
    nothing: it returns (x_BTD, (k, v)), the tokens' own keys and values, L x [B, K, T, H], for
    the caller to store (cache.store) once it knows which to keep. Inside a lax.cond that keeps
    the cache a read-only operand: a branch that updates it makes XLA copy the whole cache. The
    keys and values come tied to x_BTD (+ 0 x), so a store of them waits for this call's reads of
    the cache and writes in place: free to go first (an optimization_barrier on them did not stop
    it), XLA copied every layer for it. lengths_B (optional, [B]): the global layers' slots
    each row reads are exactly [0, lengths_B) (a decode step's), for backends that read a range.
    tap (optional, a hooks.Tap): the pass's sites embed and the layers' (the caller reads the
    captures from it).
    """
    c = params.config
    checks.cache_layout(c, cache)
    if prefix is not None:
        checks.cache_layout(c, prefix[0], "prefix cache")
        checks.no_window(c, "a shared prefix (MultiDecode)")
    # (the encoder and the cross-attention K/V projections are never read here: their
    # products are in the cache)
    cross = params.cross and tuple(x.replace(wkv=None, bkv=None) for x in params.cross)
    x_BTD, params = per_call(embed(params, tokens_BT, pos_BT),
                             params.replace(cross=cross, encoder=None))
    x_BTD = tap("embed", None, x_BTD) if tap else x_BTD
    slots_BS = jnp.arange(cache.capacity)[None, :]  # a global layer: slot s holds position s
    bias = self_bias(params, pos_BT, slots_BS)
    views = [cache_lib.linear_view(mask_BTS, slot_BT, kv_len, lengths_B), None]
    ring_pos = cache.ring_pos
    if not write:
        checks.no_window(c, "a cached pass that does not write")
    if ring_pos is not None:
        checks.fits_ring(tokens_BT.shape[1], ring_pos.shape[1])
        checks.ring_holds(ring_pos, pos_BT[:, 0], slot_BT[:, 0] < cache.capacity,
                          c.sliding_window)
        views[1], ring_pos = cache_lib.ring_view(ring_pos, c.sliding_window, mask_BTS, pos_BT,
                                                 slot_BT, kv_len)
    cross = None if cache.cross_k is None else (cache.cross_k, cache.cross_v, cache.cross_mask)
    shared = None if prefix is None else (prefix[0].k, prefix[0].v, *prefix[1:])
    x_BTD, (k, v) = layers(params, x_BTD, pos_BT, None, bias, (*cache_lib.readable(cache), *views),
                           cross, shared, write, tap)
    if write:
        return x_BTD, cache_lib.stored(cache.replace(ring_pos=ring_pos), k, v)
    after_B1T1 = 0 * x_BTD[:, None, :, :1]
    return x_BTD, jax.tree.map(lambda x: x + after_B1T1.astype(x.dtype), (k, v))


def prefill_padded(params: Params, cache: KVCache, tokens_BT, lengths_B, start_B,
                   chunk: int | None = None, hooks=None):
    """prefill without validation or bucketing (for use inside compiled code). Padding is not
    stored. The prompt runs in a loop of passes of `chunk` tokens (at most a window layer's
    ring), up to the longest row's last token (not the bucket's end): each reads the cache
    blocks the passes before it filled and its own tokens, so memory grows with the chunk, not
    with T, and work with what is filled, not the capacity. With hooks, (logits, cache, acts):
    the captures [.., B, T, D] of the prompt's tokens by index (padding's too)."""
    count_trace("prefill")
    B, T = tokens_BT.shape
    D = params.config.d_model
    chunk = chunk or ops.prefill_chunk(params.blocks[0].wqkv, B, T)
    C = min(T, chunk, *([] if cache.ring_pos is None else [cache.ring_pos.shape[1]]))
    n = -(-T // C)
    tokens_NBC = jnp.pad(tokens_BT, ((0, 0), (0, n * C - T))).reshape(B, n, C).swapaxes(0, 1)

    def chunk_pass(carry, i_tokens):
        cache, last_BD, acts = carry
        i, tokens_BC = i_tokens
        t_BC = i * C + jnp.arange(C)[None, :]  # index in the prompt
        pos_BC = start_B[:, None] + t_BC
        slot_BC = jnp.where(t_BC < lengths_B[:, None], pos_BC, cache.capacity)
        # The cache as it was reads only slots before this chunk (its own are read as own keys).
        kv_len = jnp.max(start_B + jnp.minimum(lengths_B, i * C))
        tap = hooks_lib.tap_for(hooks, pos_BC, params.config, n_keys=cache.capacity)
        x_BCD, cache = cached_pass(params, cache, tokens_BC, pos_BC, slot_BC,
                                   causal_mask(pos_BC, cache.capacity), kv_len=kv_len, tap=tap)
        if tap and hooks.captures("final", None):  # (the logits below are the last token's only)
            tap("final", None, norm(x_BCD, params.final_norm, params.config.norm,
                                    params.config.norm_eps))
        acts = hooks_lib.put_at(acts, tap.captured(), i * C) if tap else acts
        end_B = lengths_B - 1 - i * C  # the last token's index in this chunk
        x_BD = jnp.take_along_axis(x_BCD, jnp.clip(end_B, 0, C - 1)[:, None, None], axis=1)[:, 0]
        last_BD = jnp.where(((end_B >= 0) & (end_B < C))[:, None], x_BD, last_BD)
        return (cache, last_BD, acts), None

    acts = hooks_lib.empty_acts(hooks, params.config, B, n * C, params.embed.dtype,
                                cache.capacity)
    first = (cache, jnp.zeros((B, D), params.embed.dtype), acts)
    if n == 1:
        (cache, last_BD, acts), _ = chunk_pass(first, (0, tokens_NBC[0]))
    else:  # only the chunks some row's prompt reaches: work follows the prompts, not the bucket
        filled = jnp.clip(-(-jnp.max(lengths_B) // C), 1, n)
        cache, last_BD, acts = jax.lax.fori_loop(
            0, filled, lambda i, carry: chunk_pass(carry, (i, tokens_NBC[i]))[0], first)
    last_tap = hooks_lib.tap_for(hooks, (start_B + lengths_B - 1)[:, None], params.config,
                                 record=False)
    logits_BV = logits(params, last_BD[:, None], last_tap)[:, 0]
    if hooks is None:
        return logits_BV, cache
    return logits_BV, cache, hooks_lib.positions(acts, T)


def prefill(params: Params, cache: KVCache, tokens, lengths=None, start=None, hooks=None):
    """One parallel pass over right-padded prompts; returns (logits [B, V], cache), and with
    hooks (a jaxkv.Hooks) (logits, cache, acts): captures [.., B, T, D], index t row b's t-th
    token of this call (its position start + t; past its length, padding's).

    tokens [B, T] int32, lengths [B] the real lengths (default T); logits are at each row's
    last real token. start [B] (default 0) is where each row's prompt begins, so a prompt can be
    prefilled in several calls. T is padded up to a bucket, so a new T within a bucket does not
    recompile.
    """
    tokens_BT, lengths_B, start_B = checks.prefill_args(params.config, cache, tokens, lengths,
                                                        start)
    T = tokens_BT.shape[1]
    tokens_BT = checks.pad_to_bucket(tokens_BT)
    hooks_lib.tap_for(hooks, None, params.config)  # (checks hooks)
    out = _prefill_jit(params, cache, tokens_BT, lengths_B, start_B, hooks=hooks)
    return out if hooks is None else (*out[:2], hooks_lib.positions(out[2], T))


_prefill_jit = jax.jit(prefill_padded, static_argnames="chunk")


def decode_step(params: Params, cache: KVCache, token, pos, hooks=None):
    """One token per row: token [B] at position pos [B] -> (logits [B, V], cache); with hooks
    (a jaxkv.Hooks), (logits, cache, acts): the step's captures, T = 1 (see core.hooks).

    Pure: usable under jax.jit(decode_step, donate_argnames="cache"), lax.scan and vmap.
    Encoder-decoder models read their cross-attention K/V from the cache, never recomputing it.
    """
    count_trace("decode_step")
    token_B, pos_B = checks.decode_args(params.config, cache, token, pos)
    pos_BT = pos_B[:, None]
    tap = hooks_lib.tap_for(hooks, pos_BT, params.config, n_keys=cache.capacity)
    x_BTD, cache = cached_pass(params, cache, token_B[:, None], pos_BT, pos_BT,
                               causal_mask(pos_BT, cache.capacity), kv_len=jnp.max(pos_B) + 1,
                               lengths_B=pos_B, tap=tap)
    logits_BV = logits(params, x_BTD, tap)[:, 0]
    return (logits_BV, cache) if tap is None else (logits_BV, cache, tap.captured())
