"""Tokenizers (the `tokenizers` library) and chat templates, from HF directories, GGUF files
and jaxkv.save directories."""

import os

from tokenizers import (AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors)

from jaxkv.formats import locate
from jaxkv.formats.common import holds, read_json
from jaxkv.formats.gguf import gguf_reader
from jaxkv.formats.saved import SAVED_CONFIG, verify_saved_file
from jaxkv.models.common import gguf_field, gguf_required
from jaxkv.models.maps import CheckpointError

# llama.cpp's token types (tokenizer.ggml.token_type)
GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED = 1, 2, 3, 4
SPIECE_SPACE = "\u2581"  # '▁', SentencePiece's spelling of a space


def load_tokenizer(path) -> Tokenizer:
    """A tokenizers.Tokenizer for a Hugging Face / jaxkv.save directory or a GGUF file. In a
    jaxkv.save directory, tokenizer.json is first checked against the save's manifest."""
    path = locate.resolve(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return tokenizer_from_gguf(gguf_reader(path), path)
    if holds(path, "tokenizer.json"):
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
    """A tokenizer from a GGUF's metadata, for llama.cpp's 'gpt2' (byte-level BPE) and 'llama'
    (SentencePiece BPE with byte fallback: Llama 1/2, TinyLlama, Gemma) tokenizer models.

    Tokens typed control or unknown become special tokens and user-defined ones plain added
    tokens, all matched whole in the raw text before the model sees it, as llama.cpp does when it
    parses special tokens; BOS / EOS are added where tokenizer.ggml.add_bos_token / add_eos_token
    say (a 'llama' file that does not say gets BOS, llama.cpp's default).
    """
    kind = gguf_field(reader, "tokenizer.ggml.model")
    build = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}.get(kind)
    if build is None:
        raise ValueError(f"{source}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2' "
                         "byte-level BPE and 'llama' SentencePiece); use a directory with "
                         "tokenizer.json")
    tokens = gguf_required(reader, "tokenizer.ggml.tokens", source)
    types = gguf_field(reader, "tokenizer.ggml.token_type") or [GGUF_NORMAL] * len(tokens)
    tok = build(reader, tokens, types, source)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind
                            in zip(tokens, types) if kind in (GGUF_CONTROL, GGUF_UNKNOWN)])
    tok.add_tokens([AddedToken(t, normalized=False)
                    for t, kind in zip(tokens, types) if kind == GGUF_USER_DEFINED])
    tok.post_processor = _bos_eos(reader, tokens, add_bos_default=kind == "llama")
    return tok


def _byte_level_bpe(reader, tokens, types, source) -> Tokenizer:
    """GPT-2's byte-level BPE; the merges are in the file."""
    merges = [tuple(m.split(" ", 1))
              for m in gguf_required(reader, "tokenizer.ggml.merges", source)]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if gguf_field(reader, "tokenizer.ggml.pre") == "smollm":  # llama.cpp splits digits first
        byte_level = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              byte_level])
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(reader, tokens, types, source) -> Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: spaces spelled '▁', pieces merged by the scores
    of the tokens they make, a character outside the vocabulary spelled by its UTF-8 bytes'
    <0xNN> tokens. Where tokenizer.ggml.add_space_prefix (default true; Gemma: false), a space
    goes before the text and before the text after each added token, as llama.cpp and Llama 2's
    own tokenizer.json do; the decoder strips it from the start of the text."""
    scores = gguf_required(reader, "tokenizer.ggml.scores", source)
    unk = gguf_field(reader, "tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=sentencepiece_merges(tokens, scores, types),
                               unk_token=None if unk is None else tokens[unk], fuse_unk=True,
                               byte_fallback=True))
    prefix = gguf_field(reader, "tokenizer.ggml.add_space_prefix", True)
    # the normalizer runs on each stretch of text between added tokens
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend(SPIECE_SPACE)] if prefix else [])
                                          + [normalizers.Replace(" ", SPIECE_SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def sentencepiece_merges(tokens, scores, types) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    SentencePiece BPE (and llama.cpp's 'llama' tokenizer) repeatedly joins the adjacent pair
    whose joined text is the normal token of highest score, so each split of a normal token into
    two tokens is a merge ranked by that token's score (its negated merge order in the files
    seen). Ties: lower id first, then the longer left piece. Control, user-defined, byte and
    unused tokens are never made by merging.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = sorted((i for i, kind in enumerate(types) if kind == GGUF_NORMAL),
                    key=lambda i: (-scores[i], i))
    return [(tokens[i][:cut], tokens[i][cut:]) for i in normal
            for cut in range(len(tokens[i]) - 1, 0, -1)
            if tokens[i][:cut] in vocab and tokens[i][cut:] in vocab]


def _bos_eos(reader, tokens, add_bos_default: bool):
    """A post-processor adding BOS before and EOS after the text as the GGUF says, or None."""
    def end(key, default):
        token_id = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is None or not gguf_field(reader, f"tokenizer.ggml.add_{key}_token", default):
            return []
        return [(tokens[token_id], token_id)]

    bos, eos = end("bos", add_bos_default), end("eos", False)
    if not bos + eos:
        return None
    return processors.TemplateProcessing(single=[t for t, _ in bos] + ["$A"] + [t for t, _ in eos],
                                         special_tokens=bos + eos)


def chat_template(path) -> str | None:
    """The model's Jinja chat template, or None if it has none; one that does not parse is a
    ValueError naming the file it came from."""
    found = _template_and_source(locate.resolve(path))
    if found is None:
        return None
    compiled_template(*found)
    return found[0]


def _template_and_source(path: str) -> tuple[str, str] | None:
    """(the chat template, where it was read) of a model path, or None."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        template = gguf_field(gguf_reader(path), "tokenizer.chat_template")
        return None if template is None else (template, f"{path} (tokenizer.chat_template)")
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read(), jinja
    for name, key in ((SAVED_CONFIG, "chat_template"), ("tokenizer_config.json", "chat_template")):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            verify_saved_file(path, name)
            template = read_json(file).get(key)
            if template:
                return template, file
    return None


def render_chat(template: str, config, tokenizer, messages: list[dict]) -> str:
    """messages rendered with a chat template for the assistant's next turn, the model's BOS
    and EOS tokens (from config and tokenizer) passed as bos_token / eos_token."""
    name = lambda i: "" if i is None else tokenizer.id_to_token(i)  # noqa: E731
    return apply_chat_template(template, messages, bos_token=name(config.bos_id),
                               eos_token=name(config.eos_id))


def apply_chat_template(template: str, messages: list[dict], add_generation_prompt=True,
                        **special_tokens) -> str:
    """Renders messages ([{"role": ..., "content": ...}]) with a Jinja chat template; one that
    fails (or calls raise_exception) is a ValueError with Jinja's message."""
    import jinja2

    check_messages(messages)
    compiled = compiled_template(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **special_tokens)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from e


def compiled_template(template: str, source: str = "the template given"):
    """A Jinja chat template, compiled as Hugging Face compiles it (with raise_exception); one
    that does not parse is a ValueError naming source and Jinja's message."""
    import jinja2

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    if not isinstance(template, str):
        raise TypeError(f"template must be a Jinja chat template (a string), got "
                        f"{type(template).__name__}")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{source}: the chat template does not parse: {e.message} (line "
                         f"{e.lineno})") from e


def check_messages(messages) -> None:
    """messages must be a list of {"role": str, "content": ...} dicts."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f'messages must be a list of {{"role": ..., "content": ...}} dicts, got '
                        f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f'messages[{i}] must be a dict with "role" (a string) and '
                             f'"content", got {m!r:.80}')
