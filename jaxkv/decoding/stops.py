"""Stop strings checked on token ids inside the compiled loop.

A stop string may end inside a token, span several tokens, or sit inside one token with text
on either side. Each row carries which prefixes of which stop strings its text ends with (M
flags: one per stop string and prefix length 1..len-1); a token, with its text w, stops the
row when a stop string lies inside w or when w starts with the rest of a prefix the row ends
with; the flags it leaves are the prefixes w itself ends with and the prefixes it extends. All
of that is a table lookup per token: tables [V, M] built once from each token's text.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class StopStrings:
    """Lookup tables for a list of stop strings (M = the sum of their lengths - 1)."""

    inside: jax.Array  # [V] bool: a stop string lies inside the token's text
    completes: jax.Array  # [V, M] bool: the text starts with what prefix m lacks of its string
    ends_with: jax.Array  # [V, M] bool: the text ends with prefix m
    extends: jax.Array  # [V, M] int32: the prefix m becomes when the text continues it, or M
    texts: tuple = struct.field(pytree_node=False, default=())  # the stop strings


def texts_of(stop) -> list[str]:
    """The stop strings of `stop`: None -> none; a string -> that one stop; a list or tuple ->
    its strings; StopStrings -> the strings it was built from. Each must be non-empty (an empty
    stop would end every answer before its first token)."""
    if stop is None:
        return []
    if isinstance(stop, StopStrings):
        return list(stop.texts)
    texts = [stop] if isinstance(stop, str) else stop
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if not all(texts):
        raise ValueError(f"stop strings must not be empty (an empty one would end every answer "
                         f"at once), got {stop!r}")
    return list(texts)


def stop_strings(tokenizer, texts, vocab_size: int) -> StopStrings:
    """Tables for texts (a string, one stop, or a list of non-empty strings) over the ids
    0..vocab_size-1, reading each token's text with tokenizer.decode([id]) (special tokens have
    none)."""
    texts = texts_of(texts)
    prefixes = [(s, k) for s in texts for k in range(1, len(s))]
    index = {p: m for m, p in enumerate(prefixes)}
    M = len(prefixes)
    inside = np.zeros((vocab_size,), bool)
    completes, ends_with = np.zeros((2, vocab_size, M), bool)
    extends = np.full((vocab_size, M), M, np.int32)
    for v in range(vocab_size):
        w = tokenizer.decode([v], skip_special_tokens=True)
        inside[v] = any(s in w for s in texts)
        for m, (s, k) in enumerate(prefixes):
            completes[v, m] = w.startswith(s[k:])
            ends_with[v, m] = w.endswith(s[:k])
            if s[k:].startswith(w) and k + len(w) < len(s):
                extends[v, m] = index[(s, k + len(w))]
    return StopStrings(jnp.asarray(inside), jnp.asarray(completes), jnp.asarray(ends_with),
                       jnp.asarray(extends), tuple(texts))


def tables(config, stop, tokenizer=None) -> StopStrings:
    """StopStrings from None (none), built tables (for this model's vocabulary), or a string or
    list of strings with the tokenizer."""
    if isinstance(stop, StopStrings):
        if stop.inside.shape[0] != config.vocab_size:
            raise ValueError(f"stop: these tables were built for a vocabulary of "
                             f"{stop.inside.shape[0]} tokens; the model has {config.vocab_size} "
                             "(build them with jaxkv.stop_strings(tokenizer, stop, vocab_size))")
        return stop
    if not texts_of(stop):
        return no_stop_strings(config.vocab_size)
    if tokenizer is None:
        raise ValueError("stop strings need the tokenizer: pass tokenizer=, or build the "
                         "tables once with jaxkv.stop_strings(tokenizer, stop, vocab_size)")
    return stop_strings(tokenizer, stop, config.vocab_size)


def no_stop_strings(vocab_size: int) -> StopStrings:
    """Tables that never stop (M = 0)."""
    return StopStrings(jnp.zeros((vocab_size,), bool), jnp.zeros((vocab_size, 0), bool),
                       jnp.zeros((vocab_size, 0), bool), jnp.zeros((vocab_size, 0), jnp.int32))


def step(stops: StopStrings, ends_BM, token_B):
    """(stopped [B], ends [B, M]) after each row's text grew by token_B's."""
    M = ends_BM.shape[1]
    stopped_B = stops.inside[token_B] | (ends_BM & stops.completes[token_B]).any(1)
    carried_BM = jnp.zeros_like(ends_BM).at[jnp.arange(token_B.shape[0])[:, None],
                                            stops.extends[token_B]].max(ends_BM, mode="drop")
    return stopped_B, (stops.ends_with[token_B] | carried_BM) if M else ends_BM


def cut(text: str, texts) -> str:
    """text up to the first stop string in it (texts: a string or a list of non-empty
    strings)."""
    ends = [text.find(s) for s in texts_of(texts) if s in text]
    return text[: min(ends)] if ends else text
