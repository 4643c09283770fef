"""The token trees of speculative decoding: their fixed shape and masks, the pass that scores
them without storing, the drafts that fill them (n-gram lookup in a row's own history, or a
draft model), and how a round's accepted path is read off and kept (see speculative.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core.cache import store
from jaxkv.core.decoder import cached_pass, logits
from jaxkv.core.params import Params
from jaxkv.decoding import constraints
from jaxkv.decoding.sampling import argmax

NGRAM = 3  # lookup matches the last MIN_MATCH..NGRAM tokens; longer ones rank first, then recency
MIN_MATCH = 2  # a one-token match is weak evidence (docs/design-notes.md)


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
    """mask_BTS for the tree nodes `nodes` (indices, static or traced) of rows whose root sits
    at pos_B: the committed slots before the root, and the slots of each node's ancestors and
    itself."""
    rel_BS = jnp.arange(capacity)[None, :] - pos_B[:, None]  # slot - root slot
    N = anc_NN.shape[0]
    in_tree_BS = (rel_BS >= 0) & (rel_BS < N)
    anc_TN = jnp.asarray(anc_NN)[jnp.asarray(nodes)]
    reads_BTS = jnp.take(anc_TN, jnp.clip(rel_BS, 0, N - 1), axis=1).transpose(1, 0, 2)
    return (rel_BS < 0)[:, None, :] | (in_tree_BS[:, None, :] & reads_BTS)


def tree_pass(params: Params, cache, tokens_BT, pos_B, nodes, M: int, D: int):
    """Scores the tree nodes `nodes` (tokens [B, T]; indices, static or traced) of trees rooted
    at pos_B, reading the cache as if each node sat at its tree slot but storing nothing:
    (logits [B, T, V], the nodes' keys and values, L x [B, K, T, H], for cache.store)."""
    depth_N, _, anc_NN = tree_shape(M, D)
    nodes = jnp.asarray(nodes)
    node_pos_BT = pos_B[:, None] + jnp.asarray(depth_N)[nodes][None, :]
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
    # (top_k sorts the whole vocabulary on the CPU; argmax is one pass)
    first_BM = argmax(first_BV)[:, None] if M == 1 else jax.lax.top_k(first_BV, M)[1]
    chain_BMD = jnp.zeros((B, M, D), jnp.int32).at[:, :, 0].set(first_BM)

    # each chain's d-th token from its (d-1)-th, in a loop: the program (and its compile time)
    # does not grow with D
    def extend(d, carry):
        chain_BMD, dcache = carry
        nodes_M = 1 + jnp.arange(M) * D + d - 1
        last_BM = jax.lax.dynamic_index_in_dim(chain_BMD, d - 1, axis=2, keepdims=False)
        logits_BMV, kv = tree_pass(dparams, dcache, last_BM, pos_B, nodes_M, M, D)
        dcache = store(dcache, kv, pos_B[:, None] + nodes_M[None, :])
        next_BM1 = argmax(logits_BMV)[:, :, None]
        return jax.lax.dynamic_update_slice_in_dim(chain_BMD, next_BM1, d, axis=2), dcache

    return jax.lax.fori_loop(1, D, extend, (chain_BMD, dcache))


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
    # of the cache for it.
    k_moved, v_moved = jax.lax.optimization_barrier(jax.tree.map(lambda x: x[rows_B1, :, src_BN],
                                                                 (k, v)))
    move = lambda x, moved: x.at[rows_B1, :, dst_BN].set(moved, mode="drop")  # noqa
    return cache.replace(k=jax.tree.map(move, k, k_moved), v=jax.tree.map(move, v, v_moved))


def nodes_allowed(automaton, state_B, chain_BMD, step_BN, eos_E, max_new_tokens: int, V: int):
    """[B, N, V]: what each row's automaton allows at each tree node (the root at state_B, a
    chain's node after its drafted tokens so far), the budget counted from the node's step;
    None unconstrained."""
    if automaton is None:
        return None
    B, M, D = chain_BMD.shape
    states, state_X = [state_B[:, None]], jnp.repeat(state_B, M)
    for d in range(D):  # chain m's node d: its state after the chain's tokens 0..d
        state_X, _ = constraints.advance(automaton, state_X, chain_BMD[:, :, d].reshape(-1))
        states.append(state_X.reshape(B, M))
    chains = [jnp.stack(states[1:], 2).reshape(B, -1)] if D else []  # (none: the root alone)
    state_BN = jnp.concatenate([states[0], *chains], 1)
    left_X = (max_new_tokens - step_BN).reshape(-1)
    return constraints.allowed(automaton, state_BN.reshape(-1), left_X, eos_E, V).reshape(
        B, -1, V)


def drafts_allowed(allowed_BNV, chain_BMD):
    """[B, M, D] bool: each drafted token is one its parent node allows."""
    B, M, D = chain_BMD.shape
    parent_MD = np.concatenate([np.zeros((M, 1), int),
                                1 + np.arange(M)[:, None] * D + np.arange(D - 1)[None]], 1)
    return jnp.take_along_axis(allowed_BNV[:, parent_MD.reshape(-1)],
                               chain_BMD.reshape(B, -1, 1), axis=2).reshape(B, M, D)
