"""What every decoding loop keeps for each row of its batch, and does with it.

A row's Answer is the tokens drawn so far, whether the row has ended, the tokens its repetition
penalty applies to and the stop-string prefixes its text ends with. generate, generate_many
and speculative_generate draw with `draw` (or their own tree draws) and record with `append`,
so a row ends the same way in each: at an end id, a completed stop string, or its budget.
"""

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.decoding import constraints, stops
from jaxkv.decoding.sampling import sample


@struct.dataclass
class Answers:
    """B rows, answers of up to N tokens."""

    tokens: jax.Array  # [B, N] int32: each row's answer, pad where not drawn
    length: jax.Array  # [B] int32: tokens in the answer (the index of the next)
    done: jax.Array  # [B] bool: the row has ended, or serves nothing
    seen: jax.Array | None  # [B, V] bool: the repetition penalty's tokens; None: no penalty
    ends: jax.Array  # [B, M] bool: the stop-string prefixes the answer ends with (stops.py)
    # where asked for (None otherwise), each token's log-probability under the model's own
    # distribution (its logits' softmax, before temperature or penalties), and the k likeliest
    logprob: jax.Array | None = None  # [B, N] float32
    top_ids: jax.Array | None = None  # [B, N, k] int32
    top_logprob: jax.Array | None = None  # [B, N, k] float32
    # where constrained (None otherwise), each row's state in the automaton (constraints.py)
    state: jax.Array | None = None  # [B] int32


def empty(batch_size: int, max_tokens: int, stop_prefixes: int = 0, pad_id=0, seen_BV=None,
          done_B=None, logprobs: int | None = None, state_B=None) -> Answers:
    """Answers with nothing drawn. seen_BV: where the repetition penalty starts (each row's
    prompt, see prompt_seen), or None for a loop without one; done_B: rows that serve nothing
    yet (default none); logprobs: None, or k: keep each token's log-probability and the k
    likeliest (see record_logprobs); state_B: each row's start in a constraints.Automaton, or
    None for a loop without one."""
    B, N = batch_size, max_tokens
    k = logprobs or 0
    scored = {} if logprobs is None else dict(
        logprob=jnp.zeros((B, N), jnp.float32), top_ids=jnp.zeros((B, N, k), jnp.int32),
        top_logprob=jnp.zeros((B, N, k), jnp.float32))
    return Answers(tokens=jnp.full((B, N), pad_id, jnp.int32), length=jnp.zeros((B,), jnp.int32),
                   done=jnp.zeros((B,), bool) if done_B is None else done_B, seen=seen_BV,
                   ends=jnp.zeros((B, stop_prefixes), bool), state=state_B, **scored)


def prompt_seen(vocab_size: int, prompt_BT, lengths_B):
    """[B, V] bool: the tokens of each row's prompt (prompt_BT[b, :lengths_B[b]])."""
    B, T = prompt_BT.shape
    ids_BT = jnp.where(jnp.arange(T) < lengths_B[:, None], prompt_BT, vocab_size)
    return jnp.zeros((B, vocab_size), bool).at[jnp.arange(B)[:, None], ids_BT].set(
        True, mode="drop")


def draw(a: Answers, logits_BV, sampling, keys_B, banned_BV=None, pad_id=0):
    """Each row's next token [B]: sampled from logits_BV at step a.length of its answer (the
    step its key is folded with), the repetition penalty over a.seen, never a banned token;
    pad_id for rows that are done."""
    if banned_BV is not None:
        logits_BV = jnp.where(banned_BV, -jnp.inf, logits_BV)
    seen_BV = jnp.zeros(logits_BV.shape, bool) if a.seen is None else a.seen
    return jnp.where(a.done, pad_id, sample(logits_BV, sampling, keys_B, a.length, seen_BV))


def record_logprobs(a: Answers, logits_BV, token_B) -> Answers:
    """a with each live row's next token (token_B, drawn from logits_BV) scored at the answer's
    next index: its log-probability under softmax(logits_BV) and the k likeliest tokens with
    theirs. A no-op for answers that keep none."""
    if a.logprob is None:
        return a
    B, N = a.tokens.shape
    logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    top_logprob_Bk, top_ids_Bk = jax.lax.top_k(logp_BV, a.top_ids.shape[2])
    rows_B, at_B = jnp.arange(B), jnp.where(a.done, N, a.length)
    chosen_B = logp_BV[rows_B, token_B]
    return a.replace(logprob=a.logprob.at[rows_B, at_B].set(chosen_B, mode="drop"),
                     top_ids=a.top_ids.at[rows_B, at_B].set(top_ids_Bk, mode="drop"),
                     top_logprob=a.top_logprob.at[rows_B, at_B].set(top_logprob_Bk, mode="drop"))


def allowed(a: Answers, automaton, budget_B, eos_E, vocab_size: int):
    """[B, V] bool: what each row's constraint allows it to draw next (its automaton's state,
    the tokens left of budget_B); everything where the loop has no automaton."""
    if automaton is None:
        return jnp.ones((a.length.shape[0], vocab_size), bool)
    return constraints.allowed(automaton, a.state, budget_B - a.length, eos_E, vocab_size)


def append(a: Answers, tokens_BJ, n_B, eos_E, stop, budget_B, automaton=None):
    """(answers, ended [B]): each live row's answer extended by the first n_B of tokens_BJ, up
    to and including an end id (eos_E), the token that completes a stop string (stop:
    StopStrings, or None for none), the token after which its constraint's automaton (a
    constraints.Automaton, or None) must end, or its budget_B-th token (budget_B: [B] or one
    for all); a row that reaches one of them is done. A loop drawing one token a step passes
    J = 1."""
    B, N = a.tokens.shape
    j_J = jnp.arange(tokens_BJ.shape[1])
    offered_BJ = ~a.done[:, None] & (j_J < n_B[:, None])
    stopped_BJ, ends_BJM = _stop_states(stop, a.ends, tokens_BJ)
    states_BJ = None
    if automaton is not None:
        accepted_BJ, states_BJ = _automaton_states(automaton, a.state, tokens_BJ)
        stopped_BJ = stopped_BJ | accepted_BJ
    full_BJ = a.length[:, None] + j_J + 1 >= jnp.reshape(budget_B, (-1, 1))
    end_BJ = offered_BJ & (jnp.isin(tokens_BJ, eos_E) | stopped_BJ | full_BJ)
    taken_BJ = offered_BJ & (jnp.cumsum(end_BJ, axis=1) - end_BJ == 0)  # none after an end
    taken_B = taken_BJ.sum(1)
    rows_B1 = jnp.arange(B)[:, None]
    tokens = a.tokens.at[rows_B1, jnp.where(taken_BJ, a.length[:, None] + j_J, N)].set(
        tokens_BJ, mode="drop")
    seen = None if a.seen is None else a.seen.at[rows_B1, tokens_BJ].max(taken_BJ, mode="drop")
    last_B11 = jnp.maximum(taken_B - 1, 0)[:, None, None]
    ends_BM = jnp.where((taken_B > 0)[:, None],
                        jnp.take_along_axis(ends_BJM, last_B11, axis=1)[:, 0], a.ends)
    state_B = a.state if states_BJ is None else jnp.where(
        taken_B > 0, jnp.take_along_axis(states_BJ, last_B11[:, :, 0], axis=1)[:, 0], a.state)
    ended_B = end_BJ.any(1)
    return a.replace(tokens=tokens, length=a.length + taken_B, done=a.done | ended_B, seen=seen,
                     ends=ends_BM, state=state_B), ended_B


def _automaton_states(automaton, state_B, tokens_BJ):
    """(ends [B, J], states [B, J]): whether the automaton must end after token j, and its
    state then, the tokens taken in order."""
    ends, states = [], []
    for j in range(tokens_BJ.shape[1]):
        state_B, end_B = constraints.advance(automaton, state_B, tokens_BJ[:, j])
        ends.append(end_B)
        states.append(state_B)
    return jnp.stack(ends, 1), jnp.stack(states, 1)


def _stop_states(stop, ends_BM, tokens_BJ):
    """(stopped [B, J], ends [B, J, M]): whether token j completes a stop string, and the
    prefixes the text ends with after it, the tokens taken in order."""
    B, J = tokens_BJ.shape
    if stop is None:
        return jnp.zeros((B, J), bool), jnp.broadcast_to(ends_BM[:, None], (B, J) +
                                                         ends_BM.shape[1:])
    stopped, ends = [], []
    for j in range(J):
        stopped_B, ends_BM = stops.step(stop, ends_BM, tokens_BJ[:, j])
        stopped.append(stopped_B)
        ends.append(ends_BM)
    return jnp.stack(stopped, 1), jnp.stack(ends, 1)


def restart(a: Answers, row, seen_V, done, state=None) -> Answers:
    """Row `row` starts a new answer: nothing drawn, no stop-string prefix, the penalty over
    seen_V [V], done as given (a row still being admitted is), its constraint's automaton at
    state (where the answers keep states)."""
    return a.replace(length=a.length.at[row].set(0), done=a.done.at[row].set(done),
                     seen=a.seen.at[row].set(seen_V), ends=a.ends.at[row].set(False),
                     state=None if a.state is None else a.state.at[row].set(state))
