"""What the families' config readers share: defaults for absent keys, activations, special ids,
sliding-window layers (Hugging Face config.json), and GGUF metadata access."""

import dataclasses
import warnings
from collections.abc import Callable

from jaxkv.models.maps import CheckpointError


@dataclasses.dataclass(frozen=True)
class Family:
    """How one format holds one model family: its Config and the name map of its tensors."""

    config: Callable  # HF: (config.json dict, source, tensor names) -> Config;
    # GGUF: (gguf.GGUFReader, source) -> Config; CT2: (variables, config dict, tokenizer, source)
    name_map: Callable  # (Config, tensor names) -> {our name: Src | Fused} (see convert.py)


# ---- Hugging Face config.json ---------------------------------------------------------------

def with_defaults(hf: dict, defaults: dict, required: tuple, source: str) -> dict:
    """hf with defaults for absent keys; a required key absent (or null) is an error."""
    for key in required:
        if hf.get(key) is None:
            raise CheckpointError(f"{source}: required key {key!r} is missing")
    return {**defaults, **hf}


def activation(name: str, source: str) -> str:
    ours = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
            "relu": "relu", "silu": "silu", "swish": "silu"}.get(name)
    if ours is None:
        raise CheckpointError(f"{source}: unsupported activation {name!r}")
    return ours


SPECIAL_IDS = {"bos_token_id": "bos_id", "eos_token_id": "eos_id",
               "decoder_start_token_id": "decoder_start_id"}


def special_ids(hf: dict, source: str, keys: tuple) -> dict:
    """Config's special ids from hf's keys. An id outside the vocabulary is dropped (None) with
    a warning, as transformers loads such configs: that token can never occur."""
    ids = {}
    for key in keys:
        if key == "eos_token_id":
            ids.update(end_ids(hf, source))
        else:
            value = _single_id(hf.get(key))
            ids[SPECIAL_IDS[key]] = in_vocab(value, key, hf["vocab_size"], source)
    return ids


def end_ids(hf: dict, source: str) -> dict:
    """eos_id (the first) and stop_ids (the rest) of config.json's eos_token_id and then
    generation_config.json's: instruct models list several (Llama 3: end of text, of turn)."""
    ids = []
    for value in (hf.get("eos_token_id"), hf.get("generation", {}).get("eos_token_id")):
        for i in value if isinstance(value, list) else [value]:
            i = in_vocab(i, "eos_token_id", hf["vocab_size"], source)
            if i is not None and i not in ids:
                ids.append(i)
    return dict(eos_id=ids[0] if ids else None, stop_ids=tuple(ids[1:]))


def in_vocab(value, key: str, vocab_size: int, source: str):
    if value is None or 0 <= value < vocab_size:
        return value
    warnings.warn(f"{source}: {key} {value} is outside the vocabulary (vocab_size {vocab_size}); "
                  "dropped, as that token can never occur")
    return None


def _single_id(value):
    return value[0] if isinstance(value, list) and value else value


def window(hf: dict, first_windowed: int) -> dict:
    """Config's sliding_window and window_layers: the layers layer_types calls
    "sliding_attention" (transformers 5), else every layer from first_windowed on."""
    size = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if size is None:
        return {}
    types = hf.get("layer_types")
    layers = ([i for i, kind in enumerate(types) if kind == "sliding_attention"] if types else
              list(range(first_windowed, hf["num_hidden_layers"])))
    return dict(sliding_window=size, window_layers=tuple(layers)) if layers else {}


# ---- GGUF metadata ----------------------------------------------------------------------------

def gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_required(reader, key: str, source: str):
    """A metadata value the file must hold."""
    value = gguf_field(reader, key)
    if value is None:
        raise CheckpointError(f"{source}: GGUF metadata lacks the required key {key!r}")
    return value


def gguf_id(reader, which: str, vocab_size: int, source: str):
    """tokenizer.ggml.{which}_token_id, dropped (with a warning) if outside the vocabulary."""
    key = f"tokenizer.ggml.{which}_token_id"
    return in_vocab(gguf_field(reader, key), key, vocab_size, source)


def gguf_stop_ids(reader, vocab_size: int, source: str) -> tuple:
    """llama.cpp's end-of-turn and end-of-message ids, where they differ from eos."""
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    ids = (gguf_id(reader, which, vocab_size, source) for which in ("eot", "eom"))
    return tuple(dict.fromkeys(i for i in ids if i is not None and i != eos))


def gguf_tensor_names(reader) -> set:
    return {t.name for t in reader.tensors}


def gguf_arch_field(reader, key: str, default=None):
    """<architecture>.key (e.g. 'gemma3.attention.sliding_window') from a GGUF's metadata."""
    return gguf_field(reader, f"{gguf_field(reader, 'general.architecture')}.{key}", default)


def gguf_arch_required(reader, key: str, source: str):
    """<architecture>.key, which the file must hold."""
    return gguf_required(reader, f"{gguf_field(reader, 'general.architecture')}.{key}", source)
