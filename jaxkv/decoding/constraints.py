"""Constrained decoding: answers of a fixed form, enforced inside the compiled loops.

A constraint is a token-level automaton built once per pattern and tokenizer with
outlines-core (it turns a regular expression and a vocabulary into, for each state, the tokens
allowed there and the state each leads to; it also turns JSON schemas into regular
expressions). Here it is held as arrays: per state a default (allowed or not, and where an
allowed token leads) and the tokens that differ from it (its exceptions), so its memory grows
with the exceptions, never with states x vocabulary. Each step of a loop masks the logits with
the current state's allowed tokens and advances the state with the drawn token, in the same
program (no host round trip).

End of sequence is allowed exactly where the automaton accepts; a row that reaches an
accepting state with no way on ends there (as at end of sequence), and so does one that
accepts when the model has no end id. A token is allowed only if an accepting state stays
within the row's remaining budget (fewest tokens to accept, precomputed per state), so an
answer cut by max_new_tokens is still accepted.
"""

import dataclasses
import hashlib
import json
import os
import re
import time
import weakref
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True, eq=False)
class Constraint:
    """One constraint compiled for one tokenizer (host arrays; S states, X exceptions): build it
    with Regex, Choice, JsonSchema or Json."""

    description: str  # what it constrains to (for errors)
    default_allowed: np.ndarray  # [S] bool: a token that is no exception is allowed
    default_next: np.ndarray  # [S] int32: ... and leads there
    offsets: np.ndarray  # [S + 1] int32: state s's exceptions are [offsets[s], offsets[s+1])
    exc_token: np.ndarray  # [X] int32, ascending within a state
    exc_allowed: np.ndarray  # [X] bool
    exc_next: np.ndarray  # [X] int32
    final: np.ndarray  # [S] bool: accepting
    way_on: np.ndarray  # [S] bool: some token leads on from here
    fewest: np.ndarray  # [S] int32: fewest tokens from here to an accepting state
    vocab_size: int  # ids the tables cover (the tokenizer's)
    build_seconds: float = 0.0  # compiling it (0 when read from the disk cache)

    @property
    def shortest(self) -> int:
        """The fewest tokens of an accepted answer (state 0 is the start)."""
        return int(self.fewest[0])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.default_allowed, self.default_next, self.offsets,
                                      self.exc_token, self.exc_allowed, self.exc_next,
                                      self.final, self.way_on, self.fewest))

    def allowed(self, state: int, left: int) -> dict:
        """{token: next state} of the tokens allowed at state with `left` tokens to go (the
        plain reference of what the compiled loop does; end ids are not included)."""
        lo, hi = self.offsets[state], self.offsets[state + 1]
        exceptions = dict(zip(self.exc_token[lo:hi].tolist(),
                              zip(self.exc_allowed[lo:hi].tolist(), self.exc_next[lo:hi].tolist())))
        out = {}
        for t in range(self.vocab_size):
            ok, nxt = exceptions.get(t, (self.default_allowed[state], self.default_next[state]))
            if ok and self.fewest[nxt] <= left - 1:
                out[t] = int(nxt)
        return out


# ---- building ---------------------------------------------------------------------------------

def Regex(pattern: str, tokenizer) -> Constraint:  # noqa: N802 - a constructor, by name
    """Answers matching the regular expression pattern (Rust regex syntax, matched whole)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"Regex: pattern must be a non-empty string, got {pattern!r}")
    return _compiled("regex", pattern, pattern, tokenizer)


def Choice(choices, tokenizer) -> Constraint:  # noqa: N802
    """Answers that are exactly one of the strings choices."""
    if (not isinstance(choices, (list, tuple)) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"Choice: choices must be a non-empty list of non-empty strings, got "
                         f"{choices!r}")
    pattern = "|".join(_escape(c) for c in choices)
    return _compiled("choice", json.dumps(list(choices)), f"({pattern})", tokenizer)


def JsonSchema(schema, tokenizer, whitespace: str | None = None) -> Constraint:  # noqa: N802
    """JSON that the schema (a dict or a JSON string) accepts, as outlines-core's regular
    expression for it (whitespace: its pattern between tokens, default at most one space)."""
    from outlines_core.json_schema import build_regex_from_schema

    text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
    try:
        json.loads(text)
        pattern = build_regex_from_schema(text, whitespace)
    except (ValueError, TypeError) as e:
        raise ValueError(f"JsonSchema: not a schema outlines-core can compile ({e}): "
                         f"{text[:200]}") from None
    return _compiled("json_schema", text, pattern, tokenizer)


def Json(tokenizer) -> Constraint:  # noqa: N802
    """Any JSON value (objects and arrays nested to outlines-core's depth for the empty
    schema)."""
    return JsonSchema({}, tokenizer)


def _escape(text: str) -> str:
    """text as a literal in a Rust regular expression."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~ " else c for c in text)


def _compiled(kind: str, key: str, pattern: str, tokenizer) -> Constraint:
    """The constraint of pattern for tokenizer, from the disk cache or built (and stored)."""
    vocab, vocab_digest = _vocabulary(tokenizer)
    digest = hashlib.sha256(json.dumps([CACHE_VERSION, kind, key, pattern, vocab_digest])
                            .encode()).hexdigest()[:24]
    path = os.path.join(cache_dir(), f"{digest}.npz")
    description = f"{kind} {key if len(key) < 120 else key[:117] + '...'}"
    if os.path.exists(path):
        with np.load(path) as z:
            return Constraint(description, **{k: z[k] for k in z.files if k != "vocab_size"},
                              vocab_size=int(z["vocab_size"]))
    start = time.perf_counter()
    tables = _tables(pattern, vocab, description)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(temporary, **tables)
    os.replace(temporary, path)
    return Constraint(description, **{k: v for k, v in tables.items() if k != "vocab_size"},
                      vocab_size=int(tables["vocab_size"]),
                      build_seconds=time.perf_counter() - start)


# tokenizer -> (its size with added tokens, token_bytes of it, a digest of those)
_VOCABULARIES = weakref.WeakKeyDictionary()


def _vocabulary(tokenizer) -> tuple[dict, str]:
    """token_bytes(tokenizer) and a digest of it, read once per tokenizer (0.2 s for SmolLM2's)
    and again only when its size changes (tokens added to it)."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    kept = _VOCABULARIES.get(tokenizer)
    if kept is None or kept[0] != size:
        vocab = token_bytes(tokenizer)
        digest = hashlib.sha256(json.dumps(sorted((i, b.hex()) for i, b in vocab.items()))
                                .encode()).hexdigest()
        kept = _VOCABULARIES[tokenizer] = (size, vocab, digest)
    return kept[1], kept[2]


def cache_dir() -> str:
    """Where compiled constraints are kept: $JAXKV_CACHE/constraints, else
    ~/.cache/jaxkv/constraints."""
    root = os.environ.get("JAXKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "jaxkv")
    return os.path.join(root, "constraints")


def token_bytes(tokenizer) -> dict:
    """{id: the bytes the token stands for} of every token that is not special: byte-level
    BPE's characters mapped back to bytes, SentencePiece's <0xNN> byte tokens and U+2581 spaces,
    else the token's text."""
    spec = json.loads(tokenizer.to_str())
    kinds = _decoder_kinds(spec.get("decoder"))
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    to_byte = {c: b for b, c in _byte_level_chars().items()}
    out = {}
    for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i in special:
            continue
        if "ByteLevel" in kinds and all(c in to_byte for c in text):
            data = bytes(to_byte[c] for c in text)
        elif "ByteFallback" in kinds and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            data = bytes([int(text[3:5], 16)])
        else:
            data = (text.replace("\u2581", " ") if kinds & {"Metaspace", "Replace"} else
                    text).encode()
        if data:
            out[i] = data
    return out


def _decoder_kinds(decoder) -> set:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_kinds(d) for d in decoder.get("decoders", [])))
    return {decoder.get("type")}


def _byte_level_chars() -> dict:
    """GPT-2's byte-level alphabet: byte -> the printable character standing for it."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


def _tables(pattern: str, vocab: dict, description: str) -> dict:
    """outlines-core's index of pattern over vocab, as Constraint's arrays."""
    from outlines_core import Index, Vocabulary

    V = max(vocab) + 2  # (+1: the end id outlines-core needs, one past every token)
    by_bytes = {}
    for i, data in vocab.items():
        by_bytes.setdefault(data, []).append(i)
    try:
        index = Index(pattern, Vocabulary(V - 1, by_bytes))
    except (ValueError, TypeError, RuntimeError) as e:
        if "incompatible" in str(e):  # outlines-core found a character no token can make
            raise ValueError(f"constraint {description}: no sequence of this vocabulary's "
                             f"tokens is accepted ({e})") from None
        raise ValueError(f"constraint {description}: not a regular expression outlines-core "
                         f"can compile ({e})") from None
    start = index.get_initial_state()
    edges = {s: {t: n for t, n in out.items() if t != V - 1}
             for s, out in index.get_transitions().items()}
    finals = set(index.get_final_states())
    names = [start] + sorted((set(edges) | finals | {n for o in edges.values()
                                                    for n in o.values()}) - {start})
    number = {s: k for k, s in enumerate(names)}
    fewest = _fewest(len(names), [(number[s], number[n]) for s, out in edges.items()
                                  for n in out.values()], [number[s] for s in finals])
    if fewest[0] >= np.iinfo(np.int32).max:
        raise ValueError(f"constraint {description}: no sequence of this vocabulary's tokens "
                         "is accepted")
    return _state_arrays(names, number, edges, finals, fewest, V - 1)


def _fewest(S: int, edges: list, finals: list) -> np.ndarray:
    """[S] fewest edges from each state to an accepting one (int32 max: none)."""
    unreachable = np.iinfo(np.int32).max
    into = [[] for _ in range(S)]
    for s, n in edges:
        into[n].append(s)
    fewest = np.full(S, unreachable, np.int64)
    queue = deque(finals)
    fewest[finals] = 0
    while queue:
        n = queue.popleft()
        for s in into[n]:
            if fewest[s] == unreachable:
                fewest[s] = fewest[n] + 1
                queue.append(s)
    return fewest.astype(np.int32)


def _state_arrays(names, number, edges, finals, fewest, V) -> dict:
    """Per state the default (allowed where more than half the vocabulary is, leading where
    most allowed tokens lead) and its exceptions; transitions into states that cannot accept
    are dropped."""
    unreachable = np.iinfo(np.int32).max
    S = len(names)
    default_allowed, way_on = np.zeros(S, bool), np.zeros(S, bool)
    default_next = np.zeros(S, np.int32)
    tokens, allowed, nexts, offsets = [], [], [], [0]
    for k, s in enumerate(names):
        out = {t: number[n] for t, n in edges.get(s, {}).items() if fewest[number[n]] < unreachable}
        t_A = np.fromiter(out, np.int32, len(out))
        n_A = np.fromiter(out.values(), np.int32, len(out))
        way_on[k] = len(out) > 0
        if len(out) > V // 2:
            values, counts = np.unique(n_A, return_counts=True)
            default_allowed[k], default_next[k] = True, values[np.argmax(counts)]
            banned = np.setdiff1d(np.arange(V, dtype=np.int32), t_A)
            moved = n_A != default_next[k]
            t_X = np.concatenate([banned, t_A[moved]])
            ok_X = np.concatenate([np.zeros(len(banned), bool), np.ones(moved.sum(), bool)])
            n_X = np.concatenate([np.zeros(len(banned), np.int32), n_A[moved]])
        else:
            t_X, ok_X, n_X = t_A, np.ones(len(t_A), bool), n_A
        order = np.argsort(t_X, kind="stable")
        tokens.append(t_X[order])
        allowed.append(ok_X[order])
        nexts.append(n_X[order])
        offsets.append(offsets[-1] + len(t_X))
    final = np.array([s in finals for s in names])
    cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(  # noqa
        0, dtype)
    return dict(default_allowed=default_allowed, default_next=default_next,
                offsets=np.asarray(offsets, np.int32), exc_token=cat(tokens, np.int32),
                exc_allowed=cat(allowed, bool), exc_next=cat(nexts, np.int32), final=final,
                way_on=way_on, fewest=fewest, vocab_size=np.int64(V))


# ---- on the device ----------------------------------------------------------------------------

@struct.dataclass
class Automaton:
    """Several constraints' tables joined for one batch (their states numbered one after
    another, a last state that allows everything for rows without one), padded to powers of
    two so that constraints of similar size share a compiled program; W: the most exceptions a
    state has."""

    default_allowed: jax.Array  # [S] bool
    default_next: jax.Array  # [S] int32
    offsets: jax.Array  # [S + 1] int32
    exc_token: jax.Array  # [X] int32
    exc_allowed: jax.Array  # [X] bool
    exc_next: jax.Array  # [X] int32
    final: jax.Array  # [S] bool
    stop: jax.Array  # [S] bool: reaching the state ends the row
    fewest: jax.Array  # [S] int32
    limit: jax.Array  # [S] int32: ids from here on are none of the constraint's tokens
    W: int = struct.field(pytree_node=False, default=1)


def for_rows(constraint, batch_size: int, vocab_size: int, has_end: bool,
             max_new_tokens: int) -> tuple:
    """(Automaton, start states [B]) for constraint: None (no row constrained), one Constraint
    for every row, or a list of one (or None) per row. Checked before anything runs: each fits
    the model's vocabulary and its shortest answer max_new_tokens."""
    per_row = per_prompt(constraint, batch_size)
    for row, c in enumerate(per_row):
        check(c, f"prompt {row}", vocab_size, max_new_tokens)
    automaton, start_of = join(per_row, vocab_size, has_end)
    return automaton, jnp.asarray([start_of(c) for c in per_row], jnp.int32)


def per_prompt(constraint, count: int | None) -> list:
    """constraint as one (or None) per prompt: a list or tuple is that already (count of them,
    where known); a Constraint or None is every prompt's."""
    per = list(constraint) if isinstance(constraint, (list, tuple)) else [constraint] * (
        count or 1)
    if isinstance(constraint, (list, tuple)) and count is not None and len(per) != count:
        raise ValueError(f"constraint: one per prompt expected ({count}), got {len(per)}")
    for i, c in enumerate(per):
        if c is not None and not isinstance(c, Constraint):
            raise TypeError(f"constraint of prompt {i}: expected a jaxkv.constraints Regex / "
                            f"Choice / JsonSchema / Json, got {type(c).__name__}")
    return per


def check(c, name: str, vocab_size: int, max_new_tokens: int):
    """c (a Constraint or None) fits a model of vocab_size and an answer of max_new_tokens;
    errors name the prompt (name)."""
    if c is None:
        return
    if c.vocab_size > vocab_size:
        raise ValueError(f"constraint of {name} ({c.description}): built for a tokenizer of "
                         f"{c.vocab_size} ids, the model has {vocab_size}")
    if c.shortest > max_new_tokens:
        raise ValueError(f"constraint of {name} ({c.description}): its shortest answer is "
                         f"{c.shortest} tokens, more than max_new_tokens ({max_new_tokens})")


def join(constraints, V: int, has_end: bool) -> tuple:
    """(Automaton, start_of): the distinct Constraints among constraints joined (None: a row
    without one), and start_of(c) -> the start state of c (or of None)."""
    distinct = []
    for c in constraints:
        if c is not None and not any(c is d for d in distinct):
            distinct.append(c)
    first, first_x, widths = [], [], []
    s0 = x0 = 0
    for c in distinct:
        first.append(s0)
        first_x.append(x0)
        s0 += len(c.final)
        x0 += len(c.exc_token)
    free = s0  # the state of rows without a constraint: everything allowed, always accepting
    S, X = _pow2(free + 1), _pow2(max(x0, 1))
    a = dict(default_allowed=np.zeros(S, bool), default_next=np.zeros(S, np.int32),
             offsets=np.full(S + 1, x0, np.int32), exc_token=np.zeros(X, np.int32),
             exc_allowed=np.zeros(X, bool), exc_next=np.zeros(X, np.int32),
             final=np.zeros(S, bool), stop=np.zeros(S, bool),
             fewest=np.full(S, np.iinfo(np.int32).max, np.int32), limit=np.zeros(S, np.int32))
    for c, s, x in zip(distinct, first, first_x):
        n, m = len(c.final), len(c.exc_token)
        a["default_allowed"][s:s + n] = c.default_allowed
        a["default_next"][s:s + n] = c.default_next + s
        a["offsets"][s:s + n + 1] = c.offsets + x
        a["exc_token"][x:x + m], a["exc_allowed"][x:x + m] = c.exc_token, c.exc_allowed
        a["exc_next"][x:x + m] = c.exc_next + s
        a["final"][s:s + n], a["fewest"][s:s + n] = c.final, c.fewest
        a["stop"][s:s + n] = c.final & (~c.way_on | (not has_end))
        a["limit"][s:s + n] = c.vocab_size
        widths.append(np.diff(c.offsets).max(initial=0))
    a["default_allowed"][free] = a["final"][free] = True
    a["default_next"][free], a["fewest"][free], a["limit"][free] = free, 0, V

    def start_of(c) -> int:
        return free if c is None else first[next(i for i, d in enumerate(distinct) if d is c)]
    automaton = Automaton(**{k: jnp.asarray(v) for k, v in a.items()},
                          W=_pow2(max(widths, default=1)))
    return automaton, start_of


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _exceptions(a: Automaton, state_B):
    """State state_B's exceptions, W per row: (valid, token, allowed, next), each [B, W]."""
    lo_B = a.offsets[state_B]
    valid_BW = jnp.arange(a.W) < (a.offsets[state_B + 1] - lo_B)[:, None]
    at_BW = jnp.where(valid_BW, lo_B[:, None] + jnp.arange(a.W), 0)
    return valid_BW, a.exc_token[at_BW], a.exc_allowed[at_BW], a.exc_next[at_BW]


def allowed(a: Automaton, state_B, left_B, end_E, vocab_size: int):
    """[B, V] bool: the tokens row b may draw at state_B[b] with left_B[b] tokens to go (this
    one included): those the automaton allows there after which it can still accept in time,
    and the end ids (end_E, -1: none) where it accepts."""
    B, V = state_B.shape[0], vocab_size
    valid_BW, token_BW, ok_BW, next_BW = _exceptions(a, state_B)
    in_time = lambda next_: a.fewest[next_] <= (left_B - 1).reshape(  # noqa: E731
        (-1,) + (1,) * (next_.ndim - 1))
    base_B = a.default_allowed[state_B] & in_time(a.default_next[state_B])
    mask_BV = jnp.broadcast_to(base_B[:, None], (B, V))
    mask_BV = mask_BV.at[jnp.arange(B)[:, None], jnp.where(valid_BW, token_BW, V)].set(
        ok_BW & in_time(next_BW), mode="drop")
    mask_BV &= jnp.arange(V) < a.limit[state_B][:, None]
    ends_E = jnp.where(end_E < 0, V, end_E)
    return mask_BV.at[:, ends_E].set(a.final[state_B][:, None], mode="drop")


def advance(a: Automaton, state_B, token_B):
    """(next state [B], whether it ends the row [B]) after each row drew token_B."""
    valid_BW, token_BW, _, next_BW = _exceptions(a, state_B)
    hit_BW = valid_BW & (token_BW == token_B[:, None])
    next_B = jnp.where(hit_BW.any(1), jnp.sum(jnp.where(hit_BW, next_BW, 0), 1),
                       a.default_next[state_B])
    return next_B, a.stop[next_B]
