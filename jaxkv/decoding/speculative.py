"""Lossless speculative decoding on token trees, verified in one forest pass per round.

Every row keeps its committed tokens in cache slots [0, p) and one more committed token, the
pending one, not fed yet. A round:
1. A draft proposes M chains of D tokens that continue the pending one: n-gram lookup in the
   row's own prompt and answer (`lookup_chains`), or a draft model's top M first tokens, each
   continued greedily (`draft_chains`). Chains that begin alike form a trie, stored chain by
   chain (a node shared by two chains is computed twice; the tree keeps one fixed shape).
2. One forest pass over the target's cache (decoder.cached_pass with a tree mask, reading the
   cache and storing nothing): the pending token as if at slot p (position p), chain m's d-th
   token at slot p + 1 + m D + d (position p + 1 + d); each node reads the committed slots,
   its ancestors and itself.
3. The target draws its own token at every node, exactly as `generate` draws that step of that
   row (same key, same step index), and a chain is accepted while each of its tokens equals the
   token the target drew at its parent. The accepted tokens and the target's draw after them
   (the next pending token) are committed: 1 to D + 1 tokens per row per pass, each row its own.
4. Accept & compact in one write (`kept_slots`): the pending token's K/V are stored at slot p
   and the accepted nodes' at p + 1, p + 2, ...; the rejected nodes' are never stored. (A
   draft model's cache, which held its whole tree, is compacted: `compact`.)
The decision to draft at all is the batch's, each round: see ROW_COST.

Lossless: every committed token is the target's own draw, so greedy output equals generate's,
and sampled output equals generate's for the same key (up to float rounding in the tree pass's
logits). For a deterministic draft this is what speculative sampling's rejection rule reduces
to: a draft token d proposed with q(d) = 1 is accepted with probability p(d), and on rejection
the residual distribution is p without d; over several children the target's one draw accepts
child c with probability p(c), the most any lossless rule can.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.core import checks
from jaxkv.core.cache import store
from jaxkv.core.decoder import decode_step, init_cache, prefill_padded
from jaxkv.core.params import Params
from jaxkv.core.tracecount import count_trace
from jaxkv.core.sharding import check_mesh, replicated, shard_params, shard_rows
from jaxkv.decoding import constraints, rows
from jaxkv.decoding.drafts import (compact, draft_chains, drafts_allowed, kept_slots,
                                   lookup_chains, lookup_hindsight, nodes_allowed, tree_pass,
                                   tree_shape, walk)
from jaxkv.decoding.prompts import (SLOT_MULTIPLE, capacity_for, check_room, eos_ids,
                                    pad_value, prepare_prompts, whole_blocks)
from jaxkv.decoding.sampling import row_keys, sample, sampling_params

# The cost model (measured on 2-core CPUs; docs/design-notes.md has the figures): a pass over
# R rows (all rows' tree nodes together) costs about 1 + ROW_COST (R - 1) one-row steps, so a
# tree of N nodes per row costs a batch of B rows ROW_COST B (N - 1) / (1 + ROW_COST (B - 1))
# steps more than a plain step. A round drafts when the live rows' expected accepted tokens add
# up to that many per live row. Each row's expectation is a running mean (halved towards each
# new value) of what its drafts got accepted, and, in rounds it did not draft, of what they
# would have (times HINDSIGHT): the better of the lookup trees made D and D / 2 tokens earlier,
# checked against the tokens committed since; for a draft model, D if one of its first tokens
# is the target's own next token, else 0.
ROW_COST = 0.07
HINDSIGHT = 0.5
# Where each row's running mean starts: this many times what a round must expect of every live
# row for a tree pass over the whole batch to pay (tree_cost - 1), so a row's first offer is
# tried and one that comes to nothing takes it below (a failed draft halves it).
PRIOR = 1.5
# n_draft when not given (lookup): chains long enough for about TREE_NODES tree nodes a pass
# over the whole batch, at most MAX_NODES a row (the CPU kernels take a pass's rows 16 at a
# time: a pass over whole vectors costs least per node).
TREE_NODES = 32
MAX_NODES = 16


def default_n_draft(B: int, M: int) -> int:
    """n_draft for a lookup tree of M chains at batch B: 15 at batch 1 and 2, 7 at 4, 3 at 8.
    The loop takes it anew at each batch size it runs at (batch_sizes)."""
    return max(1, (min(MAX_NODES, TREE_NODES // B) - 1) // M)


def tree_cost(B: int, N: int) -> float:
    """What a pass over B rows x N tree nodes costs, in passes over B rows x 1 node (steps)."""
    return (1 + ROW_COST * (B * N - 1)) / (1 + ROW_COST * (B - 1))


@struct.dataclass
class Stats:
    """Per row: passes of the target, and drafted tokens it accepted (one more per pass is
    its own)."""

    passes: jax.Array  # [B] int32
    accepted: jax.Array  # [B] int32

    @property
    def tokens_per_pass(self):
        """[B] committed tokens per target pass (1 = no gain)."""
        return (self.passes + self.accepted) / jnp.maximum(self.passes, 1)


@struct.dataclass
class _Rows:
    cache: object
    dcache: object  # the draft model's cache, or None
    hist: jax.Array  # [B, L] committed tokens by position (prompt, answer); pending included
    pos: jax.Array  # [B] the pending token's position (= committed slots in the cache)
    need_prev: jax.Array  # [B] bool: the draft has not fed the token at pos - 1
    answers: rows.Answers  # the committed answer tokens, the pending one included
    passes: jax.Array  # [B]
    accepted: jax.Array  # [B]
    gain: jax.Array  # [B] float32: running mean of drafted tokens accepted per drafting pass
    row: jax.Array  # [B] the row's index in the caller's batch
    sampling: object  # SamplingParams, [B] each
    keys: jax.Array  # [B] the row's key


def _commit(s: _Rows, committed_BJ, a_B, eos_E, max_new_tokens: int, automaton=None) -> _Rows:
    """Records each live row's committed tokens (a_B accepted ones and the target's draw after
    them) in its answer and history; the answer ends at an EOS, its constraint or the
    budget."""
    B, J = committed_BJ.shape
    live_B = ~s.answers.done
    n_B = jnp.where(live_B, a_B + 1, 0)
    new_BJ = jnp.arange(J) < n_B[:, None]
    at_BJ = jnp.where(new_BJ, s.pos[:, None] + 1 + jnp.arange(J), s.hist.shape[1])
    hist = s.hist.at[jnp.arange(B)[:, None], at_BJ].set(committed_BJ, mode="drop")
    answers, _ = rows.append(s.answers, committed_BJ, n_B, eos_E, None, max_new_tokens,
                             automaton)
    return s.replace(hist=hist, pos=s.pos + n_B, answers=answers, passes=s.passes + live_B,
                     accepted=s.accepted + jnp.where(live_B, a_B, 0))


def _draw(logits_BNV, sampling, keys_B, step_BN, allowed_BNV=None):
    """The target's token at every node: what generate draws at that row's step (allowed_BNV:
    where constrained, what the row's automaton allows at the node)."""
    B, N, V = logits_BNV.shape
    if allowed_BNV is not None:
        logits_BNV = jnp.where(allowed_BNV, logits_BNV, -jnp.inf)
    flat = jax.tree.map(lambda x: jnp.repeat(x, N, axis=0), sampling)
    return sample(logits_BNV.reshape(B * N, V), flat, jnp.repeat(keys_B, N),
                  step_BN.reshape(-1), jnp.zeros((B * N, V), bool)).reshape(B, N)


def _start(params, dparams, tokens_BT, lengths_B, sampling, keys_B, eos_E, pad_id,
           automaton=None, starts_B=None, *, max_new_tokens: int, capacity: int, M: int,
           Ds: tuple, kv_dtype) -> _Rows:
    """The rows after prefill (of the target, and of the draft model if any), with the target's
    first token drawn and pending; Ds: n_draft at each batch size."""
    D = max(Ds)
    B, T = tokens_BT.shape
    prior = PRIOR * (tree_cost(B, 1 + M * Ds[0]) - 1)
    start_B = jnp.zeros((B,), jnp.int32)
    logits_BV, cache = prefill_padded(params, init_cache(params, B, capacity, kv_dtype),
                                      tokens_BT, lengths_B, start_B)
    dcache = None
    if dparams is not None:
        _, dcache = prefill_padded(dparams, init_cache(dparams, B, capacity, kv_dtype),
                                   tokens_BT, lengths_B, start_B)
    step_B1 = jnp.zeros((B, 1), jnp.int32)
    no_chains = jnp.zeros((B, 0, 0), jnp.int32)
    allowed_B1V = nodes_allowed(automaton, starts_B, no_chains, step_B1, eos_E, max_new_tokens,
                                logits_BV.shape[-1])
    first_B = _draw(logits_BV[:, None], sampling, keys_B, step_B1, allowed_B1V)[:, 0]
    hist = jnp.zeros((B, capacity), jnp.int32).at[:, :T].set(tokens_BT)
    zeros = jnp.zeros((B,), jnp.int32)
    s = _Rows(cache, dcache, hist, lengths_B - 1, jnp.zeros((B,), bool),
              rows.empty(B, max_new_tokens, pad_id=pad_id, state_B=starts_B), zeros, zeros,
              jnp.full((B,), prior, jnp.float32), jnp.arange(B), sampling, keys_B)
    return _commit(s, jnp.pad(first_B[:, None], ((0, 0), (0, D)), constant_values=-1), zeros,
                   eos_E, max_new_tokens, automaton).replace(passes=zeros)


def _drafting(s: _Rows, usable_BMD, N: int):
    """[B] bool: the rows that draft this round, if the live rows' expected accepted tokens
    pay for a pass over N nodes (ROW_COST); none otherwise."""
    offered_B = usable_BMD.any((1, 2)) & ~s.answers.done
    worth = jnp.sum(jnp.where(offered_B, s.gain, 0.0))
    return offered_B & (worth >= (tree_cost(s.pos.shape[0], N) - 1) * jnp.sum(~s.answers.done))


def _lookup_drafts(s: _Rows, M: int, D: int):
    """The lookup tree of each row: (chains [B, M, D], usable [B, M, D], drafting [B])."""
    chain_BMD, usable_BMD = lookup_chains(s.hist, s.pos + 1, M, D)
    return chain_BMD, usable_BMD, _drafting(s, usable_BMD, 1 + M * D)


def _lookup_missed(s: _Rows, M: int, D: int):
    """[B]: a lookup row's hindsight (what its trees from D and D / 2 tokens ago would have had
    accepted) times HINDSIGHT."""
    return HINDSIGHT * jnp.maximum(lookup_hindsight(s.hist, s.pos + 1, M, D),
                                   lookup_hindsight(s.hist, s.pos + 1, M, (D + 1) // 2))


def _plain_step(params, eos_E, automaton, s: _Rows, *, max_new_tokens: int, M: int,
                D: int) -> _Rows:
    """A lookup round in which no row drafts: generate's decode step, storing the pending
    token's K/V in place (no tree pass, no store afterwards)."""
    pending_B = jnp.take_along_axis(s.hist, s.pos[:, None], axis=1)[:, 0]
    logits_BV, cache = decode_step(params, s.cache, pending_B, s.pos)
    step_B1 = s.answers.length[:, None]
    no_chains = jnp.zeros((pending_B.shape[0], 0, 0), jnp.int32)
    allowed_B1V = nodes_allowed(automaton, s.answers.state, no_chains, step_B1, eos_E,
                                max_new_tokens, logits_BV.shape[-1])
    draw_B1 = _draw(logits_BV[:, None], s.sampling, s.keys, step_B1, allowed_B1V)
    s = s.replace(cache=cache,
                  gain=jnp.where(s.answers.done, s.gain, (s.gain + _lookup_missed(s, M, D)) / 2))
    return _commit(s, jnp.pad(draw_B1, ((0, 0), (0, D)), constant_values=-1),
                   jnp.zeros_like(s.pos), eos_E, max_new_tokens, automaton)


def _round(params, dparams, eos_E, automaton, s: _Rows, *, max_new_tokens: int, capacity: int,
           M: int, D: int) -> _Rows:
    """One round: draft, decide, verify in one tree pass, commit. A lookup round runs only when
    some row drafts (else _plain_step); a draft model's may verify the root alone."""
    B = s.pos.shape[0]
    depth_N, _, _ = tree_shape(M, D)
    N = 1 + M * D
    pending_B = jnp.take_along_axis(s.hist, s.pos[:, None], axis=1)[:, 0]
    dcache = s.dcache
    if dparams is None:
        chain_BMD, usable_BMD, drafting_B = _lookup_drafts(s, M, D)
    else:
        prev_B = jnp.take_along_axis(s.hist, jnp.maximum(s.pos - 1, 0)[:, None], axis=1)[:, 0]
        chain_BMD, dcache = draft_chains(dparams, dcache, prev_B, s.need_prev, pending_B, s.pos,
                                         M, D)
        usable_BMD = jnp.ones((B, M, D), bool)
        drafting_B = _drafting(s, usable_BMD, N)
    step_BN = s.answers.length[:, None] + depth_N[None, :]
    allowed_BNV = nodes_allowed(automaton, s.answers.state, chain_BMD, step_BN, eos_E,
                                max_new_tokens, params.config.vocab_size)
    if allowed_BNV is not None:  # a drafted token its constraint forbids is never accepted
        usable_BMD &= drafts_allowed(allowed_BNV, chain_BMD)
    usable_BMD &= drafting_B[:, None, None]
    tree_BN = jnp.concatenate([pending_B[:, None], chain_BMD.reshape(B, -1)], axis=1)

    def full():
        logits_BNV, kv = tree_pass(params, s.cache, tree_BN, s.pos, np.arange(N), M, D)
        m_B, a_B, committed_BJ = walk(_draw(logits_BNV, s.sampling, s.keys, step_BN,
                                            allowed_BNV), chain_BMD, usable_BMD)
        return m_B, jnp.where(s.answers.done, 0, a_B), committed_BJ, kv

    def root_only():  # no row drafts: an ordinary decode step
        logits_B1V, kv = tree_pass(params, s.cache, pending_B[:, None], s.pos, [0], M, D)
        draw_B1 = _draw(logits_B1V, s.sampling, s.keys, step_BN[:, :1],
                        None if allowed_BNV is None else allowed_BNV[:, :1])
        zeros_B = jnp.zeros((B,), jnp.int32)
        kv = jax.tree.map(lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, N - 1), (0, 0))), kv)
        return zeros_B, zeros_B, jnp.pad(draw_B1, ((0, 0), (0, D)), constant_values=-1), kv

    if dparams is None:
        m_B, a_B, committed_BJ, kv = full()
    else:
        m_B, a_B, committed_BJ, kv = jax.lax.cond(jnp.any(drafting_B), full, root_only)
    cache = store(s.cache, kv, kept_slots(s.pos, m_B, a_B, M, D, capacity))
    if dcache is not None:
        dcache = compact(dcache, s.pos, m_B, a_B, M, D)
    if dparams is None:
        missed_B = _lookup_missed(s, M, D)
    else:
        missed_B = D * (chain_BMD[:, :, 0] == committed_BJ[:, :1]).any(1)
    seen_B = jnp.where(drafting_B, a_B, missed_B)
    gain_B = jnp.where(s.answers.done, s.gain, (s.gain + seen_B) / 2)
    s = s.replace(cache=cache, dcache=dcache, gain=gain_B,
                  need_prev=jnp.where(s.answers.done, s.need_prev, a_B == D))
    return _commit(s, committed_BJ, a_B, eos_E, max_new_tokens, automaton)


def _rounds(params, dparams, eos_E, automaton, s: _Rows, smaller: int, *, max_new_tokens: int,
            capacity: int, M: int, D: int) -> _Rows:
    """Rounds while more than `smaller` rows are live. With lookup, plain steps run in a loop
    of their own until some row drafts, then a tree round: the loop holds no conditional, so
    a plain step stores in place as generate's does."""
    options = dict(max_new_tokens=max_new_tokens, M=M, D=D)
    round_ = functools.partial(_round, params, dparams, eos_E, automaton, capacity=capacity,
                               **options)
    enough = lambda s: jnp.sum(~s.answers.done) > smaller  # noqa: E731
    if dparams is not None:
        return jax.lax.while_loop(enough, round_, s)
    drafts = lambda s: jnp.any(_lookup_drafts(s, M, D)[2])  # noqa: E731
    plain = functools.partial(_plain_step, params, eos_E, automaton, **options)
    steps = lambda s: jax.lax.while_loop(lambda s: enough(s) & ~drafts(s), plain, s)  # noqa
    return jax.lax.while_loop(lambda s: enough(s) & drafts(s), lambda s: steps(round_(s)),
                              steps(s))


PHASES = 3  # batch sizes the loop may run at: B, B / 2, B / 4 (each compiles its own round)


def batch_sizes(B: int) -> tuple:
    """The batch sizes the loop runs at in turn: B, then half of it (rounded up), ... at most
    PHASES of them, down to 1. A row that is done costs a tree pass as much as a live one (its
    nodes are computed all the same), so once no more than the next size are live, they move to
    a smaller batch (a copy of their caches)."""
    sizes = [B]
    while sizes[-1] > 1 and len(sizes) < PHASES:
        sizes.append((sizes[-1] + 1) // 2)
    return tuple(sizes)


def _live_first(s: _Rows, size: int) -> _Rows:
    """The first `size` rows of s with the live ones first: every field, caches included."""
    take_R = jnp.argsort(s.answers.done, stable=True)[:size]
    return jax.tree.map(lambda x: x[take_R], s)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "capacity", "M", "Ds",
                                             "kv_dtype", "mesh"))
def _speculative_loop(params, dparams, tokens_BT, lengths_B, sampling, keys_B, eos_E, pad_id,
                      automaton=None, starts_B=None, *, max_new_tokens: int, capacity: int,
                      M: int, Ds: tuple, kv_dtype=None, mesh=None):
    """Ds: n_draft at each of batch_sizes(B); mesh: the results made whole on every device."""
    count_trace("speculative")
    s = _start(params, dparams, tokens_BT, lengths_B, sampling, keys_B, eos_E, pad_id,
               automaton, starts_B, max_new_tokens=max_new_tokens, capacity=capacity, M=M,
               Ds=Ds, kv_dtype=kv_dtype)
    sizes = batch_sizes(tokens_BT.shape[0])
    results = (s.answers.tokens, s.answers.length, s.passes, s.accepted)
    for size, smaller, D in zip(sizes, sizes[1:] + (0,), Ds):
        if size < sizes[0]:
            s = _live_first(s, size)
        s = _rounds(params, dparams, eos_E, automaton, s, smaller,
                    max_new_tokens=max_new_tokens, capacity=capacity, M=M, D=D)
        results = tuple(x.at[s.row].set(y) for x, y in zip(
            results, (s.answers.tokens, s.answers.length, s.passes, s.accepted)))
    tokens_BN, length_B, passes_B, accepted_B = replicated(results, mesh)
    return tokens_BN, length_B, Stats(passes_B, accepted_B)


def speculative_generate(params, prompts, max_new_tokens: int, *, draft="lookup", n_draft=None,
                         n_branches=1, temperature=0.0, top_k=None, top_p=None, min_p=None,
                         key=None, eos_id=None, pad_id=None, max_len=None, kv_dtype=None,
                         mesh=None, constraint=None):
    """generate's result, in fewer passes of the target: (tokens [B, max_new_tokens], lengths
    [B], Stats).

    draft: "lookup" (n-gram matches of the row's latest tokens in its prompt and answer) or a
    draft model's Params with the target's vocabulary. n_draft: tokens per drafted chain (D;
    default: for lookup, about 32 tree nodes a pass over the batch, see default_n_draft, taken
    anew as the batch shrinks; 8 for a draft model); n_branches: chains per round (M). Each
    pass scores 1 + M D tokens and commits 1 to D + 1 of them per row; rows draft only while
    it pays (ROW_COST). Defaults chosen with scripts/bench_speculative.py (SmolLM2 fp32): a
    second branch cost more than it gained (2-core Xeon). Other options as generate's (mesh
    included, constraint too: each node's draw masked by its row's automaton there, drafted
    tokens it forbids never accepted); tokens and lengths equal generate's (greedy, and sampled
    with the same key).
    """
    c = params.config
    checks.linear_decoder(c, "speculative_generate")
    dparams = _draft_params(params, draft)
    M = checks.int_arg(n_branches, "n_branches")
    if dparams is not None and M > c.vocab_size:
        raise ValueError(f"n_branches={M} is more than the vocabulary ({c.vocab_size} tokens)")
    tokens_BT, lengths_B = prepare_prompts(c, prompts)
    B, T = tokens_BT.shape
    sizes = batch_sizes(B)
    if n_draft is None and dparams is None:  # lookup: each batch size its own
        Ds = tuple(default_n_draft(size, M) for size in sizes)
    else:
        Ds = (checks.int_arg(8 if n_draft is None else n_draft, "n_draft"),) * len(sizes)
    D = max(Ds)
    max_new_tokens = checks.int_arg(max_new_tokens, "max_new_tokens")
    capacity = _capacity(c, dparams, lengths_B, T, max_new_tokens, max_len, M, D)
    sampling = sampling_params(B, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    eos_E = eos_ids(c, eos_id)
    kv_dtype = None if kv_dtype is None else checks.kv_dtype(kv_dtype, "kv_dtype")
    per_row = (tokens_BT, lengths_B, sampling, row_keys(key, B))
    if check_mesh(mesh) is not None:
        params, per_row = shard_params(params, mesh), shard_rows(per_row, mesh)
        dparams = dparams if dparams is None else shard_params(dparams, mesh)
    automaton = (None, None) if constraint is None else constraints.for_rows(
        constraint, B, c.vocab_size, bool(eos_E[0] >= 0), max_new_tokens)
    return _speculative_loop(params, dparams, *per_row, eos_E,
                             jnp.int32(pad_value(c, pad_id, eos_id, eos_E)), *automaton,
                             max_new_tokens=max_new_tokens, capacity=capacity, M=M, Ds=Ds,
                             kv_dtype=kv_dtype, mesh=mesh)


def _capacity(c, dparams, lengths_B, T: int, max_new_tokens: int, max_len, M: int, D: int):
    """Cache slots for prompts padded to T, their answers and the draft tree of the last round,
    which may reach M D + 1 slots past the last answer token: it must fit max_len (or the
    model's max_seq_len), and a draft model's learned positions."""
    tree = M * D + 1
    check_room(c, lengths_B, max_new_tokens, c.max_seq_len)
    if max_len is not None:
        need = _room(lengths_B, max_new_tokens, checks.int_arg(max_len, "max_len"), tree, M, D)
    elif tree >= c.max_seq_len:
        raise ValueError(f"n_draft={D} x n_branches={M}: a draft tree of {tree} nodes does not "
                         f"fit a cache of {c.max_seq_len} positions (the model's max_seq_len); "
                         "lower n_draft")
    else:
        need = capacity_for(c, T, max_new_tokens)
    learned = [(model, config) for model, config in (("the model", c), ("the draft model",
               dparams and dparams.config)) if config and config.position == "learned"]
    for model, config in learned:
        if need + tree > config.max_seq_len:
            raise ValueError(f"speculative_generate needs {need + tree} positions (prompt + "
                             f"max_new_tokens + the draft tree's {tree}); {model} has "
                             f"{config.max_seq_len} learned positions")
    if max_len is not None:
        return need + tree
    return whole_blocks(need + tree, min([config.max_seq_len for _, config in learned],
                                         default=need + tree + SLOT_MULTIPLE))


def _room(lengths_B, max_new_tokens: int, max_len: int, tree: int, M: int, D: int) -> int:
    """The slots of a max_len cache left for prompt and answer once the draft tree takes its
    tree = M D + 1; they must hold the longest prompt and max_new_tokens."""
    longest = int(np.max(np.asarray(lengths_B)))
    need = longest + max_new_tokens
    if need + tree > max_len:
        raise ValueError(f"max_len={max_len} is too small: the draft tree takes {tree} slots "
                         f"(n_draft={D} x n_branches={M} + 1), leaving {max_len - tree} for "
                         f"prompt + max_new_tokens = {longest} + {max_new_tokens} = {need}; "
                         f"pass max_len >= {need + tree} or a smaller n_draft")
    return max_len - tree


def _draft_params(params, draft):
    """None for lookup, or the draft model's params (checked against the target's)."""
    if isinstance(draft, str):
        if draft != "lookup":
            raise ValueError(f"draft must be 'lookup' or a draft model's Params, got {draft!r}")
        return None
    if not isinstance(draft, Params):
        raise TypeError(f"draft must be 'lookup' or a draft model's Params, got "
                        f"{type(draft).__name__}")
    c, dc = params.config, draft.config
    if dc.vocab_size != c.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {dc.vocab_size} tokens, the "
                         f"target's {c.vocab_size}: a draft must share the target's vocabulary")
    checks.linear_decoder(dc, "a draft model")
    return draft
