"""Sampling filters agree with Hugging Face's logits processors; draws follow the distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf

from jaxkv.decoding.sampling import apply_repetition_penalty, argmax, filter_logits, row_keys, sample, sampling_params

B, V = 6, 50


def random_logits(seed=0):
    return np.random.default_rng(seed).normal(0, 2, (B, V)).astype(np.float32)


def hf_filter(logits, top_k=None, top_p=None, min_p=None):
    x = torch.tensor(logits)
    for warper in ([hf.TopKLogitsWarper(top_k)] if top_k else []) + \
                  ([hf.TopPLogitsWarper(top_p)] if top_p else []) + \
                  ([hf.MinPLogitsWarper(min_p)] if min_p else []):
        x = warper(None, x)
    return np.isfinite(x.numpy())


def test_argmax_is_numpy_argmax():
    """Ties (first wins), NaN (the first counts as the largest), all -inf rows, and +inf. Against
    numpy, not jnp.argmax: on an H100 that took a row's last NaN (results/gpu/h100/argmax_h100.log)."""
    x = random_logits()
    x[0, 7] = x[0, 30] = 9.0
    x[1, 12], x[1, 40] = np.nan, np.nan
    x[2] = -np.inf
    x[3, 44] = np.inf
    np.testing.assert_array_equal(argmax(jnp.asarray(x)), np.argmax(x, -1))


@pytest.mark.parametrize("top_k, top_p, min_p", [
    (5, None, None), (None, 0.7, None), (None, None, 0.1), (10, 0.8, None), (20, 0.9, 0.05),
    (1, None, None), (V + 3, None, None),
])
def test_filters_keep_what_hugging_face_keeps(top_k, top_p, min_p):
    logits = random_logits()
    p = sampling_params(B, top_k=top_k, top_p=top_p, min_p=min_p)
    kept = np.isfinite(filter_logits(jnp.asarray(logits), p.top_k, p.top_p, p.min_p))
    np.testing.assert_array_equal(kept, hf_filter(logits, top_k, top_p, min_p))


def test_repetition_penalty_matches_hugging_face():
    logits = random_logits(1)
    ids = np.random.default_rng(2).integers(0, V, (B, 8))
    seen = np.zeros((B, V), bool)
    seen[np.arange(B)[:, None], ids] = True
    ours = apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen), jnp.full((B,), 1.7))
    theirs = hf.RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor(ids), torch.tensor(logits))
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)


def test_greedy_and_degenerate_filters_give_argmax():
    logits = jnp.asarray(random_logits(3))
    argmax = np.argmax(logits, -1)
    keys = row_keys(jax.random.key(0), B)
    seen = jnp.zeros((B, V), bool)
    for options in (dict(), dict(temperature=1.0, top_k=1), dict(temperature=2.0, top_p=1e-6),
                    dict(temperature=1.5, min_p=1.0)):
        got = sample(logits, sampling_params(B, **options), keys, 0, seen)
        np.testing.assert_array_equal(got, argmax)


def test_draws_follow_the_filtered_distribution():
    logits_V = jnp.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    n = 20000
    p = sampling_params(n, temperature=0.7, top_k=4)
    logits_NV = jnp.broadcast_to(logits_V, (n, 6))
    draws = jax.jit(sample)(logits_NV, p, row_keys(jax.random.key(1), n), 3,
                            jnp.zeros((n, 6), bool))
    freq = np.bincount(np.asarray(draws), minlength=6) / n
    expected = np.asarray(jax.nn.softmax(logits_V[:4] / 0.7))
    np.testing.assert_allclose(freq[:4], expected, atol=0.015)
    assert freq[4:].sum() == 0


def test_row_randomness_depends_on_key_and_step_only():
    logits = jnp.asarray(random_logits(4))
    p = sampling_params(B, temperature=1.0)
    keys = row_keys(jax.random.key(5), B)
    seen = jnp.zeros((B, V), bool)
    full = sample(logits, p, keys, 9, seen)
    for b in range(B):
        alone = sample(logits[b:b + 1], sampling_params(1, temperature=1.0), keys[b:b + 1], 9,
                       seen[:1])
        assert int(alone[0]) == int(full[b])
    assert not np.array_equal(full, sample(logits, p, keys, 10, seen))


def test_per_row_parameters():
    logits = jnp.asarray(random_logits(6))
    p = sampling_params(B, temperature=[0.0, 1.0, 0.0, 1.0, 0.0, 1.0], top_k=[0, 1] * 3)
    got = sample(logits, p, row_keys(jax.random.key(0), B), 0, jnp.zeros((B, V), bool))
    np.testing.assert_array_equal(got, np.argmax(logits, -1))  # greedy rows and top-1 rows
