"""Continuous batching: generate_many keeps batch_size rows busy over a whole data set.

A row that ends (EOS or its token budget) takes the next prompt at once: the prompt is
prefilled into that row alone, in pieces of PIECE tokens between short runs of decoding, and the
row restarts at position 0 while its neighbours go on. Every row carries its own position, so
nothing else changes shape: one compiled admission and one compiled decoding loop serve every
prompt length and every answer length.
"""

import dataclasses
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core import cache as cache_lib
from jaxkv.core import checks
from jaxkv.core import hooks as hooks_lib
from jaxkv.core.sharding import check_mesh, fetch, shard_params
from jaxkv.decoding import blocks as blocks_lib
from jaxkv.decoding import constraints, stops
from jaxkv.decoding.progress import Progress
from jaxkv.decoding.prompts import PerPrompt, budget_list, eos_ids, sized
from jaxkv.decoding.sampling import base_key
from jaxkv.decoding.serving import admit, decode, empty_rows, placed

PIECE = 128  # prompt tokens prefilled into a row per admission call
STEPS_BETWEEN_PIECES = 8  # decode steps the other rows take while a prompt is being admitted


@dataclasses.dataclass(frozen=True)
class Scored:
    """An answer with its tokens' log-probabilities (generate_many / iter_many, logprobs=k)."""

    ids: list[int]
    logprobs: list[float]  # each token's, under the model's own distribution (its softmax)
    top: list[list[tuple[int, float]]]  # per token, the k likeliest (id, log-probability)

    def __len__(self) -> int:
        return len(self.ids)


def generate_many(params, prompts: Iterable, max_new_tokens, **options) -> list[list[int]]:
    """Each prompt's answer (its generated ids, EOS included when drawn), in input order.

    prompts: any iterable of token-id lists; max_new_tokens: an int or one per prompt. Options
    as iter_many's. Greedy answers equal generate's for the prompt alone; sampled ones equal
    generate's with key=[fold_in(key, i)] for prompt i, whatever the batch size or order."""
    answers = dict(iter_many(params, prompts, max_new_tokens, **options))
    return [answers[i] for i in range(len(answers))]


def iter_many(params, prompts: Iterable, max_new_tokens, *, batch_size: int = 16,
              progress=False, **options) -> Iterator:
    """(prompt index, answer ids) as each prompt ends, over batch_size rows kept busy.

    A list or tuple of prompts sizes the cache itself (longest prompt + largest budget); other
    iterables (a generator: memory stays bounded by batch_size) need max_len, the positions one
    row may hold. Options: temperature, top_k, top_p, min_p, repetition_penalty (scalars, as
    generate's); key: prompt i draws with fold_in(key, indices[i]) (indices: default 0, 1, ...;
    a resumed job passes the indices its prompts had in the whole data set); eos_id: an id or
    ids that end an answer (included in it); stop: strings that end an answer, checked on the
    answer's text as it grows (a list with tokenizer=, or jaxkv.stop_strings tables); the
    answer keeps the token that completed one (stops.cut cuts its text). Options given as one
    value per prompt (temperature ..., max_new_tokens, indices) apply to that prompt, whichever
    row serves it, and a list of prompts needs exactly one each. logprobs=k: each answer is a
    Scored (ids, each token's log-probability under the model's own distribution, the k
    likeliest tokens with theirs) instead of its ids. constraint: a jaxkv.constraints automaton
    for every prompt, or one (or None) per prompt (see generate). hooks (a jaxkv.Hooks): its
    edits apply to every pass, and each answer comes as (answer, acts), acts {site: [L', T, D]}
    (attn_probs [L', N, T, capacity]) numpy arrays of the prompt's and answer's positions
    0..T-1 (T = prompt + answer - 1: the last token drawn is never passed through); a cached
    prefix holds no captures, so capturing turns prefix_cache off. name_of(i): how errors name
    prompt i (default: prompts[i]).

    Nothing finished is lost: a list of prompts is checked whole before anything is computed;
    an iterable that fails at item i (the item itself, or the source) stops the admissions,
    the rows at work finish and are yielded, and the error is raised carrying every answer
    finished before it (its attribute `answers`: {prompt index: ids})."""
    schedule = Schedule(params, prompts, max_new_tokens, batch_size, **options)
    bar = Progress(schedule.count, checks.bool_arg(progress, "progress"))
    finished, error = {}, None
    try:
        while True:
            try:
                busy = schedule.fill()
            except Exception as e:  # the source or its item i: finish the rows, then raise
                error, busy = e, schedule.stop_admitting()
            if not busy:
                break
            schedule.admit_pieces()
            schedule.decode(bar.steps(STEPS_BETWEEN_PIECES if schedule.admitting()
                                      else schedule.N))
            for i, answer in schedule.harvest():
                bar.ended(len(answer))
                finished[i] = answer
                yield i, answer
            bar.tick(schedule.drawing)
    finally:  # also when interrupted: the line's last state, and a newline
        bar.close()
    if error is not None:
        error.answers = finished  # every answer finished before it, also yielded
        raise error


def iter_tokens(params, prompt, max_new_tokens: int, *, steps: int = 1, **options) -> Iterator:
    """One prompt's answer as it is drawn: lists of new ids, one per compiled call of up to
    `steps` decode steps (a program with no host callback, unlike generate's on_token).
    Options as iter_many's (hooks: edits only; generate_many returns captures); the answer
    equals generate's for the prompt."""
    steps = checks.int_arg(steps, "iter_tokens: steps")
    if getattr(options.get("hooks"), "capture", None):
        raise ValueError("iter_tokens: hooks that capture are not supported (a stream returns "
                         "ids only); use generate_many or generate for captures")
    schedule = Schedule(params, [prompt], max_new_tokens, 1, **options)
    schedule.fill()
    yield from schedule.stream(steps)


class Schedule:
    """The host side: which prompt each row serves, and how much of it is prefilled."""

    def __init__(self, params, prompts, max_new_tokens, batch_size, *, temperature=0.0,
                 top_k=None, top_p=None, min_p=None, repetition_penalty=None, key=None,
                 eos_id=None, stop=None, tokenizer=None, max_len=None, indices=None,
                 logprobs=None, block_size=16, cache_tokens=None, prefix_cache=True,
                 mesh=None, limit=None, name_of=None, hooks=None, constraint=None):
        """mesh: rows over its data axis, the model over its model axis (a mesh may span
        processes: every process then runs the same Schedule). limit: how an error names the
        cache's positions (default: max_len, the model's max_seq_len, or the cache's size, as
        the capacity came); name_of(i): how it names prompt i (default: prompts[i])."""
        c = self.config = params.config
        if c.is_encoder_decoder:
            raise ValueError("generate_many: encoder-decoder models are not supported (their "
                             "rows need encoder inputs); use generate")
        batch_size = checks.int_arg(batch_size, "batch_size")
        self.count = len(prompts) if isinstance(prompts, (list, tuple, np.ndarray, jax.Array)) \
            else None  # (an array's rows: sized checks it is [B, T])
        self.budgets, N = budget_list(max_new_tokens, self.count)
        self.N = checks.bucket_len(N)  # the answers' buffer: a new budget in its bucket reuses it
        self.prompts, self.capacity = sized(c, prompts, self.N, max_len)
        self.limit = limit or (f"max_len ({self.capacity})" if max_len is not None else
                      f"the model's max_seq_len ({self.capacity})"
                      if self.capacity == c.max_seq_len else f"the cache's {self.capacity}")
        self.name_of = name_of or (lambda i: f"prompts[{i}]")
        self.sampling = PerPrompt(self.count, temperature=temperature, top_k=top_k, top_p=top_p,
                                  min_p=min_p, repetition_penalty=repetition_penalty)
        self.stop, self.eos_E = stops.tables(c, stop, tokenizer), eos_ids(c, eos_id)
        self.constraints = constraints.per_prompt(constraint, self.count)
        self.one_constraint = not isinstance(constraint, (list, tuple))  # for every prompt
        self.automaton, self.start_of = (None, None) if constraint is None else constraints.join(
            self.constraints, c.vocab_size, bool(self.eos_E[0] >= 0))
        self.params = params if check_mesh(mesh) is None else shard_params(params, mesh)
        self.key, self.indices = base_key(key), indices
        if self.key.ndim != 0:
            raise ValueError(f"key must be one key (prompt i uses fold_in(key, i)), got key "
                             f"shape {self.key.shape}")
        if indices is not None and self.count is not None and len(indices) != self.count:
            raise ValueError(f"indices has {len(indices)} values for {self.count} prompts: "
                             "expected one per prompt")
        self.paging = None
        work = ((i, ids, self.checked(i, ids)) for i, ids in enumerate(self.prompts))
        work = list(work) if self.count is not None else work  # a list: all checked now
        if logprobs is not None and checks.int_arg(logprobs, "logprobs", 0) > c.vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary's {c.vocab_size} tokens, "
                             f"got {logprobs}")
        hooks_lib.tap_for(hooks, None, c)  # (checks hooks)
        if hooks is not None and mesh is not None:
            raise ValueError("hooks: generate_many with a mesh does not capture or edit yet; "
                             "use generate(..., mesh=, hooks=)")
        self.hooks = hooks
        prefix_cache = checks.bool_arg(prefix_cache, "prefix_cache") and not (
            hooks is not None and hooks.capture)  # (reused blocks would hold no captures)
        self.paging = blocks_lib.paging_for(c, work, self.budgets, batch_size, self.capacity,
                                            block_size, cache_tokens, prefix_cache)
        if self.paging is not None:
            self.capacity = self.paging.per_row * self.paging.pool.size  # whole blocks
            for i, _, ids in work if self.count is not None else ():
                self.fits_pool(i, ids)
        self.queue, self.waiting = iter(work), None
        hooks_lib.check_fits(hooks, c, batch_size, self.capacity, params.embed.dtype,
                             n_keys=self.capacity)
        self.rows = placed(empty_rows(params, batch_size, self.capacity, self.N,
                                      self.stop.completes.shape[1], logprobs, self.paging,
                                      hooks, self.start_of and self.start_of(None)), mesh)
        # row -> [prompt index, ids, ids prefilled, budget, where the row forgets its last
        # prompt (None: it continues it, as Chat's turns do)]
        self.serving = [None] * batch_size

    def decode(self, steps: int):
        self.rows = decode(self.params, self.rows, self.eos_E, self.stop, jnp.int32(steps),
                           self.hooks, self.automaton)

    def fill(self) -> bool:
        """Gives every free row the next prompt (a paged cache's pool permitting: a prompt it
        cannot hold yet waits for rows to end, or for the pool to grow); False once no row has
        work left."""
        for b, serving in enumerate(self.serving):
            if serving is None:
                i, _, ids = self.waiting or next(self.queue, (None, None, None))
                if i is None:
                    break
                self.waiting = None
                while not self.serve(b, i, ids):
                    if self.grow():
                        continue
                    if all(s is None for s in self.serving):  # (fits_pool rules this out)
                        raise ValueError(f"{self.name_of(i)} cannot fit the cache's pool")
                    self.waiting = (i, None, ids)
                    return True
        return not all(s is None for s in self.serving)

    def grow(self) -> bool:
        """Doubles a growable pool, with the rows' cache; False where it may not grow (or no
        row would free blocks: then the prompt cannot fit at all, which checks named)."""
        blocks = None if self.paging is None else self.paging.grown()
        if blocks is None:
            return False
        self.rows = self.rows.replace(cache=cache_lib.with_blocks(self.rows.cache, blocks))
        return True

    def stop_admitting(self) -> bool:
        """No more prompts; whether rows are still at work."""
        self.queue, self.waiting = iter(()), None
        return not all(s is None for s in self.serving)

    def serve(self, row: int, i: int, ids, start: int = 0) -> bool:
        """Row `row` takes prompt i (ids checked), of which ids[:start] are in its cache (the
        row's last prompt continued: Chat). A paged cache gives the row its blocks first, some
        perhaps holding the prompt's beginning already; False if the pool cannot yet."""
        fresh = 0 if start == 0 else None  # where the row forgets its last prompt
        if self.paging is not None:
            start = self.paging.take(row, ids, len(ids) + self.budgets(i))
            if start is None:
                return False
            fresh = start
        self.serving[row] = [i, ids, start, self.budgets(i), fresh]
        return True

    def checked(self, i, ids, name=None):
        """Prompt i's ids, which must fit a row with its budget; its options must exist. name:
        what errors call the prompt (default prompts[i])."""
        name = name or self.name_of(i)
        ids = np.asarray(checks.token_ids(self.config, ids, name, 1), np.int32)
        n, budget = ids.shape[0], self.budgets(i)
        if n + budget > self.capacity:
            raise ValueError(f"{name}: {n} tokens + max_new_tokens {budget} = "
                             f"{n + budget} positions, more than {self.limit}")
        if self.paging is not None:
            self.fits_pool(i, ids, name)
        self.sampling(i)
        constraints.check(self.constraint_of(i), name, self.config.vocab_size, budget)
        if self.indices is not None and i >= len(self.indices):
            raise ValueError(f"indices has {len(self.indices)} values, but there are more "
                             f"prompts (prompt {i})")
        return ids

    def constraint_of(self, i: int):
        """Prompt i's constraint (or None)."""
        if self.one_constraint:
            return self.constraints[0]
        if i >= len(self.constraints):
            raise ValueError(f"constraint has {len(self.constraints)} values, but there are "
                             f"more prompts (prompt {i})")
        return self.constraints[i]

    def fits_pool(self, i: int, ids, name=None):
        """A prompt and its budget must fit the whole pool where it cannot grow."""
        p = self.paging
        need = p.pool.need(len(ids) + self.budgets(i))
        if not p.can_grow and need > p.pool.blocks:
            raise ValueError(f"{name or self.name_of(i)}: {len(ids)} tokens + max_new_tokens "
                             f"{self.budgets(i)} need {need} blocks of {p.pool.size}; "
                             f"cache_tokens holds {p.pool.blocks} ({p.pool.blocks * p.pool.size} "
                             f"tokens)")

    def stream(self, steps: int) -> Iterator:
        """Row 0's prompt admitted, then its answer: lists of new ids, one per decode call."""
        while self.admitting():
            self.admit_pieces()
        sent = 0
        while True:
            self.decode(steps)
            a = self.rows.answers
            t_B, done_B, tokens_BN = fetch((a.length, a.done, a.tokens))
            if t_B[0] > sent:
                yield tokens_BN[0, sent: t_B[0]].tolist()
                sent = t_B[0]
            if done_B[0]:
                self.serving[0] = None
                return

    def admitting(self):
        return any(s is not None and s[2] < len(s[1]) for s in self.serving)

    def admit_pieces(self):
        """One piece of every prompt being admitted (a prompt that reads blocks another row is
        still computing waits for them)."""
        for b, s in enumerate(self.serving):
            if s is not None and s[2] < len(s[1]) and (self.paging is None
                                                       or self.paging.ready(b)):
                i, ids, start, budget, fresh = s
                piece = ids[start: start + PIECE]
                s[2] = start + len(piece)
                tokens_P = np.zeros((PIECE,), np.int32)
                tokens_P[: len(piece)] = piece
                paged = {} if self.paging is None else dict(
                    table_M=self.paging.table(b), seen_V=self.seen_before(ids, start))
                self.rows = admit(self.params, self.rows, jnp.int32(b), tokens_P,
                                  jnp.int32(len(piece)), jnp.int32(start), self.prompt_key(i),
                                  jnp.int32(budget if s[2] == len(ids) else 0),
                                  self.sampling(i), start == fresh, **paged, hooks=self.hooks,
                                  state=self.start_of and jnp.int32(self.start_of(
                                      self.constraint_of(i))))
                if self.paging is not None:
                    self.paging.wrote(b, s[2])

    def seen_before(self, ids, start: int):
        """[V] bool: the prompt's tokens before start (read from blocks another prompt
        computed), which the repetition penalty counts."""
        seen_V = np.zeros((self.config.vocab_size,), bool)
        seen_V[ids[:start]] = True
        return seen_V

    def prompt_key(self, i: int):
        return jax.random.fold_in(self.key, i if self.indices is None else self.indices[i])

    def harvest(self):
        """(prompt index, answer) of every decoding row that has ended; those rows go free."""
        done_B, t_B = fetch((self.rows.answers.done, self.rows.answers.length))
        ended = [b for b, s in enumerate(self.serving)
                 if s is not None and s[2] == len(s[1]) and done_B[b]]
        a = self.rows.answers
        tokens, logprob, top_ids, top_logprob = fetch(
            (a.tokens, a.logprob, a.top_ids, a.top_logprob) if ended else (None,) * 4)
        for b in ended:
            if self.paging is not None:
                self.paging.give(b)
            n = t_B[b]
            ids = tokens[b, :n].tolist()
            if logprob is not None:
                top = [list(zip(i.tolist(), p.tolist()))
                       for i, p in zip(top_ids[b, :n], top_logprob[b, :n])]
                ids = Scored(ids, logprob[b, :n].tolist(), top)
            if self.hooks is not None:
                ids = (ids, hooks_lib.row_acts(self.rows.acts, b, len(self.serving[b][1]) + n - 1))
            yield self.serving[b][0], ids
            self.serving[b] = None

    def drawing(self) -> int:
        """How many tokens the answers being drawn hold (the progress line's count; a fetch,
        which every process of a mesh must make together)."""
        t_B = fetch(self.rows.answers.length)
        return sum(int(t_B[b]) for b, s in enumerate(self.serving)
                   if s is not None and s[2] == len(s[1]))
