"""The compiled side of continuous batching (see batching.py): the state of batch_size rows,
each serving one prompt at a time, one program that prefills a piece of a prompt into one row,
and one that decodes every row until some row ends."""

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.core import cache as cache_lib
from jaxkv.core import checks
from jaxkv.core import hooks as hooks_lib
from jaxkv.core.attention import causal_mask
from jaxkv.core.cache import KVCache
from jaxkv.core.decoder import cached_pass, init_cache, logits, prefill_padded
from jaxkv.core.sharding import cache_shardings, place, shard_rows
from jaxkv.core.tracecount import count_trace
from jaxkv.decoding import rows as answers_lib
from jaxkv.decoding.sampling import SamplingParams, row_keys, sampling_params
from jaxkv.decoding.stops import StopStrings


@struct.dataclass
class Rows:
    """batch_size rows, each serving one prompt at a time (B rows, N = the largest budget)."""

    cache: KVCache
    logits: jax.Array  # [B, V] float32: the next token's
    pos: jax.Array  # [B] int32: where the row's next token goes
    keys: jax.Array  # [B] keys: the row's prompt's (fold_in(key, prompt index))
    budget: jax.Array  # [B] int32: the row's prompt's max_new_tokens
    sampling: SamplingParams  # [B] each: the row's prompt's
    answers: answers_lib.Answers  # done: ended, idle, or its prompt still being admitted
    acts: dict = struct.field(default_factory=dict)  # hooks' captures [.., B, capacity, D]


def empty_rows(params, batch_size: int, capacity: int, max_new_tokens: int,
               stop_prefixes: int = 0, logprobs: int | None = None, paging=None,
               hooks=None, free_state=None) -> Rows:
    """paging: a blocks.Paging (the global layers then a pool of its size), or None; hooks:
    their captures' buffers, by position; free_state: where constrained, the automaton's state
    of a row without a constraint (every row's until admitted)."""
    B, V = batch_size, params.config.vocab_size
    answers = answers_lib.empty(B, max_new_tokens, stop_prefixes, seen_BV=jnp.zeros((B, V), bool),
                                done_B=jnp.ones((B,), bool), logprobs=logprobs,
                                state_B=None if free_state is None else jnp.full(
                                    (B,), free_state, jnp.int32))
    blocks = {} if paging is None else dict(block_size=paging.pool.size,
                                            blocks=paging.pool.blocks)
    return Rows(init_cache(params, B, capacity, **blocks), jnp.zeros((B, V), jnp.float32),
                jnp.zeros((B,), jnp.int32), row_keys(None, B), jnp.zeros((B,), jnp.int32),
                sampling_params(B), answers,
                hooks_lib.empty_acts(hooks, params.config, B, capacity, params.embed.dtype,
                                     capacity))


def placed(rows: Rows, mesh) -> Rows:
    """rows split over the mesh's data axis (the cache's kv heads over its model axis)."""
    if mesh is None:
        return rows
    cache = jax.tree.map(place, rows.cache, cache_shardings(rows.cache, mesh))
    return shard_rows(rows.replace(cache=None), mesh).replace(cache=cache)


@functools.partial(jax.jit, donate_argnames="rows")
def admit(params, rows: Rows, row, tokens_P, length, start, key, budget, sampling, first,
          table_M=None, seen_V=None, hooks=None, state=None) -> Rows:
    """Prefills tokens_P[:length] into row `row` at positions start.. (first: a new prompt's
    first piece, which forgets the row's last prompt). The row starts decoding once start +
    length is the whole prompt, i.e. when called with its last piece: the caller says so through
    budget > 0. key and sampling (scalars each) are the prompt's own. A paged cache's row reads
    and writes through table_M; seen_V: the prompt's tokens before start that the row did not
    compute (read from blocks another prompt computed), for the repetition penalty. hooks:
    edits applied, captures written at the row's positions. state: the start of the prompt's
    constraint's automaton (where constrained)."""
    count_trace("admit")
    with checks.trusted():  # row, start and length come from Schedule, which checked them
        return _admit(params, rows, row, tokens_P, length, start, key, budget, sampling, first,
                      table_M, seen_V, hooks, state)


def _admit(params, rows: Rows, row, tokens_P, length, start, key, budget, sampling, first,
           table_M, seen_V, hooks, state) -> Rows:
    cache_1 = cache_lib.row_of(rows.cache, row)
    if table_M is not None:
        cache_1 = cache_lib.with_table(cache_1, table_M[None])
    if cache_1.ring_pos is not None:  # a new prompt: the ring's positions are another row's
        cache_1 = cache_1.replace(ring_pos=jnp.where(first, -1, cache_1.ring_pos))
    logits_1V, cache_1, *acts = prefill_padded(params, cache_1, tokens_P[None], length[None],
                                               start[None], hooks=hooks)
    if acts:
        t_P = jnp.arange(tokens_P.shape[0])
        at_1P = jnp.where(t_P < length, start + t_P, rows.cache.capacity)[None]
        rows = rows.replace(acts=hooks_lib.put_positions(rows.acts, acts[0], row[None], at_1P))
    a = rows.answers
    before_V = jnp.where(first, False if seen_V is None else seen_V, a.seen[row])
    seen_V = before_V | answers_lib.prompt_seen(a.seen.shape[1], tokens_P[None], length[None])[0]
    return rows.replace(cache=cache_lib.with_row(rows.cache, cache_1, row),
                        logits=rows.logits.at[row].set(logits_1V[0]),
                        pos=rows.pos.at[row].set(start + length), keys=rows.keys.at[row].set(key),
                        budget=rows.budget.at[row].set(budget),
                        sampling=jax.tree.map(lambda x, v: x.at[row].set(v), rows.sampling,
                                              sampling),
                        answers=answers_lib.restart(a, row, seen_V, budget == 0, state))


@functools.partial(jax.jit, donate_argnames="rows")
def decode(params, rows: Rows, eos_E, stop: StopStrings, max_steps, hooks=None,
           automaton=None) -> Rows:
    """Up to max_steps tokens for every decoding row; returns early once some row ends (EOS,
    a stop string, its constraint, or its budget). hooks: edits applied, captures written at
    the positions; automaton: the rows' constraints (constraints.Automaton), or None."""
    count_trace("decode_rows")
    with checks.trusted():  # positions stay below the capacity Schedule checked
        return _decode(params, rows, eos_E, stop, max_steps, hooks, automaton)


def _decode(params, rows: Rows, eos_E, stop: StopStrings, max_steps, hooks, automaton) -> Rows:
    B, V = rows.pos.shape[0], params.config.vocab_size

    def step(carry):
        rows, n, _ = carry
        banned_BV = None if automaton is None else ~answers_lib.allowed(
            rows.answers, automaton, rows.budget, eos_E, V)
        token_B = answers_lib.draw(rows.answers, rows.logits, rows.sampling, rows.keys,
                                   banned_BV)
        answers = answers_lib.record_logprobs(rows.answers, rows.logits, token_B)
        answers, ended_B = answers_lib.append(answers, token_B[:, None],
                                              jnp.ones((B,), jnp.int32), eos_E, stop, rows.budget,
                                              automaton)
        going_B = ~answers.done
        pos_B1, capacity = rows.pos[:, None], rows.cache.capacity
        tap = hooks_lib.tap_for(hooks, pos_B1, params.config, n_keys=capacity)
        x_B1D, cache = cached_pass(params, rows.cache, token_B[:, None], pos_B1,
                                   jnp.where(going_B[:, None], pos_B1, capacity),
                                   causal_mask(pos_B1, capacity),
                                   kv_len=jnp.max(jnp.where(going_B, rows.pos, 0)) + 1, tap=tap)
        logits_BV = logits(params, x_B1D, tap)[:, 0]
        acts = rows.acts if tap is None else hooks_lib.put_rows(
            rows.acts, tap.captured(), jnp.where(going_B, rows.pos, capacity))
        rows = rows.replace(cache=cache, logits=logits_BV, pos=rows.pos + going_B,
                            answers=answers, acts=acts)
        return rows, n + 1, ended_B.any()

    def more(carry):
        rows, n, ended = carry
        return (n < max_steps) & ~ended & ~rows.answers.done.all()

    rows, _, _ = jax.lax.while_loop(more, step, (rows, jnp.int32(0), False))
    return rows
