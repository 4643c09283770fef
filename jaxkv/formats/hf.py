"""Hugging Face directories: config.json (+ generation_config.json) and *.safetensors
shards, read through each family's config reader and name map (jaxkv.models)."""

import glob
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxkv import models
from jaxkv.core.config import Config
from jaxkv.core.params import Params, skeleton
from jaxkv.core.sharding import param_shardings
from jaxkv.formats.common import build_config, holds, parse_error, read_json
from jaxkv.models.maps import CheckpointError, build_params


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
    return build_config(lambda: family.config(hf, source, tensor_names), source)


def load_hf(directory: str, dtype=None, mesh=None) -> Params:
    """mesh: each process reads only its devices' shares of the tensors held as we hold them
    (the others, fused, one at a time whole), see build_params."""
    config_path = os.path.join(directory, "config.json")
    hf = read_json(config_path)
    generation_path = os.path.join(directory, "generation_config.json")
    if holds(directory, "generation_config.json"):
        hf["generation"] = read_json(generation_path)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights found")
    tensors = _safetensors_index(files)
    config = config_from_hf(hf, config_path, tensors)
    name_map = hf_family(hf, config_path).name_map(config, tensors)
    read = lambda name: _read(tensors, name)  # noqa: E731
    spread = {}
    if mesh is not None:  # every read from the file itself: no mapped pages, no device copies
        spread = dict(shardings=param_shardings(skeleton(config), mesh),
                      get_slice=lambda name: _slice(tensors, name))
        read = lambda name: None if name not in tensors else _slice(tensors, name)[:]  # noqa
    return build_params(config, name_map, read, directory, dtype or jnp.float32,
                        names=tensors, **spread)


def _safetensors_index(files):
    """{tensor name: (open file, its path)} over one or several safetensors shards."""
    from safetensors import SafetensorError, safe_open

    index = {}
    for file in files:
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: not a file (a safetensors shard must be one)")
        try:
            handle = safe_open(file, framework="flax")  # flax: bfloat16 tensors load too
        except SafetensorError as e:
            raise parse_error(file, "safetensors file", e) from None
        index.update({name: (handle, file) for name in handle.keys()})
    return index


def _slice(tensors, name):
    return None if name not in tensors else Rows(tensors[name][1], name)


class Rows:
    """One tensor of a safetensors file, read by rows: [index] reads from the file only the
    rows index[0] covers (safetensors' own slices come through numpy, which has no bfloat16,
    or through a framework's device arrays: a second copy)."""

    DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64}

    def __init__(self, file: str, name: str):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            entry = json.loads(f.read(size))[name]
        self.file, self.shape = file, tuple(entry["shape"])
        self.dtype = np.dtype(self.DTYPES[entry["dtype"]])
        self.start = 8 + size + entry["data_offsets"][0]

    def get_shape(self):
        return self.shape

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        first = range(self.shape[0])[index[0]]
        row = int(np.prod(self.shape[1:], dtype=np.int64))
        x = np.fromfile(self.file, self.dtype, len(first) * row,
                        offset=self.start + first.start * row * self.dtype.itemsize)
        return x.reshape(len(first), *self.shape[1:])[(slice(None, None, first.step),
                                                        *index[1:])]


def _read(tensors, name):
    return None if name not in tensors else np.asarray(tensors[name][0].get_tensor(name),
                                                       np.float32)
