"""Loading and saving parameters: Hugging Face directories, GGUF files, CTranslate2 Whisper,
jaxkv's own format (orbax + a sha256 manifest).

A file that cannot be read as what it claims to be is a CheckpointError naming the file and
what is wrong, never a parser's traceback.
"""

import functools
import glob
import hashlib
import json
import math
import os
import struct
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxkv import checks, convert, locate, models, pages, quant
from jaxkv.config import Config
from jaxkv.convert import CheckpointError
from jaxkv.models.common import gguf_field, gguf_required  # noqa: F401 - jaxkv.tokenizer's
from jaxkv.params import Params, init_params

SAVED_CONFIG = "jaxkv_config.json"
MANIFEST = "jaxkv_manifest.json"


def load(path, dtype=None, int8=False) -> Params:
    """Params from a Hugging Face directory (config.json + *.safetensors: GPT-2, Llama, Qwen2,
    Qwen3, Mistral, Gemma 2, Gemma 3 (text), T5, Whisper), a .gguf file (llama, qwen2, qwen3,
    gemma2, gemma3), a CTranslate2 Whisper directory, a jaxkv.save directory, or a model name in the local Hugging Face cache (see
    jaxkv.locate.resolve; nothing is downloaded).

    dtype: what floating weights become (float32, bfloat16 or float16); by default float32 for
    foreign formats and the saved dtype (bitwise as saved) for jaxkv's own.
    int8: every decoder matrix int8 (jaxkv.Int8), read as int8 where a GGUF holds it as Q8_0
    (one scale per 32 inputs, no float copy made), quantized with one scale per row otherwise
    (jaxkv.quantize) -- so the result is an all-int8 model whatever the file holds.
    A jaxkv.save directory is checked against its manifest first (see load_saved); a file that
    is damaged or malformed is a CheckpointError naming it.
    """
    path = locate.resolve(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load: {path!r} does not exist")
    if dtype is not None:
        checks.float_dtype(dtype, "load: dtype")
    if not isinstance(int8, bool):
        raise TypeError(f"load: int8 must be True or False, got {int8!r}")
    if os.path.isfile(path) and path.endswith(".gguf"):
        return pages.huge_pages(load_gguf(path, dtype, int8))
    params = _load_other(path, dtype)
    return quant.quantize(params) if int8 else pages.huge_pages(params)


def _load_other(path: str, dtype=None) -> Params:
    """load's formats other than GGUF."""
    if any(os.path.isfile(os.path.join(path, name)) for name in (SAVED_CONFIG, MANIFEST)):
        return load_saved(path, dtype)
    if os.path.isfile(os.path.join(path, "model.bin")) and not glob.glob(
            os.path.join(path, "*.safetensors")):
        return load_ct2_whisper(path, dtype)
    if os.path.isfile(os.path.join(path, "config.json")):
        return load_hf(path, dtype)
    raise FileNotFoundError(f"load: {path!r} is neither a .gguf file nor a directory holding "
                            f"config.json (Hugging Face), model.bin (CTranslate2 Whisper) or "
                            f"{SAVED_CONFIG} (jaxkv.save)")


def read_json(file: str) -> dict:
    """A JSON object from file; anything else is a CheckpointError naming the file and where."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def _parse_error(file: str, what: str, error: Exception) -> CheckpointError:
    """The CheckpointError for a file a third-party parser rejected (its message kept)."""
    return CheckpointError(f"{file}: not a valid {what} (truncated or corrupt?): "
                           f"{type(error).__name__}: {error}")


# ---- Hugging Face -------------------------------------------------------------------------

def hf_family(hf: dict, source: str = "config.json") -> models.Family:
    """The family reader of a Hugging Face config.json dict's architecture."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in models.HF_ARCHITECTURES:
        raise CheckpointError(f"{source}: architecture {arch!r} is not supported; expected one of "
                              f"{', '.join(models.HF_ARCHITECTURES)}")
    return models.HF_ARCHITECTURES[arch]


def config_from_hf(hf: dict, source: str = "config.json", tensor_names=()) -> Config:
    """Our Config from a Hugging Face config.json dict (tensor_names: the checkpoint's, which
    say whether T5's head is tied)."""
    family = hf_family(hf, source)
    return _build_config(lambda: family.config(hf, source, tensor_names), source)


def _build_config(make, source: str) -> Config:
    """make(); Config's own validation errors (a zero width, a null count, a string where a
    number belongs) become CheckpointErrors naming the file they came from."""
    try:
        return make()
    except CheckpointError:
        raise
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def load_hf(directory: str, dtype=None) -> Params:
    config_path = os.path.join(directory, "config.json")
    hf = read_json(config_path)
    generation_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation_path):
        hf["generation"] = read_json(generation_path)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights found")
    tensors = _safetensors_index(files)
    config = config_from_hf(hf, config_path, tensors)
    name_map = hf_family(hf, config_path).name_map(config, tensors)
    return convert.build_params(config, name_map, lambda name: _read(tensors, name), directory,
                                dtype or jnp.float32)


def _safetensors_index(files):
    """{tensor name: open file} over one or several safetensors shards."""
    from safetensors import SafetensorError, safe_open

    index = {}
    for file in files:
        try:
            handle = safe_open(file, framework="flax")  # flax: bfloat16 tensors load too
        except SafetensorError as e:
            raise _parse_error(file, "safetensors file", e) from None
        index.update({name: handle for name in handle.keys()})
    return index


def _read(tensors, name):
    handle = tensors.get(name)
    return None if handle is None else np.asarray(handle.get_tensor(name), np.float32)


# ---- CTranslate2 (Whisper) ----------------------------------------------------------------

CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
CT2_VERSIONS = (5, 6)


class _ByteReader:
    """Reads a binary file front to back; a read past its end is a CheckpointError saying what
    needed how many bytes where."""

    def __init__(self, path: str):
        self.path, self.size, self.offset = path, os.path.getsize(path), 0
        self.data = np.memmap(path, np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)

    def span(self, n: int, what: str) -> int:
        """The offset of the next n bytes, which are then passed over."""
        if self.offset + n > self.size:
            raise CheckpointError(f"{self.path}: truncated: {what} needs {n} bytes at offset "
                                  f"{self.offset}, file has {self.size}")
        self.offset += n
        return self.offset - n

    def take(self, fmt: str, what: str):
        values = struct.unpack_from(fmt, self.data, self.span(struct.calcsize(fmt), what))
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> str:
        """A length-prefixed (uint16), NUL-terminated UTF-8 string."""
        start = self.span(self.take("<H", what), what)
        try:
            return bytes(self.data[start:self.offset]).rstrip(b"\0").decode()
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: {what} at offset {start} is not UTF-8 text") \
                from None

    def array(self, dtype, shape: tuple, what: str) -> np.ndarray:
        count = math.prod(shape)
        start = self.span(count * np.dtype(dtype).itemsize, what)
        return np.frombuffer(self.data, dtype, count, start).reshape(shape)


def read_ct2(path: str) -> dict:
    """{variable name: numpy array} from a CTranslate2 model.bin (format version 6), aliases
    resolved."""
    reader = _ByteReader(path)
    version = reader.take("<I", "the format version")
    if version not in CT2_VERSIONS:
        raise CheckpointError(f"{path}: CTranslate2 model format {version} is not supported; "
                              f"expected one of {CT2_VERSIONS}")
    spec, _revision = reader.string("the spec name"), reader.take("<I", "the spec revision")
    variables = {"__spec__": spec}
    variables.update(_ct2_variable(reader) for _ in range(reader.take("<I", "the variable count")))
    for _ in range(reader.take("<I", "the alias count")):
        alias, target = reader.string("an alias"), reader.string("an alias target")
        if target not in variables:
            raise CheckpointError(f"{path}: alias {alias!r} names {target!r}, which the file "
                                  "does not hold")
        variables[alias] = variables[target]
    return variables


def _ct2_variable(reader: _ByteReader) -> tuple:
    """(name, array): name, rank (uint8), shape (uint32s), dtype code (uint8), byte count
    (uint32), data."""
    name = reader.string("a variable name")
    what = f"variable {name!r}"
    shape = tuple(reader.take("<I", what) for _ in range(reader.take("<B", what)))
    code, nbytes = reader.take("<B", what), reader.take("<I", what)
    if code not in CT2_DTYPES:
        raise CheckpointError(f"{reader.path}: {what} has unsupported dtype code {code}")
    expected = math.prod(shape) * np.dtype(CT2_DTYPES[code]).itemsize
    if nbytes != expected:
        raise CheckpointError(f"{reader.path}: {what} of shape {shape} and dtype "
                              f"{np.dtype(CT2_DTYPES[code])} takes {expected} bytes, but the "
                              f"file says {nbytes}")
    return name, reader.array(CT2_DTYPES[code], shape, what)


def load_ct2_whisper(directory: str, dtype=None) -> Params:
    """A CTranslate2 Whisper directory (model.bin, config.json, tokenizer.json)."""
    from jaxkv.tokenizer import read_tokenizer  # tokenizer imports this module

    source = os.path.join(directory, "model.bin")
    variables = read_ct2(source)
    family = models.CT2_SPECS.get(variables["__spec__"])
    if family is None:
        raise CheckpointError(f"{source}: CTranslate2 spec {variables['__spec__']!r} is not "
                              f"supported; expected {' or '.join(map(repr, models.CT2_SPECS))}")
    ct2_config = read_json(os.path.join(directory, "config.json"))
    tokenizer = read_tokenizer(os.path.join(directory, "tokenizer.json"))
    config = _build_config(lambda: family.config(variables, ct2_config, tokenizer, source),
                           source)
    return convert.build_params(config, family.name_map(config, set(variables)), variables.get,
                                source, dtype or jnp.float32)


# ---- GGUF ---------------------------------------------------------------------------------

@functools.cache
def _reader_class():
    """gguf.GGUFReader reading a plain ndarray view of its memmap. The reader slices its data a
    few times per metadata item (millions of slices for Gemma 3's 262,144-token vocabulary), and
    numpy's memmap subclass costs microseconds a slice: Gemma 3 270M's file parses in 3.1 s
    instead of 10.5, SmolLM2's in 0.8 instead of 2.4 (AMD EPYC Zen 4)."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, memmap):
            self._plain = memmap.view(np.ndarray)

    return Reader


@functools.lru_cache(maxsize=4)
def _gguf_reader(path: str, mtime: float):
    try:
        return _reader_class()(path)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - the reader fails on bad bytes in many ways
        raise _parse_error(path, "GGUF file", e) from None


def gguf_reader(path: str):
    """A GGUFReader, kept for reuse: parsing a large vocabulary's metadata takes seconds, and
    weights, tokenizer and chat template all come from the same file."""
    path = os.path.abspath(path)
    return _gguf_reader(path, os.path.getmtime(path))


def gguf_family(reader, source: str) -> models.Family:
    """The family reader of a GGUF's general.architecture."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in models.GGUF_ARCHITECTURES:
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} is not supported; expected "
                              f"one of {', '.join(map(repr, models.GGUF_ARCHITECTURES))}")
    return models.GGUF_ARCHITECTURES[arch]


def config_from_gguf(reader, source: str) -> Config:
    family = gguf_family(reader, source)
    return _build_config(lambda: family.config(reader, source), source)


def load_gguf(path: str, dtype=None, int8=False) -> Params:
    """A GGUF of one of models.GGUF_ARCHITECTURES, dequantized with the gguf package; int8 (see
    load): Q8_0 matrices read straight from their blocks, every other matrix quantized per row."""
    import gguf

    reader = gguf_reader(path)
    config = config_from_gguf(reader, path)
    tensors = {t.name: t for t in reader.tensors}

    def get_tensor(name):
        t = tensors.get(name)
        if t is None:
            return None
        if int8 and t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and t.data.ndim == 2:
            return quant.from_q8_0(t.data)
        return gguf.dequantize(t.data, t.tensor_type)

    name_map = gguf_family(reader, path).name_map(config, set(tensors))
    return convert.build_params(config, name_map, get_tensor, path, dtype or jnp.float32, int8)


# ---- jaxkv's own format (orbax + manifest) ------------------------------------------------

def _flat(params):
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {convert.path_name(path): leaf for path, leaf in leaves}


def save(params: Params, path, tokenizer=None, chat_template: str | None = None) -> None:
    """Writes params (bitwise) with orbax, plus the config; optionally the tokenizer too. Last,
    MANIFEST: the size and sha256 of every file written, which load checks."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), _flat(params), force=True)
    meta = {"config": params.config.to_dict(), "dtype": str(params.dtype),
            "chat_template": chat_template}
    with open(os.path.join(path, SAVED_CONFIG), "w") as f:
        json.dump(meta, f, indent=2)
    written = [SAVED_CONFIG, *_files_under(path, "params")]
    if tokenizer is not None:
        tokenizer.save(os.path.join(path, "tokenizer.json"))
        written.append("tokenizer.json")
    _write_manifest(path, written)


def load_saved(path: str, dtype=None) -> Params:
    """Params written by save, bitwise as saved (dtype=None) or cast to dtype.

    Every file is first checked against the manifest save wrote: one missing, or whose size or
    sha256 differs, is a CheckpointError naming it (files the manifest does not list are
    ignored). A directory without a manifest (saved before jaxkv wrote one) loads with a
    warning that it is unverified."""
    path = os.path.abspath(path)
    verify_saved(path)
    source = os.path.join(path, SAVED_CONFIG)
    meta = read_json(source)
    config = _build_config(lambda: Config.from_dict(meta["config"]), source)
    skeleton = jax.eval_shape(lambda: init_params(config, jax.random.key(0),
                                                  jnp.dtype(meta["dtype"])))
    with ocp.StandardCheckpointer() as ckptr:
        flat = ckptr.restore(os.path.join(path, "params"), _flat(skeleton))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(skeleton)
    params = jax.tree_util.tree_unflatten(treedef, [flat[convert.path_name(p)] for p, _ in leaves])
    if dtype is not None and jnp.dtype(dtype) != params.dtype:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    return params


def _files_under(path: str, folder: str) -> list[str]:
    """Every file under path/folder, as '/'-separated paths relative to path."""
    found = []
    for root, _dirs, files in os.walk(os.path.join(path, folder)):
        found += [os.path.relpath(os.path.join(root, f), path).replace(os.sep, "/")
                  for f in files]
    return sorted(found)


def _sha256(file: str, chunk_bytes: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in chunks: checkpoints can be larger than memory."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(path: str, names: list[str]) -> None:
    """MANIFEST: {"files": {relative path: {"size": bytes, "sha256": hex}}}."""
    files = {}
    for name in names:
        file = os.path.join(path, *name.split("/"))
        files[name] = {"size": os.path.getsize(file), "sha256": _sha256(file)}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump({"format": "jaxkv-manifest-1", "files": files}, f, indent=1)


def _manifest_files(path: str) -> dict | None:
    """The manifest's {relative path: {"size", "sha256"}}, or None if path has no manifest."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        return None
    files = read_json(file).get("files")
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and {"size", "sha256"} <= e.keys() for e in files.values()):
        raise CheckpointError(f"{file}: not a jaxkv manifest (expected "
                              '{"files": {path: {"size": ..., "sha256": ...}}})')
    return files


def _file_problem(path: str, name: str, entry: dict) -> str | None:
    """What is wrong with path/name against its manifest entry, or None if nothing."""
    file = os.path.join(path, *name.split("/"))
    if not os.path.isfile(file):
        return f"{name}: missing"
    size = os.path.getsize(file)
    if size != entry["size"]:
        return (f"{name}: {size} bytes, expected {entry['size']}: the file changed since "
                "jaxkv.save wrote it")
    if _sha256(file) != entry["sha256"]:
        return f"{name}: sha256 mismatch: the file changed since jaxkv.save wrote it"
    return None


def _check_files(path: str, entries: dict) -> None:
    problems = [p for name in sorted(entries) if (p := _file_problem(path, name, entries[name]))]
    if problems:
        raise CheckpointError(f"{path}: jaxkv.save directory failed verification against "
                              f"{MANIFEST}: " + "; ".join(problems))


def verify_saved(path: str) -> None:
    """Checks every file a jaxkv.save directory's manifest lists (see load_saved); without a
    manifest, warns that the directory is unverified."""
    files = _manifest_files(path)
    if files is None:
        warnings.warn(f"{path}: no {MANIFEST} (saved by an older jaxkv?); loading it "
                      "unverified: corrupted files will not be detected")
        return
    _check_files(path, files)


def verify_saved_file(directory: str, name: str) -> None:
    """Checks one file of a jaxkv.save directory if its manifest lists it; anything else (a
    Hugging Face directory, a file the manifest does not list) passes unchecked."""
    files = _manifest_files(directory)
    if files is not None and name in files:
        _check_files(directory, {name: files[name]})
