"""Tokenizers and chat templates agree with transformers' own readings of the same files."""

import os
from pathlib import Path

import gguf
import pytest
from transformers import AutoTokenizer

import jaxkv
from jaxkv.formats.locate import default_model
from tests.conftest import finish_gguf, hf_from_gguf

GGUF = default_model()
TEXTS = ["Hello, world!", "What is the capital of France?", "  leading spaces\n\nand\ttabs",
         "naïve café — ünïcödé ✓ 日本語", "<|im_start|>user\nHi<|im_end|>\n", "it's 12 o'clock"]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return hf_from_gguf(AutoTokenizer, GGUF)


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


# ---- SentencePiece GGUFs (tokenizer model 'llama'): Gemma 3, Llama 1/2, TinyLlama ----------------

SHAKESPEARE = Path(__file__).resolve().parent / "data/tinyshakespeare.txt"
SPM_TEXTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog.",
             "  two leading spaces", "trailing spaces   ", "many     spaces  between",
             "new\nlines\n\n\nand\ttabs\t\t", "digits 0123456789 3.14159 1,000,000",
             "odd: !? ...; (x) [y] {z} \"q\" 'single' #@$%^&*",
             "naïve café — ünïcödé ✓ Ångström", "日本語のテキスト 中文 한국어", "emoji 😀🦙👍🏽 and 𝔹",
             "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
             "<table><tr><td>x</td></tr></table>", "<bos>", "", " ", "\n"]


@pytest.fixture(scope="module")
def gemma_gguf(gemma3_gguf):
    return gemma3_gguf


@pytest.fixture(scope="module")
def gemma_hf(gemma3_hf_tokenizer):
    return gemma3_hf_tokenizer


@pytest.fixture(scope="module")
def gemma(gemma_gguf):
    return jaxkv.load_tokenizer(gemma_gguf)


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_gemma_gguf_matches_transformers(gemma, gemma_hf, text):
    assert gemma.encode(text).ids == gemma_hf(text).input_ids  # with <bos>
    ids = gemma.encode(text, add_special_tokens=False).ids
    assert ids == gemma_hf(text, add_special_tokens=False).input_ids
    assert gemma.decode(ids, skip_special_tokens=False) == text


def test_gemma_gguf_shakespeare(gemma, gemma_hf):
    text = SHAKESPEARE.read_text()[:2000]
    ids = gemma.encode(text).ids
    assert ids == gemma_hf(text).input_ids and len(ids) > 400
    assert gemma.decode(ids, skip_special_tokens=True) == text


def test_gemma_gguf_long_space_run(gemma):
    """Runs of spaces are Gemma's user-defined tokens (2 to 31 spaces), matched whole and longest
    first as llama.cpp does; transformers' GGUF reader merges them pairwise instead (16 + 24)."""
    ids = gemma.encode("x" + " " * 40 + "y", add_special_tokens=False).ids
    assert ids[1:3] == [gemma.token_to_id(" " * 31), gemma.token_to_id(" " * 9)]


def test_gemma_gguf_chat_template(gemma_gguf):
    assert jaxkv.chat_template(gemma_gguf) is None  # this file carries none


# A toy SentencePiece BPE vocabulary as Llama 2's GGUFs lay it out: <unk>, <s>, </s>, 256 byte
# tokens, merged pieces scored by merge order, then single characters.
TOY_PIECES = ["▁t", "he", "▁the", "in", "▁a", "er", "on", "▁w", "or", "ld", "▁wor", "▁world", "ll",
              "▁h", "▁he", "▁hell", "▁hello", "an", "▁an", "▁and", "is", "▁is", "▁i", "ing", "▁th",
              "▁▁", *"▁ehtlonwrdaisg,.!"]
TOY_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def toy_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("toy") / "toy.gguf")
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *TOY_PIECES, "<tool>"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(TOY_PIECES))] + [0.0])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(TOY_PIECES) + [4])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(TOY_TEMPLATE)
    for add, value in ((writer.add_context_length, 64), (writer.add_embedding_length, 8),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count, 2), (writer.add_layer_norm_rms_eps, 1e-6)):
        add(value)  # transformers reads a config before the tokenizer
    finish_gguf(writer)
    return path


@pytest.fixture(scope="module")
def toy_hf(toy_gguf):
    return AutoTokenizer.from_pretrained(os.path.dirname(toy_gguf),
                                         gguf_file=os.path.basename(toy_gguf))


@pytest.mark.parametrize("text", ["hello world", "the thing and this is it", "hello  world ",
                                  "Héllo 日本\n\tx", ""])
def test_toy_spm_gguf_matches_transformers(toy_gguf, toy_hf, text):
    ours = jaxkv.load_tokenizer(toy_gguf)
    assert ours.encode(text).ids == toy_hf(text).input_ids  # <s> added: the file does not say
    assert ours.decode(ours.encode(text).ids, skip_special_tokens=True) == text


def test_toy_spm_gguf_space_prefix(toy_gguf):
    """With add_space_prefix (the default), llama.cpp puts a space before the text and before the
    text after each added token, even where one is there already. transformers' GGUF reader does
    neither: it gives ['▁▁', 'l', ...] for '  lead', which decodes to ' lead'."""
    ours = jaxkv.load_tokenizer(toy_gguf)
    assert ours.encode("  lead").tokens == ["<s>", "▁▁", "▁", "l", "e", "a", "d"]
    assert ours.decode(ours.encode("  lead").ids) == "  lead"
    assert ours.encode("a<tool>the</s>").tokens == ["<s>", "▁a", "<tool>", "▁the", "</s>"]
    assert ours.encode("<unk>a").tokens == ["<s>", "<unk>", "▁a"]
    assert ours.encode("<s>", add_special_tokens=False).tokens == ["<s>"]


def test_toy_spm_gguf_chat_template(toy_gguf):
    assert jaxkv.chat_template(toy_gguf) == TOY_TEMPLATE


def test_broken_chat_template_names_its_file(tmp_path):
    """A template that does not parse is one ValueError naming the file and Jinja's message."""
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: the chat template does not "
                                         r"parse: .*\(line 1\)"):
        jaxkv.chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{% if %}"}')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: the chat template does not"):
        jaxkv.chat_template(tmp_path)


@pytest.mark.parametrize("messages, error, words", [
    ("Hi", TypeError, 'messages must be a list of {"role": ..., "content": ...} dicts, got str'),
    ([{"role": "user"}], ValueError, 'messages[0] must be a dict with "role" (a string) and '
                                     '"content", got {\'role\': \'user\'}'),
    ([{"role": "user", "content": "Hi"}, "Hi"], ValueError, "messages[1] must be a dict"),
])
def test_apply_chat_template_checks_messages(messages, error, words):
    with pytest.raises(error) as info:
        jaxkv.apply_chat_template(TOY_TEMPLATE, messages)
    assert words in str(info.value)


def test_template_failing_as_it_renders_is_a_value_error():
    with pytest.raises(ValueError, match="the chat template failed: 'nothing' is undefined"):
        jaxkv.apply_chat_template("{{ nothing.here }}", [{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="chat template: no system role"):
        jaxkv.apply_chat_template("{{ raise_exception('no system role') }}", [])
    with pytest.raises(TypeError, match="template must be a Jinja chat template"):
        jaxkv.apply_chat_template(None, [])
