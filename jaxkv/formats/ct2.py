"""CTranslate2 model directories (model.bin, config.json, tokenizer.json): Whisper."""

import math
import os
import struct

import jax.numpy as jnp
import numpy as np

from jaxkv import models
from jaxkv.core.params import Params
from jaxkv.formats.common import build_config, read_json
from jaxkv.formats.tokenizer import read_tokenizer
from jaxkv.models.maps import CheckpointError, build_params


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
    source = os.path.join(directory, "model.bin")
    variables = read_ct2(source)
    family = models.CT2_SPECS.get(variables["__spec__"])
    if family is None:
        raise CheckpointError(f"{source}: CTranslate2 spec {variables['__spec__']!r} is not "
                              f"supported; expected {' or '.join(map(repr, models.CT2_SPECS))}")
    ct2_config = read_json(os.path.join(directory, "config.json"))
    tokenizer = read_tokenizer(os.path.join(directory, "tokenizer.json"))
    config = build_config(lambda: family.config(variables, ct2_config, tokenizer, source),
                           source)
    return build_params(config, family.name_map(config, set(variables)), variables.get,
                        source, dtype or jnp.float32,
                        names={n for n, x in variables.items() if np.ndim(x) > 0})
