"""Continuous batching: generate_many's answers equal generate's, whatever the batch size, the
order prompts end in, or how a prompt is cut into admission pieces; shapes never change."""

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.core.tracecount import TRACE_COUNTS
from jaxkv.decoding import batching, serving
from tests.conftest import ENCDEC_CONFIGS, TINY, char_tokenizer, random_tokens

EOS = 5
LENGTHS = [3, 40, 1, 17, 90, 8, 25, 2, 60, 11, 33, 6, 70]  # 13 prompts
BUDGETS = [4, 12, 1, 20, 6, 16, 3, 9, 2, 18, 7, 13, 5]  # long-tailed: rows end at different times


def prompts():
    tokens = np.asarray(random_tokens(11, (len(LENGTHS), max(LENGTHS))))
    return [tokens[i, :n].tolist() for i, n in enumerate(LENGTHS)]


def reference(params, **options):
    """generate on all prompts as one ragged batch, each answer cut at its budget and EOS."""
    tokens_BN, _ = jaxkv.generate(params, prompts(), max(BUDGETS), eos_id=EOS, **options)
    answers = []
    for row, budget in zip(np.asarray(tokens_BN), BUDGETS):
        row = row[:budget].tolist()
        answers.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return answers


@pytest.fixture(scope="module")
def window():
    config = jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=96, sliding_window=16,
                                window_layers=(0, 2), **TINY)
    return jaxkv.init_params(config, jax.random.key(7))


@pytest.mark.parametrize("batch_size", [1, 4, 13])
def test_greedy_equals_generate(llama, batch_size):
    got = jaxkv.generate_many(llama, prompts(), BUDGETS, batch_size=batch_size, eos_id=EOS)
    assert got == reference(llama)
    assert any(a[-1] == EOS for a in got) and any(len(a) == b for a, b in zip(got, BUDGETS))


@pytest.mark.parametrize("batch_size", [1, 4, 13])
def test_sampling_depends_on_key_and_prompt_index_only(llama, batch_size):
    """Prompt i draws with fold_in(key, i), as generate's row i does: equal answers for every
    batch size, so for every order of completion."""
    options = dict(temperature=0.9, top_k=20, repetition_penalty=1.2, key=jax.random.key(3))
    got = jaxkv.generate_many(llama, prompts(), BUDGETS, batch_size=batch_size, eos_id=EOS,
                              **options)
    assert got == reference(llama, **options)


def test_window_model_and_prompts_admitted_in_pieces(window, monkeypatch):
    """Pieces of 16 tokens (a 90-token prompt takes 6 admissions, with decoding between them);
    a sliding-window row that took a new prompt forgets the last one's ring."""
    monkeypatch.setattr(batching, "PIECE", 16)
    got = jaxkv.generate_many(window, prompts(), BUDGETS, batch_size=3, eos_id=EOS)
    assert got == reference(window)


def test_stop_strings_end_answers_where_the_text_first_holds_one(llama):
    """A two-character stop string (two tokens of a character tokenizer) taken from inside one
    answer: every answer ends at the token that completes its first occurrence, if any."""
    tokenizer = char_tokenizer(llama.config.vocab_size)
    plain = jaxkv.generate_many(llama, prompts(), 20, batch_size=4)
    text = tokenizer.decode(plain[1])
    stop = text[5:7]
    got = jaxkv.generate_many(llama, prompts(), 20, batch_size=4, stop=[stop], tokenizer=tokenizer)
    for ours, whole in zip(got, plain):
        ends = [t for t in range(len(whole)) if stop in tokenizer.decode(whole[: t + 1])]
        assert ours == (whole[: ends[0] + 1] if ends else whole)
    assert len(got[1]) <= 7 and jaxkv.stops.cut(tokenizer.decode(got[1]), [stop]) == text[:5]


def test_no_recompile_for_new_lengths_and_a_generator(llama):
    """After one data set, another with other prompt lengths and budgets (the largest in the
    same bucket: 17..32), given as a generator, traces nothing new (the same cache_tokens: a
    pool sized by each data set itself would differ)."""
    jaxkv.generate_many(llama, prompts(), BUDGETS, batch_size=4, max_len=128, cache_tokens=512)
    before = dict(TRACE_COUNTS)
    other = (p[: max(1, len(p) // 2)] for p in prompts()[::-1])
    got = jaxkv.generate_many(llama, other, 30, batch_size=4, max_len=128, cache_tokens=512)
    assert len(got) == len(LENGTHS) and all(len(a) == 30 for a in got)
    assert {k: TRACE_COUNTS[k] - before.get(k, 0) for k in ("admit", "decode_rows")} == {
        "admit": 0, "decode_rows": 0}


def test_bad_inputs(llama):
    with pytest.raises(ValueError, match="pass max_len"):
        jaxkv.generate_many(llama, iter(prompts()), 4)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        jaxkv.generate_many(llama, [[1, 2], []], 4)
    with pytest.raises(ValueError, match=r"max_new_tokens has 2 values"):
        jaxkv.generate_many(llama, [[1], [2], [3]], [4, 4])
    with pytest.raises(ValueError, match=r"prompts\[0\]: 100 tokens \+ max_new_tokens 40 = 140 "
                       r"positions, more than max_len \(128\)"):
        jaxkv.generate_many(llama, [[1] * 100], 40, max_len=128)
    with pytest.raises(ValueError, match="max_seq_len"):
        jaxkv.generate_many(llama, [[1]], 4, max_len=4096)
    with pytest.raises(ValueError, match=r"more than the model's max_seq_len \(128\)"):
        jaxkv.generate_many(llama, [[1] * 100], 40)
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        jaxkv.generate_many(llama, [[1]], 4, stop=["\n"])
    with pytest.raises(TypeError, match="batch_size"):
        jaxkv.generate_many(llama, [[1]], 4, batch_size=2.5)
    with pytest.raises(ValueError, match="encoder-decoder"):
        t5 = jaxkv.init_params(ENCDEC_CONFIGS["t5_relu"], jax.random.key(0))
        jaxkv.generate_many(t5, [[1]], 4)


def test_iter_tokens_streams_generate_answer_without_callbacks(llama, window):
    """One prompt's answer in pieces of up to 3 steps, equal to generate's; the compiled
    programs hold no host callback (so JAX's persistent compilation cache can keep them), not
    even a sliding-window model's, whose ring is value-checked in decode_step."""
    options = dict(temperature=0.8, top_p=0.9, key=jax.random.key(4))
    pieces = list(jaxkv.iter_tokens(llama, prompts()[4], 10, steps=3, **options))
    tokens, _ = jaxkv.generate(llama, [prompts()[4]], 10, **options)
    assert [len(p) for p in pieces] == [3, 3, 3, 1]
    assert sum(pieces, []) == tokens[0].tolist()
    s = batching.Schedule(window, [prompts()[4]], 10, 1)
    programs = [serving.decode.lower(window, s.rows, s.eos_E, s.stop, 3),
                serving.admit.lower(window, s.rows, 0, np.zeros(batching.PIECE, np.int32), 5,
                                     0, s.prompt_key(0), 10, s.sampling(0), True,
                                     s.paging.table(0), s.seen_before([1], 0))]
    assert not any("callback" in p.as_text() for p in programs)
    step = jax.jit(jaxkv.decode_step).lower(window, s.rows.cache, s.rows.pos, s.rows.pos)
    assert "callback" in step.as_text()  # what the check would find


# ---- per-prompt options and nothing finished lost -------------------------------------------

def test_per_prompt_options_follow_their_prompt(llama):
    """temperature=[0, 3, 0, 3, 0] applies to prompts 0..4 whichever of 3 rows serves them (it
    applied to the rows): each answer equals generate's for its prompt, option and key."""
    key, temps, top_k = jax.random.key(8), [0.0, 3.0, 0.0, 3.0, 0.0], [0, 5, 0, 2, 0]
    got = jaxkv.generate_many(llama, prompts()[:5], 8, batch_size=3, temperature=temps,
                              top_k=top_k, key=key)
    for i, (prompt, t, k) in enumerate(zip(prompts()[:5], temps, top_k)):
        want, _ = jaxkv.generate(llama, [prompt], 8, temperature=t, top_k=k,
                                 key=jax.random.fold_in(key, i)[None])
        assert got[i] == want[0].tolist(), i


@pytest.mark.parametrize("options, match", [
    (dict(temperature=[0.5] * 3), "temperature has 3 values for 4 prompts"),
    (dict(max_new_tokens=[2] * 6), "max_new_tokens has 6 values for 4 prompts"),
    (dict(max_new_tokens=[2] * 3), "max_new_tokens has 3 values for 4 prompts"),
    (dict(indices=[0, 1]), "indices has 2 values for 4 prompts"),
])
def test_per_prompt_options_need_one_per_prompt(llama, monkeypatch, options, match):
    monkeypatch.setattr(batching, "admit", lambda *a: pytest.fail("computed something"))
    budget = options.pop("max_new_tokens", 2)
    with pytest.raises(ValueError, match=match):
        jaxkv.generate_many(llama, prompts()[:4], budget, **options)


def test_a_list_is_checked_whole_before_anything_is_computed(llama, monkeypatch):
    monkeypatch.setattr(batching, "admit", lambda *a: pytest.fail("computed something"))
    bad = prompts()[:6] + [[1, 500]] + prompts()[:3]
    with pytest.raises(ValueError, match=r"prompts\[6\]\[1\] = 500 is not a token id"):
        jaxkv.generate_many(llama, bad, 4)
    with pytest.raises(ValueError, match=r"prompts\[4\] is empty"):
        jaxkv.generate_many(llama, prompts()[:4] + [[]], 4)


def source(n, fail):
    """A lazy source of prompts that fails at item n: its own error, or a bad prompt."""
    for i, p in enumerate(prompts()):
        if i == n:
            if fail == "source":
                raise ConnectionError("the data set went away")
            yield [1, 500]
        yield p


@pytest.mark.parametrize("fail, error, match", [
    ("source", ConnectionError, "the data set went away"),
    ("item", ValueError, r"prompts\[6\]\[1\] = 500 is not a token id")])
def test_a_failing_source_keeps_every_finished_answer(llama, fail, error, match):
    """The rows at work finish and are yielded, then the error is raised carrying them all."""
    want = jaxkv.generate_many(llama, prompts()[:6], BUDGETS[:6], eos_id=EOS)
    seen = {}
    with pytest.raises(error, match=match) as info:
        for i, answer in jaxkv.iter_many(llama, source(6, fail), BUDGETS, eos_id=EOS,
                                         batch_size=4, max_len=128):
            seen[i] = answer
    assert info.value.answers == seen == dict(enumerate(want))
    with pytest.raises(error) as info:
        jaxkv.generate_many(llama, source(6, fail), BUDGETS, eos_id=EOS, batch_size=4,
                            max_len=128)
    assert info.value.answers == dict(enumerate(want))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_models_own(llama, temperature):
    """logprobs=k: the same ids as without, each token's log-probability equal to the uncached
    forward's log-softmax at its position (the model's own distribution, whatever the sampling
    temperature), and the k likeliest, best first."""
    import jax.numpy as jnp

    some = prompts()[:5]
    options = dict(batch_size=2, temperature=temperature, key=jax.random.key(4))
    plain = jaxkv.generate_many(llama, some, 6, **options)
    scored = jaxkv.generate_many(llama, some, 6, logprobs=3, **options)
    assert [s.ids for s in scored] == plain
    for prompt, s in zip(some, scored):
        logp_TV = jax.nn.log_softmax(jaxkv.forward(llama, jnp.array([prompt + s.ids]))[0], -1)
        for t, (token, logp, top) in enumerate(zip(s.ids, s.logprobs, s.top)):
            row = logp_TV[len(prompt) - 1 + t]
            assert logp == pytest.approx(float(row[token]), abs=1e-4)
            assert [i for i, _ in top] == np.argsort(-np.asarray(row))[:3].tolist()
            np.testing.assert_allclose([p for _, p in top], np.sort(row)[::-1][:3], atol=1e-4)
            if temperature == 0.0:
                assert top[0][0] == token
    none = jaxkv.generate_many(llama, some[:1], 3, logprobs=0)[0]
    assert none.top == [[], [], []] and len(none.logprobs) == 3


@pytest.mark.parametrize("logprobs, error, match", [
    (-1, ValueError, "logprobs must be an int >= 0, got -1"),
    (True, TypeError, "logprobs must be an int >= 0, got True"),
    (98, ValueError, "logprobs must be at most the vocabulary's 97 tokens, got 98"),
])
def test_bad_logprobs_are_named(llama, logprobs, error, match):
    with pytest.raises(error, match=match):
        jaxkv.generate_many(llama, prompts()[:2], 3, logprobs=logprobs)


# ---- the paged cache and its prefix cache ---------------------------------------------------

def shared_prefix_prompts(n=6, prefix_len=40):
    """n prompts that begin with the same prefix_len tokens (two whole blocks of 16 and a part)
    and end differently."""
    tokens = np.asarray(random_tokens(12, (n, prefix_len + 9)))
    return [tokens[0, :prefix_len].tolist() + tokens[i, prefix_len:prefix_len + 1 + i].tolist()
            for i in range(n)]


@pytest.mark.parametrize("options", [dict(), dict(repetition_penalty=1.3, temperature=0.7,
                                                  key=jax.random.key(2))])
def test_the_prefix_cache_changes_no_answer(llama, monkeypatch, options):
    """Prompts sharing a beginning read its blocks once computed (the last prompt token is
    always computed); the answers equal those computed afresh, and generate's."""
    reused = []
    take = batching.blocks_lib.BlockPool.take

    def counting(pool, ids, tokens):
        got = take(pool, ids, tokens)
        reused.append(None if got is None else got[1])
        return got
    monkeypatch.setattr(batching.blocks_lib.BlockPool, "take", counting)
    some = shared_prefix_prompts()
    cached = jaxkv.generate_many(llama, some, 8, batch_size=2, **options)
    assert max(reused) == 32  # two whole blocks of the 40 shared tokens
    fresh = jaxkv.generate_many(llama, some, 8, batch_size=2, prefix_cache=False, **options)
    assert cached == fresh
    if not options:
        assert cached == [a.tolist() for a in jaxkv.generate(llama, some, 8)[0]]


def test_rows_admitted_together_compute_a_shared_beginning_once(llama, monkeypatch):
    """Four prompts sharing 40 tokens, admitted into four rows at once: the first row computes
    the two whole shared blocks, the others wait for them and compute only the rest."""
    admitted = []
    admit = batching.admit

    def counting(params, rows, row, tokens_P, length, *args, **kwargs):
        admitted.append(int(length))
        return admit(params, rows, row, tokens_P, length, *args, **kwargs)
    monkeypatch.setattr(batching, "admit", counting)
    some = shared_prefix_prompts(n=4)
    cached = jaxkv.generate_many(llama, some, 6, batch_size=4)
    assert sum(admitted) == len(some[0]) + sum(len(p) - 32 for p in some[1:])
    assert cached == jaxkv.generate_many(llama, some, 6, batch_size=4, prefix_cache=False)


def test_a_batch_holds_what_its_rows_need(llama):
    """One long prompt among short ones: the pool holds the longest rows in flight at once,
    a fraction of batch_size x capacity, and the answers are generate's."""
    lengths = [100, 5, 7, 3, 9, 4, 6, 8]
    tokens = np.asarray(random_tokens(13, (len(lengths), 100)))
    some = [tokens[i, :n].tolist() for i, n in enumerate(lengths)]
    s = batching.Schedule(llama, some, 4, 8)
    assert s.paging.pool.blocks * 16 <= 0.25 * 8 * s.capacity  # 14 blocks: 224 of 1024 slots
    got = jaxkv.generate_many(llama, some, 4, batch_size=8)
    assert got == [a.tolist() for a in jaxkv.generate(llama, some, 4)[0]]


def test_a_small_pool_makes_prompts_wait_and_a_generator_grows_it(llama):
    """cache_tokens for about two rows of four: prompts wait for rows to end; a generator
    without cache_tokens starts with one row's blocks and doubles them as rows need: the
    answers are the reference's either way."""
    want = reference(llama)
    assert jaxkv.generate_many(llama, prompts(), BUDGETS, batch_size=4, eos_id=EOS,
                               cache_tokens=256) == want
    assert jaxkv.generate_many(llama, iter(prompts()), BUDGETS, batch_size=4, eos_id=EOS,
                               max_len=112) == want


def test_a_pool_too_small_for_a_prompt_is_named_before_any_work(llama, monkeypatch):
    monkeypatch.setattr(batching, "admit", lambda *a, **k: pytest.fail("admitted"))
    with pytest.raises(ValueError, match=r"prompts\[4\]: 90 tokens \+ max_new_tokens 6 need 6 "
                                         r"blocks of 16; cache_tokens holds 5 \(80 tokens\)"):
        jaxkv.generate_many(llama, prompts(), BUDGETS, cache_tokens=80)
    with pytest.raises(ValueError, match="cache_tokens .* holds no block of 16 tokens"):
        jaxkv.generate_many(llama, prompts(), BUDGETS, cache_tokens=8)
