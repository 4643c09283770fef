"""Argument validation: bad input gets an error naming the argument, what was expected and what
came.

Shapes, dtypes and the cache's layout are checked when a function is traced (they are static).
Values (token ids, positions, lengths) are checked at once when they are concrete, which is
how every entry point that takes them from the caller (generate, generate_many, prefill and
decode_step called with arrays, the command line) checks them where they come in; the loops
those entry points compile make their own positions and are traced `trusted()`.

Inside a caller's own jit / lax.scan / vmap, values are traced. On a CPU (by default) a check
is compiled into the program there: a lax.cond that, only when a value is out of range, calls
back to the host to raise a ValueError naming the entry, which reaches the caller (as a
jax.errors.JaxRuntimeError carrying that message) when the result is read. On a GPU or TPU that
cond would cost a host round trip per check and step (a GPU waits for the predicate), so there
the compiled checks are off by default: values are checked where they come in. JAXKV_VALUE_CHECKS
=1 or 0 in the environment, or set_value_checks(True / False), turns them on or off everywhere
(None: by platform again).
"""

import contextlib
import logging
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import ops
from jaxkv.core import cache as cache_lib
from jaxkv.core.cache import KVCache, ring_size, slots
from jaxkv.ops.arrays import HALF_DTYPES, HalfKV, Int8KV, PagedKV

MIN_BUCKET = 16
INT32_MAX = 2**31 - 1
_ENV = os.environ.get("JAXKV_VALUE_CHECKS", "")
_VALUE_CHECKS = {"on": None if _ENV == "" else _ENV != "0"}  # None: by platform


class OutOfRange(ValueError):
    """A token id, position or length outside what the model or cache can take."""


def set_value_checks(enabled: bool | None) -> None:
    """Turns the compiled value checks on or off on every platform (None: on where programs are
    built for a CPU, off on a GPU or TPU, the default). They are part of the traced program, so
    JAX's caches are cleared: every function traces again with the new setting."""
    _VALUE_CHECKS["on"] = None if enabled is None else bool_arg(enabled, "enabled")
    jax.clear_caches()


def compiled_checks() -> bool:
    """Whether a traced value is checked inside the program being traced (see the module's
    docstring)."""
    on = _VALUE_CHECKS["on"]
    return ops.platform() == "cpu" if on is None else on


@contextlib.contextmanager
def trusted():
    """Traces without compiled value checks: for a loop whose positions and slots it makes
    itself (they are checked where they come in). Such a program has no host callback, so
    JAX's persistent compilation cache can keep it."""
    was = _VALUE_CHECKS["on"]
    _VALUE_CHECKS["on"] = False
    try:
        yield
    finally:
        _VALUE_CHECKS["on"] = was


class _HideCheckTraceback(logging.Filter):
    """jax logs a failing callback's traceback before raising it; ours carry their own message."""

    def filter(self, record):
        return not (record.exc_info and isinstance(record.exc_info[1], OutOfRange))


logging.getLogger("jax._src.debugging").addFilter(_HideCheckTraceback())


def concrete(x):
    """x as a numpy array, or None when x is a tracer (inside jit / scan / vmap)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _out_of_range(name, low, high, what):
    """describe(values) -> the error message for the first entry outside [low, high), or None."""
    def describe(values):
        values = np.asarray(values)
        bad = (values < low) | (values >= high)
        if not bad.any():
            return None
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        index = f"[{', '.join(map(str, where))}]" if where else ""
        return f"{name}{index} = {int(values[where])} {what}"
    return describe


def _raise(describe, *values):
    message = describe(*values)
    if message:  # under vmap the callback runs for every row, bad or not
        raise OutOfRange(message)


def in_range(x, name: str, low: int, high: int, what: str):
    """Raises OutOfRange unless every entry of the int array x lies in [low, high): now if x is
    concrete, when the result is read if x is traced (and value checks are on). The message is
    "{name}[index] = {value} {what}"."""
    describe = _out_of_range(name, low, high, what)
    values = concrete(x)
    if values is not None:
        _raise(describe, values)
    elif compiled_checks():
        bad = jnp.any((x < low) | (x >= high))
        jax.lax.cond(bad, lambda: jax.debug.callback(_raise, describe, x), lambda: None)


def int_arg(value, name: str, minimum: int = 1, or_none: bool = False) -> int | None:
    """value as a Python int >= minimum (or None, where or_none allows it); numpy integer
    scalars are accepted, bools and floats are not."""
    expected = ("a positive int" if minimum == 1 else f"an int >= {minimum}") + (
        " or None" if or_none else "")
    if value is None and or_none:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {value!r} "
                        f"({type(value).__name__})") from None
    if n < minimum:
        raise ValueError(f"{name} must be {expected}, got {n}")
    return n


def bool_arg(value, name: str) -> bool:
    """value, which must be True or False (numpy's bools too): a string such as "no", a number
    or None is an error, never taken for its truth."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def float_dtype(dtype, name: str):
    """dtype as a jnp.dtype, which must be float32, bfloat16 or float16."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in FLOAT_DTYPES:
        got = repr(dtype) if dt is None else dt.name
        raise ValueError(f"{name} must be a float dtype ({', '.join(FLOAT_DTYPES)}), got {got}")
    return dt


def kv_dtype(dtype, name: str):
    """dtype as a jnp.dtype, which must be a float dtype or int8 (a cache's keys and values)."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in (*FLOAT_DTYPES, "int8"):
        got = repr(dtype) if dt is None else dt.name
        raise ValueError(f"{name} must be a float dtype ({', '.join(FLOAT_DTYPES)}) or int8, "
                         f"got {got}")
    return dt


def int_array(x, name: str, ndim: int, bounds=None, what: str = "is out of range"):
    """x as an int32 array of ndim dimensions. Its values are checked to lie in bounds
    (low, high) before the cast, and a concrete array of a wider dtype to fit int32, so an int64
    id never wraps around."""
    if isinstance(x, str) or (isinstance(x, (list, tuple)) and x and isinstance(x[0], str)):
        raise TypeError(f"{name} must be token ids (ints), got text {str(x)[:40]!r}: encode it "
                        "first, e.g. tokenizer.encode(text).ids")
    x = _as_array(x, name, ndim)
    if x.ndim != ndim:
        value = concrete(x)
        got = (f"the scalar {value.item()!r}" if x.ndim == 0 and value is not None else
               f"shape {tuple(x.shape)}")
        raise ValueError(f"{name} must have {ndim} dimension(s), got {got}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers (token ids, positions or lengths), got dtype "
                        f"{x.dtype}")
    if bounds is not None:
        in_range(x, name, *bounds, what)
    elif x.dtype.itemsize > 4 and concrete(x) is not None:
        in_range(x, name, -INT32_MAX - 1, INT32_MAX, "does not fit int32")
    return jnp.asarray(x, jnp.int32)


def _as_array(x, name: str, ndim: int):
    """x as a numpy array (a jax array as it is). Lists of rows of different lengths are an
    error naming x; empty lists hold ints (numpy would make them floats)."""
    if isinstance(x, jax.Array):
        return x
    try:
        array = np.asarray(x)
    except ValueError:  # numpy: "setting an array element with a sequence ... inhomogeneous"
        raise ValueError(f"{name} must be a {ndim}-D array of ints, got lists of different "
                         "lengths") from None
    if array.size == 0 and not isinstance(x, np.ndarray):
        return array.astype(np.int32)
    return array


def token_ids(config, x, name: str, ndim: int):
    """int_array of token ids: at least one, every entry in [0, vocab_size)."""
    ids = int_array(x, name, ndim, (0, config.vocab_size), "is not a token id: expected "
                    f"0 <= id < vocab_size ({config.vocab_size})")
    if ids.size == 0:
        raise ValueError(f"{name} is empty: expected at least one token id, got shape "
                         f"{tuple(ids.shape)}")
    return ids


def tokens_2d(config, tokens, name: str):
    tokens_BT = token_ids(config, tokens, name, 2)
    if tokens_BT.shape[1] > config.max_seq_len:
        raise ValueError(f"{name} has {tokens_BT.shape[1]} positions, more than the model's "
                         f"max_seq_len ({config.max_seq_len})")
    return tokens_BT


def cache_layout(config, cache, name: str = "cache"):
    """The cache must be one init_cache made for this model: layers, kv heads, head dim, a float
    dtype or int8, and cross-attention K/V exactly for encoder-decoder models. Shapes are
    static, so this costs nothing at run time."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"{name} must be a jaxkv.KVCache (from jaxkv.init_cache), got "
                        f"{type(cache).__name__}")
    B, S = cache.batch_size, cache.capacity
    if not isinstance(S, int) or S < 1:
        raise ValueError(f"{name}.capacity is {S!r}; make the cache with jaxkv.init_cache")
    expected = [(B, config.n_kv_heads, slots(config, i, S), config.head_dim)
                for i in range(config.n_layers)]
    _layers(config, cache, ("k", "v"), expected, name, "[batch, kv heads, slots, head dim]")
    R = ring_size(config, S)
    ring = None if cache.ring_pos is None else tuple(cache.ring_pos.shape)
    if ring != (None if R is None else (B, R)):
        raise ValueError(f"{name}.ring_pos has shape {ring}; this model needs "
                         f"{None if R is None else (B, R)} (the position each slot of a window "
                         "layer's ring holds): make the cache with jaxkv.init_cache")
    if config.is_encoder_decoder:
        if cache.cross_k is None or cache.cross_v is None or cache.cross_mask is None:
            raise ValueError(f"{name} has no cross-attention K/V, but this is an "
                             "encoder-decoder model: make it with init_cache(params, ..., "
                             "encoder_inputs=...)")
        M = cache.cross_mask.shape[-1]
        cross = [(B, config.n_kv_heads, M, config.head_dim)] * config.n_layers
        _layers(config, cache, ("cross_k", "cross_v"), cross, name,
                "[batch, kv heads, encoder positions, head dim]")
        if cache.cross_mask.shape != (B, M):
            raise ValueError(f"{name}.cross_mask has shape {cache.cross_mask.shape}, expected "
                             f"{(B, M)}")
    elif cache.cross_k is not None:
        raise ValueError(f"{name} holds cross-attention K/V, but this is a decoder-only model")


def _layers(config, cache, fields, expected, name, layout):
    readable = dict(zip(("k", "v"), cache_lib.readable(cache)))
    for field in fields:
        arrays = readable.get(field, getattr(cache, field))
        if len(arrays) != config.n_layers:
            raise ValueError(f"{name}.{field} has {len(arrays)} layers; the model has "
                             f"{config.n_layers}")
        for layer, (x, shape) in enumerate(zip(arrays, expected)):
            if tuple(x.shape) != shape:
                raise ValueError(f"{name}.{field}[{layer}] has shape {tuple(x.shape)}; this "
                                 f"model needs {shape} {layout}")
            _stored(x, f"{name}.{field}[{layer}]")


def _stored(x, name: str):
    """A layer's keys or values: a float array, an Int8KV with a float32 scale per vector, or a
    HalfKV (bfloat16 or float16 bits); or a PagedKV of one of them, with an int32 table."""
    if isinstance(x, PagedKV):
        if x.table.dtype != jnp.int32 or x.table.ndim != 2:
            raise TypeError(f"{name.split('.')[0]}.table must be int32 [batch, blocks per row], "
                            f"got {x.table.dtype} {tuple(x.table.shape)}")
        x, name = x.pool, f"{name}.pool"
    if isinstance(x, Int8KV):
        if x.q.dtype != jnp.int8 or x.scale.dtype != jnp.float32:
            raise TypeError(f"{name} is Int8KV with q {x.q.dtype}, scale {x.scale.dtype}; "
                            "expected int8 and float32 (make it with jaxkv.init_cache)")
        if tuple(x.scale.shape) != tuple(x.q.shape[:-1]):
            raise ValueError(f"{name}.scale has shape {tuple(x.scale.shape)}, expected "
                             f"{tuple(x.q.shape[:-1])} (one per token and kv head)")
    elif isinstance(x, HalfKV):
        if x.bits.dtype != jnp.uint16 or x.dtype not in HALF_DTYPES:
            raise TypeError(f"{name} is HalfKV of {x.dtype} with bits {x.bits.dtype}; expected "
                            "bfloat16 or float16 as uint16 (make it with jaxkv.init_cache)")
    elif not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} has dtype {x.dtype}; expected a float dtype (float32, bfloat16 "
                        "or float16) or Int8KV")


def fits_ring(T: int, ring_slots: int):
    """One call writes at most a ring's worth of tokens per row (more would overwrite each other
    within the call)."""
    if T > ring_slots:
        raise ValueError(f"extend: {T} tokens in one call, but the sliding-window layers keep a "
                         f"ring of {ring_slots} slots; pass at most {ring_slots} tokens per call "
                         "(prefill splits longer prompts itself)")


def ring_holds(ring_pos_BR, first_B, active_B, window: int):
    """A window layer's ring must hold the window's positions before each row's first token of
    this call (first_B, rows where active_B): a row that goes back more than one position once
    past its window finds newer positions in their slots."""
    need_B = jnp.minimum(first_B, window - 1)
    near_BR = ((ring_pos_BR < first_B[:, None]) &
               (ring_pos_BR > jnp.maximum(first_B[:, None] - window, -1)))
    missing_B = jnp.where(active_B, need_B - near_BR.sum(1), 0)
    in_range(missing_B, "positions missing from the window before this call's first token, row",
             0, 1, f"(a row that passed its sliding window of {window} positions may go back at "
             "most one position; prefill it again from an earlier position)")


def linear_decoder(config, what: str):
    """Forests, trees and shared prefixes need a decoder-only model whose every layer keeps a
    linear cache: RoPE or learned positions, no sliding window."""
    if config.is_encoder_decoder or config.position == "relative":
        raise ValueError(f"{what} supports decoder-only models with RoPE or learned positions")
    no_window(config, what)


def no_window(config, what: str):
    """MultiDecode reads linear caches (slot s holds position s) only, for now."""
    if config.sliding_window is not None:
        raise ValueError(f"{what} is not supported on sliding-window models yet (this model's "
                         f"layers {list(config.window_layers)} read a window of "
                         f"{config.sliding_window} positions)")


def prefill_args(config, cache, tokens, lengths, start):
    cache_layout(config, cache)
    tokens_BT = tokens_2d(config, tokens, "tokens")
    B, T = tokens_BT.shape
    if B != cache.batch_size:
        raise ValueError(f"tokens has {B} rows but the cache has {cache.batch_size}")
    lengths_B = jnp.full((B,), T, jnp.int32) if lengths is None else int_array(
        lengths, "lengths", 1, (1, T + 1), f"is not a prompt length: expected 1 <= length <= "
        f"{T} (empty prompts are not allowed)")
    start_B = jnp.zeros((B,), jnp.int32) if start is None else int_array(
        start, "start", 1, (0, cache.capacity), f"is not a cache slot: expected 0 <= start < "
        f"capacity ({cache.capacity})")
    for name, x in (("lengths", lengths_B), ("start", start_B)):
        if x.shape != (B,):
            raise ValueError(f"{name} must have shape ({B},) to match tokens, got {x.shape}")
    in_range(start_B + lengths_B, "start + lengths", 1, cache.capacity + 1,
             f"slots are needed: the prompt is longer than the cache (capacity "
             f"{cache.capacity})")
    return tokens_BT, lengths_B, start_B


def decode_args(config, cache, token, pos):
    cache_layout(config, cache)
    B = cache.batch_size
    token_B = token_ids(config, token, "token", 1)
    pos_B = int_array(pos, "pos", 1, (0, cache.capacity), "is outside the cache: expected 0 "
                      f"<= pos < capacity ({cache.capacity})")
    if token_B.shape != (B,) or pos_B.shape != (B,):
        raise ValueError(f"token and pos must have shape ({B},) to match the cache, got "
                         f"{tuple(token_B.shape)} and {tuple(pos_B.shape)}")
    return token_B, pos_B


def bucket_len(n: int) -> int:
    """Prompt-length bucket: powers of two from 16 up to 512, then multiples of 512."""
    if n <= 512:
        return max(MIN_BUCKET, 1 << (n - 1).bit_length())
    return -(-n // 512) * 512


def pad_to_bucket(tokens_BT, pad_id: int = 0):
    T = tokens_BT.shape[1]
    return jnp.pad(tokens_BT, ((0, 0), (0, bucket_len(T) - T)), constant_values=pad_id)


def encoder_args(config, encoder_inputs, encoder_lengths, batch_size=None):
    """Validated (inputs, lengths_B or None) for an encoder: tokens [B, M] or audio features
    [B, n_mels, frames]; batch_size, when given, must match B."""
    if not config.is_encoder_decoder:
        raise ValueError("encoder_inputs given, but this is a decoder-only model")
    if encoder_inputs is None:
        raise ValueError("this encoder-decoder model needs encoder_inputs (tokens [B, M] for "
                         "T5, log-mel features [B, n_mels, frames] for Whisper)")
    x = encoder_inputs if isinstance(encoder_inputs, jax.Array) else np.asarray(encoder_inputs)
    inputs, lengths = (_audio_features(config.encoder, x, encoder_lengths)
                       if config.encoder.input == "audio" else
                       _encoder_tokens(config, x, encoder_lengths))
    if batch_size is not None and inputs.shape[0] != batch_size:
        raise ValueError(f"encoder_inputs has {inputs.shape[0]} rows, expected {batch_size} (one "
                         "per decoder row)")
    return inputs, lengths


def _audio_features(e, x, encoder_lengths):
    if encoder_lengths is not None:
        raise ValueError("encoder_lengths is for token encoders; Whisper attends over the "
                         "whole 30 s window (shorter audio is padded with silence by "
                         "jaxkv.log_mel)")
    expected = (e.n_mels, e.max_input_len)
    if x.ndim != 3 or tuple(x.shape[1:]) != expected:
        raise ValueError(f"encoder_inputs must be log-mel features [B, {expected[0]}, "
                         f"{expected[1]}] (use jaxkv.log_mel, which pads audio to 30 s), got "
                         f"shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"encoder_inputs must be float log-mel features, got {x.dtype}")
    finite(x, "encoder_inputs", "log-mel features")
    return jnp.asarray(x, jnp.float32), None


def finite(x, name: str, what: str):
    """A concrete float array must hold no NaN or infinity (they would decode to nothing)."""
    values = concrete(x)
    if values is not None and not np.isfinite(values).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(values))[0])
        raise ValueError(f"{name} holds {values[where]} at {list(where)}: {what} must be finite "
                         "numbers")


def _encoder_tokens(config, x, encoder_lengths):
    tokens_BM = token_ids(config, x, "encoder_inputs", 2)
    B, M = tokens_BM.shape
    if M == 0 or M > config.encoder.max_input_len:
        raise ValueError(f"encoder_inputs has {M} tokens; the encoder takes 1 to "
                         f"{config.encoder.max_input_len}")
    if encoder_lengths is None:
        return tokens_BM, None
    lengths_B = int_array(encoder_lengths, "encoder_lengths", 1, (1, M + 1),
                          f"is not an encoder input length: expected 1 <= length <= {M}")
    if lengths_B.shape != (B,):
        raise ValueError(f"encoder_lengths must have shape ({B},), got {lengths_B.shape}")
    return tokens_BM, lengths_B
