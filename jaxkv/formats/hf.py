"""Hugging Face directories: config.json (+ generation_config.json) and *.safetensors
shards, read through each family's config reader and name map (jaxkv.models)."""

import glob
import os

import jax.numpy as jnp
import numpy as np

from jaxkv import models
from jaxkv.core.config import Config
from jaxkv.core.params import Params
from jaxkv.formats.common import build_config, parse_error, read_json
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
    return build_params(config, name_map, lambda name: _read(tensors, name), directory,
                        dtype or jnp.float32, names=tensors)


def _safetensors_index(files):
    """{tensor name: open file} over one or several safetensors shards."""
    from safetensors import SafetensorError, safe_open

    index = {}
    for file in files:
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: not a file (a safetensors shard must be one)")
        try:
            handle = safe_open(file, framework="flax")  # flax: bfloat16 tensors load too
        except SafetensorError as e:
            raise parse_error(file, "safetensors file", e) from None
        index.update({name: handle for name in handle.keys()})
    return index


def _read(tensors, name):
    handle = tensors.get(name)
    return None if handle is None else np.asarray(handle.get_tensor(name), np.float32)
