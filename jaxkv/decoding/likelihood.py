"""Log-likelihoods over data sets: continuations scored given their contexts (what
lm-evaluation-harness calls loglikelihood) and whole documents in windows (its
loglikelihood_rolling, for perplexity).

Requests that share a context share its prefill: their continuations form a trie hanging off
it (MultiDecode's forest pass), so the four choices of a multiple-choice question cost one
context and the distinct tokens of the choices; a continuation's last token is predicted, never
fed (as in the harness), so context + continuation may hold one token more than max_seq_len.
Contexts are prefilled batch_size at a time, longest first (similar lengths share a batch, and
the first batch tells at once whether the longest fit in memory).
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core import checks
from jaxkv.core import hooks as hooks_lib
from jaxkv.core.sharding import check_mesh, fetch, shard_params
from jaxkv.decoding.multidecode import check_positions, forest_pass, make_prefix, trie


def loglikelihood_many(params, requests: Sequence, *, batch_size: int = 16,
                       kv_dtype=None, mesh=None, hooks=None) -> list[tuple[float, bool]]:
    """For each request (context ids, continuation ids): (the continuation's summed
    log-probability given the context, whether greedy decoding from the context gives exactly
    the continuation), in the requests' order.

    Every request is checked before anything is computed: a context and a continuation of at
    least one token each, ids of the vocabulary, both within the model's max_seq_len positions;
    errors name the request's index. batch_size: contexts prefilled at once. kv_dtype: the
    caches' (init_cache's dtype). mesh: contexts over its data axis, the model over its model
    axis (a mesh may span processes: every process passes the same requests and gets every
    result). hooks (a jaxkv.Hooks): its edits apply to every pass (a steering vector or an
    ablation scored on a data set), and each result gains a third item, acts {site: [L', T,
    D]} numpy arrays of the positions fed, context then continuation less its last token
    (attn_probs is not captured here: the continuations read their context as a shared
    prefix)."""
    checks.int_arg(batch_size, "batch_size")
    pairs = checked_requests(params.config, requests)
    hooks_lib.tap_for(hooks, None, params.config)  # (checks hooks)
    if hooks is not None and mesh is not None:
        raise ValueError("hooks: loglikelihood_many with a mesh does not capture or edit yet")
    if check_mesh(mesh) is not None:
        params = shard_params(params, mesh)
    by_context: dict[tuple, list[int]] = {}
    for i, (context, _) in enumerate(pairs):
        by_context.setdefault(tuple(context.tolist()), []).append(i)
    contexts = sorted(by_context, key=len, reverse=True)
    results: list = [None] * len(pairs)
    for start in range(0, len(contexts), batch_size):
        batch = contexts[start:start + batch_size]
        batch += [batch[-1]] * (batch_size - len(batch))  # one shape for every batch
        tries = [trie([pairs[i][1] for i in by_context[c]]) for c in batch]
        logp, greedy, acts = _score_tries(params, batch, tries, kv_dtype, mesh, hooks)
        for b, context in enumerate(batch[:len(contexts) - start]):
            for i, path in zip(by_context[context], tries[b][2]):
                results[i] = (float(logp[b, path].sum()), bool(greedy[b, path].all()))
                if hooks is not None:
                    results[i] += (_path_acts(acts, b, len(context), path),)
    return results


def checked_requests(config, requests: Sequence) -> list[tuple[np.ndarray, np.ndarray]]:
    """requests as (context, continuation) int arrays, each checked (see loglikelihood_many)."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence) or not requests:
        raise ValueError(f"requests must be a non-empty list of (context ids, continuation ids) "
                         f"pairs, got {requests!r:.60}")
    pairs = []
    for i, request in enumerate(requests):
        if not isinstance(request, (tuple, list)) or len(request) != 2:
            raise ValueError(f"requests[{i}] must be a pair (context ids, continuation ids), got "
                             f"{request!r:.60}")
        for x, what in zip(request, ("context", "continuation")):
            if np.size(x) == 0:
                raise ValueError(f"requests[{i}] has an empty {what}: a {what} needs a token "
                                 f"(lm-evaluation-harness puts the end-of-text token in an empty "
                                 f"context)")
        context, continuation = (checks.token_ids(config, x, f"requests[{i}] {what}", 1)
                                 for x, what in zip(request, ("context", "continuation")))
        if context.size + continuation.size - 1 > config.max_seq_len:
            raise ValueError(f"requests[{i}] has {context.size} + {continuation.size} tokens of "
                             f"context and continuation, {context.size + continuation.size - 1} "
                             f"fed to the model (the last is only predicted); the model allows "
                             f"{config.max_seq_len} (max_seq_len)")
        pairs.append((np.asarray(context), np.asarray(continuation)))
    return pairs


def _score_tries(params, contexts, tries, kv_dtype, mesh, hooks=None):
    """Per trie node (padded): its token's log-probability given its path and whether it is the
    argmax there; [B, N] numpy arrays. Only the nodes with children are fed to the model. With
    hooks, also (the contexts' captures [.., B, T, D], the fed nodes' [.., B, M, D], per trie
    the node each fed row is); else None."""
    prefix = make_prefix(params, [list(c) for c in contexts], kv_dtype=kv_dtype, mesh=mesh,
                         hooks=hooks)
    prefix, context_acts = prefix if hooks is not None else (prefix, None)
    fed = [_fed(parents) for _, parents, _ in tries]
    check_positions(params, prefix, max(1, *(int(f[0].size) for f in fed)))
    # a trie with no inner node still gets one lone root (its logits unread): forests are not empty
    logits_BMV, _, _, *node_acts = forest_pass(
        params, [t[0][f[0]] if f[0].size else np.zeros(1, np.int32) for t, f in zip(tries, fed)],
        [f[1] if f[1].size else np.full(1, -1, np.int32) for f in fed], prefix, hooks)
    N = max(t[0].size for t in tries)
    tokens_BN, source_BN = np.zeros((len(tries), N), np.int32), np.full((len(tries), N), -1,
                                                                        np.int32)
    for b, ((tokens, _, _), (_, _, source)) in enumerate(zip(tries, fed)):
        tokens_BN[b, :tokens.size], source_BN[b, :source.size] = tokens, source
    logp, greedy = _node_scores(logits_BMV, prefix.logits, tokens_BN, source_BN)
    acts = None if hooks is None else (context_acts, node_acts[0], [f[0] for f in fed])
    return (*fetch((logp, greedy)), acts)


def _path_acts(acts, b: int, context_len: int, path) -> dict:
    """One request's captures: its context's positions, then its continuation's nodes but the
    last (never fed), in order: {site: [.., T, D]} numpy arrays."""
    context_acts, node_acts, fed = acts
    rows = np.searchsorted(fed[b], np.asarray(path[:-1], np.int64))  # fed row of each node
    head = hooks_lib.row_acts(context_acts, b, context_len)
    tail = hooks_lib.row_acts(hooks_lib.gathered(node_acts, rows), b, len(rows))
    return {site: np.asarray(x) for site, x in hooks_lib.joined([head, tail]).items()}


def _fed(parents):
    """Of a trie's nodes, those with children (fed to the model), in order: (their indices,
    their parents among them, and for every node the fed row its token is predicted at, -1 for
    a root: the context's last)."""
    inner = np.zeros(parents.size, bool)
    inner[parents[parents >= 0]] = True
    row = np.cumsum(inner) - 1
    source = np.where(parents >= 0, row[np.maximum(parents, 0)], -1).astype(np.int32)
    fed = np.flatnonzero(inner)
    return fed, source[fed], source


@jax.jit
def _node_scores(logits_BMV, first_BV, tokens_BN, source_BN):
    """Node n's token read where it is predicted: at fed row source_BN[b, n]'s logits, or at
    the context's last (first_BV) where that is -1: (log-probability, is the argmax), [B, N]."""
    lse_BM, top_BM = jax.nn.logsumexp(logits_BMV, -1), jnp.argmax(logits_BMV, -1)
    lse_B, top_B = jax.nn.logsumexp(first_BV, -1), jnp.argmax(first_BV, -1)
    root_BN = source_BN < 0
    row_BN = jnp.maximum(source_BN, 0)
    rows_B1 = jnp.arange(tokens_BN.shape[0])[:, None]
    picked_BN = jnp.where(root_BN, first_BV[rows_B1, tokens_BN],
                          logits_BMV[rows_B1, row_BN, tokens_BN])
    lse_BN = jnp.where(root_BN, lse_B[:, None], jnp.take_along_axis(lse_BM, row_BN, 1))
    top_BN = jnp.where(root_BN, top_B[:, None], jnp.take_along_axis(top_BM, row_BN, 1))
    return picked_BN - lse_BN, top_BN == tokens_BN


def rolling_windows(tokens, prefix_id: int, max_len: int) -> list[tuple[list, list]]:
    """(context, continuation) pairs that predict every token of a document once, each window
    within max_len positions (lm-evaluation-harness's loglikelihood_rolling, one token of
    context): the first window predicts tokens[:max_len] after prefix_id; each next one
    predicts the following max_len tokens after the token before them; the last, shorter one
    reads as much earlier text as fits beside it."""
    tokens = list(tokens)
    windows, done = [], 0
    while done < len(tokens):
        n = min(max_len, len(tokens) - done)
        if done == 0:
            context = [prefix_id]
        else:  # the max_len tokens that end just before the window's last token, less its own
            context = tokens[max(0, done + n - 1 - max_len):done]
        windows.append((context, tokens[done:done + n]))
        done += n
    return windows


def loglikelihood_rolling(params, documents: Sequence, *, prefix_id: int | None = None,
                          max_len: int | None = None, batch_size: int = 16,
                          kv_dtype=None, mesh=None) -> list[float]:
    """Each document's (token ids') total log-probability, every token predicted once, in
    windows of at most max_len positions (default the model's max_seq_len): see
    rolling_windows. prefix_id: what the first token is predicted after (default the model's
    bos_id, else its eos_id). mesh: as loglikelihood_many's."""
    c = params.config
    prefix_id = next((i for i in (prefix_id, c.bos_id, c.eos_id) if i is not None), None)
    if prefix_id is None:
        raise ValueError("prefix_id: the model names no bos_id or eos_id; pass the token the "
                         "first token of a document is predicted after")
    checks.token_ids(c, [prefix_id], "prefix_id", 1)
    max_len = c.max_seq_len if max_len is None else checks.int_arg(max_len, "max_len")
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
        raise ValueError(f"documents must be a list of token-id lists, got {documents!r:.60}")
    requests, owner = [], []
    for d, document in enumerate(documents):
        if np.size(document) == 0:
            raise ValueError(f"documents[{d}] is empty")
        windows = rolling_windows(checks.token_ids(c, document, f"documents[{d}]", 1).tolist(),
                                  prefix_id, max_len)
        requests += windows
        owner += [d] * len(windows)
    totals = np.zeros(len(documents))
    for d, (logp, _) in zip(owner, loglikelihood_many(params, requests, batch_size=batch_size,
                                                       kv_dtype=kv_dtype, mesh=mesh)):
        totals[d] += logp
    return totals.tolist()
