"""GPT-NeoX (Pythia) on tiny random Hugging Face checkpoints (models/gptneox.py): attention and
MLP in parallel off one residual (and the sequential variant), RoPE on a quarter of each head's
dims, LayerNorms with biases, per-head fused Q/K/V. Loaded from save_pretrained's files, it
must match transformers' logits and greedy tokens; Pythia's own config.json keys load too."""

import json

import numpy as np
import pytest

import jaxkv
from jaxkv.models.maps import CheckpointError
from tests.conftest import (HF_TINY, assert_decode_equals_forward, assert_logits_match_hf,
                            assert_paths_agree, assert_ragged_greedy_matches_hf,
                            assert_save_load_round_trip, edited_copy, random_tokens,
                            save_tiny_models)

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
             max_position_embeddings=128, **HF_TINY)


def neox_configs():
    import transformers as tf

    return {
        "pythia_like": (tf.GPTNeoXConfig(num_hidden_layers=3, **SMALL), tf.GPTNeoXForCausalLM),
        "sequential_half_rotary_tied": (tf.GPTNeoXConfig(
            num_hidden_layers=2, use_parallel_residual=False, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=500.0,
                                 partial_rotary_factor=0.5), **SMALL), tf.GPTNeoXForCausalLM),
    }


def pythia_style(path):
    """Rewrite config.json as Pythia's files have it: rotary_pct / rotary_emb_base top-level."""
    file = path / "config.json"
    hf = json.loads(file.read_text())
    rope = hf.pop("rope_parameters")
    hf["rotary_pct"], hf["rotary_emb_base"] = rope["partial_rotary_factor"], rope["rope_theta"]
    file.write_text(json.dumps(hf))


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """{name: (torch model, directory written by save_pretrained)}; no download."""
    models = save_tiny_models(neox_configs(), tmp_path_factory, seed=500)
    pythia_style(models["pythia_like"][1])
    return models


NAMES = sorted(neox_configs())


def test_configs_load_as_written(neox):
    a, b = (jaxkv.load(neox[name][1]).config for name in NAMES)
    assert (a.parallel_residual, a.rotary_dim, a.head_dim, a.rope_theta) == (True, 4, 16, 1e4)
    assert a.norm == "layernorm" and a.activation == "gelu" and a.attn_bias and a.mlp_bias
    assert not a.tie_embeddings
    assert (b.parallel_residual, b.rotary_dim, b.rope_theta, b.tie_embeddings) == (
        False, 8, 500.0, True)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hugging_face(neox, name):
    model, path = neox[name]
    diff = assert_logits_match_hf(model, jaxkv.load(path), random_tokens(3, (2, 40)))
    print(f"{name}: max |diff| {diff:.2e}")


@pytest.mark.parametrize("name", NAMES)
def test_ragged_greedy_matches_hugging_face_per_prompt(neox, name):
    model, path = neox[name]
    assert_ragged_greedy_matches_hf(model, jaxkv.load(path))


def test_decode_equals_forward_and_round_trip(neox, tmp_path):
    params = jaxkv.load(neox["pythia_like"][1])
    assert_decode_equals_forward(params, np.asarray(random_tokens(5, (2, 12))), 5, 16)
    assert_save_load_round_trip(params, tmp_path)


def test_hooks_sites_add_up_with_parallel_residual(neox):
    """resid_post = resid_pre + attn_out + mlp_out also where both sublayers read resid_pre."""
    params = jaxkv.load(neox["pythia_like"][1])
    hooks = jaxkv.Hooks(capture=["resid_pre", "attn_out", "mlp_out", "resid_post"])
    _, acts = jaxkv.forward(params, random_tokens(6, (1, 9)), hooks=hooks)
    np.testing.assert_allclose(acts["resid_post"],
                               acts["resid_pre"] + acts["attn_out"] + acts["mlp_out"], atol=1e-5)


def test_rope_scaling_is_refused(neox, tmp_path):
    path = edited_copy(neox["pythia_like"][1], tmp_path,
                       rope_scaling=dict(type="linear", factor=2.0))
    with pytest.raises(CheckpointError, match="GPT-NeoX rope scaling"):
        jaxkv.load(path)


def test_a_checkpoint_sweep_compiles_each_program_once(tmp_path, monkeypatch):
    """Three revisions of one model in a local Hugging Face cache (as Pythia's step checkpoints
    are): each loads by name@revision, scores and generates differently, and forward, generate
    and loglikelihood_many each compile once for all three."""
    import torch
    import transformers as tf

    from jaxkv.core.decoder import _forward
    from jaxkv.core.tracecount import TRACE_COUNTS
    from jaxkv.formats.locate import revisions

    repo = tmp_path / "hub" / "models--Org--neox-tiny"
    for k, step in enumerate([1000, 20000, 3000]):
        torch.manual_seed(600 + k)
        snapshot = repo / "snapshots" / f"{k:040x}"
        tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(num_hidden_layers=2, **SMALL)).save_pretrained(
            snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / f"step{step}").write_text(f"{k:040x}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert revisions("Org/neox-tiny") == ["step1000", "step3000", "step20000"]
    tokens_BT, prompts = random_tokens(7, (2, 8)), [[5, 9, 2], [4, 6, 11, 3]]
    requests = [([5, 9, 2], [7, 1]), ([4, 6], [11])]
    forwards, before = _forward._cache_size(), dict(TRACE_COUNTS)
    answers, scores = [], []
    for revision in revisions("Org/neox-tiny"):
        params = jaxkv.load(f"Org/neox-tiny@{revision}")
        jaxkv.forward(params, tokens_BT)
        answers.append(np.asarray(jaxkv.generate(params, prompts, 6)[0]).tolist())
        scores.append(jaxkv.loglikelihood_many(params, requests))
    assert _forward._cache_size() == forwards + 1
    # (prefill: once inside generate's program, once as the contexts' own)
    for program, traces in (("generate", 1), ("prefill", 2), ("forest_pass", 1)):
        assert TRACE_COUNTS[program] - before.get(program, 0) == traces, program
    assert scores[0] != scores[1] != scores[2]


def test_every_path_runs_it(neox):
    assert_paths_agree(jaxkv.load(neox["pythia_like"][1]))
