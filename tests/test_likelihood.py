"""loglikelihood_many and loglikelihood_rolling against the plain uncached forward pass: each
continuation's summed log-probability and greedy flag, shared contexts, batch sizes, windows,
and bad requests named before anything runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.decoding import likelihood
from tests.conftest import random_tokens


def uncached(params, context, continuation):
    """(summed log-probability, greedy) of continuation after context from one forward pass over
    context + continuation[:-1]."""
    tokens = list(context) + list(continuation)
    logp_TV = jax.nn.log_softmax(jaxkv.forward(params, jnp.array([tokens[:-1]]))[0], -1)
    rows = np.arange(len(context) - 1, len(tokens) - 1)
    total = float(logp_TV[rows, np.array(continuation)].sum())
    return total, bool((np.argmax(logp_TV[rows], -1) == np.array(continuation)).all())


def requests_with_shared_contexts(vocab: int):
    """Three contexts of different lengths; one with four choices sharing beginnings, one
    continuation that is the greedy one, single-token choices."""
    contexts = [random_tokens(1, (9,)).tolist(), random_tokens(2, (3,)).tolist(), [5]]
    choices = [[[4, 7], [4, 7, 1], [4, 2], [9]], [[1], [2], [3]], [[8, 8, 8, 8]]]
    return [(c, x) for c, xs in zip(contexts, choices) for x in xs]


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_each_request_equals_the_uncached_pass(which, request):
    params = request.getfixturevalue(which)
    requests = requests_with_shared_contexts(params.config.vocab_size)
    greedy = [int(np.argmax(jaxkv.forward(params, jnp.array([requests[0][0]]))[0, -1]))]
    requests.append((requests[0][0], greedy))  # a greedy continuation: True
    got = jaxkv.loglikelihood_many(params, requests, batch_size=2)
    for (context, continuation), (logp, is_greedy) in zip(requests, got):
        want, want_greedy = uncached(params, context, continuation)
        assert logp == pytest.approx(want, abs=2e-4) and is_greedy == want_greedy
    assert got[-1][1]


def test_batch_size_does_not_change_results(llama):
    requests = requests_with_shared_contexts(llama.config.vocab_size)
    one = jaxkv.loglikelihood_many(llama, requests, batch_size=1)
    three = jaxkv.loglikelihood_many(llama, requests, batch_size=3)
    np.testing.assert_allclose([x for x, _ in one], [x for x, _ in three], atol=1e-5)
    assert [g for _, g in one] == [g for _, g in three]


@pytest.mark.parametrize("n, max_len", [(5, 8), (8, 8), (9, 8), (21, 8), (3, 1)])
def test_rolling_windows_predict_every_token_once(n, max_len):
    """Each token is predicted once, in order, with at most max_len positions fed per window and
    the window's context ending just before it."""
    tokens = list(range(100, 100 + n))
    windows = likelihood.rolling_windows(tokens, 7, max_len)
    assert [t for _, cont in windows for t in cont] == tokens
    assert windows[0][0] == [7]
    for context, continuation in windows:
        assert len(context) + len(continuation) - 1 <= max_len and len(continuation) <= max_len
        if context != [7]:
            assert context[-1] + 1 == continuation[0]


def test_rolling_equals_its_windows_run_uncached(gpt2):
    """A document longer than the window (GPT-2's learned positions allow no more): the sum of
    its windows, each an uncached pass."""
    document = random_tokens(5, (30,)).tolist()
    got = jaxkv.loglikelihood_rolling(gpt2, [document, document[:5]], prefix_id=3, max_len=12)
    windows = likelihood.rolling_windows(document, 3, 12)
    want = sum(uncached(gpt2, c, x)[0] for c, x in windows)
    assert got[0] == pytest.approx(want, abs=5e-4)
    assert got[1] == pytest.approx(uncached(gpt2, [3], document[:5])[0], abs=2e-4)


@pytest.mark.parametrize("requests, match", [
    ([([1, 2], [3]), ([1], [])], r"requests\[1\] has an empty continuation"),
    ([([], [3])], r"requests\[0\] has an empty context"),
    ([([1, 2], [3]), ([1], [97])], r"requests\[1\] continuation.*vocab_size \(97\)"),
    ([([1] * 120, [2] * 10)], r"requests\[0\] has 120 \+ 10 tokens.*allows 128"),
    ([([1, 2], [3], [4])], r"requests\[0\] must be a pair"),
    ([], "non-empty list"),
    ("abc", "non-empty list"),
])
def test_bad_requests_are_named_before_any_work(llama, monkeypatch, requests, match):
    monkeypatch.setattr(likelihood, "make_prefix", lambda *a, **k: pytest.fail("computed"))
    with pytest.raises(ValueError, match=match):
        jaxkv.loglikelihood_many(llama, requests)


def test_bad_rolling_arguments_are_named(llama):
    with pytest.raises(ValueError, match=r"documents\[1\] is empty"):
        jaxkv.loglikelihood_rolling(llama, [[1, 2], []], prefix_id=0)
    with pytest.raises(ValueError, match="prefix_id: the model names no bos_id"):
        jaxkv.loglikelihood_rolling(llama, [[1, 2]])
    with pytest.raises(TypeError, match="batch_size must be a positive int"):
        jaxkv.loglikelihood_many(llama, [([1], [2])], batch_size=1.5)
