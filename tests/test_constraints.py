"""Constrained decoding (jaxkv.constraints): every sampled answer is accepted by its constraint,
greedy answers equal a plain Python loop masking the uncached forward's logits with the same
automaton, sampling draws from the model's distribution restricted to the allowed tokens and
renormalized (chi-square), byte-level tokens and Unicode on SmolLM2's real tokenizer, and bad
constraints are refused before anything runs."""

import json
import re

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.decoding import constraints
from tests.conftest import char_tokenizer

TINY = dict(vocab_size=97, d_model=32, n_layers=2, max_seq_len=128)
EOS = 96  # the character tokenizer's <unk>: an end id for the tests that want one
PROMPTS = [[5, 9, 2], [7, 1, 4, 4], [11], [3, 3, 60, 12, 40]]


@pytest.fixture(scope="module", autouse=True)
def cache_in_tmp(tmp_path_factory):
    """Compiled constraints cached in a folder of the test's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXKV_CACHE", str(tmp_path_factory.mktemp("jaxkv_cache")))
        yield


@pytest.fixture(scope="module")
def params():
    return jaxkv.init_params(jaxkv.Config.llama(n_heads=2, n_kv_heads=1, d_ff=48, **TINY),
                             jax.random.key(0))


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer(TINY["vocab_size"])


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"]}


def kinds(tok):
    """{name: (constraint, whether a decoded answer is accepted)}."""
    def schema_ok(text):
        value = json.loads(text)
        return (set(value) == {"n", "ok"} and isinstance(value["n"], int)
                and isinstance(value["ok"], bool))
    return {
        "regex": (jaxkv.constraints.Regex(r"[0-9]{2,4}-[a-c]+", tok),
                  lambda t: re.fullmatch(r"[0-9]{2,4}-[a-c]+", t) is not None),
        "choice": (jaxkv.constraints.Choice(["yes", "no", "maybe so"], tok),
                   lambda t: t in ("yes", "no", "maybe so")),
        "json_schema": (jaxkv.constraints.JsonSchema(SCHEMA, tok), schema_ok),
        "json": (jaxkv.constraints.Json(tok), lambda t: json.loads(t) is not None or True),
    }


def decoded(tok, tokens, lengths, eos=None):
    """Each answer's text, an end id (the last token, where it is eos) left out."""
    out = []
    for row, n in zip(np.asarray(tokens), np.asarray(lengths)):
        ids = row[:n].tolist()
        out.append(tok.decode(ids[:-1] if eos is not None and ids and ids[-1] == eos else ids))
    return out


@pytest.mark.parametrize("kind", ["regex", "choice", "json_schema", "json"])
@pytest.mark.parametrize("eos", [None, EOS])
def test_every_sampled_answer_is_accepted(params, tok, kind, eos):
    """1,024 answers at temperature 1.5 (2,048 a kind), with and without an end id (where the
    automaton accepts, the model may end; without one the row ends on accepting), each
    accepted: by
    Python's re, by set membership, by json.loads and the schema's keys and types."""
    constraint, accepts = kinds(tok)[kind]
    budget = 24 if kind.startswith("json") else 12
    tokens, lengths = jaxkv.generate(params, [PROMPTS[i % 4] for i in range(1024)], budget,
                                     constraint=constraint, temperature=1.5, eos_id=eos,
                                     key=jax.random.key(7))
    texts = decoded(tok, tokens, lengths, eos)
    bad = [t for t in texts if not accepts(t)]
    assert not bad, bad[:5]
    assert len(set(texts)) > (2 if kind == "choice" else 50)  # sampled, not one answer


def python_reference(params, constraint, prompt, budget, eos=None):
    """Greedy by hand: the uncached forward's last logits, masked with what constraint allows at
    its state (Constraint.allowed, an end id where it accepts), until it must end."""
    answer, state = [], 0
    while len(answer) < budget:
        logits = np.asarray(jaxkv.forward(params, np.array([prompt + answer]))[0, -1])
        allowed = constraint.allowed(state, budget - len(answer))
        choices = dict(allowed)
        if eos is not None and constraint.final[state]:
            choices[eos] = None
        token = max(choices, key=lambda t: logits[t])
        answer.append(token)
        if token == eos:
            break
        state = choices[token]
        if constraint.final[state] and (eos is None or not constraint.way_on[state]):
            break
    return answer


@pytest.mark.parametrize("kind", ["regex", "choice", "json_schema"])
@pytest.mark.parametrize("eos", [None, EOS])
def test_greedy_equals_a_plain_python_reference(params, tok, kind, eos):
    constraint, _ = kinds(tok)[kind]
    budget = 22 if kind == "json_schema" else 10
    tokens, lengths = jaxkv.generate(params, PROMPTS, budget, constraint=constraint, eos_id=eos)
    for row, prompt in enumerate(PROMPTS):
        want = python_reference(params, constraint, prompt, budget, eos)
        assert np.asarray(tokens[row, :lengths[row]]).tolist() == want, row


def test_sampling_is_the_model_restricted_and_renormalized(params, tok):
    """4,000 one-token answers from five allowed characters: their counts against softmax of
    the prompt's logits over those five, renormalized (chi-square, 4 degrees of freedom)."""
    constraint = jaxkv.constraints.Choice(list("aeiou"), tok)
    n = 4000
    tokens, _ = jaxkv.generate(params, [PROMPTS[0]] * n, 1, constraint=constraint,
                               temperature=1.0, key=jax.random.key(11))
    ids = [tok.token_to_id(c) for c in "aeiou"]
    logits = np.asarray(jaxkv.forward(params, np.array([PROMPTS[0]]))[0, -1], np.float64)[ids]
    expected = np.exp(logits - logits.max())
    expected = expected / expected.sum() * n
    seen = np.array([(np.asarray(tokens[:, 0]) == i).sum() for i in ids])
    assert seen.sum() == n
    stat = float(((seen - expected) ** 2 / expected).sum())
    assert stat < 4 + 4 * np.sqrt(8), (seen, expected)


def test_one_constraint_per_prompt_and_unconstrained_rows(params, tok):
    """A list gives each prompt its own (None: free); a free row draws as without any."""
    regex, choice = kinds(tok)["regex"][0], kinds(tok)["choice"][0]
    tokens, lengths = jaxkv.generate(params, PROMPTS, 10, constraint=[regex, None, choice, None])
    free, free_lengths = jaxkv.generate(params, PROMPTS, 10)
    texts = decoded(tok, tokens, lengths)
    assert re.fullmatch(r"[0-9]{2,4}-[a-c]+", texts[0]) and texts[2] in ("yes", "no", "maybe so")
    for row in (1, 3):
        np.testing.assert_array_equal(tokens[row], free[row])
        assert lengths[row] == free_lengths[row]


def test_smollm2s_byte_level_tokens_and_unicode(tmp_path):
    """SmolLM2's real tokenizer (byte-level BPE, 49,152 tokens): a choice among words with
    accents and CJK characters, which take several tokens and tokens of partial characters;
    every sampled answer decodes to one of them. A tiny random model of its vocabulary."""
    tokenizer = jaxkv.load_tokenizer(jaxkv.default_model())
    words = ["café", "naïve", "日本語", "Zürich straße"]
    constraint = jaxkv.constraints.Choice(words, tokenizer)
    assert constraint.vocab_size == 49152
    bytes_of = constraints.token_bytes(tokenizer)
    assert bytes_of[tokenizer.token_to_id("Ġthe")] == b" the"
    model = jaxkv.init_params(jaxkv.Config.llama(
        vocab_size=49152, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
        max_seq_len=64), jax.random.key(1))
    tokens, lengths = jaxkv.generate(model, [[1, 2, 3]] * 64, 12, constraint=constraint,
                                     temperature=2.0, key=jax.random.key(2))
    texts = decoded(tokenizer, tokens, lengths)
    assert set(texts) <= set(words) and len(set(texts)) >= 2, set(texts)


def test_a_ten_field_schema_on_smollm2_is_small_and_cached(tmp_path, monkeypatch):
    """A JSON schema of 10 fields on SmolLM2's vocabulary: its tables' bytes (printed) are far
    below states x vocabulary; a second build reads the disk cache."""
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path))
    tokenizer = jaxkv.load_tokenizer(jaxkv.default_model())
    types = ["string", "integer", "boolean", "number", "string"]
    schema = {"type": "object", "required": [f"field_{i}" for i in range(10)],
              "properties": {f"field_{i}": {"type": types[i % 5]} for i in range(10)}}
    built = jaxkv.constraints.JsonSchema(schema, tokenizer)
    S = len(built.final)
    print(f"10-field schema: {S} states, {len(built.exc_token)} exceptions, "
          f"{built.nbytes / 2**20:.2f} MiB ({S * 49152 / 8 / 2**20:.1f} MiB as a bitmask per "
          f"state); built in {built.build_seconds:.1f} s")
    assert built.nbytes < S * 49152 / 8 / 4 and built.build_seconds > 0
    reads, read = [], constraints.token_bytes
    monkeypatch.setattr(constraints, "token_bytes", lambda tok: reads.append(1) or read(tok))
    again = jaxkv.constraints.JsonSchema(schema, tokenizer)
    assert again.build_seconds == 0 and not reads  # the vocabulary's bytes kept, not reread
    np.testing.assert_array_equal(again.exc_next, built.exc_next)
    tokenizer.add_tokens(["<new token>"])  # a changed vocabulary is read again
    jaxkv.constraints.Regex("[0-9]+", tokenizer)
    assert reads == [1]


@pytest.mark.parametrize("build, message", [
    (lambda tok: jaxkv.constraints.Regex("(ab", tok), "not a regular expression"),
    (lambda tok: jaxkv.constraints.Regex("", tok), "non-empty"),
    (lambda tok: jaxkv.constraints.JsonSchema({"type": "nonsense"}, tok), "Unsupported type"),
    (lambda tok: jaxkv.constraints.JsonSchema("{not json", tok), "JsonSchema"),
    (lambda tok: jaxkv.constraints.Regex("é+", tok), "no sequence of this vocabulary"),
    (lambda tok: jaxkv.constraints.Choice([], tok), "non-empty list"),
])
def test_bad_constraints_are_refused(tok, build, message):
    with pytest.raises(ValueError, match=message):
        build(tok)


def test_bad_uses_name_the_prompt(params, tok):
    long = jaxkv.constraints.Regex("[a-z]{20}", tok)
    with pytest.raises(ValueError, match=r"prompt 1 .*shortest answer is 20 tokens, more than "
                                         r"max_new_tokens \(10\)"):
        jaxkv.generate(params, PROMPTS, 10, constraint=[None, long, None, None])
    with pytest.raises(ValueError, match=r"one per prompt expected \(4\), got 2"):
        jaxkv.generate(params, PROMPTS, 10, constraint=[long, long])
    with pytest.raises(TypeError, match="prompt 0: expected a jaxkv.constraints"):
        jaxkv.generate(params, PROMPTS, 10, constraint="[a-z]+")
    big = jaxkv.constraints.Choice(["x"], char_tokenizer(200))
    with pytest.raises(ValueError, match="tokenizer of 200 ids, the model has 97"):
        jaxkv.generate(params, PROMPTS, 10, constraint=big)


def test_generate_many_and_stream_keep_each_prompts_constraint(params, tok):
    """Continuous batching (3 rows for 6 prompts, a paged cache) and streaming: each prompt's
    answer is generate's for it alone under the same constraint."""
    regex, choice, schema = (kinds(tok)[k][0] for k in ("regex", "choice", "json_schema"))
    prompts = [PROMPTS[i % 4] + [i] for i in range(6)]
    per_prompt = [regex, choice, None, schema, regex, choice]
    answers = jaxkv.generate_many(params, prompts, 22, constraint=per_prompt, batch_size=3,
                                  eos_id=EOS)
    for prompt, c, answer in zip(prompts, per_prompt, answers):
        tokens, lengths = jaxkv.generate(params, [prompt], 22, constraint=c, eos_id=EOS)
        assert answer == np.asarray(tokens[0, :lengths[0]]).tolist()
    streamed = "".join(jaxkv.stream(params, tok, tok.decode(prompts[3]), 22, constraint=schema,
                                    eos_id=EOS))
    want = decoded(tok, *jaxkv.generate(params, [prompts[3]], 22, constraint=schema,
                                        eos_id=EOS), EOS)[0]
    assert streamed == want and json.loads(streamed)["ok"] in (True, False)


def test_generate_many_names_the_prompt_a_constraint_does_not_fit(params, tok):
    long = jaxkv.constraints.Regex("[a-z]{20}", tok)
    with pytest.raises(ValueError, match=r"prompts\[2\] .*shortest answer is 20 tokens"):
        jaxkv.generate_many(params, PROMPTS, [30, 30, 10, 30], constraint=long)


@pytest.mark.parametrize("draft", ["lookup", "model"])
def test_speculative_equals_generate_under_a_constraint(params, tok, draft):
    """Each tree node's draw masked by its row's automaton: speculative_generate's answers
    equal generate's, greedy and sampled with the same key (a drafted token the constraint
    forbids is never accepted). Prompts that repeat, so lookup drafts."""
    drafter = draft if draft == "lookup" else jaxkv.init_params(
        jaxkv.Config.gpt2(n_heads=2, **TINY), jax.random.key(5))
    regex = jaxkv.constraints.Regex(r"([0-9]{2}-)+[a-c]", tok)
    prompts = [[16, 17, 13, 16, 17, 13, 16], [18, 13, 18, 13, 18], [5, 6], [20, 21, 13, 20]]
    for options in ({}, dict(temperature=1.0, key=jax.random.key(3))):
        want = jaxkv.generate(params, prompts, 16, constraint=regex, eos_id=EOS, **options)
        got = jaxkv.speculative_generate(params, prompts, 16, constraint=regex, eos_id=EOS,
                                         draft=drafter, n_draft=3, **options)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[0], want[0])
