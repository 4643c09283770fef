"""Tokenizers and chat templates agree with transformers' own readings of the same files."""

import os

import pytest
from transformers import AutoTokenizer

import jaxkv
from jaxkv.locate import default_model

GGUF = default_model()
TEXTS = ["Hello, world!", "What is the capital of France?", "  leading spaces\n\nand\ttabs",
         "naïve café — ünïcödé ✓ 日本語", "<|im_start|>user\nHi<|im_end|>\n", "it's 12 o'clock"]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF))


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(hf_tokenizer, text):
    ours = jaxkv.load_tokenizer(GGUF)
    ids = ours.encode(text).ids
    assert ids == hf_tokenizer(text).input_ids
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_hf_directory_tokenizer(hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    ours = jaxkv.load_tokenizer(tmp_path)
    for text in TEXTS:
        assert ours.encode(text).ids == hf_tokenizer(text).input_ids


def test_chat_template_matches_transformers(hf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Why?"}]
    ours = jaxkv.apply_chat_template(jaxkv.chat_template(GGUF), messages)
    assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)


def test_missing_tokenizer_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        jaxkv.load_tokenizer(tmp_path)
