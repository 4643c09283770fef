"""generate: prefill, then a while loop of decode_step, compiled as one program."""

import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import io_callback

from jaxkv import ops
from jaxkv.core import checks
from jaxkv.core import hooks as hooks_lib
from jaxkv.core.cache import KVCache
from jaxkv.core.decoder import decode_step, init_cache, prefill_padded
from jaxkv.core.sharding import (check_mesh, constrain_cache, replicated, shard_params,
                                 shard_rows)
from jaxkv.core.tracecount import count_trace
from jaxkv.decoding import constraints, rows, stops
from jaxkv.decoding.prompts import (SLOT_MULTIPLE, capacity_for, check_room, eos_ids,
                                    pad_value, padded_encoder_inputs, prepare_prompts,
                                    token_mask, whole_blocks)
from jaxkv.decoding.sampling import SamplingParams, row_keys, sampling_params
from jaxkv.decoding.stops import StopStrings


@struct.dataclass
class _Decoding:
    cache: KVCache
    logits: jax.Array  # [B, V] float32: the next token's
    pos: jax.Array  # [B] int32: where the next token goes
    answers: rows.Answers
    acts: dict  # hooks' captures {site: [.., B, capacity, D]} by position; {} without hooks


@functools.partial(jax.jit, static_argnames=("slots", "capacity", "on_token", "mesh",
                                             "kv_dtype"))
@checks.trusted()  # generate_args checked the prompts; the loop makes its own positions
def generate_loop(params, tokens_BT, lengths_B, sampling: SamplingParams, keys_B, eos_E, pad_id,
                  suppress_V, begin_suppress_V, stop: StopStrings, max_new_tokens,
                  encoder_inputs=None, encoder_lengths=None, hooks=None, automaton=None,
                  starts_B=None, *, slots: int, capacity: int, on_token=None, mesh=None,
                  kv_dtype=None):
    """The compiled program behind generate: (encoder and cross K/V,) prefill, then a while
    loop of sample + decode_step that stops when every row has ended (with hooks, each pass's
    captures written at its positions; with a constraints.Automaton, each row's draws kept to
    what its constraint allows, from its start state starts_B). max_new_tokens is traced and
    the answers have `slots` >= it (tokens [B, slots], pad past it), so the budgets of one block
    of SLOT_MULTIPLE share a program."""
    count_trace("generate")
    B = tokens_BT.shape[0]
    cache = constrain_cache(init_cache(params, B, capacity, kv_dtype,
                                       encoder_inputs=encoder_inputs,
                                       encoder_lengths=encoder_lengths), mesh)
    logits_BV, cache, *acts = prefill_padded(params, cache, tokens_BT, lengths_B,
                                             jnp.zeros((B,), jnp.int32), hooks=hooks)
    acts = hooks_lib.positions(acts[0], capacity) if acts else {}
    seen_BV = rows.prompt_seen(params.config.vocab_size, tokens_BT, lengths_B)
    answers = rows.empty(B, slots, stop.completes.shape[1], pad_id, seen_BV,
                         state_B=starts_B)
    V = params.config.vocab_size
    state = _Decoding(constrain_cache(cache, mesh), logits_BV, lengths_B, answers, acts)

    def draw(s: _Decoding):
        """(s with every row's next token recorded, the tokens [B]: pad_id after a row's end)."""
        first_B1 = (s.answers.length == 0)[:, None]
        banned_BV = (suppress_V | (begin_suppress_V & first_B1) |
                     ~rows.allowed(s.answers, automaton, max_new_tokens, eos_E, V))
        token_B = rows.draw(s.answers, s.logits, sampling, keys_B, banned_BV, pad_id)
        if on_token is not None:
            io_callback(on_token, None, token_B, ordered=True)
        answers, _ = rows.append(s.answers, token_B[:, None], jnp.ones((B,), jnp.int32), eos_E,
                                 stop, max_new_tokens, automaton)
        return s.replace(answers=answers), token_B

    def step(s: _Decoding) -> _Decoding:
        s, token_B = draw(s)
        logits_BV, cache, *acts = decode_step(params, s.cache, token_B, s.pos, hooks)
        acts = hooks_lib.put_rows(s.acts, acts[0], s.pos) if acts else s.acts
        return s.replace(cache=constrain_cache(cache, mesh), logits=logits_BV, pos=s.pos + 1,
                         acts=acts)

    # The last token needs no decode step after it; nor does anything once every row has ended.
    more = lambda s: (jnp.max(s.answers.length) < max_new_tokens - 1) & ~jnp.all(  # noqa
        s.answers.done)
    state, _ = draw(jax.lax.while_loop(more, step, state))
    out = (state.answers.tokens, state.answers.length)
    return replicated(out if hooks is None else (*out, state.acts), mesh)


def generate(params, prompts, max_new_tokens: int, **options):
    """Continues each prompt by up to max_new_tokens tokens: (tokens [B, max_new_tokens],
    lengths [B]).

    prompts: a list of token-id lists (ragged) or a [B, T] array with lengths=[B]. Options:
    temperature (0: greedy), top_k, top_p, min_p, repetition_penalty: scalars or per-row [B]
    sequences, None meaning off; key: one key (row b uses fold_in(key, b)) or [B] keys;
    eos_id: an id or a list of ids; after a row's EOS its tokens are pad_id (default: the first
    EOS id) and its length counts the EOS; stop: strings that end a row (with tokenizer=, or
    jaxkv.stop_strings tables), checked on token ids in the loop: the row's length counts the
    token that completed one (jaxkv.stops.cut cuts the text); max_len: the cache capacity
    (default: prompt bucket + max_new_tokens); on_token(token [B]): called from inside the
    compiled loop for each token drawn (generation stops early once every row has ended);
    mesh: a jax.sharding.Mesh with axes ("data", "model") (see jaxkv.sharding.make_mesh): rows
    are split over "data", heads / MLP width / vocabulary over "model"; kv_dtype: the cache's
    dtype (init_cache's: float32, bfloat16, float16 or int8; default the params'); hooks: a
    jaxkv.Hooks, whose edits apply to every pass and whose captures come back as a third
    result, acts {site: [.., B, capacity, D]} (attn_probs [L', B, N, capacity, capacity]):
    index t is row b's position t, prompt and
    generated (the last token drawn is never passed through, so a row's positions up to its
    prompt length + its length - 2 hold captures; the rest zeros or the prompt's padding);
    constraint: a jaxkv.constraints Regex / Choice / JsonSchema / Json for every row, or a list
    of one (or None) per prompt: each answer is one the constraint accepts (end of sequence
    allowed exactly where it accepts; a row ends where it must; see jaxkv.constraints).
    """
    args, static = generate_args(params, prompts, max_new_tokens, **options)
    with ops.on(args[0]):  # the program is built for where the weights are (or the mesh)
        if static["on_token"] is None:
            return _cut(generate_loop(*args, **static), max_new_tokens)
        try:  # wait here, so that an exception on_token raised surfaces as itself
            return _cut(jax.block_until_ready(generate_loop(*args, **static)), max_new_tokens)
        except jax.errors.JaxRuntimeError:
            if RaisedInCallback.errors:
                raise RaisedInCallback.errors.pop() from None
            raise


def _cut(out: tuple, max_new_tokens: int) -> tuple:
    """generate_loop's results with the tokens [B, slots] cut to [B, max_new_tokens]."""
    tokens = out[0] if out[0].shape[1] == max_new_tokens else out[0][:, :max_new_tokens]
    return (tokens, *out[1:])


@dataclasses.dataclass(frozen=True)
class RaisedInCallback:
    """on_token as the compiled loop calls it: an exception it raises is kept, and generate
    raises it as itself instead of XLA's runtime error. Equal for the same function, so wrapping
    it never recompiles."""

    fn: Callable
    errors: ClassVar[list] = []

    def __call__(self, token_B):
        try:
            self.fn(token_B)
        except Exception as e:
            RaisedInCallback.errors[:] = [e]
            raise


def generate_args(params, prompts, max_new_tokens: int, *, lengths=None, temperature=0.0,
                  top_k=None, top_p=None, min_p=None, repetition_penalty=None, key=None,
                  eos_id=None, pad_id=None, max_len=None, on_token=None, encoder_inputs=None,
                  encoder_lengths=None, suppress_ids=None, begin_suppress_ids=None, mesh=None,
                  kv_dtype=None, stop=None, tokenizer=None, hooks=None, constraint=None):
    """Validated (args, static kwargs) for generate_loop; lets callers compile ahead of time."""
    c = params.config
    tokens_BT, lengths_B = prepare_prompts(c, prompts, lengths)
    B, T = tokens_BT.shape
    max_new_tokens = checks.int_arg(max_new_tokens, "max_new_tokens")
    capacity = capacity_for(c, T, max_new_tokens, max_len)
    check_room(c, lengths_B, max_new_tokens, capacity, max_len)
    if max_len is None:
        capacity = whole_blocks(capacity, c.max_seq_len)
    sampling = sampling_params(B, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                               repetition_penalty=repetition_penalty)
    eos_E = eos_ids(c, eos_id)
    pad_id = pad_value(c, pad_id, eos_id, eos_E)
    suppress_V = token_mask(c, c.suppress_ids if suppress_ids is None else suppress_ids,
                            "suppress_ids")
    begin_V = token_mask(c, c.begin_suppress_ids if begin_suppress_ids is None else
                         begin_suppress_ids, "begin_suppress_ids")
    encoder = padded_encoder_inputs(c, encoder_inputs, encoder_lengths, B)
    per_row = (tokens_BT, lengths_B, sampling, row_keys(key, B))
    if check_mesh(mesh) is not None:
        params, per_row, encoder = (shard_params(params, mesh), shard_rows(per_row, mesh),
                                    shard_rows(encoder, mesh))
    hooks_lib.tap_for(hooks, None, c)  # (checks hooks)
    hooks_lib.check_fits(hooks, c, B, capacity, params.embed.dtype, n_keys=capacity)
    automaton = None if constraint is None else constraints.for_rows(
        constraint, B, c.vocab_size, bool(eos_E[0] >= 0), max_new_tokens)
    args = (params, *per_row, eos_E, jnp.int32(pad_id), suppress_V, begin_V,
            stops.tables(c, stop, tokenizer), jnp.int32(max_new_tokens), *encoder, hooks,
            *(automaton or (None, None)))
    if on_token is not None and mesh is not None and mesh.is_multi_process:
        raise ValueError("on_token: a host callback inside a program spread over several "
                         "processes is not supported; use iter_many / iter_tokens, or no mesh")
    on_token = None if on_token is None else RaisedInCallback(on_token)
    kv_dtype = None if kv_dtype is None else checks.kv_dtype(kv_dtype, "kv_dtype")
    slots = -(-max_new_tokens // SLOT_MULTIPLE) * SLOT_MULTIPLE  # capacity rounds up as much
    return args, dict(slots=slots, capacity=capacity, on_token=on_token,
                      mesh=mesh, kv_dtype=kv_dtype)
