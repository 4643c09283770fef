"""MultiDecode: exact forest decoding over a shared cached prefix.

Tokens may form a forest. Flattened in any topological order, each node sits at the position of
its depth (plus the prefix length) and attends only to itself, its ancestors and the prefix, so
one pass gives every node the logits its root-to-node path would get alone. The prefix's K/V are
computed and stored once; rows that share it read it once per step (attention split in two
parts, shared prefix and own suffix, merged by log-sum-exp). Beam search over a shared
prefix is in beam.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.core import checks
from jaxkv.core import hooks as hooks_lib
from jaxkv.core.cache import KVCache
from jaxkv.core.decoder import extend, init_cache, logits, prefill
from jaxkv.core.sharding import cache_shardings, fetch, place
from jaxkv.core.tracecount import count_trace
from jaxkv.decoding.sampling import row_keys, sample, sampling_params


# ---- forests ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Forest:
    """A validated forest in topological order (every parent before its children)."""

    parents: np.ndarray  # [N] int; -1 for a root
    depth: np.ndarray  # [N] int; 0 for a root
    mask: np.ndarray  # [N, N] bool; mask[i, j] iff j is i or an ancestor of i

    def path(self, node: int) -> np.ndarray:
        """Node indices from the root down to node."""
        return np.flatnonzero(self.mask[node])[np.argsort(self.depth[self.mask[node]])]


def build_forest(parents) -> Forest:
    """Depths and the ancestor mask of a parent array; bad parent arrays are clear errors."""
    p = np.asarray(parents)
    if p.ndim != 1 or (p.size and p.dtype.kind not in "iu"):
        raise ValueError(f"parents must be a 1-D int array, got shape {p.shape} dtype {p.dtype}")
    N = p.shape[0]
    for i, parent in enumerate(p.tolist()):
        if not -1 <= parent < N:
            raise ValueError(f"parents[{i}] = {parent} is out of range: expected -1 (a root) or "
                             f"a node index in [0, {N})")
    for i, parent in enumerate(p.tolist()):
        if parent >= i:
            node, seen = i, set()
            while node != -1 and node not in seen:
                seen.add(node)
                node = int(p[node])
            if node != -1:
                raise ValueError(f"parents form a cycle through node {node}")
            raise ValueError(f"parents[{i}] = {parent}: a parent must come before its children "
                             "(list the nodes in a topological order)")
    depth = np.zeros(N, np.int32)
    mask = np.eye(N, dtype=bool)
    for i, parent in enumerate(p.tolist()):
        if parent >= 0:
            depth[i] = depth[parent] + 1
            mask[i] |= mask[parent]
    return Forest(p.astype(np.int32), depth, mask)


# ---- the shared prefix --------------------------------------------------------------------

@struct.dataclass
class Prefix:
    """Prompts prefilled once: their K/V are read, never copied, by the rows that share them."""

    cache: KVCache  # per layer [P, K, S, H]
    length: jax.Array  # [P] int32; slots [0, length) hold the prompt
    logits: jax.Array  # [P, V] float32 at each prompt's last token

    @property
    def mask(self):
        """[P, S] bool: the prompt's slots."""
        return jnp.arange(self.cache.capacity)[None, :] < self.length[:, None]

    @property
    def shared(self):
        """What extend(..., prefix=) takes: per-layer K/V, slot mask, a bound on filled slots."""
        return self.cache, self.mask, jnp.max(self.length)


def make_prefix(params, prompts, chunk_size: int | None = None, kv_dtype=None,
                mesh=None, hooks=None) -> Prefix:
    """Prefill prompts (one token list, or a list of them) once; chunk_size splits the prefill
    into several calls, giving the same cache. kv_dtype: the cache's (init_cache's dtype); the
    caches of what hangs off the prefix (forests, branches, beams) take the same. mesh: the
    prompts' rows split over its data axis (params already placed on it). hooks (a
    jaxkv.Hooks): edits applied; returns (prefix, acts), captures [.., P, T, D] by position."""
    _check_model(params)
    if isinstance(prompts, str) or len(prompts) == 0:
        raise ValueError(f"prefix must be token ids or a list of token-id lists, got "
                         f"{prompts!r:.40}")
    rows = [prompts] if np.ndim(prompts[0]) == 0 else list(prompts)
    lengths = np.array([np.size(r) for r in rows], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"prefix[{int(np.argmin(lengths))}] is empty: a prefix needs a token")
    rows = [checks.token_ids(params.config, r, f"prefix[{b}]", 1) for b, r in enumerate(rows)]
    T = int(lengths.max())
    tokens = np.zeros((len(rows), T), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    cache = init_cache(params, len(rows), checks.bucket_len(T), kv_dtype)
    if mesh is not None:
        cache = jax.tree.map(place, cache, cache_shardings(cache, mesh))
    chunk = checks.int_arg(chunk_size, "chunk_size", or_none=True) or T
    last = np.zeros((len(rows), params.config.vocab_size), np.float32)
    acts = []
    for start in range(0, T, chunk):
        piece = np.clip(lengths - start, 1, chunk)  # rows already done write masked padding
        step_logits, cache, *captured = prefill(params, cache, tokens[:, start:start + chunk],
                                                piece, np.full(len(rows), start, np.int32),
                                                hooks=hooks)
        acts += captured
        ends_here = (lengths > start) & (lengths <= start + chunk)
        last[ends_here] = fetch(step_logits)[ends_here]
    prefix = Prefix(cache, jnp.asarray(lengths), jnp.asarray(last))
    return prefix if hooks is None else (prefix, hooks_lib.joined(acts))


def _check_model(params):
    checks.linear_decoder(params.config, "MultiDecode (forests, branches, beam search, scoring)")


def check_positions(params, prefix: Prefix, longest: int):
    c = params.config
    need = int(np.max(np.asarray(prefix.length))) + longest
    if c.position == "learned" and need > c.max_seq_len:
        raise ValueError(f"prefix + forest need {need} positions; the model has "
                         f"{c.max_seq_len} learned positions")


# ---- one pass over forests ----------------------------------------------------------------

@jax.jit
def _forest_pass(params, prefix: Prefix, tokens_BN, depth_BN, mask_BNN, hooks=None):
    """Logits [B, N, V] of every node, and the nodes' own cache (node i at slot i); with hooks,
    their captures [.., B, N, D] by node."""
    count_trace("forest_pass")
    B, N = tokens_BN.shape
    pos_BN = prefix.length[:, None] + depth_BN
    slot_BN = jnp.broadcast_to(jnp.arange(N), (B, N))
    tap = hooks_lib.tap_for(hooks, pos_BN, params.config, n_keys=N)
    x_BND, cache = extend(params, init_cache(params, B, N, prefix.cache.dtype), tokens_BN, pos_BN,
                          slot_BN, mask_BNN, prefix=prefix.shared, tap=tap)
    logits_BNV = logits(params, x_BND, tap)
    return (logits_BNV, cache) if tap is None else (logits_BNV, cache, tap.captured())


def forest_pass(params, tokens, parents, prefix: Prefix, hooks=None):
    """(logits [B, N, V], node cache, forests) for B forests, each hanging off its own prefix row
    (or all off one). tokens / parents: lists of 1-D arrays. Node counts are padded to a bucket
    with lone roots that no real node reads. hooks (a jaxkv.Hooks): edits applied, and a
    fourth result, the nodes' captures [.., B, N, D] (node n at index n)."""
    forests = [build_forest(p) for p in parents]
    tokens = [checks.token_ids(params.config, t, f"tokens[{b}]", 1) for b, t in enumerate(tokens)]
    for b, (t, f) in enumerate(zip(tokens, forests)):
        if np.shape(t) != f.parents.shape:
            raise ValueError(f"tokens[{b}] has shape {np.shape(t)}, parents[{b}] "
                             f"{f.parents.shape}: one token per node")
        if f.parents.size == 0:
            raise ValueError(f"forest {b} is empty")
    N = checks.bucket_len(max(f.parents.size for f in forests))
    B = len(forests)
    tokens_BN, depth_BN = np.zeros((B, N), np.int32), np.zeros((B, N), np.int32)
    mask_BNN = np.broadcast_to(np.eye(N, dtype=bool), (B, N, N)).copy()
    for b, (t, f) in enumerate(zip(tokens, forests)):
        n = f.parents.size
        tokens_BN[b, :n], depth_BN[b, :n], mask_BNN[b, :n, :n] = t, f.depth, f.mask
    check_positions(params, prefix, int(depth_BN.max()) + 1)
    if prefix.length.shape[0] not in (1, B):
        raise ValueError(f"prefix has {prefix.length.shape[0]} rows; expected 1 or {B}")
    hooks_lib.tap_for(hooks, None, params.config)  # (checks hooks)
    logits_BNV, cache, *acts = _forest_pass(params, prefix, jnp.asarray(tokens_BN),
                                            jnp.asarray(depth_BN), jnp.asarray(mask_BNN), hooks)
    return (logits_BNV, cache, forests, *acts)


def _empty_prefix(params, rows: int, kv_dtype=None) -> Prefix:
    """A prefix of length 0 (forests that hang off nothing)."""
    return Prefix(init_cache(params, rows, 1, kv_dtype), jnp.zeros((rows,), jnp.int32),
                  jnp.zeros((rows, params.config.vocab_size), jnp.float32))


def forest_logits(params, tokens, parents, *, prefix=None, kv_dtype=None):
    """Next-token logits of every node of a forest, each as if its root-to-node path ran alone.

    tokens [N], parents [N] (-1 for a root), in any topological order; prefix: a token list the
    forest hangs off (its K/V computed once), or a Prefix. Batched form: tokens and parents as
    lists of 1-D arrays (ragged; prefix one list per forest or one for all) -> [B, max N, V].
    kv_dtype: the caches' (init_cache's dtype) unless prefix is a Prefix, whose dtype is used.
    """
    _check_model(params)
    batched = isinstance(tokens, (list, tuple)) and len(tokens) and np.ndim(tokens[0]) == 1
    token_rows, parent_rows = (tokens, parents) if batched else ([tokens], [parents])
    if prefix is None:
        prefix = _empty_prefix(params, 1, kv_dtype)
    elif not isinstance(prefix, Prefix):
        prefix = make_prefix(params, prefix, kv_dtype=kv_dtype)
    logits_BNV, _, forests = forest_pass(params, token_rows, parent_rows, prefix)
    n = max(f.parents.size for f in forests)
    return logits_BNV[:, :n] if batched else logits_BNV[0, :n]


# ---- scoring continuations ----------------------------------------------------------------

def trie(candidates):
    """A forest sharing candidates' common beginnings: (tokens, parents, path of each)."""
    tokens, parents, paths, index = [], [], [], {}
    for cand in candidates:
        node, path = -1, []
        for token in np.asarray(cand).tolist():
            key = (node, token)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = index[key]
            path.append(node)
        paths.append(path)
    return np.array(tokens, np.int32), np.array(parents, np.int32), paths


def score_continuations(params, context, candidates, *, kv_dtype=None):
    """Total log-probability [C] of each candidate continuation given the context.

    One pass: the context is prefilled once and the candidates form a trie hanging off it.
    kv_dtype: the caches' (init_cache's dtype).
    """
    if len(candidates) == 0:
        raise ValueError("candidates is empty")
    for i, cand in enumerate(candidates):
        if np.size(cand) == 0:
            raise ValueError(f"candidates[{i}] is empty")
        checks.token_ids(params.config, cand, f"candidates[{i}]", 1)
    prefix = make_prefix(params, context, kv_dtype=kv_dtype)
    tokens, parents, paths = trie(candidates)
    logits_BNV, _, _ = forest_pass(params, [tokens], [parents], prefix)
    logp_NV = jax.nn.log_softmax(logits_BNV[0], axis=-1)
    first_V = jax.nn.log_softmax(prefix.logits[0])
    scores = []
    for path in paths:
        total = first_V[tokens[path[0]]]
        for prev, node in zip(path[:-1], path[1:]):
            total = total + logp_NV[prev, tokens[node]]
        scores.append(total)
    return jnp.stack(scores)


# ---- branches -----------------------------------------------------------------------------

@struct.dataclass
class Branches:
    tokens: jax.Array  # [n, T] sampled tokens
    cache: KVCache  # per layer [n, K, T, H]; slot t of row b holds branch b's token t
    logits: jax.Array  # [n, V] after each branch's last token


def branch_step(params, prefix: Prefix, cache, token_n, t):
    """Feed token_n as every branch's t-th token (position prefix length + t): (logits, cache)."""
    n = token_n.shape[0]
    pos_n1 = jnp.broadcast_to(prefix.length[:1, None] + t, (n, 1))
    mask_n1T = jnp.broadcast_to(jnp.arange(cache.capacity) <= t, (n, 1, cache.capacity))
    x_n1D, cache = extend(params, cache, token_n[:, None], pos_n1, jnp.full((n, 1), t),
                          mask_n1T, prefix=prefix.shared, kv_len=t + 1)
    return logits(params, x_n1D)[:, 0], cache


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def _decode_branches(params, prefix: Prefix, sampling, keys_n, *, max_new_tokens: int):
    count_trace("decode_branches")
    n = keys_n.shape[0]
    V = params.config.vocab_size
    logits_nV = jnp.broadcast_to(prefix.logits[0], (n, V))
    never_seen = jnp.zeros((n, V), bool)

    def step(carry, t):
        cache, logits_nV = carry
        token_n = sample(logits_nV, sampling, keys_n, t, never_seen)
        logits_nV, cache = branch_step(params, prefix, cache, token_n, t)
        return (cache, logits_nV), token_n

    (cache, logits_nV), tokens_Tn = jax.lax.scan(
        step, (init_cache(params, n, max_new_tokens, prefix.cache.dtype), logits_nV),
        jnp.arange(max_new_tokens))
    return Branches(tokens_Tn.T, cache, logits_nV)


def decode_branches(params, prompt, n_branches: int, max_new_tokens: int, *, temperature=1.0,
                    top_k=None, top_p=None, min_p=None, key=None,
                    kv_dtype=None) -> tuple[Prefix, Branches]:
    """n_branches continuations of one prompt; the prompt's K/V are stored once and shared.
    kv_dtype: the caches' (init_cache's dtype)."""
    n_branches = checks.int_arg(n_branches, "n_branches")
    max_new_tokens = checks.int_arg(max_new_tokens, "max_new_tokens")
    checks.token_ids(params.config, prompt, "prompt", 1)
    prefix = make_prefix(params, list(prompt), kv_dtype=kv_dtype)
    check_positions(params, prefix, max_new_tokens)
    sampling = sampling_params(n_branches, temperature=temperature, top_k=top_k, top_p=top_p,
                               min_p=min_p)
    return prefix, _decode_branches(params, prefix, sampling, row_keys(key, n_branches),
                                    max_new_tokens=max_new_tokens)


def generate_branches(params, prompt, n_branches: int, max_new_tokens: int, *, temperature=1.0,
                      top_k=None, top_p=None, min_p=None, key=None, kv_dtype=None):
    """[n_branches, max_new_tokens]: sampled continuations of one prompt sharing its cache.

    Branch b uses key fold_in(key, b) (or key[b] for [n] keys), so it equals
    generate(params, [prompt], max_new_tokens, key=<that key>[None], ...).
    """
    _, branches = decode_branches(params, prompt, n_branches, max_new_tokens,
                                  temperature=temperature, top_k=top_k, top_p=top_p,
                                  min_p=min_p, key=key, kv_dtype=kv_dtype)
    return branches.tokens


# ---- accept & compact ---------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("capacity",))
def _compact(params, prefix: Prefix, prefix_row, own: KVCache, row, slots_T, *, capacity):
    cache = init_cache(params, 1, capacity, own.dtype)
    P = min(prefix.cache.capacity, capacity)
    start = prefix.length[prefix_row]
    dest_T = start + jnp.arange(slots_T.shape[0])

    def fill(linear_1KCH, shared_PKSH, mine_nKTH):
        linear_1KCH = linear_1KCH.at[0, :, :P].set(shared_PKSH[prefix_row, :, :P])  # rest masked
        # Index arrays around a slice: both sides are viewed [T, K, H].
        return linear_1KCH.at[0, :, dest_T].set(mine_nKTH[row, :, slots_T], mode="drop")

    # (tree.map: an Int8KV's int8 numbers [.., H] and scales alike)
    return cache.replace(k=jax.tree.map(fill, cache.k, prefix.cache.k, own.k),
                         v=jax.tree.map(fill, cache.v, prefix.cache.v, own.v))


def accept(params, prefix: Prefix, own: KVCache, row: int, slots, capacity: int,
           prefix_row: int = 0):
    """A linear cache [1, capacity] holding prefix row prefix_row followed by the chosen path:
    own row `row`, slots `slots` (root first). Returns (cache, next position); ordinary
    decode_step continues from there."""
    n, T = own.batch_size, own.capacity
    for name, value, bound in (("row", row, n), ("prefix_row", prefix_row, prefix.length.size)):
        if checks.int_arg(value, name, minimum=0) >= bound:
            raise ValueError(f"{name} = {value} is out of range: expected 0 <= {name} < {bound} "
                             "(the rows there are)")
    slots = checks.int_array(slots, "slots", 1, (0, T), f"is not a slot of the node cache "
                             f"(capacity {T})")
    end = int(prefix.length[prefix_row]) + slots.size
    if end > capacity:
        raise ValueError(f"capacity {capacity} is too small for prefix + path ({end} slots)")
    return _compact(params, prefix, prefix_row, own, row, slots, capacity=capacity), end


def accept_branch(params, prefix: Prefix, branches: Branches, b: int, capacity: int):
    """Accept branch b of decode_branches: (linear cache, next position)."""
    T = branches.tokens.shape[1]
    return accept(params, prefix, branches.cache, b, np.arange(T), capacity)


def accept_node(params, prefix: Prefix, node_cache: KVCache, forest: Forest, node: int,
                capacity: int, row: int = 0):
    """Accept the root-to-node path of a forest_pass: (linear cache, next position)."""
    return accept(params, prefix, node_cache, row, forest.path(node), capacity,
                  prefix_row=row if prefix.length.shape[0] > 1 else 0)
