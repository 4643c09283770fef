"""load: parameters from whichever format a path holds (Hugging Face, GGUF, CTranslate2,
jaxkv.save), or from a model name in the local Hugging Face cache.

A file that cannot be read as what it claims to be is a CheckpointError naming the file and
what is wrong, never a parser's traceback.
"""

import glob
import os

from jaxkv import ops
from jaxkv.core import checks, quant
from jaxkv.core.params import Params
from jaxkv.core.sharding import check_mesh, shard_params
from jaxkv.formats import locate
from jaxkv.formats.common import holds
from jaxkv.formats.ct2 import load_ct2_whisper
from jaxkv.formats.gguf import load_gguf
from jaxkv.formats.hf import load_hf
from jaxkv.formats.saved import MANIFEST, SAVED_CONFIG, load_saved


def load(path, dtype=None, int8=False, mesh=None) -> Params:
    """Params from a Hugging Face directory (config.json + *.safetensors: GPT-2, Llama, Qwen2,
    Qwen3, Mistral, Gemma 2, Gemma 3 (text), T5, Whisper), a .gguf file (llama, qwen2, qwen3,
    gemma2, gemma3), a CTranslate2 Whisper directory, a jaxkv.save directory, or a model name
    in the local Hugging Face cache (see jaxkv.formats.locate.resolve; nothing is downloaded).

    dtype: what floating weights become (float32, bfloat16 or float16); by default float32 for
    foreign formats and the saved dtype (bitwise as saved) for jaxkv's own.
    int8: every decoder matrix int8 (jaxkv.Int8), read as int8 where a GGUF holds it as Q8_0
    (one scale per 32 inputs, no float copy made), quantized with one scale per row otherwise
    (jaxkv.quantize) -- so the result is an all-int8 model whatever the file holds.
    A jaxkv.save directory is checked against its manifest first (see load_saved); a file that
    is damaged or malformed is a CheckpointError naming it.
    mesh (jaxkv.make_mesh; it may span processes, every one calling load): the params laid out
    on it (heads, MLP width and vocabulary over its model axis), each process reading from a
    Hugging Face directory or a jaxkv.save only its devices' shares (the others' formats are
    read whole, then placed).
    """
    path = locate.resolve(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load: {path!r} does not exist")
    if dtype is not None:
        checks.float_dtype(dtype, "load: dtype")
    if not isinstance(int8, bool):
        raise TypeError(f"load: int8 must be True or False, got {int8!r}")
    if check_mesh(mesh) is not None and int8:
        raise ValueError("load: int8 with a mesh is not supported; load the float model on "
                         "the mesh, or int8 on one process")
    gguf = os.path.isfile(path) and path.endswith(".gguf")
    params = load_gguf(path, dtype, int8) if gguf else _load_other(path, dtype, mesh)
    if mesh is not None:
        return shard_params(params, mesh)
    return quant.quantize(params) if int8 and not gguf else ops.placed(params)


def _load_other(path: str, dtype=None, mesh=None) -> Params:
    """load's formats other than GGUF."""
    if any(holds(path, name) for name in (SAVED_CONFIG, MANIFEST)):
        return load_saved(path, dtype, mesh)
    if holds(path, "model.bin") and not glob.glob(os.path.join(path, "*.safetensors")):
        return load_ct2_whisper(path, dtype)
    if holds(path, "config.json"):
        return load_hf(path, dtype, mesh)
    raise FileNotFoundError(f"load: {path!r} is neither a .gguf file nor a directory holding "
                            f"config.json (Hugging Face), model.bin (CTranslate2 Whisper) or "
                            f"{SAVED_CONFIG} (jaxkv.save)")
