"""Damaged or malformed checkpoints are errors that name the file and what is wrong; what
transformers accepts (ids outside the vocabulary, omitted optional keys) loads."""

import dataclasses
import json
import os
import shutil
import struct
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

import jaxkv
from jaxkv.formats.saved import MANIFEST, SAVED_CONFIG
from jaxkv.models import llama
from jaxkv.models.maps import CheckpointError, tensor_shapes
from tests.conftest import CONFIGS, edited_copy, finish_gguf, random_tokens


def tiny_tokenizer():
    return Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory, gpt2):
    path = tmp_path_factory.mktemp("saved") / "model"
    jaxkv.save(gpt2, path, tokenizer=tiny_tokenizer(), chat_template="{{ messages }}")
    return path


@pytest.fixture
def saved(saved_once, tmp_path):
    """A fresh copy of a jaxkv.save directory (GPT-2, with a tokenizer) to damage."""
    return shutil.copytree(saved_once, tmp_path / "model")


def largest_orbax_file(path):
    files = [os.path.join(root, f) for root, _, names in os.walk(path / "params") for f in names]
    return max(files, key=os.path.getsize)


def flip_byte(file, at=None):
    data = bytearray(open(file, "rb").read())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0xFF
    open(file, "wb").write(bytes(data))


def truncate(file, keep):
    data = open(file, "rb").read()
    open(file, "wb").write(data[:keep] if keep >= 0 else data[:len(data) + keep])


# ---- jaxkv.save directories: the manifest -------------------------------------------------

def test_save_writes_a_manifest_that_load_verifies_silently(saved, gpt2):
    files = json.loads((saved / MANIFEST).read_text())["files"]
    assert {SAVED_CONFIG, "tokenizer.json", "params/_METADATA"} <= set(files)
    assert all(len(entry["sha256"]) == 64 for entry in files.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = jaxkv.load(saved)
    jax.tree.map(np.testing.assert_array_equal, loaded, gpt2)


def test_flipped_byte_in_an_orbax_file_is_named(saved):
    file = largest_orbax_file(saved)
    flip_byte(file)
    name = os.path.relpath(file, saved)
    with pytest.raises(CheckpointError, match=f"{name}: sha256 mismatch: the file changed since "
                                              "jaxkv.save wrote it"):
        jaxkv.load(saved)


def test_truncated_orbax_file_is_named(saved):
    file = largest_orbax_file(saved)
    size = os.path.getsize(file)
    truncate(file, -100)
    name = os.path.relpath(file, saved)
    with pytest.raises(CheckpointError, match=f"{name}: {size - 100} bytes, expected {size}"):
        jaxkv.load(saved)


def test_truncated_orbax_file_of_a_save_without_manifest_names_the_leaf(saved):
    """Without the manifest, tensorstore's byte-range error named no file."""
    os.remove(saved / MANIFEST)
    truncate(largest_orbax_file(saved), 100)
    with pytest.warns(UserWarning, match="unverified"), pytest.raises(
            CheckpointError, match=f"{saved / 'params'}: leaf [a-z_.0-9]+ cannot be read: the "
                                   "save looks truncated or corrupt"):
        jaxkv.load(saved)


@pytest.mark.parametrize("name", ["params/_METADATA", SAVED_CONFIG])
def test_deleted_file_is_named(saved, name):
    os.remove(saved / name)
    with pytest.raises(CheckpointError, match=f"{name}: missing"):
        jaxkv.load(saved)


def test_edited_config_is_named(saved):
    text = (saved / SAVED_CONFIG).read_text()
    (saved / SAVED_CONFIG).write_text(text.replace('"n_layers": 3', '"n_layers": 2'))
    with pytest.raises(CheckpointError, match=f"{SAVED_CONFIG}: sha256 mismatch"):
        jaxkv.load(saved)


def test_extra_file_is_ignored(saved, gpt2):
    (saved / "notes.txt").write_text("mine")
    jax.tree.map(np.testing.assert_array_equal, jaxkv.load(saved), gpt2)


def test_directory_without_manifest_loads_with_a_warning(saved, gpt2):
    os.remove(saved / MANIFEST)
    with pytest.warns(UserWarning, match="unverified"):
        loaded = jaxkv.load(saved)
    jax.tree.map(np.testing.assert_array_equal, loaded, gpt2)


def test_corrupt_manifest_is_named(saved):
    truncate(saved / MANIFEST, 50)
    with pytest.raises(CheckpointError, match=f"{MANIFEST}: not valid JSON"):
        jaxkv.load(saved)


def test_load_tokenizer_verifies_a_saved_tokenizer(saved):
    assert jaxkv.load_tokenizer(saved).token_to_id("b") == 1
    flip_byte(saved / "tokenizer.json", at=5)
    with pytest.raises(CheckpointError, match="tokenizer.json: sha256 mismatch"):
        jaxkv.load_tokenizer(saved)


def test_chat_template_verifies_the_saved_config(saved):
    assert jaxkv.chat_template(saved) == "{{ messages }}"
    flip_byte(saved / SAVED_CONFIG, at=3)
    with pytest.raises(CheckpointError, match=f"{SAVED_CONFIG}: sha256 mismatch"):
        jaxkv.chat_template(saved)


# ---- Hugging Face directories -------------------------------------------------------------

def copy_hf(hf_models, name, tmp_path):
    return shutil.copytree(hf_models[name][1], tmp_path / name)


def edit_config(path, drop=(), **changes):
    """Rewrites path/config.json without the keys in drop, with changes."""
    config = json.loads((path / "config.json").read_text())
    config = {k: v for k, v in {**config, **changes}.items() if k not in drop}
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage", [lambda f: truncate(f, -100), lambda f: truncate(f, 20),
                                    lambda f: open(f, "wb").write(os.urandom(4096))],
                         ids=["truncated_data", "truncated_header", "garbage"])
def test_bad_safetensors_is_named(hf_models, tmp_path, damage):
    path = copy_hf(hf_models, "gpt2", tmp_path)
    damage(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors: not a valid safetensors file"):
        jaxkv.load(path)


def test_config_that_is_not_json_names_the_position(hf_models, tmp_path):
    path = copy_hf(hf_models, "gpt2", tmp_path)
    truncate(path / "config.json", 40)
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON: .* line \d+ column "
                                              r"\d+ \(char \d+\)"):
        jaxkv.load(path)


@pytest.mark.parametrize("name, key", [("gpt2", "vocab_size"), ("gpt2", "n_embd"),
                                       ("llama_gqa", "hidden_size"), ("t5_relu", "d_model")])
def test_config_lacking_a_required_key_names_it(hf_models, tmp_path, name, key):
    path = copy_hf(hf_models, name, tmp_path)
    edit_config(path, drop=[key])
    with pytest.raises(CheckpointError, match=f"config.json: required key '{key}' is missing"):
        jaxkv.load(path)


def test_config_with_a_null_count_names_the_file(hf_models, tmp_path):
    path = copy_hf(hf_models, "gpt2", tmp_path)
    edit_config(path, n_layer=None)
    with pytest.raises(CheckpointError, match="config.json: Config.n_layers must be a positive"):
        jaxkv.load(path)


@pytest.mark.parametrize("name, omitted", [
    ("gpt2", ["n_inner", "activation_function", "layer_norm_epsilon"]),
    ("llama_gqa", ["rms_norm_eps", "hidden_act", "head_dim", "attention_bias", "mlp_bias",
                   "rope_theta", "rope_parameters", "tie_word_embeddings"]),
])
def test_omitted_optional_keys_take_transformers_defaults(hf_models, tmp_path, name, omitted):
    path = copy_hf(hf_models, name, tmp_path)
    edit_config(path, drop=omitted)
    reference = jaxkv.load(hf_models[name][1])
    loaded = jaxkv.load(path)
    assert loaded.config == reference.config
    jax.tree.map(np.testing.assert_array_equal, loaded, reference)


def test_hf_gpt2_with_default_ids_outside_a_small_vocabulary_loads(tmp_path):
    """GPT2Config(vocab_size=97) keeps transformers' bos/eos 50256; transformers loads it."""
    import transformers

    config = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning) as caught:
        params = jaxkv.load(tmp_path)
    for key in ("bos_token_id", "eos_token_id"):
        assert any(f"{key} 50256 is outside the vocabulary (vocab_size 97)" in str(w.message)
                   for w in caught)
    assert params.config.bos_id is None and params.config.eos_id is None
    tokens_BT = np.asarray(random_tokens(0, (1, 8)))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens_BT)).logits.numpy()
    np.testing.assert_allclose(jaxkv.forward(params, tokens_BT), theirs, atol=1e-4, rtol=0)


def test_user_config_with_a_negative_id_is_still_an_error():
    with pytest.raises(ValueError, match=r"eos_id must be in \[0, 97\), got -1"):
        jaxkv.Config.gpt2(n_heads=4, vocab_size=97, d_model=64, n_layers=1, max_seq_len=8,
                          eos_id=-1)


def test_truncated_tokenizer_json_is_named(tmp_path):
    tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    truncate(tmp_path / "tokenizer.json", 30)
    with pytest.raises(CheckpointError, match="tokenizer.json: not a valid tokenizer.json"):
        jaxkv.load_tokenizer(tmp_path)


# ---- GGUF ---------------------------------------------------------------------------------

GGUF_METADATA = {"block_count": 3, "context_length": 128, "embedding_length": 64,
                 "feed_forward_length": 96, "head_count": 4, "head_count_kv": 2,
                 "layer_norm_rms_eps": 1e-5, "vocab_size": 97}


def write_tiny_gguf(path, omit=(), edit=None):
    """A llama GGUF for CONFIGS['llama_gqa'] with random float32 weights; edit(writer), if
    given, adds to it."""
    import gguf

    config, rng = CONFIGS["llama_gqa"], np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in GGUF_METADATA.items():
        if key not in omit:
            getattr(writer, f"add_{key}")(value)
    for name, shape in tensor_shapes(config, llama.gguf_map(config)).items():
        writer.add_tensor(name, rng.normal(size=shape).astype(np.float32))
    finish_gguf(writer, edit)
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_tiny_gguf_loads(tiny_gguf):
    config = jaxkv.load(tiny_gguf).config
    assert dataclasses.replace(config, norm_eps=1e-5) == CONFIGS["llama_gqa"]


@pytest.mark.parametrize("keep", [0, 1000, -10])
def test_truncated_gguf_is_named(tiny_gguf, tmp_path, keep):
    path = shutil.copy(tiny_gguf, tmp_path / "cut.gguf")
    truncate(path, keep)
    with pytest.raises(CheckpointError, match="cut.gguf: not a valid GGUF file"):
        jaxkv.load(path)


def test_garbage_gguf_is_named(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + os.urandom(2000))
    with pytest.raises(CheckpointError, match="junk.gguf: not a valid GGUF file"):
        jaxkv.load(path)


@pytest.mark.parametrize("key", ["block_count", "embedding_length", "feed_forward_length"])
def test_gguf_lacking_required_metadata_names_the_key(tmp_path, key):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", omit=(key,))
    with pytest.raises(CheckpointError, match=f"lacks the required key 'llama.{key}'"):
        jaxkv.load(path)


# ---- CTranslate2 --------------------------------------------------------------------------

def ct2_bytes(variables: dict, spec="WhisperSpec") -> bytes:
    """A CTranslate2 model.bin (format 6) holding float32 variables and no aliases."""
    def string(text):
        raw = text.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    out = struct.pack("<I", 6) + string(spec) + struct.pack("<II", 1, len(variables))
    for name, array in variables.items():
        out += string(name) + struct.pack(f"<B{array.ndim}I", array.ndim, *array.shape)
        out += struct.pack("<BI", 0, array.nbytes) + array.astype("<f4").tobytes()
    return out + struct.pack("<I", 0)


@pytest.mark.parametrize("keep, what, needs, offset", [
    (2, "the format version", 4, 0),
    (12, "the spec name", 12, 6),
    (-10, "variable 'decoder/embeddings/weight'", 97 * 8 * 4, None),
])
def test_truncated_ct2_model_says_what_needs_how_many_bytes(tmp_path, keep, what, needs, offset):
    full = ct2_bytes({"decoder/embeddings/weight": np.zeros((97, 8), np.float32)})
    offset = len(full) - 4 - needs if offset is None else offset
    cut = full[:keep] if keep >= 0 else full[:len(full) + keep]
    (tmp_path / "model.bin").write_bytes(cut)
    with pytest.raises(CheckpointError, match=f"model.bin: truncated: {what} needs {needs} bytes "
                                              f"at offset {offset}, file has {len(cut)}"):
        jaxkv.load(tmp_path)


# ---- load's arguments ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.int8, "int32", "bogus"])
def test_non_float_dtype_is_an_error(saved_once, dtype):
    with pytest.raises(ValueError, match=r"dtype must be a float dtype \(float32, bfloat16, "
                                         r"float16\), got"):
        jaxkv.load(saved_once, dtype=dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, "bfloat16", jnp.float16])
def test_float_dtypes_are_accepted(saved_once, dtype):
    assert jaxkv.load(saved_once, dtype=dtype).embed.dtype == jnp.dtype(dtype)


def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
        jaxkv.load(tmp_path / "nowhere")


def test_tensors_the_config_does_not_use_are_named(hf_models, tmp_path):
    """A config.json of 2 layers over a checkpoint of 3 loaded 2 and dropped the third."""
    path = edited_copy(hf_models["llama_gqa"][1], tmp_path, num_hidden_layers=2)
    with pytest.raises(CheckpointError, match=r"tensor\(s\) this config does not use, e\.g\. "
                                              r"'model\.layers\.2\."):
        jaxkv.load(path)


def test_save_replaces_an_earlier_save_whole_and_refuses_other_files(gpt2, llama, tmp_path):
    """A save over another model's leaves none of it (its tokenizer loaded with the new weights
    before); a directory of other files is refused, untouched."""
    from tests.conftest import char_tokenizer

    jaxkv.save(llama, tmp_path / "model", tokenizer=char_tokenizer(97))
    jaxkv.save(gpt2, tmp_path / "model")
    assert not (tmp_path / "model" / "tokenizer.json").exists()
    assert jaxkv.load(tmp_path / "model").config == gpt2.config
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=r"save: .*mine holds other files \(notes\.txt\)"):
        jaxkv.save(gpt2, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_safetensors_name_that_is_a_directory_is_named(hf_models, tmp_path):
    path = shutil.copytree(hf_models["gpt2"][1], tmp_path / "gpt2")
    (path / "model-extra.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"model-extra\.safetensors: not a file"):
        jaxkv.load(path)



@pytest.mark.parametrize("earlier", [True, False])
def test_a_save_that_fails_midway_leaves_the_earlier_one_loadable(gpt2, llama, tmp_path,
                                                                  monkeypatch, earlier):
    """The disk fills after the params are written: the earlier save still loads (it was
    deleted first before), or a new path is left as it was; nothing half-written stays."""
    from jaxkv.formats import saved

    if earlier:
        jaxkv.save(gpt2, tmp_path / "model")

    def disk_full(path, names):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(saved, "_write_manifest", disk_full)
    with pytest.raises(OSError, match="save: could not write .*model: .*No space left.*"
                       + ("; the earlier save there is as it was" if earlier else "")):
        jaxkv.save(llama, tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["model"] if earlier else [])
    if earlier:
        jax.tree.map(np.testing.assert_array_equal, jaxkv.load(tmp_path / "model"), gpt2)


SAVE_INTO = """
import errno, os, sys
import jax, jaxkv
from tests.conftest import CONFIGS
folder = sys.argv[1]
if os.geteuid() == 0:  # root writes into a 0o500 folder: refuse as a read-only one would
    mkdir = os.mkdir
    def refused(path, *args, **kwargs):
        if os.path.abspath(path).startswith(folder + os.sep):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return mkdir(path, *args, **kwargs)
    os.mkdir = refused
try:
    jaxkv.save(jaxkv.init_params(CONFIGS["gpt2"], jax.random.key(0)), folder)
except OSError as e:
    print(e)
"""


def test_a_save_into_a_read_only_folder_is_refused_and_the_process_exits(tmp_path):
    """Orbax's asynchronous checkpointer left threads waiting: the process never exited."""
    import subprocess
    import sys

    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", SAVE_INTO, str(folder)], cwd=root,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"save: could not write {folder}" in done.stdout, done.stdout
    assert "Permission denied" in done.stdout, done.stdout


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json"])
def test_a_file_that_is_a_directory_is_named(hf_models, tmp_path, name):
    """Such a config.json or tokenizer.json was reported missing."""
    from jaxkv.formats.tokenizer import load_tokenizer

    path = shutil.copytree(hf_models["gpt2"][1], tmp_path / "gpt2")
    if (path / name).exists():
        os.remove(path / name)
    (path / name).mkdir()
    with pytest.raises(CheckpointError, match=f"{name}: is a directory; expected the file"):
        load_tokenizer(path) if name == "tokenizer.json" else jaxkv.load(path)
