"""jaxkv's own format: parameters written bitwise with orbax, the config beside them, and a
manifest of every file's size and sha256 that loading checks first."""

import contextlib
import hashlib
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jaxkv.core.config import Config
from jaxkv.core.params import (Params, cast, gate_up_block, path_name, regroup_gate_up,
                                skeleton)
from jaxkv.core.sharding import param_shardings
from jaxkv.formats.common import build_config, read_json
from jaxkv.models.maps import CheckpointError
from jaxkv.ops.arrays import Int8

SAVED_CONFIG = "jaxkv_config.json"
MANIFEST = "jaxkv_manifest.json"
# Each leaf is stored in chunks of at most this many bytes, so that a process reading its share
# decodes little more than the share (docs/design-notes.md, "Across processes").
CHUNK_BYTES = 1 << 20


def _flat(params):
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {path_name(path): leaf for path, leaf in leaves}


def save(params: Params, path, tokenizer=None, chat_template: str | None = None) -> None:
    """Writes params (bitwise, int8 matrices as int8) with orbax, plus the config; optionally
    the tokenizer too. Last, MANIFEST: the size and sha256 of every file written, which load
    checks. path must be new, empty, or an earlier save, which is replaced whole (never mixed
    with this one: its tokenizer does not stay beside these weights). An earlier save is
    replaced only once the new one is whole: it is written beside it (path + '.jaxkv-saving'),
    then renamed into place, so a save that fails midway (a full disk) leaves it loadable."""
    if not isinstance(params, Params):
        raise TypeError(f"save: params must be jaxkv Params (jaxkv.load, jaxkv.init_params), "
                        f"got {type(params).__name__}")
    path = os.path.abspath(os.fspath(path))
    earlier, made = _check_target(path), not os.path.exists(path)
    folder = path + ".jaxkv-saving" if earlier else path
    if earlier and os.path.exists(folder):
        shutil.rmtree(folder)  # what an interrupted save left
    try:
        os.makedirs(folder, exist_ok=True)
        _write(params, folder, tokenizer, chat_template)
        if earlier:
            _swap(folder, path)
    except (OSError, ValueError) as e:
        _undo(folder, whole=earlier or made)
        kept = "; the earlier save there is as it was" if earlier else ""
        raise OSError(f"save: could not write {path}: {e}{kept}") from e


def _write(params: Params, folder: str, tokenizer, chat_template: str | None) -> None:
    """save's files, in folder. Orbax's synchronous checkpointer: its asynchronous one leaves
    threads waiting forever (the process never exits) when it cannot create its folder."""
    flat = _flat(params)
    chunks = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), flat)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        ckptr.save(os.path.join(folder, "params"), args=ocp.args.StandardSave(flat, chunks),
                   force=True)
    meta = {"config": params.config.to_dict(), "dtype": str(params.dtype),
            "chat_template": chat_template,
            "gate_up_block": gate_up_block(params.config.d_ff), "int8": _int8_leaves(params)}
    with open(os.path.join(folder, SAVED_CONFIG), "w") as f:
        json.dump(meta, f, indent=2)
    written = [SAVED_CONFIG, *_files_under(folder, "params")]
    if tokenizer is not None:
        tokenizer.save(os.path.join(folder, "tokenizer.json"))
        written.append("tokenizer.json")
    _write_manifest(folder, written)


SAVED_ENTRIES = ("params", SAVED_CONFIG, MANIFEST, "tokenizer.json")  # what save writes


def _check_target(path: str) -> bool:
    """Whether path holds an earlier save (else it is new or an empty directory); a file, or
    a directory that holds anything else, is refused."""
    if not os.path.isdir(path):
        if os.path.exists(path):
            raise FileExistsError(f"save: {path} is a file; save into a directory")
        return False
    entries = os.listdir(path)
    others = sorted(set(entries) - set(SAVED_ENTRIES))
    if others:
        raise FileExistsError(f"save: {path} holds other files ({', '.join(others[:3])}"
                              f"{', ...' if len(others) > 3 else ''}); save into a new or empty "
                              "directory, or into an earlier jaxkv.save, which is replaced")
    return bool(entries)


def _swap(new: str, path: str) -> None:
    """The whole save in new takes path's place: path is renamed away, new renamed in, and
    only then the earlier save deleted (put back if new cannot be renamed in)."""
    old = path + ".jaxkv-replaced"
    if os.path.exists(old):
        shutil.rmtree(old)  # what an interrupted save left: older than path
    os.rename(path, old)
    try:
        os.rename(new, path)
    except OSError:
        os.rename(old, path)
        raise
    shutil.rmtree(old)


def _undo(folder: str, whole: bool) -> None:
    """After a failed save: folder removed (whole), or emptied (a directory that was empty);
    what cannot be removed stays (the save's own error says why)."""
    entries = [folder] if whole else [os.path.join(folder, e) for e in os.listdir(folder)]
    for full in entries:
        if os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif os.path.exists(full):
            with contextlib.suppress(OSError):
                os.remove(full)


def _int8_leaves(params: Params) -> dict:
    """{name: [scale shape, scale dtype]} of every Int8 matrix (jaxkv.quantize, GGUF's Q8_0)."""
    leaves = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, Int8))[0]
    return {path_name(p): [list(x.scale.shape), str(x.scale.dtype)] for p, x in leaves
            if isinstance(x, Int8)}


def _with_int8(shapes: Params, int8: dict) -> Params:
    """shapes (ShapeDtypeStruct leaves) with the matrices save found Int8 made Int8."""
    def one(path, x):
        if path_name(path) not in int8:
            return x
        scale, dtype = int8[path_name(path)]
        return Int8(jax.ShapeDtypeStruct(x.shape, jnp.int8),
                    jax.ShapeDtypeStruct(tuple(scale), jnp.dtype(dtype)))
    return jax.tree_util.tree_map_with_path(one, shapes)


def load_saved(path: str, dtype=None, mesh=None) -> Params:
    """Params written by save, bitwise as saved (dtype=None) or cast to dtype; mesh: each leaf
    laid out on it as jaxkv.sharding.param_shardings says, each process reading only its
    devices' shares (tensorstore reading the arrays orbax wrote, a region per share).

    Every file is first checked against the manifest save wrote: one missing, or whose size or
    sha256 differs, is a CheckpointError naming it (files the manifest does not list are
    ignored). A directory without a manifest (saved before jaxkv wrote one) loads with a
    warning that it is unverified."""
    path = os.path.abspath(path)
    verify_saved(path)
    source = os.path.join(path, SAVED_CONFIG)
    meta = read_json(source)
    config = build_config(lambda: Config.from_dict(meta["config"]), source)
    shapes = _with_int8(skeleton(config, jnp.dtype(meta["dtype"])), meta.get("int8", {}))
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # not where it was saved
    shardings = param_shardings(shapes, mesh) if mesh is not None else jax.tree.map(
        lambda _: here, shapes)
    shapes = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          shapes, shardings)
    flat = _restore(os.path.join(path, "params"), _flat(shapes))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    params = jax.tree_util.tree_unflatten(treedef, [flat[path_name(p)] for p, _ in leaves])
    # (saves before gate_up_block was written held gate and up rows one by one)
    params = regroup_gate_up(params, meta.get("gate_up_block", 1))
    if dtype is not None and jnp.dtype(dtype) != params.dtype:
        params = cast(params, dtype)
    return params


def _restore(folder: str, shapes: dict) -> dict:
    """Every leaf of the params orbax wrote, as shapes say (shape, dtype, sharding), each
    process reading only its devices' shares. Orbax writes each leaf as a zarr array in one OCDBT
    store, which tensorstore reads a region at a time; orbax's own restore stages what it reads
    (docs/design-notes.md). A store tensorstore cannot open as expected goes to orbax's restore,
    which names what is wrong."""
    try:
        stores = {name: _store(folder, name, shape) for name, shape in shapes.items()}
    except ValueError:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(folder, shapes)
    return {name: _read_leaf(folder, name, shape, stores[name]) for name, shape in shapes.items()}


def _read_leaf(folder: str, name: str, shape, store):
    """One leaf as shape says, from its store; one that tensorstore cannot read (a file cut
    short, a byte-range error naming no file) is a CheckpointError naming the folder and leaf."""
    try:
        return jax.make_array_from_callback(shape.shape, shape.sharding, _reader(store))
    except ValueError as e:
        raise CheckpointError(f"{folder}: leaf {name} cannot be read: the save looks truncated "
                              f"or corrupt (a file under {folder} cut short or changed; a save "
                              f"with its {MANIFEST} names the file): {e}") from None


def _reader(store):
    """index -> that region of store, read into a fresh 64-byte-aligned numpy array: a CPU
    device's buffer then is that array, not a copy of it."""
    def read(index):
        region = store[index]
        out = _aligned_empty(region.shape, region.dtype.numpy_dtype)
        ts.array(out, copy=False, write=True).write(region).result()
        return out
    return read


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _store(folder: str, name: str, shape):
    """The opened zarr array of one leaf; ValueError if it is not there as shape says."""
    spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{folder}",
                                          "path": name}}
    store = ts.open(spec, read=True).result()
    if tuple(store.shape) != tuple(shape.shape) or store.dtype.numpy_dtype != shape.dtype:
        raise ValueError(f"{name}: {store.shape} {store.dtype}, expected {shape}")
    return store


def _files_under(path: str, folder: str) -> list[str]:
    """Every file under path/folder, as '/'-separated paths relative to path."""
    found = []
    for root, _dirs, files in os.walk(os.path.join(path, folder)):
        found += [os.path.relpath(os.path.join(root, f), path).replace(os.sep, "/")
                  for f in files]
    return sorted(found)


def _sha256(file: str) -> str:
    """Hex sha256 of a file, read through a small buffer: checkpoints can be larger than
    memory, and loading a share must not hold much more than the share."""
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
