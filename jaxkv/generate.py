"""generate: prefill, then a while loop of decode_step, compiled as one program."""

import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import io_callback

from jaxkv import checks, stops
from jaxkv.cache import KVCache, init_cache
from jaxkv.decoder import decode_step, prefill_padded
from jaxkv.sampling import SamplingParams, row_keys, sample, sampling_params
from jaxkv.stops import StopStrings
from jaxkv.sharding import constrain_cache, shard_params, shard_rows
from jaxkv.tracecount import count_trace


def prepare_prompts(config, prompts, lengths=None):
    """Right-padded tokens [B, bucket(T)] and lengths [B] from ragged lists or a [B, T] array."""
    if isinstance(prompts, (list, tuple)) and not (prompts and isinstance(prompts[0], str)):
        if lengths is not None:
            raise ValueError("lengths is only for a [B, T] prompts array, not a list of lists")
        prompts, lengths = pad_rows(config, prompts)
    elif prompts is None:
        raise TypeError("prompts must be a list of token-id lists or a [B, T] array, got None")
    tokens_BT = checks.int_array(prompts, "prompts", 2)
    B, T = tokens_BT.shape
    lengths_B = jnp.full((B,), T, jnp.int32) if lengths is None else checks.int_array(
        lengths, "lengths", 1, (1, T + 1),
        f"is not a prompt length: expected 1 <= length <= {T}")
    if lengths_B.shape != (B,):
        raise ValueError(f"lengths must have shape ({B},), got {lengths_B.shape}")
    lengths = np.asarray(lengths_B)
    for b in range(B):
        checks.token_ids(config, tokens_BT[b, : lengths[b]], f"prompts[{b}]", 1)
    return checks.pad_to_bucket(tokens_BT), lengths_B


def pad_rows(config, prompts):
    """(tokens [B, T] right-padded with 0, lengths [B]) from a list of token-id lists."""
    if not prompts:
        raise ValueError("prompts is empty: expected at least one prompt")
    if np.ndim(prompts[0]) == 0:
        raise TypeError(f"prompts must be a list of token-id lists (one per row), got "
                        f"{prompts!r:.60}; for one prompt p, pass [p]")
    for i, p in enumerate(prompts):
        if np.size(p) == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
    rows = [checks.token_ids(config, p, f"prompts[{i}]", 1) for i, p in enumerate(prompts)]
    lengths = np.array([row.shape[0] for row in rows], np.int32)
    tokens = np.zeros((len(rows), lengths.max()), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : row.shape[0]] = row
    return tokens, lengths


def capacity_for(config, padded_len: int, max_new_tokens: int, lengths_B, max_len=None) -> int:
    """Cache slots for a generation; the default depends only on the prompt bucket."""
    max_new_tokens = checks.int_arg(max_new_tokens, "max_new_tokens")
    longest = int(np.max(np.asarray(lengths_B)))
    if longest + max_new_tokens > config.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens = {longest} + {max_new_tokens} = "
                         f"{longest + max_new_tokens} positions, more than the model's "
                         f"max_seq_len ({config.max_seq_len})")
    if max_len is None:
        return min(padded_len + max_new_tokens, config.max_seq_len)
    capacity = checks.int_arg(max_len, "max_len")
    if longest + max_new_tokens > capacity:
        raise ValueError(f"prompt + max_new_tokens = {longest} + {max_new_tokens} = "
                         f"{longest + max_new_tokens} positions, over the cache capacity "
                         f"(max_len: {capacity})")
    return capacity


def token_mask(config, ids, name: str):
    """A [V] bool mask of ids."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ((ids < 0) | (ids >= config.vocab_size)).any():
        raise ValueError(f"{name} must hold token ids in [0, {config.vocab_size}), got "
                         f"{ids[(ids < 0) | (ids >= config.vocab_size)].tolist()}")
    return jnp.zeros((config.vocab_size,), bool).at[ids].set(True)


def encoder_args(config, encoder_inputs, encoder_lengths, batch_size: int):
    """(inputs, lengths) for generate_loop; token inputs padded to a length bucket."""
    if not config.is_encoder_decoder and encoder_inputs is None:
        return None, None
    inputs, lengths_B = checks.encoder_args(config, encoder_inputs, encoder_lengths, batch_size)
    if config.encoder.input == "tokens":
        B, M = inputs.shape
        lengths_B = jnp.full((B,), M, jnp.int32) if lengths_B is None else lengths_B
        padded = min(checks.bucket_len(M), config.encoder.max_input_len)
        inputs = jnp.pad(inputs, ((0, 0), (0, padded - M)))
    return inputs, lengths_B


@struct.dataclass
class _Decoding:
    cache: KVCache
    logits: jax.Array  # [B, V] float32, for the next token
    pos: jax.Array  # [B] int32, where the next token goes
    seen: jax.Array  # [B, V] bool, tokens the repetition penalty applies to
    done: jax.Array  # [B] bool, the row has ended (an EOS id or a stop string)
    length: jax.Array  # [B] int32, the row's answer length (max_new_tokens until it ends)
    ends: jax.Array  # [B, M] bool, the stop-string prefixes the answer ends with (stops.py)
    tokens: jax.Array  # [max_new_tokens, B] int32, pad_id where not yet drawn
    t: jax.Array  # int32, the index of the next token


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "capacity", "on_token", "mesh",
                                             "kv_dtype"))
def generate_loop(params, tokens_BT, lengths_B, sampling: SamplingParams, keys_B, eos_E, pad_id,
                  suppress_V, begin_suppress_V, stop: StopStrings, encoder_inputs=None,
                  encoder_lengths=None, *,
                  max_new_tokens: int, capacity: int, on_token=None, mesh=None, kv_dtype=None):
    """The compiled program behind generate: (encoder and cross K/V,) prefill, then a while
    loop of sample + decode_step that stops when every row has ended."""
    count_trace("generate")
    B, T = tokens_BT.shape
    V = params.config.vocab_size
    rows_B1 = jnp.arange(B)[:, None]
    cache = constrain_cache(init_cache(params, B, capacity, kv_dtype,
                                       encoder_inputs=encoder_inputs,
                                       encoder_lengths=encoder_lengths), mesh)
    logits_BV, cache = prefill_padded(params, cache, tokens_BT, lengths_B,
                                      jnp.zeros((B,), jnp.int32))
    prompt_BT = jnp.where(jnp.arange(T) < lengths_B[:, None], tokens_BT, V)
    seen_BV = jnp.zeros((B, V), bool).at[rows_B1, prompt_BT].set(True, mode="drop")
    state = _Decoding(constrain_cache(cache, mesh), logits_BV, lengths_B, seen_BV,
                      jnp.zeros((B,), bool), jnp.full((B,), max_new_tokens, jnp.int32),
                      jnp.zeros((B, stop.completes.shape[1]), bool),
                      jnp.full((max_new_tokens, B), pad_id, jnp.int32), jnp.int32(0))

    def draw(s: _Decoding) -> _Decoding:
        """Token s.t of every row (pad_id after its end), recorded; logits and cache unchanged."""
        banned_V = suppress_V | (begin_suppress_V & (s.t == 0))
        logits_BV = jnp.where(banned_V, -jnp.inf, s.logits)
        token_B = jnp.where(s.done, pad_id, sample(logits_BV, sampling, keys_B, s.t, s.seen))
        if on_token is not None:
            io_callback(on_token, None, token_B, ordered=True)
        stopped_B, ends_BM = stops.step(stop, s.ends, token_B)
        ended_B = ~s.done & (jnp.isin(token_B, eos_E) | stopped_B)
        return s.replace(seen=s.seen.at[rows_B1[:, 0], token_B].set(True),
                         done=s.done | ended_B, length=jnp.where(ended_B, s.t + 1, s.length),
                         ends=ends_BM, tokens=s.tokens.at[s.t].set(token_B), t=s.t + 1)

    def step(s: _Decoding) -> _Decoding:
        s = draw(s)
        logits_BV, cache = decode_step(params, s.cache, s.tokens[s.t - 1], s.pos)
        return s.replace(cache=constrain_cache(cache, mesh), logits=logits_BV, pos=s.pos + 1)

    # The last token needs no decode step after it; nor does anything once every row has ended.
    state = jax.lax.while_loop(lambda s: (s.t < max_new_tokens - 1) & ~jnp.all(s.done), step,
                               state)
    state = draw(state)
    return state.tokens.T, state.length


def generate(params, prompts, max_new_tokens: int, **options):
    """Continues each prompt by up to max_new_tokens tokens: (tokens [B, max_new_tokens], lengths [B]).

    prompts: a list of token-id lists (ragged) or a [B, T] array with lengths=[B]. Options:
    temperature (0: greedy), top_k, top_p, min_p, repetition_penalty: scalars or per-row [B]
    sequences, None meaning off; key: one key (row b uses fold_in(key, b)) or [B] keys;
    eos_id: an id or a list of ids; after a row's EOS its tokens are pad_id (default: the first
    EOS id) and its length counts the EOS; stop: strings that end a row (with tokenizer=, or
    jaxkv.stop_strings tables), checked on token ids in the loop: the row's length counts the
    token that completed one (jaxkv.stops.cut cuts the text); max_len: the cache capacity
    (default: prompt bucket + max_new_tokens); on_token(token [B]): called from inside the
    compiled loop for each token drawn (generation stops early once every row has ended);
    mesh: a jax.sharding.Mesh with axes ("data", "model") (see jaxkv.sharding.make_mesh): rows
    are split over "data", heads / MLP width / vocabulary over "model"; kv_dtype: the cache's
    dtype (init_cache's: float32, bfloat16, float16 or int8; default the params').
    """
    args, static = generate_args(params, prompts, max_new_tokens, **options)
    if static["on_token"] is None:
        return generate_loop(*args, **static)
    try:  # wait here, so that an exception on_token raised surfaces as itself
        return jax.block_until_ready(generate_loop(*args, **static))
    except jax.errors.JaxRuntimeError:
        if RaisedInCallback.errors:
            raise RaisedInCallback.errors.pop() from None
        raise


@dataclasses.dataclass(frozen=True)
class RaisedInCallback:
    """on_token as the compiled loop calls it: an exception it raises is kept, and generate
    raises it as itself instead of XLA's runtime error. Equal for the same function, so wrapping
    it never recompiles."""

    fn: Callable
    errors: ClassVar[list] = []

    def __call__(self, token_B):
        try:
            self.fn(token_B)
        except Exception as e:
            RaisedInCallback.errors[:] = [e]
            raise


def eos_ids(eos_id):
    """[E] int32 end-of-sequence ids ([-1]: none) from None, an id or a list of ids."""
    if eos_id is None:
        return jnp.array([-1], jnp.int32)
    ids = np.asarray(eos_id)
    if ids.ndim > 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise ValueError(f"eos_id must be a token id or a non-empty list of token ids, got "
                         f"{eos_id!r}")
    checks.in_range(ids, "eos_id", 0, checks.INT32_MAX, "is not a token id")
    return jnp.atleast_1d(jnp.asarray(ids, jnp.int32))


def pad_value(pad_id, eos_id, eos_E) -> int:
    """pad_id, checked; by default the first EOS id, or 0 without one."""
    if pad_id is None:
        pad_id = 0 if eos_id is None else int(eos_E[0])
    return checks.int_arg(pad_id, "pad_id", minimum=0)


def generate_args(params, prompts, max_new_tokens: int, *, lengths=None, temperature=0.0,
                  top_k=None, top_p=None, min_p=None, repetition_penalty=None, key=None,
                  eos_id=None, pad_id=None, max_len=None, on_token=None, encoder_inputs=None,
                  encoder_lengths=None, suppress_ids=None, begin_suppress_ids=None, mesh=None,
                  kv_dtype=None, stop=None, tokenizer=None):
    """Validated (args, static kwargs) for generate_loop; lets callers compile ahead of time."""
    c = params.config
    tokens_BT, lengths_B = prepare_prompts(c, prompts, lengths)
    B, T = tokens_BT.shape
    max_new_tokens = checks.int_arg(max_new_tokens, "max_new_tokens")
    capacity = capacity_for(params.config, T, max_new_tokens, lengths_B, max_len)
    sampling = sampling_params(B, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                               repetition_penalty=repetition_penalty)
    eos_E = eos_ids(eos_id)
    pad_id = pad_value(pad_id, eos_id, eos_E)
    suppress_V = token_mask(c, c.suppress_ids if suppress_ids is None else suppress_ids,
                            "suppress_ids")
    begin_V = token_mask(c, c.begin_suppress_ids if begin_suppress_ids is None else
                         begin_suppress_ids, "begin_suppress_ids")
    encoder = encoder_args(c, encoder_inputs, encoder_lengths, B)
    rows = (tokens_BT, lengths_B, sampling, row_keys(key, B))
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see jaxkv.sharding.make_mesh), got "
                        f"{type(mesh).__name__}")
    if mesh is not None:
        params = shard_params(params, mesh)
        rows = jax.tree.map(lambda x: shard_rows(x, mesh), rows)
        encoder = jax.tree.map(lambda x: shard_rows(x, mesh), encoder)
    args = (params, *rows, eos_E, jnp.int32(pad_id), suppress_V, begin_V,
            stops.tables(c, stop, tokenizer), *encoder)
    on_token = None if on_token is None else RaisedInCallback(on_token)
    kv_dtype = None if kv_dtype is None else checks.kv_dtype(kv_dtype, "kv_dtype")
    return args, dict(max_new_tokens=max_new_tokens, capacity=capacity, on_token=on_token,
                      mesh=mesh, kv_dtype=kv_dtype)
