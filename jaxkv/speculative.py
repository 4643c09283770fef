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

from jaxkv import checks
from jaxkv.cache import init_cache, store
from jaxkv.decoder import cached_pass, decode_step, logits, prefill_padded
from jaxkv.generate import capacity_for, eos_ids, pad_value, prepare_prompts
from jaxkv.params import Params
from jaxkv.sampling import argmax, row_keys, sample, sampling_params
from jaxkv.tracecount import count_trace

NGRAM = 3  # lookup matches the last MIN_MATCH..NGRAM tokens; longer ones rank first, then recency
# A match of one token is weak evidence: SmolLM2's answers to the free-form prompts of
# scripts/bench_speculative.py, drafting every round, 8 tokens per chain, got 0.23 tokens
# accepted per chain from 168 one-token matches, 0.88 from two-token ones and 2.8 from three
# (the grounded prompts 6.7 from three); a row drafted on such matches counted as offering a
# chain and cost its batch a tree pass. Measured with a replay of the lookup and drafting rule
# over generate's answers (the passes it predicts equal speculative_generate's).
MIN_MATCH = 2
# When drafting pays. A pass over R rows (tokens of all rows together) costs about
# 1 + ROW_COST (R - 1) one-row steps: its products read every weight once, and each row adds
# compute. SmolLM2 fp32, 2-core Xeon, `scripts/bench_speculative.py --costs`, with the tree
# kernels (queries across lanes in attention, rows past whole vectors in the dot form), two
# runs: 9 rows 1.55-1.59 steps, a batch of 4 x 9 nodes 2.56-2.60 of its 4-row step, 4 x 5 nodes
# 2.01-2.08; the model says 1.56, 2.85 and 1.93 (0.08 before those kernels, when 4 x 9 cost
# 2.78-3.04; 0.06 had drafted on free-form text at a loss then). The kernels and 0.07 together
# (results/bench_speculative_trees against _hindsight): grounded batch 4 1.59x -> 1.80x
# generate (8 x 1), free-form batch 4 1.00x -> 0.98x, never drafting there; 0.05 was no better
# on grounded batch 4 (7 x 1, one run: 1.67x against 1.68x). Since the outer form's stores go
# through L1 (dense.cc), 4 x 9 nodes cost 2.08 steps and 4 x 5 1.79 (1 x 9 1.52): the model
# overstates batch 4's trees, which keeps free-form text from drafting there; 0.05 drafted the
# same rounds on grounded batch 4 and a few more on free-form text (one run each).
# A tree of N nodes per row therefore costs a batch of B rows ROW_COST B (N - 1) / (1 + ROW_COST
# (B - 1)) steps more than a plain step; a round drafts when the live rows' expected accepted
# tokens add up to that many per live row. Each row's expectation is a running mean (halved
# towards each new value) of what its drafts got accepted, and, in rounds it did not draft, of
# what they would have (times HINDSIGHT, below): the better of the lookup trees made D and
# D / 2 tokens earlier, each checked against the tokens committed since (D / 2: a row whose
# text turns copyable drafts again sooner; grounded batch 4 took 33 rounds instead of 38); for a
# draft model, D if one of its first tokens is the target's own next token, else 0 (as if the
# rest would follow).
ROW_COST = 0.07
# What a lookup row's hindsight (the drafted tokens its tree from D or D / 2 tokens ago would have
# had accepted) counts for in its running mean. Text that repeated a while does not go on
# repeating as often: on the free-form prompts SmolLM2 at batch 4 drafted at a loss on it (8 x 1:
# 5-11 tokens accepted for a handful of 4 x 9-node passes, 0.93-0.97x generate; never drafting
# 1.00x). A replay of the rule over generate's answers at batch 4 (n_draft 8 / 4): free-form
# 0.97x / 0.98x -> 1.00x / 1.00x, grounded 1.87x / 2.05x -> 1.91x / 1.99x at half.
HINDSIGHT = 0.5
# Where each row's running mean starts: this many times what a round must expect of every live
# row for a tree pass over the whole batch to pay (tree_cost - 1), so a row's first offer is
# tried and one that comes to nothing takes it below (a failed draft halves it). It started at
# 1 token, below the 1.85 a batch of 4 x 9 nodes needs: grounded batch 4 took 9 plain steps
# before hindsight let it draft. From 1.5 x: passes per row 25, 35, 23, 23 -> 17, 27, 16, 15 (as
# at batch 1), 1.72x -> 1.85x generate; free-form unchanged (1.00x batch 4, 1.05x batch 1).
PRIOR = 1.5
# n_draft when not given (lookup): chains long enough for about this many tree nodes a pass over
# the whole batch, at most MAX_NODES a row. The CPU product kernels take a pass's rows 16 at a
# time (a vector of rows in their outer-product form); a pass over whole vectors costs least per
# node. scripts/bench_kernels.py, SmolLM2's products: 32 rows 21.2 ms, 36 rows 26.5 (AMD Zen 5),
# 39.0 and 45.1 ms (Intel Xeon). Grounded prompts of scripts/bench_speculative.py, Zen 5, ratios
# to generate in one process: batch 1 n_draft 15 3.23x, 8 3.16x, 31 2.79x (another run: 15
# 3.93x, 8 3.16x); batch 2 15 2.40x, 7 2.12x; batch 4 7 2.00x, 15 1.99x, 8 1.91x. Free-form
# prompts, which rarely draft, moved by 3% at most.
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


# ---- the tree's fixed shape ---------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def tree_shape(M: int, D: int):
    """(depth [N], chain [N] (-1 for the root), ancestor-or-self mask [N, N]) of a root with M
    chains of D nodes: node 0 is the root (the pending token), chain m's d-th node is
    1 + m D + d."""
    depth_N = np.concatenate([[0], np.tile(np.arange(1, D + 1), M)]).astype(np.int32)
    chain_N = np.concatenate([[-1], np.repeat(np.arange(M), D)])
    anc_NN = (chain_N[:, None] == chain_N[None, :]) & (depth_N[None, :] <= depth_N[:, None])
    anc_NN[:, 0] = True
    return depth_N, chain_N, anc_NN


def tree_mask(pos_B, nodes, anc_NN, capacity: int):
    """mask_BTS for the tree nodes `nodes` (static indices) of rows whose root sits at pos_B:
    the committed slots before the root, and the slots of each node's ancestors and itself."""
    rel_BS = jnp.arange(capacity)[None, :] - pos_B[:, None]  # slot - root slot
    N = anc_NN.shape[0]
    in_tree_BS = (rel_BS >= 0) & (rel_BS < N)
    anc_TN = jnp.asarray(anc_NN[np.asarray(nodes)])
    reads_BTS = jnp.take(anc_TN, jnp.clip(rel_BS, 0, N - 1), axis=1).transpose(1, 0, 2)
    return (rel_BS < 0)[:, None, :] | (in_tree_BS[:, None, :] & reads_BTS)


def tree_pass(params: Params, cache, tokens_BT, pos_B, nodes, M: int, D: int):
    """Scores the tree nodes `nodes` (tokens [B, T]) of trees rooted at pos_B, reading the cache
    as if each node sat at its tree slot but storing nothing: (logits [B, T, V], the nodes'
    keys and values, L x [B, K, T, H], for cache.store)."""
    depth_N, _, anc_NN = tree_shape(M, D)
    nodes = np.asarray(nodes)
    node_pos_BT = pos_B[:, None] + depth_N[nodes][None, :]
    slot_BT = pos_B[:, None] + nodes[None, :]
    mask_BTS = tree_mask(pos_B, nodes, anc_NN, cache.capacity)
    x_BTD, kv = cached_pass(params, cache, tokens_BT, node_pos_BT, slot_BT, mask_BTS,
                            kv_len=jnp.max(pos_B) + 1 + M * D, write=False)
    return logits(params, x_BTD), kv


# ---- drafts -------------------------------------------------------------------------------

def lookup_chains(hist_BL, hlen_B, M: int, D: int):
    """Chains from n-gram lookup: (tokens [B, M, D], usable [B, M, D]).

    The row's history hist_BL (prompt, answer, pending token; hlen_B of them) is searched for
    earlier ends of its last MIN_MATCH..NGRAM tokens; the D tokens that followed each of the M best
    matches (longest first, then latest) are its chains. A chain is usable as far as the
    history goes; chains that repeat an earlier one whole are dropped."""
    B, L = hist_BL.shape
    i_L = jnp.arange(L)
    last_BG = jnp.take_along_axis(hist_BL, jnp.clip(hlen_B[:, None] - 1 - jnp.arange(NGRAM),
                                                    0, L - 1), axis=1)
    same_BL = jnp.ones((B, L), bool)
    length_BL = jnp.zeros((B, L), jnp.int32)  # the match's length ending at i
    for g in range(NGRAM):
        shifted_BL = jnp.pad(hist_BL, ((0, 0), (g, 0)), constant_values=-1)[:, :L]
        same_BL &= (shifted_BL == last_BG[:, g:g + 1]) & (i_L >= g) & (g < hlen_B[:, None] - 1)
        length_BL += same_BL
    earlier_BL = i_L[None, :] < hlen_B[:, None] - 1
    score_BL = jnp.where(earlier_BL & (length_BL >= MIN_MATCH), length_BL * L + i_L, -1)
    if M == 1:  # top_k lowers to a sort of the whole history on the CPU; argmax is one pass
        end_BM = jnp.argmax(score_BL, axis=1)[:, None]
        score_BM = jnp.take_along_axis(score_BL, end_BM, axis=1)
    else:
        score_BM, end_BM = jax.lax.top_k(score_BL, M)
    at_BMD = end_BM[:, :, None] + 1 + jnp.arange(D)
    tokens_BMD = jnp.take_along_axis(hist_BL, jnp.clip(at_BMD, 0, L - 1).reshape(B, -1),
                                     axis=1).reshape(B, M, D)
    usable_BMD = (score_BM >= 0)[:, :, None] & (at_BMD < hlen_B[:, None, None])
    tokens_BMD = jnp.where(usable_BMD, tokens_BMD, -1)
    repeat_BM = jnp.zeros((B, M), bool)
    for m in range(1, M):
        repeat_BM = repeat_BM.at[:, m].set(
            (tokens_BMD[:, :m] == tokens_BMD[:, m:m + 1]).all(2).any(1))
    return jnp.where(usable_BMD, tokens_BMD, 0), usable_BMD & ~repeat_BM[:, :, None]


def lookup_hindsight(hist_BL, hlen_B, M: int, D: int):
    """[B]: the drafted tokens that the lookup tree made D tokens ago (from the history as it
    was then) would have had accepted: its chains' leading matches with the D tokens committed
    since, the target's own draws. 0 where the history is shorter."""
    then_B = hlen_B - D
    chain_BMD, usable_BMD = lookup_chains(hist_BL, jnp.maximum(then_B, 1), M, D)
    since_BD = jnp.take_along_axis(hist_BL, jnp.maximum(then_B, 0)[:, None] + jnp.arange(D),
                                   axis=1)
    a_BM = accepted_depth(chain_BMD, usable_BMD, since_BD[:, None, :])
    return jnp.where(then_B >= 1, jnp.max(a_BM, axis=1), 0)


def draft_chains(dparams: Params, dcache, prev_B, need_prev_B, pending_B, pos_B, M: int,
                 D: int):
    """Chains from a draft model: its top M tokens after the pending one, each continued
    greedily for D - 1 more steps, all in its own cache laid out as the target's tree.

    The draft's cache holds the committed slots below pos_B - 1, and slot pos_B - 1 unless
    need_prev_B (the last accepted token was the end of a chain, which the draft never fed):
    prev_B is then fed first. Returns (tokens [B, M, D], draft cache)."""
    B = pos_B.shape[0]
    pos_B2 = jnp.stack([pos_B - 1, pos_B], 1)
    slot_B2 = jnp.stack([jnp.where(need_prev_B, pos_B - 1, dcache.capacity), pos_B], 1)
    x_B2D, dcache = cached_pass(dparams, dcache, jnp.stack([prev_B, pending_B], 1), pos_B2,
                                slot_B2, jnp.arange(dcache.capacity) <= pos_B2[:, :, None],
                                kv_len=jnp.max(pos_B) + 1)
    first_BV = logits(dparams, x_B2D[:, 1:])[:, 0]
    # (top_k sorts the vocabulary on the CPU: a batch-4 draft took 108.5 ms with it, 102.6
    # with argmax, alone in a jitted call)
    first_BM = argmax(first_BV)[:, None] if M == 1 else jax.lax.top_k(first_BV, M)[1]
    chain_BMD = jnp.zeros((B, M, D), jnp.int32).at[:, :, 0].set(first_BM)
    for d in range(1, D):
        nodes = 1 + np.arange(M) * D + d - 1
        logits_BMV, kv = tree_pass(dparams, dcache, chain_BMD[:, :, d - 1], pos_B, nodes, M, D)
        dcache = store(dcache, kv, pos_B[:, None] + nodes[None, :])
        chain_BMD = chain_BMD.at[:, :, d].set(argmax(logits_BMV))
    return chain_BMD, dcache


# ---- verification -------------------------------------------------------------------------

def accepted_depth(chain_BMD, usable_BMD, parent_draw_BMD):
    """[B, M]: how many of each chain's tokens are accepted, i.e. equal to the target's draw at
    their parent (leading matches)."""
    match_BMD = usable_BMD & (chain_BMD == parent_draw_BMD)
    return jnp.cumprod(match_BMD, axis=2).sum(2)


def walk(draw_BN, chain_BMD, usable_BMD):
    """The longest accepted chain: (chain m [B], accepted count a [B], committed [B, D + 1]:
    the accepted tokens, then the target's draw after them, then -1)."""
    B, M, D = chain_BMD.shape
    root_B, node_BMD = draw_BN[:, 0], draw_BN[:, 1:].reshape(B, M, D)
    parent_BMD = jnp.concatenate([jnp.broadcast_to(root_B[:, None, None], (B, M, 1)),
                                  node_BMD[:, :, :-1]], axis=2)
    a_BM = accepted_depth(chain_BMD, usable_BMD, parent_BMD)
    m_B = jnp.argmax(a_BM, axis=1)
    a_B = jnp.max(a_BM, axis=1)
    rows = jnp.arange(B)
    chain_BD, draws_BD = chain_BMD[rows, m_B], node_BMD[rows, m_B]
    bonus_B = jnp.where(a_B == 0, root_B, draws_BD[rows, jnp.maximum(a_B - 1, 0)])
    j_J = jnp.arange(D + 1)
    committed_BJ = jnp.where(j_J < a_B[:, None], jnp.pad(chain_BD, ((0, 0), (0, 1))),
                             jnp.where(j_J == a_B[:, None], bonus_B[:, None], -1))
    return m_B, a_B, committed_BJ


def kept_slots(pos_B, m_B, a_B, M: int, D: int, capacity: int):
    """[B, 1 + M D]: the slot each tree node's K/V is stored at, so that accept & compact is one
    write: the root at pos_B, chain m_B's first a_B nodes right after it, every other node
    nowhere (capacity: dropped), never visible again."""
    depth_N, chain_N, _ = tree_shape(M, D)
    keep_BN = ((chain_N == m_B[:, None]) & (depth_N <= a_B[:, None])) | (depth_N == 0)
    return jnp.where(keep_BN, pos_B[:, None] + depth_N, capacity)


def compact(cache, pos_B, m_B, a_B, M: int, D: int):
    """A cache that holds whole trees rooted at pos_B (a draft model's) with the kept nodes'
    K/V moved to their kept_slots; the other nodes stay above, never read again."""
    src_BN = pos_B[:, None] + np.arange(1 + M * D)
    dst_BN = kept_slots(pos_B, m_B, a_B, M, D, cache.capacity)
    rows_B1 = jnp.arange(pos_B.shape[0])[:, None]
    k, v = cache.k, cache.v
    # The moved K/V are read out whole first (the barrier keeps the read out of the write's
    # loop): fused, one loop would read and write the same layer, and XLA copied every layer
    # of the cache for it (at batch 1).
    k_moved, v_moved = jax.lax.optimization_barrier(jax.tree.map(lambda x: x[rows_B1, :, src_BN],
                                                                 (k, v)))
    move = lambda x, moved: x.at[rows_B1, :, dst_BN].set(moved, mode="drop")  # noqa
    return cache.replace(k=jax.tree.map(move, k, k_moved), v=jax.tree.map(move, v, v_moved))


# ---- the compiled loop --------------------------------------------------------------------

@struct.dataclass
class _Rows:
    cache: object
    dcache: object  # the draft model's cache, or None
    hist: jax.Array  # [B, L] committed tokens by position (prompt, answer); pending included
    pos: jax.Array  # [B] the pending token's position (= committed slots in the cache)
    need_prev: jax.Array  # [B] bool: the draft has not fed the token at pos - 1
    t: jax.Array  # [B] answer tokens committed (the pending one included)
    out: jax.Array  # [B, max_new_tokens + D + 1] answer tokens
    done: jax.Array  # [B] bool
    length: jax.Array  # [B]
    passes: jax.Array  # [B]
    accepted: jax.Array  # [B]
    gain: jax.Array  # [B] float32: running mean of drafted tokens accepted per drafting pass
    row: jax.Array  # [B] the row's index in the caller's batch
    sampling: object  # SamplingParams, [B] each
    keys: jax.Array  # [B] the row's key


def _commit(s: _Rows, committed_BJ, a_B, eos_E, max_new_tokens: int) -> _Rows:
    """Records each live row's committed tokens (answer and history), ending rows at an EOS or
    the budget."""
    B, J = committed_BJ.shape
    live_B = ~s.done
    n_B = jnp.where(live_B, a_B + 1, 0)
    j_J = jnp.arange(J)
    new_BJ = j_J < n_B[:, None]
    rows_B1 = jnp.arange(B)[:, None]
    at_BJ = jnp.where(new_BJ, s.t[:, None] + j_J, s.out.shape[1])
    out = s.out.at[rows_B1, at_BJ].set(committed_BJ, mode="drop")
    hist = s.hist.at[rows_B1, jnp.where(new_BJ, s.pos[:, None] + 1 + j_J, s.hist.shape[1])].set(
        committed_BJ, mode="drop")
    eos_BJ = new_BJ & jnp.isin(committed_BJ, eos_E)
    first_eos_B = jnp.argmax(eos_BJ, axis=1)
    t_B = s.t + n_B
    ended_B = live_B & (eos_BJ.any(1) | (t_B >= max_new_tokens))
    length_B = jnp.where(eos_BJ.any(1), s.t + first_eos_B + 1, max_new_tokens)
    return s.replace(out=out, hist=hist, t=t_B, pos=s.pos + n_B, done=s.done | ended_B,
                     length=jnp.where(ended_B, jnp.minimum(length_B, max_new_tokens), s.length),
                     passes=s.passes + live_B, accepted=s.accepted + jnp.where(live_B, a_B, 0))


def _draw(logits_BNV, sampling, keys_B, step_BN):
    """The target's token at every node: what generate draws at that row's step."""
    B, N, V = logits_BNV.shape
    flat = jax.tree.map(lambda x: jnp.repeat(x, N, axis=0), sampling)
    return sample(logits_BNV.reshape(B * N, V), flat, jnp.repeat(keys_B, N),
                  step_BN.reshape(-1), jnp.zeros((B * N, V), bool)).reshape(B, N)


def _start(params, dparams, tokens_BT, lengths_B, sampling, keys_B, eos_E, pad_id, *,
           max_new_tokens: int, capacity: int, M: int, Ds: tuple, kv_dtype) -> _Rows:
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
    first_B = _draw(logits_BV[:, None], sampling, keys_B, jnp.zeros((B, 1), jnp.int32))[:, 0]
    hist = jnp.zeros((B, capacity), jnp.int32).at[:, :T].set(tokens_BT)
    zeros = jnp.zeros((B,), jnp.int32)
    s = _Rows(cache, dcache, hist, lengths_B - 1, jnp.zeros((B,), bool), zeros,
              jnp.full((B, max_new_tokens + D + 1), pad_id, jnp.int32), jnp.zeros((B,), bool),
              jnp.full((B,), max_new_tokens, jnp.int32), zeros, zeros,
              jnp.full((B,), prior, jnp.float32), jnp.arange(B), sampling, keys_B)
    return _commit(s, jnp.pad(first_B[:, None], ((0, 0), (0, D)), constant_values=-1), zeros,
                   eos_E, max_new_tokens).replace(passes=zeros)


def _drafting(s: _Rows, usable_BMD, N: int):
    """[B] bool: the rows that draft this round, if the live rows' expected accepted tokens
    pay for a pass over N nodes (ROW_COST); none otherwise."""
    offered_B = usable_BMD.any((1, 2)) & ~s.done
    worth = jnp.sum(jnp.where(offered_B, s.gain, 0.0))
    return offered_B & (worth >= (tree_cost(s.pos.shape[0], N) - 1) * jnp.sum(~s.done))


def _lookup_drafts(s: _Rows, M: int, D: int):
    """The lookup tree of each row: (chains [B, M, D], usable [B, M, D], drafting [B])."""
    chain_BMD, usable_BMD = lookup_chains(s.hist, s.pos + 1, M, D)
    return chain_BMD, usable_BMD, _drafting(s, usable_BMD, 1 + M * D)


def _lookup_missed(s: _Rows, M: int, D: int):
    """[B]: a lookup row's hindsight (what its trees from D and D / 2 tokens ago would have had
    accepted) times HINDSIGHT."""
    return HINDSIGHT * jnp.maximum(lookup_hindsight(s.hist, s.pos + 1, M, D),
                                   lookup_hindsight(s.hist, s.pos + 1, M, (D + 1) // 2))


def _plain_step(params, eos_E, s: _Rows, *, max_new_tokens: int, M: int, D: int) -> _Rows:
    """A lookup round in which no row drafts: generate's decode step, storing the pending
    token's K/V in place (no tree pass, no store afterwards)."""
    pending_B = jnp.take_along_axis(s.hist, s.pos[:, None], axis=1)[:, 0]
    logits_BV, cache = decode_step(params, s.cache, pending_B, s.pos)
    draw_B1 = _draw(logits_BV[:, None], s.sampling, s.keys, s.t[:, None])
    s = s.replace(cache=cache,
                  gain=jnp.where(s.done, s.gain, (s.gain + _lookup_missed(s, M, D)) / 2))
    return _commit(s, jnp.pad(draw_B1, ((0, 0), (0, D)), constant_values=-1),
                   jnp.zeros_like(s.pos), eos_E, max_new_tokens)


def _round(params, dparams, eos_E, s: _Rows, *, max_new_tokens: int, capacity: int, M: int,
           D: int) -> _Rows:
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
    usable_BMD &= drafting_B[:, None, None]
    step_BN = s.t[:, None] + depth_N[None, :]
    tree_BN = jnp.concatenate([pending_B[:, None], chain_BMD.reshape(B, -1)], axis=1)

    def full():
        logits_BNV, kv = tree_pass(params, s.cache, tree_BN, s.pos, np.arange(N), M, D)
        m_B, a_B, committed_BJ = walk(_draw(logits_BNV, s.sampling, s.keys, step_BN),
                                      chain_BMD, usable_BMD)
        return m_B, jnp.where(s.done, 0, a_B), committed_BJ, kv

    def root_only():  # no row drafts: an ordinary decode step
        logits_B1V, kv = tree_pass(params, s.cache, pending_B[:, None], s.pos, [0], M, D)
        draw_B1 = _draw(logits_B1V, s.sampling, s.keys, step_BN[:, :1])
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
    gain_B = jnp.where(s.done, s.gain, (s.gain + seen_B) / 2)
    s = s.replace(cache=cache, dcache=dcache, gain=gain_B,
                  need_prev=jnp.where(s.done, s.need_prev, a_B == D))
    return _commit(s, committed_BJ, a_B, eos_E, max_new_tokens)


def _rounds(params, dparams, eos_E, s: _Rows, smaller: int, *, max_new_tokens: int,
            capacity: int, M: int, D: int) -> _Rows:
    """Rounds while more than `smaller` rows are live. With lookup, plain steps run in a loop
    of their own until some row drafts, then a tree round: the loop holds no conditional, so
    a plain step stores in place as generate's does."""
    options = dict(max_new_tokens=max_new_tokens, M=M, D=D)
    round_ = functools.partial(_round, params, dparams, eos_E, capacity=capacity, **options)
    enough = lambda s: jnp.sum(~s.done) > smaller  # noqa: E731
    if dparams is not None:
        return jax.lax.while_loop(enough, round_, s)
    drafts = lambda s: jnp.any(_lookup_drafts(s, M, D)[2])  # noqa: E731
    plain = functools.partial(_plain_step, params, eos_E, **options)
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
    take_R = jnp.argsort(s.done, stable=True)[:size]
    return jax.tree.map(lambda x: x[take_R], s)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "capacity", "M", "Ds",
                                             "kv_dtype"))
def _speculative_loop(params, dparams, tokens_BT, lengths_B, sampling, keys_B, eos_E, pad_id, *,
                      max_new_tokens: int, capacity: int, M: int, Ds: tuple, kv_dtype=None):
    """Ds: n_draft at each of batch_sizes(B)."""
    count_trace("speculative")
    s = _start(params, dparams, tokens_BT, lengths_B, sampling, keys_B, eos_E, pad_id,
               max_new_tokens=max_new_tokens, capacity=capacity, M=M, Ds=Ds, kv_dtype=kv_dtype)
    sizes = batch_sizes(tokens_BT.shape[0])
    out, length, passes, accepted = s.out, s.length, s.passes, s.accepted
    for size, smaller, D in zip(sizes, sizes[1:] + (0,), Ds):
        if size < sizes[0]:
            s = _live_first(s, size)
        s = _rounds(params, dparams, eos_E, s, smaller, max_new_tokens=max_new_tokens,
                    capacity=capacity, M=M, D=D)
        out, length, passes, accepted = (
            x.at[s.row].set(y) for x, y in zip((out, length, passes, accepted),
                                               (s.out, s.length, s.passes, s.accepted)))
    j_J = jnp.arange(max_new_tokens)
    tokens_BJ = jnp.where(j_J < length[:, None], out[:, :max_new_tokens], pad_id)
    return tokens_BJ, length, Stats(passes, accepted)


def speculative_generate(params, prompts, max_new_tokens: int, *, draft="lookup", n_draft=None,
                         n_branches=1, temperature=0.0, top_k=None, top_p=None, min_p=None,
                         key=None, eos_id=None, pad_id=None, max_len=None, kv_dtype=None):
    """generate's result, in fewer passes of the target: (tokens [B, max_new_tokens], lengths
    [B], Stats).

    draft: "lookup" (n-gram matches of the row's latest tokens in its prompt and answer) or a
    draft model's Params with the target's vocabulary. n_draft: tokens per drafted chain (D;
    default: for lookup, about 32 tree nodes a pass over the batch, see default_n_draft, taken
    anew as the batch shrinks; 8 for a draft model); n_branches: chains per round (M). Each
    pass scores 1 + M D tokens and commits 1 to D + 1 of them per row; rows draft only while
    it pays (ROW_COST). Defaults chosen with scripts/bench_speculative.py (SmolLM2 fp32): a
    second branch cost more than it gained (2-core Xeon). Other options as generate's; tokens
    and lengths equal generate's (greedy, and sampled with the same key).
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
    # The tree of the last round may reach M D + 1 slots past the last answer token.
    need = capacity_for(c, T, max_new_tokens, lengths_B, None if max_len is None else
                        checks.int_arg(max_len, "max_len") - M * D - 1)
    capacity = need + M * D + 1
    if c.position == "learned" and capacity > c.max_seq_len:
        raise ValueError(f"speculative_generate needs {capacity} positions (prompt + "
                         f"max_new_tokens + the draft tree's {M * D + 1}); the model has "
                         f"{c.max_seq_len} learned positions")
    sampling = sampling_params(B, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    eos_E = eos_ids(eos_id)
    kv_dtype = None if kv_dtype is None else checks.kv_dtype(kv_dtype, "kv_dtype")
    return _speculative_loop(params, dparams, tokens_BT, lengths_B, sampling, row_keys(key, B),
                             eos_E, jnp.int32(pad_value(pad_id, eos_id, eos_E)),
                             max_new_tokens=max_new_tokens, capacity=capacity, M=M, Ds=Ds,
                             kv_dtype=kv_dtype)


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
