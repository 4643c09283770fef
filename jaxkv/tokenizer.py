"""Tokenizers (the `tokenizers` library) and chat templates, from HF directories, GGUF files
and jaxkv.save directories."""

import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from jaxkv import locate
from jaxkv.checkpoint import (SAVED_CONFIG, gguf_field, gguf_reader, gguf_required, read_json,
                              verify_saved_file)
from jaxkv.convert import CheckpointError

GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4


def load_tokenizer(path) -> Tokenizer:
    """A tokenizers.Tokenizer for a Hugging Face / jaxkv.save directory or a GGUF file. In a
    jaxkv.save directory, tokenizer.json is first checked against the save's manifest."""
    path = locate.resolve(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return tokenizer_from_gguf(gguf_reader(path), path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        verify_saved_file(path, "tokenizer.json")
        return read_tokenizer(os.path.join(path, "tokenizer.json"))
    vocab, merges = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
    if os.path.isfile(vocab) and os.path.isfile(merges):  # GPT-2's original files
        tok = Tokenizer(_parsed(f"{vocab} + {merges}", "vocab.json + merges.txt",
                                models.BPE.from_file, vocab, merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok
    raise FileNotFoundError(f"load_tokenizer: no tokenizer.json (or vocab.json + merges.txt) in "
                            f"{path!r}, and it is not a .gguf file")


def read_tokenizer(file: str) -> Tokenizer:
    """Tokenizer.from_file; a file it cannot parse is a CheckpointError naming it."""
    return _parsed(file, "tokenizer.json", Tokenizer.from_file, file)


def _parsed(source: str, what: str, parse, *args):
    try:
        return parse(*args)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions
        raise CheckpointError(f"{source}: not a valid {what}: {e}") from None


def tokenizer_from_gguf(reader, source: str = "GGUF") -> Tokenizer:
    """A byte-level BPE tokenizer ('gpt2' GGUF tokenizer model) from the GGUF's metadata."""
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{source}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2' "
                         "byte-level BPE); use a directory with tokenizer.json")
    tokens = gguf_required(reader, "tokenizer.ggml.tokens", source)
    merges = [tuple(m.split(" ", 1))
              for m in gguf_required(reader, "tokenizer.ggml.merges", source)]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if gguf_field(reader, "tokenizer.ggml.pre") == "smollm":  # llama.cpp splits digits first
        byte_level = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              byte_level])
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = gguf_field(reader, "tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == GGUF_CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False)
                    for t, kind in zip(tokens, types) if kind == GGUF_USER_DEFINED])
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    if gguf_field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)])
    return tok


def chat_template(path) -> str | None:
    """The model's Jinja chat template, or None if it has none."""
    path = locate.resolve(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return gguf_field(gguf_reader(path), "tokenizer.chat_template")
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    for name, key in ((SAVED_CONFIG, "chat_template"), ("tokenizer_config.json", "chat_template")):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            verify_saved_file(path, name)
            template = read_json(file).get(key)
            if template:
                return template
    return None


def apply_chat_template(template: str, messages: list[dict], add_generation_prompt=True,
                        **special_tokens) -> str:
    """Renders messages ([{"role": ..., "content": ...}]) with a Jinja chat template."""
    import jinja2

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages,
                                            add_generation_prompt=add_generation_prompt,
                                            **special_tokens)
