"""Speculative decoding: greedy and sampled results equal generate's, the sampled distribution is
the target's (chi-square against forward's exact probabilities), no recompiles, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.decoding import drafts, speculative
from jaxkv.decoding.sampling import row_keys, sampling_params
from tests.conftest import CONFIGS


@pytest.fixture(scope="module")
def draft_model():
    """A different random model with llama_gqa's vocabulary."""
    return jaxkv.init_params(CONFIGS["llama_mqa"], jax.random.key(7))


def ragged_prompts(seed=0, vocab=97):
    """Ragged rows: repetitive ones (lookup finds its chains) and a random one."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, vocab, 9).tolist()
    return [motif * 3, rng.integers(0, vocab, 5).tolist(), motif[:4] * 4 + [3]]


@pytest.mark.parametrize("name,xla", [("llama_gqa", False), ("gpt2", False), ("llama_gqa", True)],
                         ids=["llama_gqa", "gpt2", "llama_gqa_xla_backend"])
def test_lookup_greedy_equals_generate_on_a_ragged_batch(name, xla, monkeypatch, request):
    """Also as a GPU or TPU runs it (xla: XLA's products and attention, no CPU kernels)."""
    if xla:
        request.getfixturevalue("xla_backend")
        assert jaxkv.ops.backend_name() == "xla"
    monkeypatch.setattr(speculative, "ROW_COST", 0.0)  # trees cost a step: rows draft when offered
    params = jaxkv.init_params(CONFIGS[name], jax.random.key(1))
    prompts = ragged_prompts()
    want, want_len = jaxkv.generate(params, prompts, 30)
    tokens, lengths, stats = jaxkv.speculative_generate(params, prompts, 30, n_draft=3)
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(lengths, want_len)
    assert int(stats.accepted[0]) > 0  # the repeated motif was drafted and accepted
    # After the first token (from the prompt's pass) each pass commits its accepted tokens and
    # one of its own; the last one may go past the budget.
    assert (np.asarray(stats.passes) + np.asarray(stats.accepted) >= 29).all()
    assert int(stats.passes[0]) < 29


def test_draft_model_greedy_equals_generate(llama, draft_model):
    prompts = ragged_prompts(1)
    want, want_len = jaxkv.generate(llama, prompts, 24)
    for draft in (draft_model, llama):
        tokens, lengths, stats = jaxkv.speculative_generate(llama, prompts, 24, draft=draft,
                                                            n_draft=3, n_branches=2)
        np.testing.assert_array_equal(tokens, want)
        np.testing.assert_array_equal(lengths, want_len)
    # The target as its own draft: every drafted token is accepted, from the first round on
    # (each row's estimate starts above what a tree pass over the batch needs): 6 passes of 4.
    np.testing.assert_array_equal(stats.passes, [6, 6, 6])
    np.testing.assert_array_equal(stats.accepted, [6 * 3] * 3)


def compiled_loop(params, dparams, B: int) -> str:
    """The optimized HLO of the speculative loop for B prompts of 8 tokens, 8 new, n_draft 4."""
    sampling = sampling_params(B, temperature=0.0)
    loop = speculative._speculative_loop.lower(
        params, dparams, jnp.ones((B, 8), jnp.int32), jnp.full((B,), 8), sampling,
        row_keys(None, B), jnp.array([0]), jnp.int32(0), max_new_tokens=8,
        capacity=24, M=1, Ds=(4,) * len(speculative.batch_sizes(B)))
    return loop.compile().as_text()


def layer_copies(hlo: str, models, B: int) -> list:
    """Lines of the HLO that copy a layer of one of the models' caches (capacity 24)."""
    layers = {f"[{B},{p.config.n_kv_heads},24,{p.config.head_dim}]" for p in models}
    return [line for line in hlo.splitlines() if " copy(" in line and "broadcast" not in line
            and any(layer in line for layer in layers)]


@pytest.mark.parametrize("B", [1, 2])
def test_draft_rounds_copy_no_cache_layer(llama, draft_model, B):
    """The compiled loop copies a layer of a cache only to make it (zeros): each store of the
    draft's tree waits for the reads before it, and compact reads what it moves before writing
    it (at batch 1 XLA had copied every layer of both caches each round)."""
    copies = layer_copies(compiled_loop(llama, draft_model, B), (llama, draft_model), B)
    assert not copies, copies[:2]


def test_lookup_rounds_choose_no_pass_in_a_conditional(llama, B=1):
    """With lookup, rounds in which no row drafts are decode steps in a loop of their own: no
    conditional of the compiled loop returns a pass's keys and values (a draft model's rounds
    choose the tree or the root alone in one), and no cache layer is copied."""
    kv = f"[{B},{llama.config.n_kv_heads},5,{llama.config.head_dim}]"  # 1 + 1 x 4 tree nodes

    def passes_in_conditionals(hlo):
        return [line for line in hlo.splitlines()
                if " conditional(" in line and kv in line.split(" conditional(")[0]]

    hlo = compiled_loop(llama, None, B)
    assert not passes_in_conditionals(hlo)
    assert not layer_copies(hlo, (llama,), B)
    assert passes_in_conditionals(compiled_loop(llama, llama, B))


def test_sampled_equals_generate_with_the_same_key(llama, draft_model):
    """(The budget, shapes and draft settings of the greedy tests: sampling values are traced,
    so their compiled programs serve.)"""
    prompts = ragged_prompts(2)
    options = dict(temperature=0.8, top_k=40, top_p=0.95, key=jax.random.key(11))
    want, _ = jaxkv.generate(llama, prompts, 24, **options)
    for draft, kw in (("lookup", {}), (draft_model, dict(n_draft=3, n_branches=2))):
        tokens, _, _ = jaxkv.speculative_generate(llama, prompts, 24, draft=draft, **options,
                                                  **kw)
        np.testing.assert_array_equal(tokens, want)


def test_eos_ends_each_row_as_generate_does(llama):
    prompts = ragged_prompts(3)
    free, _ = jaxkv.generate(llama, prompts, 24)
    eos = [int(free[0, 6]), int(free[2, 11])]  # tokens each row draws on its way
    want, want_len = jaxkv.generate(llama, prompts, 24, eos_id=eos)
    tokens, lengths, _ = jaxkv.speculative_generate(llama, prompts, 24, eos_id=eos)
    np.testing.assert_array_equal(lengths, want_len)
    np.testing.assert_array_equal(tokens, want)
    # Row 0 ends first (7 tokens), row 2 next (12): rows 1 and 2 go on in a batch of 2, row 1
    # then alone; the answers come back in the caller's order.
    np.testing.assert_array_equal(lengths, [7, 24, 12])


def test_the_batch_halves_at_most_twice():
    assert speculative.batch_sizes(1) == (1,)
    assert speculative.batch_sizes(3) == (3, 2, 1)
    assert speculative.batch_sizes(4) == (4, 2, 1)
    assert speculative.batch_sizes(6000) == (6000, 3000, 1500)


def test_int8_cache_equals_generate_with_an_int8_cache(llama):
    prompts = ragged_prompts(4)
    want, _ = jaxkv.generate(llama, prompts, 16, kv_dtype=jnp.int8)
    tokens, _, _ = jaxkv.speculative_generate(llama, prompts, 16, kv_dtype=jnp.int8)
    np.testing.assert_array_equal(tokens, want)


def test_no_recompile_for_new_lengths_or_sampling_values(llama):
    run = lambda prompts, **kw: jaxkv.speculative_generate(llama, prompts, 12, **kw)  # noqa
    run([[1, 2, 3, 1, 2]], temperature=0.5)
    jaxkv.trace_counts.clear()
    run([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5]], temperature=1.0, top_k=5)
    run([[9, 9, 9]], temperature=0.0, top_p=0.9, min_p=0.1)
    assert dict(jaxkv.trace_counts) == {}


def test_the_lookup_finds_the_longest_latest_matches():
    hist = np.array([[5, 1, 2, 7, 1, 2, 8, 9, 3, 1, 2, 0, 0]])
    tokens, usable = drafts.lookup_chains(jnp.asarray(hist), jnp.array([11]), 3, 2)
    # "1 2" ends at 5 (then 8 9) and at 2 (then 7 1); "2" nowhere else; "1 2" at 10 is the end.
    np.testing.assert_array_equal(tokens[0, :2], [[8, 9], [7, 1]])
    assert usable[0, :2].all() and not usable[0, 2].any()


def test_the_lookup_offers_no_one_token_match():
    """MIN_MATCH: the last token 2 ends earlier (then 7 1), but no two-token match does."""
    hist = np.array([[5, 2, 7, 1, 3, 2, 0, 0]])
    tokens, usable = drafts.lookup_chains(jnp.asarray(hist), jnp.array([6]), 1, 2)
    assert drafts.MIN_MATCH == 2 and not usable.any()


def test_hindsight_checks_the_lookup_tree_made_d_tokens_ago():
    hist = np.array([[5, 1, 2, 7, 8, 9, 1, 2, 7, 8, 4, 0, 0],
                     [3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    # Row 0, 3 tokens ago (history 5 1 2 7 8 9 1 2): "1 2" had been followed by 7 8 9; then
    # came 7 8 4: two accepted. Row 1's history is shorter than 3 + 1 tokens.
    seen = drafts.lookup_hindsight(jnp.asarray(hist), jnp.array([11, 2]), 1, 3)
    np.testing.assert_array_equal(seen, [2, 0])


# ---- the sampled distribution -------------------------------------------------------------

SMALL = dict(vocab_size=6, d_model=32, n_layers=2, max_seq_len=64)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # lookup drafts "3 1 2 ..."
DRAWS = 6000


def exact_probabilities(params):
    """p(x1 x2 x3 | PROMPT) for all 6^3 continuations, from the uncached forward."""
    V = SMALL["vocab_size"]
    conts = np.stack(np.meshgrid(*[np.arange(V)] * 3, indexing="ij"), -1).reshape(-1, 3)
    tokens = np.concatenate([np.tile(PROMPT, (len(conts), 1)), conts], 1)
    logp = jax.nn.log_softmax(jaxkv.forward(params, tokens), -1)
    T = len(PROMPT)
    steps = [logp[np.arange(len(conts)), T - 1 + i, conts[:, i]] for i in range(3)]
    return conts, np.exp(np.asarray(sum(steps), np.float64))


def chi_square(params, draft):
    """(statistic, degrees of freedom) of DRAWS speculative samples against the exact law."""
    tokens, _, _ = jaxkv.speculative_generate(params, [PROMPT] * DRAWS, 3, draft=draft,
                                              n_draft=2, n_branches=2, temperature=1.0,
                                              key=jax.random.key(0))
    V = SMALL["vocab_size"]
    conts, p = exact_probabilities(params)
    code = np.asarray(tokens) @ np.array([V * V, V, 1])
    seen = np.bincount(code, minlength=len(conts)).astype(np.float64)
    expected = p * DRAWS
    big = expected >= 5  # the rest (if any) pooled into one bin
    obs, exp = seen[big], expected[big]
    if not big.all():
        obs, exp = np.append(obs, seen[~big].sum()), np.append(exp, expected[~big].sum())
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def broken_accepted_depth(chain_BMD, usable_BMD, parent_draw_BMD):
    """A wrong rule: drafted tokens accepted without comparing them to the target's draws."""
    return jnp.cumprod(usable_BMD, axis=2).sum(2)


@pytest.mark.parametrize("draft", ["lookup", "model"])
def test_sampled_sequences_follow_the_target_distribution(draft, monkeypatch):
    params = jaxkv.init_params(jaxkv.Config.llama(n_heads=2, n_kv_heads=1, d_ff=48, **SMALL),
                               jax.random.key(4))
    drafter = draft if draft == "lookup" else jaxkv.init_params(
        jaxkv.Config.gpt2(n_heads=2, **SMALL), jax.random.key(5))
    # At 6000 rows a tree never pays (every row's nodes are compute): draft in every round.
    # One batch size: smaller ones would compile two more rounds for a test of the acceptance
    # rule (the EOS test covers them).
    monkeypatch.setattr(speculative, "ROW_COST", 0.0)
    monkeypatch.setattr(speculative, "PHASES", 1)
    jax.clear_caches()
    stat, df = chi_square(params, drafter)
    limit = df + 4 * np.sqrt(2 * df)  # ~4 standard deviations of chi-square(df)
    assert stat < limit, (stat, df)
    monkeypatch.setattr(drafts, "accepted_depth", broken_accepted_depth)
    jax.clear_caches()  # the loop was traced with the right rule
    try:
        broken, _ = chi_square(params, drafter)
    finally:
        jax.clear_caches()
    assert broken > 3 * limit, (broken, limit)


# ---- errors -------------------------------------------------------------------------------

def test_bad_arguments_are_clear_errors(llama):
    prompts = [[1, 2, 3]]
    other = jaxkv.init_params(jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=96,
                                                 vocab_size=50, d_model=64, n_layers=1,
                                                 max_seq_len=128), jax.random.key(0))
    with pytest.raises(ValueError, match="draft model's vocabulary has 50 tokens.*97"):
        jaxkv.speculative_generate(llama, prompts, 4, draft=other)
    for bad in (0, -2, 2.5, "4"):
        with pytest.raises((ValueError, TypeError), match="n_draft"):
            jaxkv.speculative_generate(llama, prompts, 4, n_draft=bad)
    with pytest.raises(ValueError, match="n_branches"):
        jaxkv.speculative_generate(llama, prompts, 4, n_branches=0)
    with pytest.raises(ValueError, match=r"max_len=10 is too small: the draft tree takes 9 slots "
                                         r"\(n_draft=8 x n_branches=1 \+ 1\), leaving 1 for "
                                         r"prompt \+ max_new_tokens = 3 \+ 4 = 7; pass max_len "
                                         r">= 16 or a smaller n_draft"):
        jaxkv.speculative_generate(llama, prompts, 4, n_draft=8, max_len=10)
    with pytest.raises(ValueError, match="draft must be 'lookup'"):
        jaxkv.speculative_generate(llama, prompts, 4, draft="ngram")
    with pytest.raises(TypeError, match="draft must be 'lookup'"):
        jaxkv.speculative_generate(llama, prompts, 4, draft=3)
    windowed = jaxkv.init_params(jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=96,
                                                    sliding_window=8, vocab_size=97, d_model=64,
                                                    n_layers=2, max_seq_len=128),
                                 jax.random.key(0))
    with pytest.raises(ValueError, match="sliding-window"):
        jaxkv.speculative_generate(windowed, prompts, 4)


def test_default_n_draft_fills_about_32_tree_nodes():
    """Lookup trees of about 32 nodes a pass (whole 16-row vectors of the CPU kernels), at most
    16 a row; at least one drafted token."""
    n_draft = [speculative.default_n_draft(B, 1) for B in (1, 2, 4, 8, 16, 64)]
    assert n_draft == [15, 15, 7, 3, 1, 1]
    assert speculative.default_n_draft(1, 2) == 7 and speculative.default_n_draft(4, 3) == 2


def test_each_batch_size_takes_its_own_default_n_draft(llama, monkeypatch):
    """As rows finish the batch shrinks (4, 2, 1) and a default lookup tree grows with it (7,
    15, 15 tokens a chain); a given n_draft holds at every size."""
    seen, real = [], speculative._round
    monkeypatch.setattr(speculative, "_round", lambda *a, **kw: seen.append(
        (a[-1].pos.shape[0], kw["D"])) or real(*a, **kw))
    prompts = ragged_prompts(5) + [[4, 5, 6]]
    for n_draft, want in [(None, [(4, 7), (2, 15), (1, 15)]), (3, [(4, 3), (2, 3), (1, 3)])]:
        seen.clear()
        speculative._speculative_loop.clear_cache()  # rounds are seen only while it traces
        tokens, _, _ = jaxkv.speculative_generate(llama, prompts, 7, n_draft=n_draft)
        assert seen == want
        np.testing.assert_array_equal(tokens, jaxkv.generate(llama, prompts, 7)[0])
