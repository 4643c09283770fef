"""Beam search over one prompt, as Hugging Face's generate(num_beams=...) runs it: the prompt's
K/V are stored once (a MultiDecode prefix), and each step reorders only the beams' own."""

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.core import checks
from jaxkv.core.cache import KVCache
from jaxkv.core.decoder import init_cache
from jaxkv.core.tracecount import count_trace
from jaxkv.decoding.multidecode import Prefix, branch_step, check_positions, make_prefix
from jaxkv.decoding.prompts import eos_ids, pad_value

NEG = -1.0e9  # Hugging Face's "impossible" score, kept so that results match its beam search


@struct.dataclass
class _Beams:
    cache: KVCache  # per layer [nb, K, T, H]: each running beam's own tokens (the prompt is shared)
    logits: jax.Array  # [nb, V] after each running beam's last token
    running: jax.Array  # [nb, T] running beams' tokens
    running_score: jax.Array  # [nb] sum of log-probs
    best: jax.Array  # [nb, T] finished hypotheses, best first
    best_score: jax.Array  # [nb] length-penalized; NEG where none
    best_length: jax.Array  # [nb]
    finished: jax.Array  # [nb] bool
    improvable: jax.Array  # [] bool: can a running beam still beat the worst finished one
    stopped: jax.Array  # [] bool


def _beam_step(params, prefix, eos_E, length_penalty, s: _Beams, t):
    """One step of Hugging Face's beam search (transformers 5, early_stopping=False)."""
    nb, T = s.running.shape
    V = s.logits.shape[-1]
    K = max(2, 1 + eos_E.shape[0]) * nb
    logp_nV = jax.nn.log_softmax(s.logits, axis=-1) + s.running_score[:, None]
    vals_K, flat_K = jax.lax.top_k(logp_nV.reshape(-1), K)
    beam_K, token_K = flat_K // V, (flat_K % V).astype(jnp.int32)
    seq_KT = s.running[beam_K].at[:, t].set(token_K)
    hits_K = jnp.isin(token_K, eos_E) | (t == T - 1)
    # Running beams: the best nb candidates that did not just end.
    live_K = vals_K + hits_K * NEG
    _, keep = jax.lax.top_k(live_K, nb)
    # Finished hypotheses: the candidates among the top nb that just ended.
    ended_K = hits_K & (jnp.arange(K) < nb)
    final_K = vals_K / ((t + 1.0) ** length_penalty) + (~s.improvable) * NEG + (~ended_K) * NEG
    merged = jnp.concatenate([s.best_score, final_K])
    _, top = jax.lax.top_k(merged, nb)
    best = jnp.concatenate([s.best, seq_KT])[top]
    best_score = merged[top]
    best_length = jnp.concatenate([s.best_length, jnp.full((K,), t + 1, jnp.int32)])[top]
    finished = jnp.concatenate([s.finished, ended_K])[top]
    running_score = live_K[keep]
    worst_n = jnp.where(finished, best_score.min(), NEG)
    improvable = s.improvable & jnp.any(running_score[0] / ((t + 1.0) ** length_penalty)
                                        > worst_n)
    stopped = ~improvable | jnp.all(hits_K)
    cache = jax.tree.map(lambda x: x[beam_K[keep]], s.cache)  # rows follow their beams
    logits_nV, cache = jax.lax.cond(
        stopped, lambda: (s.logits, cache),
        lambda: branch_step(params, prefix, cache, token_K[keep], t))
    return _Beams(cache, logits_nV, seq_KT[keep], running_score, best, best_score, best_length,
                  finished, improvable, stopped)


@functools.partial(jax.jit, static_argnames=("beam_size", "max_new_tokens"))
def _beam_search(params, prefix: Prefix, eos_E, length_penalty, *, beam_size, max_new_tokens):
    count_trace("beam_search")
    nb, T, V = beam_size, max_new_tokens, params.config.vocab_size
    state = _Beams(
        cache=init_cache(params, nb, T, prefix.cache.dtype),
        logits=jnp.broadcast_to(prefix.logits[0], (nb, V)),
        running=jnp.zeros((nb, T), jnp.int32),
        running_score=jnp.full((nb,), NEG).at[0].set(0.0),  # one live beam at the start
        best=jnp.zeros((nb, T), jnp.int32), best_score=jnp.full((nb,), NEG),
        best_length=jnp.zeros((nb,), jnp.int32), finished=jnp.zeros((nb,), bool),
        improvable=jnp.array(True), stopped=jnp.array(False))

    def step(s, t):
        new = _beam_step(params, prefix, eos_E, length_penalty, s, t)
        return jax.tree.map(lambda old, x: jnp.where(s.stopped, old, x), s, new), None

    s, _ = jax.lax.scan(step, state, jnp.arange(T))
    return s.best, s.best_score, s.best_length


def beam_search(params, prompt, beam_size: int, max_new_tokens: int, *, length_penalty=1.0,
                eos_id=None, pad_id=None, kv_dtype=None):
    """Beam search over one prompt, as Hugging Face's generate(num_beams=beam_size,
    early_stopping=False): (tokens [beam_size, max_new_tokens], scores [beam_size], lengths
    [beam_size]), best first. Scores are summed log-probs / length ** length_penalty (length in
    generated tokens, EOS included); tokens past a length are pad_id (default: the EOS id).
    The prompt's K/V are stored once; each step reorders only the beams' own tokens' K/V.
    kv_dtype: the caches' (init_cache's dtype).
    """
    beam_size = checks.int_arg(beam_size, "beam_size")
    max_new_tokens = checks.int_arg(max_new_tokens, "max_new_tokens")
    if beam_size * 2 > params.config.vocab_size:
        raise ValueError(f"beam_size={beam_size} needs a vocabulary of at least {2 * beam_size}")
    checks.token_ids(params.config, prompt, "prompt", 1)
    prefix = make_prefix(params, list(prompt), kv_dtype=kv_dtype)
    check_positions(params, prefix, max_new_tokens)
    eos_E = eos_ids(params.config, eos_id)
    pad = pad_value(params.config, pad_id, eos_id, eos_E)
    tokens, scores, lengths = _beam_search(params, prefix, eos_E, jnp.float32(length_penalty),
                                           beam_size=beam_size, max_new_tokens=max_new_tokens)
    tokens = jnp.where(jnp.arange(max_new_tokens) < lengths[:, None], tokens, pad)
    return tokens, scores, lengths
