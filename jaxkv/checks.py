"""Argument validation: bad input gets an error naming the argument, what was expected and what
came. Value checks run only on concrete arrays; under jit they are skipped (shapes still checked).
"""

import jax
import jax.numpy as jnp
import numpy as np

MIN_BUCKET = 16


def concrete(x):
    """x as a numpy array, or None when x is a tracer (inside jit / scan / vmap)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def int_array(x, name: str, ndim: int):
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer token ids/positions, got dtype {x.dtype}")
    return jnp.asarray(x, jnp.int32)


def token_range(config, tokens, name: str):
    values = concrete(tokens)
    if values is not None and values.size:
        bad = (values < 0) | (values >= config.vocab_size)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name}{list(where)} = {int(values[where])} is not a token id: "
                             f"expected 0 <= id < vocab_size ({config.vocab_size})")


def tokens_2d(config, tokens, name: str):
    tokens_BT = int_array(tokens, name, 2)
    if tokens_BT.shape[1] == 0:
        raise ValueError(f"{name} is empty: shape {tuple(tokens_BT.shape)}")
    if config.position == "learned" and tokens_BT.shape[1] > config.max_seq_len:
        raise ValueError(f"{name} has {tokens_BT.shape[1]} positions; the model has "
                         f"{config.max_seq_len} learned positions")
    token_range(config, tokens_BT, name)
    return tokens_BT


def prefill_args(config, cache, tokens, lengths, start):
    tokens_BT = tokens_2d(config, tokens, "tokens")
    B, T = tokens_BT.shape
    if B != cache.batch_size:
        raise ValueError(f"tokens has {B} rows but the cache has {cache.batch_size}")
    lengths_B = jnp.full((B,), T, jnp.int32) if lengths is None else int_array(lengths, "lengths", 1)
    start_B = jnp.zeros((B,), jnp.int32) if start is None else int_array(start, "start", 1)
    for name, x in (("lengths", lengths_B), ("start", start_B)):
        if x.shape != (B,):
            raise ValueError(f"{name} must have shape ({B},) to match tokens, got {x.shape}")
    lengths, start = concrete(lengths_B), concrete(start_B)
    if lengths is not None and ((lengths < 1) | (lengths > T)).any():
        raise ValueError(f"lengths must be in [1, {T}] (empty prompts are not allowed), got "
                         f"{lengths.tolist()}")
    if start is not None and (start < 0).any():
        raise ValueError(f"start must be >= 0, got {start.tolist()}")
    if lengths is not None and start is not None and (start + lengths > cache.capacity).any():
        row = int(np.argmax(start + lengths > cache.capacity))
        raise ValueError(f"prompt longer than the cache: row {row} needs "
                         f"{int(start[row] + lengths[row])} slots, the cache holds "
                         f"{cache.capacity}")
    return tokens_BT, lengths_B, start_B


def decode_args(config, cache, token, pos):
    token_B, pos_B = int_array(token, "token", 1), int_array(pos, "pos", 1)
    B = cache.batch_size
    if token_B.shape != (B,) or pos_B.shape != (B,):
        raise ValueError(f"token and pos must have shape ({B},) to match the cache, got "
                         f"{tuple(token_B.shape)} and {tuple(pos_B.shape)}")
    token_range(config, token_B, "token")
    pos = concrete(pos_B)
    if pos is not None and ((pos < 0) | (pos >= cache.capacity)).any():
        raise ValueError(f"pos must be in [0, {cache.capacity}) (the cache capacity), got "
                         f"{pos.tolist()}")
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
    return jnp.asarray(x, jnp.float32), None


def _encoder_tokens(config, x, encoder_lengths):
    tokens_BM = int_array(x, "encoder_inputs", 2)
    B, M = tokens_BM.shape
    if M == 0 or M > config.encoder.max_input_len:
        raise ValueError(f"encoder_inputs has {M} tokens; the encoder takes 1 to "
                         f"{config.encoder.max_input_len}")
    token_range(config, tokens_BM, "encoder_inputs")
    if encoder_lengths is None:
        return tokens_BM, None
    lengths_B = int_array(encoder_lengths, "encoder_lengths", 1)
    lengths = concrete(lengths_B)
    if lengths_B.shape != (B,) or (lengths is not None and ((lengths < 1) | (lengths > M)).any()):
        raise ValueError(f"encoder_lengths must have shape ({B},) with values in [1, {M}], got "
                         f"{lengths_B.shape} {None if lengths is None else lengths.tolist()}")
    return tokens_BM, lengths_B
