"""GGUF files (llama.cpp): metadata through each family's config reader, tensors dequantized
with the gguf package, or Q8_0 blocks kept as int8 (from_q8_0)."""

import functools
import os

import jax.numpy as jnp
import numpy as np

from jaxkv import models
from jaxkv.core.config import Config
from jaxkv.core.params import Params
from jaxkv.formats.common import build_config, parse_error
from jaxkv.models.common import gguf_field
from jaxkv.models.maps import CheckpointError, build_params
from jaxkv.ops.arrays import Int8


@functools.cache
def _reader_class():
    """gguf.GGUFReader reading a plain ndarray view of its memmap. The reader slices its data a
    few times per metadata item (millions of slices for Gemma 3's 262,144-token vocabulary), and
    numpy's memmap subclass costs microseconds a slice (a third of the parse time)."""
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
        raise parse_error(path, "GGUF file", e) from None


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
    return build_config(lambda: family.config(reader, source), source)


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
            return from_q8_0(t.data)
        return gguf.dequantize(t.data, t.tensor_type)

    name_map = gguf_family(reader, path).name_map(config, set(tensors))
    return build_params(config, name_map, get_tensor, path, dtype or jnp.float32, int8,
                        names=tensors)


def from_q8_0(data_OX) -> Int8:
    """numpy views of GGUF Q8_0 bytes [O, NB * 34] (per block: a float16 scale, 32 int8) ->
    Int8(q [O, NB * 32] int8, scale [O, NB] float16); nothing is converted to float."""
    data_OX = np.asarray(data_OX, np.uint8)
    O, X = data_OX.shape
    if X % 34:
        raise ValueError(f"from_q8_0: rows of {X} bytes are not whole 34-byte Q8_0 blocks")
    blocks_OBX = data_OX.reshape(O, X // 34, 34)
    scale_OB = np.ascontiguousarray(blocks_OBX[..., :2]).view(np.float16)[..., 0]
    q_OBK = np.ascontiguousarray(blocks_OBX[..., 2:]).view(np.int8)
    return Int8(q_OBK.reshape(O, -1), scale_OB)
