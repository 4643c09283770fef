"""Bad input, inside jit or out: every case is an error naming the argument, what was expected
and what came; nothing is clamped, dropped, wrapped or NaN. (Checkpoint files:
test_bad_checkpoints.py; the command line: test_cli.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.core import checks
from jaxkv.decoding import batching
from jaxkv.front.stream import Text
from tests.conftest import CONFIGS, ENCDEC_CONFIGS

RUNTIME = (ValueError, jax.errors.JaxRuntimeError)  # eager: ValueError; compiled: XLA's error


@pytest.fixture(scope="module")
def params():
    return jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(1))


@pytest.fixture(scope="module")
def cache(params):
    return jaxkv.init_cache(params, 2, 16)


@pytest.fixture(scope="module")
def step():
    return jax.jit(jaxkv.decode_step)


def run(fn, *args):
    return jax.block_until_ready(fn(*args))


# ---- decode_step: values, inside and outside jit ------------------------------------------

@pytest.mark.parametrize("token, pos, match", [
    ([1, 2], [3, 16], r"pos\[1\] = 16 is outside the cache: expected 0 <= pos < capacity \(16\)"),
    ([1, 2], [-1, 3], r"pos\[0\] = -1 is outside the cache"),
    ([1, 97], [3, 3], r"token\[1\] = 97 is not a token id: expected 0 <= id < vocab_size \(97\)"),
    ([-5, 2], [3, 3], r"token\[0\] = -5 is not a token id"),
])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_decode_step_values(params, cache, step, token, pos, match, compiled):
    fn = step if compiled else jaxkv.decode_step
    with pytest.raises(RUNTIME, match=match):
        run(fn, params, cache, jnp.array(token), jnp.array(pos))


def test_readme_loop_past_the_cache_is_an_error(params):
    """docs/guide.md's loop, run past a 16-slot cache: it wrote nowhere and returned plausible
    logits before; now the step that would write past the cache raises."""
    step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
    cache = jaxkv.init_cache(params, 1, 16)
    logits_BV, cache = jaxkv.prefill(params, cache, np.arange(1, 13)[None])
    token_B, pos_B = logits_BV.argmax(-1), jnp.array([12])
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"pos\[0\] = 16 is outside the cache"):
        for _ in range(8):
            logits_BV, cache = step(params, cache, token_B, pos_B)
            token_B, pos_B = jax.block_until_ready(logits_BV).argmax(-1), pos_B + 1


def test_bad_position_under_scan(params, cache):
    def body(cache, pos_B):
        logits_BV, cache = jaxkv.decode_step(params, cache, jnp.array([1, 2]), pos_B)
        return cache, logits_BV

    positions_NB = jnp.array([[0, 0], [1, 1], [2, 40]])
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"pos\[1\] = 40 is outside the cache"):
        run(jax.jit(lambda c, p: jax.lax.scan(body, c, p)), cache, positions_NB)


def test_bad_token_under_vmap(params, cache):
    """vmap over candidate tokens; one of them is past the vocabulary."""
    fn = jax.jit(jax.vmap(lambda tok: jaxkv.decode_step(params, cache, tok, jnp.array([0, 0]))[0]))
    run(fn, jnp.array([[1, 2], [3, 4]]))  # fine
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"= 200 is not a token id"):
        run(fn, jnp.array([[1, 2], [3, 200]]))


def test_int64_id_does_not_wrap(params, cache):
    token = np.array([2**32 + 5, 1], np.int64)
    with pytest.raises(ValueError, match=r"token\[0\] = 4294967301 is not a token id"):
        jaxkv.decode_step(params, cache, token, np.array([0, 0]))


def test_float_tokens_are_an_error(params, cache):
    with pytest.raises(TypeError, match="token must hold integers"):
        jaxkv.decode_step(params, cache, np.array([1.0, 2.0]), np.array([0, 0]))


def test_checks_can_be_switched_off(params, cache):
    """The documented switch: compiled checks left out (a bad position then writes nowhere)."""
    try:
        checks.set_value_checks(False)
        logits_BV, _ = run(jax.jit(jaxkv.decode_step), params, cache, jnp.array([1, 2]),
                           jnp.array([0, 16]))
        assert logits_BV.shape == (2, 97)
    finally:
        checks.set_value_checks(None)
    with pytest.raises(jax.errors.JaxRuntimeError, match="outside the cache"):
        run(jax.jit(jaxkv.decode_step), params, cache, jnp.array([1, 2]), jnp.array([0, 16]))


def test_checks_do_not_change_results(params, cache, step):
    token_B, pos_B = jnp.array([5, 6]), jnp.array([0, 0])
    on, _ = run(step, params, cache, token_B, pos_B)
    try:
        checks.set_value_checks(False)
        off, _ = run(jax.jit(jaxkv.decode_step), params, cache, token_B, pos_B)
    finally:
        checks.set_value_checks(None)
    np.testing.assert_array_equal(on, off)


def test_checks_are_compiled_in_by_platform(params, cache):
    """By default a traced decode step holds its value checks' host callback when built for a
    CPU, not for a GPU or TPU (there a cond waits on the host every step); True puts them in
    everywhere, None is the default again."""
    token_B, pos_B = jnp.array([1, 2]), jnp.array([0, 1])  # (made here: no GPU to make them on)

    def callbacks():
        return "callback" in str(jax.make_jaxpr(jaxkv.decode_step)(params, cache, token_B,
                                                                   pos_B))

    def on_each():
        counts = [callbacks()]
        for platform in ("gpu", "tpu"):
            with jaxkv.ops.on(platform):
                counts.append(callbacks())
        return counts

    assert on_each() == [True, False, False]  # (CPU, GPU, TPU)
    try:
        checks.set_value_checks(True)
        assert on_each() == [True, True, True]
    finally:
        checks.set_value_checks(None)
    assert on_each() == [True, False, False]


# ---- prefill, extend, forests --------------------------------------------------------------

@pytest.mark.parametrize("tokens, lengths, start, match", [
    ([[1, 2, 3], [4, 5, 97]], None, None, r"tokens\[1, 2\] = 97 is not a token id"),
    ([[1, 2, 3], [4, 5, 6]], [3, 4], None, r"lengths\[1\] = 4 is not a prompt length"),
    ([[1, 2, 3], [4, 5, 6]], [3, 0], None, r"lengths\[1\] = 0 is not a prompt length"),
    ([[1, 2, 3], [4, 5, 6]], None, [0, -2], r"start\[1\] = -2 is not a cache slot"),
    ([[1, 2, 3], [4, 5, 6]], None, [0, 14], r"start \+ lengths\[1\] = 17 slots are needed: the "
                                            r"prompt is longer than the cache \(capacity 16\)"),
])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_prefill_values(params, cache, tokens, lengths, start, match, compiled):
    fn = jax.jit(jaxkv.prefill) if compiled else jaxkv.prefill
    args = [jnp.array(x) if x is not None else None for x in (tokens, lengths, start)]
    with pytest.raises(RUNTIME, match=match):
        run(fn, params, cache, *args)


def test_prefill_longer_than_max_seq_len(params):
    cache = jaxkv.init_cache(params, 1, 256)
    with pytest.raises(ValueError, match=r"tokens has 130 positions, more than the model's "
                                         r"max_seq_len \(128\)"):
        jaxkv.prefill(params, cache, np.ones((1, 130), np.int32))


@pytest.mark.parametrize("tokens, pos, slot, match", [
    ([[1, 97]], [[0, 1]], [[0, 1]], r"tokens\[0, 1\] = 97 is not a token id"),
    ([[1, 2]], [[0, -1]], [[0, 1]], r"pos\[0, 1\] = -1 is not a position"),
    ([[1, 2]], [[0, 1]], [[0, -1]], r"slot\[0, 1\] = -1 is not a cache slot"),
])
def test_extend_values_under_jit(params, tokens, pos, slot, match):
    cache = jaxkv.init_cache(params, 1, 16)
    mask = jnp.tril(jnp.ones((1, 2, 16), bool), 0)
    fn = jax.jit(jaxkv.extend)
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        run(fn, params, cache, jnp.array(tokens), jnp.array(pos), jnp.array(slot), mask)


def test_forest_token_out_of_range(params):
    with pytest.raises(ValueError, match=r"tokens\[0\]\[2\] = 120 is not a token id"):
        jaxkv.forest_logits(params, tokens=[1, 2, 120], parents=[-1, 0, 0])


def test_forest_prefix_token_out_of_range(params):
    with pytest.raises(ValueError, match=r"prefix\[0\]\[1\] = -4 is not a token id"):
        jaxkv.forest_logits(params, tokens=[1, 2], parents=[-1, 0], prefix=[3, -4])


def test_branches_prompt_out_of_range(params):
    with pytest.raises(ValueError, match=r"prompt\[2\] = 97 is not a token id"):
        jaxkv.generate_branches(params, [1, 2, 97], 2, 4)


def test_beam_search_numpy_sizes(params):
    tokens, _, _ = jaxkv.beam_search(params, [1, 2, 3], np.int64(2), np.int32(3))
    assert tokens.shape == (2, 3)


# ---- the cache must be the model's ---------------------------------------------------------

def bad_caches(params):
    good = jaxkv.init_cache(params, 1, 16)
    L = params.config.n_layers
    return {
        "int8": (good.replace(k=tuple(k.astype(jnp.int8) for k in good.k)),
                 TypeError, r"cache.k\[0\] has dtype int8; expected a float dtype"),
        "one layer more": (good.replace(k=good.k + good.k[:1], v=good.v + good.v[:1]),
                           ValueError, f"cache.k has {L + 1} layers; the model has {L}"),
        "one layer less": (good.replace(k=good.k[:-1], v=good.v[:-1]),
                           ValueError, f"cache.k has {L - 1} layers; the model has {L}"),
        "kv heads": (good.replace(v=tuple(jnp.zeros((1, 4, 16, 16)) for _ in good.v)),
                     ValueError, r"cache.v\[0\] has shape \(1, 4, 16, 16\); this model needs "
                                 r"\(1, 2, 16, 16\)"),
        "head dim": (good.replace(k=tuple(jnp.zeros((1, 2, 16, 8)) for _ in good.k)),
                     ValueError, r"cache.k\[0\] has shape \(1, 2, 16, 8\)"),
        "not a cache": ({"k": good.k, "v": good.v}, TypeError, "cache must be a jaxkv.KVCache"),
    }


@pytest.mark.parametrize("case", ["int8", "one layer more", "one layer less", "kv heads",
                                  "head dim", "not a cache"])
def test_cache_of_another_model(params, step, case):
    cache, error, match = bad_caches(params)[case]
    with pytest.raises(error, match=match):
        step(params, cache, jnp.array([1]), jnp.array([0]))


def test_encoder_decoder_cache_without_cross_kv():
    t5 = jaxkv.init_params(ENCDEC_CONFIGS["t5_relu"], jax.random.key(0))
    llama_cache = jaxkv.init_cache(
        jaxkv.init_params(jaxkv.Config.llama(vocab_size=97, d_model=64, n_layers=3, n_heads=4,
                                             n_kv_heads=4, d_ff=96, max_seq_len=64),
                          jax.random.key(0)), 1, 16)
    with pytest.raises(ValueError, match="cache has no cross-attention K/V, but this is an "
                                         "encoder-decoder model"):
        jaxkv.decode_step(t5, llama_cache, np.array([0]), np.array([0]))


def test_decoder_only_model_with_cross_kv(params):
    cache = jaxkv.init_cache(params, 1, 16)
    cache = cache.replace(cross_k=cache.k, cross_v=cache.v, cross_mask=jnp.ones((1, 16), bool))
    with pytest.raises(ValueError, match="cache holds cross-attention K/V, but this is a "
                                         "decoder-only model"):
        jaxkv.decode_step(params, cache, np.array([0]), np.array([0]))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(batch_size=0, max_len=16), ValueError, "batch_size must be a positive int, got 0"),
    (dict(batch_size=1.5, max_len=16), TypeError, r"batch_size must be a positive int, got 1.5"),
    (dict(batch_size=True, max_len=16), TypeError, "batch_size must be a positive int, got True"),
    (dict(batch_size=1, max_len=16, dtype=jnp.int16), ValueError,
     r"init_cache: dtype must be a float dtype \(float32, bfloat16, float16\) or int8, got int16"),
])
def test_init_cache_arguments(params, kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxkv.init_cache(params, **kwargs)


def test_init_cache_takes_numpy_ints(params):
    cache = jaxkv.init_cache(params, np.int64(2), np.int32(16))
    assert (cache.batch_size, cache.capacity) == (2, 16)


# ---- generate and sampling arguments -------------------------------------------------------

@pytest.mark.parametrize("prompts, options, error, match", [
    ([[1]], dict(temperature=float("inf")), ValueError, "temperature must be finite and >= 0"),
    ([[1]], dict(temperature=float("nan")), ValueError, "temperature must be finite and >= 0"),
    ([[1]], dict(temperature="0.5"), TypeError, "temperature must be a number"),
    ([[1]], dict(top_p="high"), TypeError, "top_p must be a number"),
    ([[1]], dict(key=42), TypeError, r"key must be a JAX PRNG key such as jax.random.key"),
    ([[1]], dict(key=np.zeros(3, np.uint32)), TypeError, "key must be a JAX PRNG key"),
    ([[1]], dict(eos_id=[]), ValueError, "eos_id must be a token id or a non-empty list"),
    ([[1]], dict(eos_id=-2), ValueError, r"eos_id = -2 is not a token id"),
    ([[1]], dict(eos_id=2.5), ValueError, "eos_id must be a token id"),
    ([[1]], dict(pad_id=-1), ValueError, "pad_id must be an int >= 0, got -1"),
    ([[1]], dict(eos_id=500), ValueError, r"eos_id = 500 is not a token id: expected 0 <= id "
                                          r"< vocab_size \(97\)"),
    ([[1]], dict(eos_id=[3, 97]), ValueError, r"eos_id\[1\] = 97 is not a token id"),
    ([[1]], dict(pad_id=97), ValueError, r"pad_id = 97 is not a token id"),
    ([[1]], dict(max_len=2.0), TypeError, "max_len must be a positive int"),
    ("hello", {}, TypeError, "prompts must be token ids .*encode it first"),
    (["hello", "world"], {}, TypeError, "prompts must be token ids .*got text"),
    ([[1] * 130], {}, ValueError, r"130 \+ 4 = 134 positions, more than the model's max_seq_len "
                                  r"\(128\)"),
    ([[1] * 126], dict(max_len=256), ValueError, r"126 \+ 4 = 130 positions, more than the "
                                                 r"model's max_seq_len \(128\)"),
    ([np.array([2**32 + 1])], {}, ValueError, r"prompts\[0\]\[0\] = 4294967297 is not a token"),
])
def test_generate_arguments(params, prompts, options, error, match):
    with pytest.raises(error, match=match):
        jaxkv.generate(params, prompts, 4, **options)


def test_generate_takes_numpy_ints(params):
    tokens, lengths = jaxkv.generate(params, [[1, 2]], np.int64(3), max_len=np.int32(32),
                                     eos_id=np.int64(5), pad_id=np.int32(0))
    assert tokens.shape == (1, 3) and lengths.shape == (1,)


def test_suppressed_ids_never_drawn_at_high_temperature(params):
    suppressed = list(range(0, 97, 2))
    tokens, _ = jaxkv.generate(params, [[1, 2], [3]], 12, temperature=1e30,
                               suppress_ids=suppressed, key=jax.random.key(0))
    assert not np.isin(np.asarray(tokens), suppressed).any()


class Stop(Exception):
    pass


def test_on_token_exception_surfaces_as_itself(params):
    seen = []

    def on_token(token_B):
        seen.append(token_B)
        if len(seen) == 3:
            raise Stop("enough")

    with pytest.raises(Stop, match="enough"):
        jaxkv.generate(params, [[1, 2]], 8, on_token=on_token)
    assert len(seen) == 3


# ---- the rest of the API ---------------------------------------------------------------------

def branches(params):
    return jaxkv.decode_branches(params, [1, 2], 2, 3)


@pytest.mark.parametrize("call, error, match", [
    (lambda p: jaxkv.forest_logits(p, tokens=["a", "b"], parents=[-1, 0]), TypeError,
     r"tokens\[0\] must be token ids \(ints\), got text"),
    (lambda p: jaxkv.score_continuations(p, [1, 2], ["a"]), TypeError,
     r"candidates\[0\] must be token ids"),
    (lambda p: jaxkv.score_continuations(p, [1, 2], [[3], [98]]), ValueError,
     r"candidates\[1\]\[0\] = 98 is not a token id"),
    (lambda p: jaxkv.make_prefix(p, []), ValueError, "prefix must be token ids"),
    (lambda p: jaxkv.make_prefix(p, "hi"), ValueError, "prefix must be token ids"),
    (lambda p: jaxkv.beam_search(p, "hi", 2, 3), TypeError, "prompt must be token ids"),
    (lambda p: jaxkv.accept_branch(p, *branches(p), 5, 16), ValueError,
     r"row = 5 is out of range: expected 0 <= row < 2"),
    (lambda p: jaxkv.accept(p, *branches(p)[:1], branches(p)[1].cache, 0, [0, 7], 16),
     ValueError, r"slots\[1\] = 7 is not a slot of the node cache \(capacity 3\)"),
    (lambda p: jaxkv.cast(p, jnp.int8), ValueError, "cast: dtype must be a float dtype"),
    (lambda p: jaxkv.generate(p, [1, 2, 3], 3), TypeError,
     r"prompts must be a list of token-id lists \(one per row\), got \[1, 2, 3\]; for one "
     r"prompt p, pass \[p\]"),
    (lambda p: jaxkv.generate(p, None, 3), TypeError, "prompts must be a list of token-id lists"),
    (lambda p: jaxkv.generate(p, [[1]], 3, mesh="x"), TypeError,
     "mesh must be a jax.sharding.Mesh"),
    (lambda p: jaxkv.sample(jnp.zeros((1, 97)), jaxkv.sampling_params(1), jax.random.key(0), 0,
                            jnp.zeros((1, 97), bool)), ValueError, "keys must be one key per row"),
    (lambda p: jaxkv.forward(p, "abc"), TypeError, "tokens must be token ids"),
    (lambda p: jaxkv.prefill(p, jaxkv.init_cache(p, 1, 16), [[1, 2]], [1.5]), TypeError,
     r"lengths must hold integers"),
    (lambda p: jaxkv.generate_many(p, [[1]], 3, eos_id=500), ValueError,
     r"eos_id = 500 is not a token id: expected 0 <= id < vocab_size \(97\)"),
    (lambda p: jaxkv.speculative_generate(p, [[1]], 3, eos_id=500), ValueError,
     r"eos_id = 500 is not a token id"),
    (lambda p: jaxkv.beam_search(p, [1], 2, 3, eos_id=500), ValueError,
     r"eos_id = 500 is not a token id"),
    (lambda p: jaxkv.beam_search(p, [1], 2, 3, pad_id=100), ValueError,
     r"pad_id = 100 is not a token id"),
    (lambda p: next(jaxkv.iter_tokens(p, [1], 3, steps=0)), ValueError,
     "iter_tokens: steps must be a positive int, got 0"),
    (lambda p: next(jaxkv.iter_tokens(p, [1], 3, steps=-2)), ValueError,
     "iter_tokens: steps must be a positive int, got -2"),
    (lambda p: jaxkv.speculative_generate(p, [[1]], 3, n_draft=10**6), ValueError,
     r"n_draft=1000000 x n_branches=1: a draft tree of 1000001 nodes does not fit a cache of "
     r"128 positions \(the model's max_seq_len\); lower n_draft"),
    (lambda p: jaxkv.speculative_generate(p, [[1]], 3, n_draft=20, max_len=16), ValueError,
     r"max_len=16 is too small: the draft tree takes 21 slots \(n_draft=20 x n_branches=1 \+ "
     r"1\), leaving -5 for prompt \+ max_new_tokens = 1 \+ 3 = 4; pass max_len >= 25"),
    (lambda p: jaxkv.quantize(p, block=True), TypeError,
     "quantize: block must be a positive int or None, got True"),
    (lambda p: jaxkv.quantize(p, block=0), ValueError,
     "quantize: block must be a positive int or None, got 0"),
    (lambda p: jaxkv.make_prefix(p, [[1, 2, 3]], chunk_size=-1), ValueError,
     "chunk_size must be a positive int or None, got -1"),
    (lambda p: jaxkv.make_prefix(p, [[1, 2, 3]], chunk_size=True), TypeError,
     "chunk_size must be a positive int or None, got True"),
    (lambda p: jaxkv.generate_many(p, [[1]], 3, prefix_cache="no"), TypeError,
     "prefix_cache must be True or False, got 'no'"),
    (lambda p: jaxkv.generate_many(p, [[1]], 3, progress=1), TypeError,
     "progress must be True or False, got 1"),
    (lambda p: jaxkv.stops.cut("abc zz", ["", "zz"]), ValueError,
     "stop strings must not be empty"),
    (lambda p: jaxkv.set_value_checks("no"), TypeError, "enabled must be True or False"),
])
def test_api_arguments(params, call, error, match):
    with pytest.raises(error, match=match):
        call(params)


# ---- prompts: arrays are prompts, empty ones are refused -----------------------------------

def test_generate_many_takes_an_array_of_prompts(params):
    """A [B, T] numpy or jax array is B prompts, as generate takes it."""
    prompts = [[5, 6, 7], [8, 9, 10]]
    want = jaxkv.generate_many(params, prompts, 3)
    assert jaxkv.generate_many(params, np.array(prompts), 3) == want
    assert jaxkv.generate_many(params, jnp.array(prompts), 3) == want
    assert jaxkv.generate_many(params, list(np.array(prompts)), 3) == want
    assert jaxkv.generate(params, np.array(prompts), 3)[0].tolist() == want


def test_an_array_of_prompts_is_counted_before_any_work(params, monkeypatch):
    """Options given per prompt are checked against an array's rows up front, as a list's."""
    monkeypatch.setattr(batching, "admit", lambda *a, **k: pytest.fail("admitted"))
    with pytest.raises(ValueError, match="temperature"):
        jaxkv.generate_many(params, np.array([[5, 6], [7, 8]]), 3, temperature=[0.5])


@pytest.mark.parametrize("call, error, match", [
    (lambda p: jaxkv.generate_many(p, np.arange(1, 4), 3), ValueError,
     r"prompts as an array must be \[B, T\] token ids \(one row per prompt\), got shape "
     r"\(3,\); for one prompt p, pass \[p\]"),
    (lambda p: jaxkv.generate_many(p, [1, 2, 3], 3), ValueError,
     r"prompts\[0\] must have 1 dimension\(s\), got the scalar 1"),
    (lambda p: jaxkv.generate_many(p, np.zeros((2, 0), np.int32), 3), ValueError,
     r"prompts is empty: expected at least one token id, got shape \(2, 0\)"),
    (lambda p: jaxkv.generate_many(p, jnp.array([[1, 2], [3, 97]]), 3), ValueError,
     r"prompts\[1, 1\] = 97 is not a token id"),
    (lambda p: jaxkv.generate_many(p, iter([[1]]), 3), ValueError,
     r"prompts is an iterator \(list_iterator\), so generate_many cannot size the cache ahead: "
     r"pass max_len"),
    (lambda p: jaxkv.generate(p, np.zeros((0, 3), np.int32), 3), ValueError,
     r"prompts is empty: expected \[B, T\] token ids with B, T >= 1, got shape \(0, 3\)"),
    (lambda p: jaxkv.generate(p, np.zeros((2, 0), np.int32), 3), ValueError,
     r"prompts is empty: .* got shape \(2, 0\)"),
    (lambda p: jaxkv.generate(p, [[1, 2], []], 3), ValueError,
     r"prompts\[1\] is empty: expected at least one token id"),
    (lambda p: jaxkv.speculative_generate(p, np.zeros((1, 0), np.int32), 3), ValueError,
     "prompts is empty"),
    (lambda p: jaxkv.prefill(p, jaxkv.init_cache(p, 2, 16), [[1], [2, 3]]), ValueError,
     "tokens must be a 2-D array of ints, got lists of different lengths"),
    (lambda p: jaxkv.beam_search(p, [], 2, 3), ValueError,
     r"prompt is empty: expected at least one token id, got shape \(0,\)"),
    (lambda p: jaxkv.generate_branches(p, [], 2, 3), ValueError, "prompt is empty"),
    (lambda p: jaxkv.forest_logits(p, tokens=[[]], parents=[[]]), ValueError,
     r"tokens\[0\] is empty"),
    (lambda p: jaxkv.decode_step(p, jaxkv.init_cache(p, 1, 16), 3, np.array([0])), ValueError,
     r"token must have 1 dimension\(s\), got the scalar 3"),
    (lambda p: next(jaxkv.stream(p, None, 5)), TypeError,
     r"prompt must be text or token ids, got 5 \(int\)"),
    (lambda p: next(jaxkv.stream(p, None, [[1, 2]])), ValueError,
     r"prompt must have 1 dimension\(s\), got shape \(1, 2\)"),
    (lambda p: next(jaxkv.stream(p, None, [])), ValueError, "prompt is empty"),
])
def test_prompt_arguments(params, call, error, match):
    with pytest.raises(error, match=match):
        call(params)


@pytest.mark.parametrize("call", [
    lambda p, n: jaxkv.generate(p, [[1]], n),
    lambda p, n: jaxkv.generate_many(p, [[1]], n),
    lambda p, n: jaxkv.generate_many(p, [[1], [2]], [3, n]),
    lambda p, n: jaxkv.speculative_generate(p, [[1]], n),
    lambda p, n: jaxkv.speculative_generate(p, [[1]], 3, n_draft=n),
    lambda p, n: jaxkv.generate_branches(p, [1], n, 3),
    lambda p, n: jaxkv.beam_search(p, [1], 2, n),
    lambda p, n: jaxkv.generate_many(p, [[1]], 3, batch_size=n),
])
@pytest.mark.parametrize("n, error, match", [
    (True, TypeError, "must be a positive int, got True"),
    (2.0, TypeError, r"must be a positive int, got 2.0 \(float\)"),
    (-1, ValueError, "must be a positive int, got -1"),
    (0, ValueError, "must be a positive int, got 0"),
])
def test_counts_must_be_positive_ints(params, call, n, error, match):
    with pytest.raises(error, match=match):
        call(params, n)


def test_numpy_ints_are_ints(params):
    """np.int64(32) is an int wherever one is asked: quantize's block, make_prefix's chunk_size,
    the end id stream leaves out of its text."""
    assert jaxkv.quantize(params, block=np.int64(32)).embed.q.shape == params.embed.shape
    whole = jaxkv.make_prefix(params, [[1, 2, 3]])
    chunked = jaxkv.make_prefix(params, [[1, 2, 3]], chunk_size=np.int64(2))
    np.testing.assert_allclose(chunked.logits, whole.logits, atol=1e-5)
    assert Text(None, np.int64(3)).ends == {3}


@pytest.mark.parametrize("where, error, match", [
    ("missing.wav", FileNotFoundError, r"load_audio: no such audio file: '.*missing.wav'"),
    (".", IsADirectoryError, r"load_audio: '.*' is a directory, not an audio file"),
])
def test_load_audio_names_a_missing_path(tmp_path, where, error, match):
    with pytest.raises(error, match=match):
        jaxkv.load_audio(tmp_path / where)


def test_log_mel_features_must_be_finite():
    """An all-NaN log-mel once decoded to zeros; now it is refused where it comes in."""
    whisper = jaxkv.init_params(ENCDEC_CONFIGS["whisper"], jax.random.key(3))
    e = whisper.config.encoder
    mel = np.full((1, e.n_mels, e.max_input_len), np.nan, np.float32)
    for call in (lambda: jaxkv.init_cache(whisper, 1, 8, encoder_inputs=mel),
                 lambda: jaxkv.generate(whisper, [[1]], 4, encoder_inputs=mel)):
        with pytest.raises(ValueError, match=r"encoder_inputs holds nan at \[0, 0, 0\]: "
                                             "log-mel features must be finite"):
            call()
