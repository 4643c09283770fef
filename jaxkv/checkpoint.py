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
import re
import struct
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxkv import checks, convert, locate
from jaxkv.config import ROPE_SCALINGS, Config
from jaxkv.convert import CheckpointError
from jaxkv.params import Params, init_params

SAVED_CONFIG = "jaxkv_config.json"
MANIFEST = "jaxkv_manifest.json"


def load(path, dtype=None) -> Params:
    """Params from a Hugging Face directory (config.json + *.safetensors: GPT-2, Llama, Qwen2,
    Qwen3, Mistral, Gemma 2, Gemma 3 (text), T5, Whisper), a .gguf file (llama), a CTranslate2
    Whisper directory, a jaxkv.save directory, or a model name in the local Hugging Face cache (see
    jaxkv.locate.resolve; nothing is downloaded).

    dtype: what floating weights become (float32, bfloat16 or float16); by default float32 for
    foreign formats and the saved dtype (bitwise as saved) for jaxkv's own.
    A jaxkv.save directory is checked against its manifest first (see load_saved); a file that
    is damaged or malformed is a CheckpointError naming it.
    """
    path = locate.resolve(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load: {path!r} does not exist")
    if dtype is not None:
        checks.float_dtype(dtype, "load: dtype")
    if os.path.isfile(path) and path.endswith(".gguf"):
        return load_gguf(path, dtype)
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

# transformers' defaults for keys a config.json may omit (its GPT2Config, LlamaConfig, ...);
# the vocabulary size and the width have no default worth guessing and must be present.
GPT2_DEFAULTS = dict(n_positions=1024, n_layer=12, n_head=12, n_inner=None,
                     activation_function="gelu_new", layer_norm_epsilon=1e-5,
                     bos_token_id=50256, eos_token_id=50256)
LLAMA_DEFAULTS = dict(intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=None, head_dim=None, hidden_act="silu",
                      max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                      attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
# Qwen2Config / Qwen3Config: q/k/v biases always (Qwen2) or as attention_bias says (Qwen3)
QWEN2_DEFAULTS = dict(intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, head_dim=None, hidden_act="silu",
                      max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
                      max_window_layers=28, bos_token_id=None, eos_token_id=None)
QWEN3_DEFAULTS = {**QWEN2_DEFAULTS, "head_dim": 128, "attention_bias": False}
MISTRAL_DEFAULTS = dict(intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=None, hidden_act="silu",
                        max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, rope_theta=10000.0,
                        tie_word_embeddings=False, sliding_window=4096, bos_token_id=1,
                        eos_token_id=2)
GEMMA2_DEFAULTS = dict(intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                       max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
                       attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                       layer_types=None, final_logit_softcapping=30.0,
                       attn_logit_softcapping=50.0, tie_word_embeddings=True, bos_token_id=2,
                       eos_token_id=1)
# Gemma3TextConfig: older configs give the RoPE bases top-level and the local/global layer
# pattern as sliding_window_pattern; transformers 5 writes rope_parameters per layer type and
# layer_types
GEMMA3_DEFAULTS = {**GEMMA2_DEFAULTS, "max_position_embeddings": 131072, "rope_theta": 1e6,
                   "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
                   "final_logit_softcapping": None, "attn_logit_softcapping": None}
T5_DEFAULTS = dict(d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=None, num_heads=8,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128,
                   layer_norm_epsilon=1e-6, feed_forward_proj="relu", n_positions=512,
                   eos_token_id=1, decoder_start_token_id=0)  # T5 starts from its pad id, 0
WHISPER_DEFAULTS = dict(num_mel_bins=80, encoder_layers=4, encoder_attention_heads=6,
                        decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536,
                        encoder_ffn_dim=1536, activation_function="gelu",
                        max_source_positions=1500, max_target_positions=448,
                        decoder_start_token_id=50257, eos_token_id=50256,
                        begin_suppress_tokens=[220, 50256])


def _with_defaults(hf: dict, defaults: dict, required: tuple, source: str) -> dict:
    """hf with defaults for absent keys; a required key absent (or null) is an error."""
    for key in required:
        if hf.get(key) is None:
            raise CheckpointError(f"{source}: required key {key!r} is missing")
    return {**defaults, **hf}


def _gpt2_config(hf: dict, source: str) -> Config:
    hf = _with_defaults(hf, GPT2_DEFAULTS, ("vocab_size", "n_embd"), source)
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise CheckpointError(f"{source}: GPT-2 attention variants are not supported")
    return Config.gpt2(vocab_size=hf["vocab_size"], d_model=hf["n_embd"], n_layers=hf["n_layer"],
                       n_heads=hf["n_head"], max_seq_len=hf["n_positions"], d_ff=hf["n_inner"],
                       norm_eps=hf["layer_norm_epsilon"],
                       activation=_activation(hf["activation_function"], source),
                       **_special_ids(hf, source, ("bos_token_id", "eos_token_id")))


def _llama_config(hf: dict, source: str) -> Config:
    hf = _with_defaults(hf, LLAMA_DEFAULTS, ("vocab_size", "hidden_size"), source)
    return _rope_decoder_config(hf, source, attn_bias=hf["attention_bias"],
                                mlp_bias=hf["mlp_bias"])


def _qwen2_config(hf: dict, source: str) -> Config:
    """Qwen2 / Qwen2.5: Llama with q/k/v biases (none on the output projection)."""
    hf = _with_defaults(hf, QWEN2_DEFAULTS, ("vocab_size", "hidden_size"), source)
    return _rope_decoder_config(hf, source, attn_bias=True, attn_out_bias=False,
                                **_window(hf, hf["max_window_layers"]))


def _qwen3_config(hf: dict, source: str) -> Config:
    """Qwen3: Llama with per-head RMSNorm of queries and keys."""
    hf = _with_defaults(hf, QWEN3_DEFAULTS, ("vocab_size", "hidden_size"), source)
    return _rope_decoder_config(hf, source, attn_bias=hf["attention_bias"], qk_norm=True,
                                **_window(hf, hf["max_window_layers"]))


def _mistral_config(hf: dict, source: str) -> Config:
    """Mistral: Llama whose every layer reads a sliding window (sliding_window null: none)."""
    hf = _with_defaults(hf, MISTRAL_DEFAULTS, ("vocab_size", "hidden_size"), source)
    return _rope_decoder_config(hf, source, **_window(hf, 0))


def _gemma2_config(hf: dict, source: str) -> Config:
    """Gemma 2: local (even) and global (odd) layers; scores and logits soft-capped."""
    hf = _with_defaults(hf, GEMMA2_DEFAULTS, ("vocab_size", "hidden_size"), source)
    theta, scaling = _rope_scaling(hf, source)
    return _gemma_config(hf, source, 2, rope_theta=theta, rope_scaling=scaling,
                         attn_softcap=hf["attn_logit_softcapping"])


def _gemma3_config(hf: dict, source: str) -> Config:
    """Gemma 3 (text): five local layers to one global by default; per-head q/k norms; the
    local layers' RoPE base is their own. Its attention never soft-caps scores (transformers'
    Gemma3Attention ignores attn_logit_softcapping), so neither do we."""
    hf = _with_defaults(hf, GEMMA3_DEFAULTS, ("vocab_size", "hidden_size"), source)
    theta, scaling, local_theta = _gemma3_rope(hf, source)
    return _gemma_config(hf, source, hf["sliding_window_pattern"], qk_norm=True,
                         rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)


def _gemma3_rope(hf: dict, source: str) -> tuple:
    """(theta, scaling) of the global layers and the local layers' theta, from rope_parameters
    per layer type (transformers 5) or rope_theta, rope_scaling and rope_local_base_freq."""
    rope = hf.get("rope_parameters") or {}
    if not {"full_attention", "sliding_attention"} & set(rope):
        return (*_rope_scaling(hf, source), hf["rope_local_base_freq"])
    full = rope.get("full_attention") or {"rope_type": "default"}
    local = rope.get("sliding_attention") or {}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise CheckpointError(f"{source}: RoPE scaling in the sliding-window layers ({local!r}) "
                              "is not supported")
    theta, scaling = _rope_scaling({**hf, "rope_parameters": full}, source)
    return theta, scaling, local.get("rope_theta", hf["rope_local_base_freq"])


def _gemma_config(hf: dict, source: str, pattern: int, **family) -> Config:
    """What Gemma 2 and 3 share: gated GELU-tanh, embeddings scaled by sqrt(width), sublayer
    outputs normed, scores scaled by query_pre_attn_scalar**-0.5, logits soft-capped where
    final_logit_softcapping says; layer_types (else every pattern-th layer global) picks the
    sliding-window layers."""
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: bidirectional attention (use_bidirectional_attention) "
                              "is not supported")
    if _activation(hf["hidden_activation"], source) != "gelu_tanh":
        raise CheckpointError(f"{source}: unsupported hidden_activation "
                              f"{hf['hidden_activation']!r}")
    L, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    types = hf["layer_types"] or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(L)]
    return Config.llama(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=L, n_heads=n_heads,
        n_kv_heads=hf["num_key_value_heads"] or n_heads, head_dim=hf["head_dim"],
        d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf["rms_norm_eps"], activation="gelu_tanh", attn_bias=hf["attention_bias"],
        tie_embeddings=hf["tie_word_embeddings"], scale_embeddings=True, post_norms=True,
        attn_scale_base=hf["query_pre_attn_scalar"],
        logit_softcap=hf["final_logit_softcapping"], **_window({**hf, "layer_types": types}, 0),
        **family, **_special_ids(hf, source, ("bos_token_id", "eos_token_id")))


def _window(hf: dict, first_windowed: int) -> dict:
    """Config's sliding_window and window_layers: the layers layer_types calls
    "sliding_attention" (transformers 5), else every layer from first_windowed on."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window is None:
        return {}
    types = hf.get("layer_types")
    layers = ([i for i, kind in enumerate(types) if kind == "sliding_attention"] if types else
              list(range(first_windowed, hf["num_hidden_layers"])))
    return dict(sliding_window=window, window_layers=tuple(layers)) if layers else {}


def _rope_decoder_config(hf: dict, source: str, **family) -> Config:
    """The Llama-shaped part of a decoder-only config (hf already has its family's defaults);
    family: what differs (biases, q/k norms)."""
    if _activation(hf["hidden_act"], source) != "silu":
        raise CheckpointError(f"{source}: unsupported hidden_act {hf['hidden_act']!r}")
    n_heads = hf["num_attention_heads"]
    theta, scaling = _rope_scaling(hf, source)
    return Config.llama(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf["num_key_value_heads"] or n_heads,
        head_dim=hf["head_dim"], d_ff=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"], norm_eps=hf["rms_norm_eps"],
        rope_theta=theta, rope_scaling=scaling, tie_embeddings=hf["tie_word_embeddings"],
        **family, **_special_ids(hf, source, ("bos_token_id", "eos_token_id")))


# Config.rope_scaling's parameter names (config.ROPE_SCALINGS) where Hugging Face's differ
HF_ROPE_KEYS = {"original_max_len": "original_max_position_embeddings"}


def _rope_scaling(hf: dict, source: str) -> tuple:
    """(rope_theta, Config.rope_scaling) from rope_parameters (transformers 5) or rope_scaling
    (older configs, whose theta is top-level)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf["rope_theta"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: partial rotary embeddings ({rope!r}) are not supported")
    if kind == "default":
        return theta, ()
    if kind not in ROPE_SCALINGS:
        raise CheckpointError(f"{source}: rope scaling {rope!r} is not supported; supported "
                              f"rope_type values: default, {', '.join(ROPE_SCALINGS)}")
    # llama3's context length, as transformers reads it: a top-level key wins over the rope
    # dict's, and max_position_embeddings stands in for both
    context = (hf.get("original_max_position_embeddings")
               or rope.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    rope = {**rope, "original_max_position_embeddings": context}
    keys = [HF_ROPE_KEYS.get(name, name) for name in ROPE_SCALINGS[kind]]
    missing = [key for key in keys if rope.get(key) is None]
    if missing:
        raise CheckpointError(f"{source}: rope scaling {kind!r} lacks {', '.join(missing)} "
                              f"(got {rope!r})")
    return theta, (kind, *(rope[key] for key in keys))


def _t5_config(hf: dict, source: str, tensor_names=()) -> Config:
    hf = _with_defaults(hf, T5_DEFAULTS, ("vocab_size", "d_model"), source)
    proj = hf["feed_forward_proj"]
    if proj not in ("relu", "gated-gelu"):
        raise CheckpointError(f"{source}: feed_forward_proj {proj!r} is not supported; expected "
                              "'relu' or 'gated-gelu'")
    tied = "lm_head.weight" not in tensor_names
    # transformers 5 ties T5's head always and keeps the rescale as scale_decoder_outputs;
    # older configs said both with tie_word_embeddings.
    rescale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    return Config.t5(
        vocab_size=hf["vocab_size"], d_model=hf["d_model"],
        n_layers=hf["num_decoder_layers"] or hf["num_layers"],
        n_encoder_layers=hf["num_layers"], n_heads=hf["num_heads"], head_dim=hf["d_kv"],
        d_ff=hf["d_ff"], gated=proj == "gated-gelu", tie_embeddings=tied,
        max_source_len=hf["n_positions"], rescale_logits=rescale,
        norm_eps=hf["layer_norm_epsilon"], relative_buckets=hf["relative_attention_num_buckets"],
        relative_max_distance=hf["relative_attention_max_distance"],
        **_special_ids(hf, source, ("eos_token_id", "decoder_start_token_id")))


def _whisper_config(hf: dict, source: str) -> Config:
    hf = _with_defaults(hf, WHISPER_DEFAULTS, ("vocab_size", "d_model"), source)
    if hf.get("scale_embedding"):
        raise CheckpointError(f"{source}: Whisper with scale_embedding is not supported")
    if hf["encoder_attention_heads"] != hf["decoder_attention_heads"] or \
            hf["encoder_ffn_dim"] != hf["decoder_ffn_dim"]:
        raise CheckpointError(f"{source}: encoder and decoder must share heads and MLP width")
    generation = hf.get("generation", {})

    def ids(key):  # ids past the vocabulary (transformers' defaults) can never be sampled anyway
        return tuple(i for i in generation.get(key) or hf.get(key) or () if i < hf["vocab_size"])

    return Config.whisper(
        vocab_size=hf["vocab_size"], d_model=hf["d_model"], n_layers=hf["decoder_layers"],
        n_encoder_layers=hf["encoder_layers"], n_heads=hf["decoder_attention_heads"],
        d_ff=hf["decoder_ffn_dim"], n_mels=hf["num_mel_bins"],
        max_source_len=hf["max_source_positions"], max_seq_len=hf["max_target_positions"],
        activation=_activation(hf["activation_function"], source),
        suppress_ids=ids("suppress_tokens"), begin_suppress_ids=ids("begin_suppress_tokens"),
        **_special_ids(hf, source, ("eos_token_id", "decoder_start_token_id")))


HF_ARCHITECTURES = {
    "GPT2LMHeadModel": (_gpt2_config, lambda c, names: convert.gpt2_map(
        c, "transformer." if "transformer.wte.weight" in names else "")),
    "LlamaForCausalLM": (_llama_config, lambda c, names: convert.llama_map(
        c, convert.HF_LLAMA_NAMES)),
    "Qwen2ForCausalLM": (_qwen2_config, lambda c, names: convert.llama_map(
        c, convert.HF_LLAMA_NAMES)),
    "Qwen3ForCausalLM": (_qwen3_config, lambda c, names: convert.llama_map(
        c, convert.HF_LLAMA_NAMES)),
    "MistralForCausalLM": (_mistral_config, lambda c, names: convert.llama_map(
        c, convert.HF_LLAMA_NAMES)),
    "Gemma2ForCausalLM": (_gemma2_config, lambda c, names: convert.gemma_map(c)),
    "Gemma3ForCausalLM": (_gemma3_config, lambda c, names: convert.gemma_map(c)),
    "T5ForConditionalGeneration": (_t5_config, lambda c, names: convert.t5_map(c)),
    "WhisperForConditionalGeneration": (_whisper_config, lambda c, names: convert.whisper_map(c)),
}


def _activation(name: str, source: str) -> str:
    ours = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
            "relu": "relu", "silu": "silu", "swish": "silu"}.get(name)
    if ours is None:
        raise CheckpointError(f"{source}: unsupported activation {name!r}")
    return ours


SPECIAL_IDS = {"bos_token_id": "bos_id", "eos_token_id": "eos_id",
               "decoder_start_token_id": "decoder_start_id"}


def _special_ids(hf: dict, source: str, keys: tuple) -> dict:
    """Config's special ids from hf's keys. An id outside the vocabulary is dropped (None) with
    a warning, as transformers loads such configs: that token can never occur."""
    ids = {}
    for key in keys:
        ids[SPECIAL_IDS[key]] = _in_vocab(_single_id(hf.get(key)), key, hf["vocab_size"], source)
    return ids


def _in_vocab(value, key: str, vocab_size: int, source: str):
    if value is None or 0 <= value < vocab_size:
        return value
    warnings.warn(f"{source}: {key} {value} is outside the vocabulary (vocab_size {vocab_size}); "
                  "dropped, as that token can never occur")
    return None


def _single_id(value):
    return value[0] if isinstance(value, list) and value else value


def config_from_hf(hf: dict, source: str = "config.json", tensor_names=()) -> Config:
    """Our Config from a Hugging Face config.json dict."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in HF_ARCHITECTURES:
        raise CheckpointError(f"{source}: architecture {arch!r} is not supported; expected one of "
                              f"{', '.join(HF_ARCHITECTURES)}")
    parse = HF_ARCHITECTURES[arch][0]
    if parse is _t5_config:
        return _build_config(lambda: parse(hf, source, tensor_names), source)
    return _build_config(lambda: parse(hf, source), source)


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
    name_map = HF_ARCHITECTURES[(hf.get("architectures"))[0]][1](config, tensors)
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
    if variables["__spec__"] != "WhisperSpec":
        raise CheckpointError(f"{source}: CTranslate2 spec {variables['__spec__']!r} is not "
                              "supported; expected 'WhisperSpec'")
    ct2_config = read_json(os.path.join(directory, "config.json"))
    tokenizer = read_tokenizer(os.path.join(directory, "tokenizer.json"))
    config = _build_config(lambda: _ct2_whisper_config(variables, ct2_config, tokenizer, source),
                           source)
    return convert.build_params(config, convert.ct2_whisper_map(config), variables.get, source,
                                dtype or jnp.float32)


def _ct2_whisper_config(variables: dict, ct2_config: dict, tokenizer, source: str) -> Config:
    def var(name):
        if name not in variables:
            raise CheckpointError(f"{source}: missing variable {name!r}")
        return variables[name]

    vocab, d_model = var("decoder/embeddings/weight").shape
    layers = lambda side: len({m.group(1) for k in variables  # noqa: E731
                               if (m := re.match(rf"{side}/layer_(\d+)/", k))})
    return Config.whisper(
        vocab_size=vocab, d_model=d_model, n_layers=layers("decoder"),
        n_encoder_layers=layers("encoder"), n_heads=int(var("decoder/num_heads")),
        d_ff=var("decoder/layer_0/ffn/linear_0/weight").shape[0],
        n_mels=var("encoder/conv1/weight").shape[1],
        max_source_len=var("encoder/position_encodings/encodings").shape[0],
        max_seq_len=var("decoder/position_encodings/encodings").shape[0],
        decoder_start_id=tokenizer.token_to_id("<|startoftranscript|>"),
        eos_id=tokenizer.token_to_id("<|endoftext|>"),
        suppress_ids=tuple(ct2_config.get("suppress_ids", ())),
        begin_suppress_ids=tuple(ct2_config.get("suppress_ids_begin", ())))


# ---- GGUF ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _gguf_reader(path: str, mtime: float):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - the reader fails on bad bytes in many ways
        raise _parse_error(path, "GGUF file", e) from None


def gguf_reader(path: str):
    """A GGUFReader, kept for reuse: parsing a large vocabulary's metadata takes seconds, and
    weights, tokenizer and chat template all come from the same file."""
    path = os.path.abspath(path)
    return _gguf_reader(path, os.path.getmtime(path))


def gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_required(reader, key: str, source: str):
    """A metadata value the file must hold."""
    value = gguf_field(reader, key)
    if value is None:
        raise CheckpointError(f"{source}: GGUF metadata lacks the required key {key!r}")
    return value


def config_from_gguf(reader, source: str) -> Config:
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} is not supported; expected "
                              "'llama'")
    get = lambda key, default=None: gguf_field(reader, f"llama.{key}", default)  # noqa: E731
    need = lambda key: gguf_required(reader, f"llama.{key}", source)  # noqa: E731
    n_heads, d_model = need("attention.head_count"), need("embedding_length")
    vocab = get("vocab_size") or len(gguf_required(reader, "tokenizer.ggml.tokens", source))
    names = {t.name for t in reader.tensors}
    scaling = _gguf_rope_scaling(get, names, source)
    return _build_config(lambda: Config.llama(
        vocab_size=vocab, d_model=d_model, n_layers=need("block_count"), n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        head_dim=get("attention.key_length", d_model // n_heads),
        d_ff=need("feed_forward_length"), max_seq_len=get("context_length", 2048),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_embeddings="output.weight" not in names,
        bos_id=_gguf_id(reader, "bos", vocab, source),
        eos_id=_gguf_id(reader, "eos", vocab, source)), source)


def _gguf_rope_scaling(get, names: set, source: str) -> tuple:
    """Config.rope_scaling from llama.* metadata: none or linear. llama.cpp stores Llama 3.1's
    scaling as per-frequency divisors (the tensor rope_freqs.weight), which are not read yet:
    loading such a file without them would decode wrongly."""
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{source}: per-frequency RoPE factors (rope_freqs.weight, Llama "
                              "3.1+ scaling) are not supported yet; load the Hugging Face "
                              "checkpoint instead")
    kind, factor = get("rope.scaling.type", "none"), float(get("rope.scaling.factor", 1.0))
    if kind not in ("none", "linear"):
        raise CheckpointError(f"{source}: rope scaling {kind!r} is not supported; supported: "
                              "none, linear")
    return ("linear", factor) if kind == "linear" and factor != 1.0 else ()


def _gguf_id(reader, which: str, vocab_size: int, source: str):
    """tokenizer.ggml.{which}_token_id, dropped (with a warning) if outside the vocabulary."""
    key = f"tokenizer.ggml.{which}_token_id"
    return _in_vocab(gguf_field(reader, key), key, vocab_size, source)


def load_gguf(path: str, dtype=None) -> Params:
    """A llama-architecture GGUF, dequantized with the gguf package."""
    import gguf

    reader = gguf_reader(path)
    config = config_from_gguf(reader, path)
    tensors = {t.name: t for t in reader.tensors}

    def get_tensor(name):
        t = tensors.get(name)
        return None if t is None else gguf.dequantize(t.data, t.tensor_type)

    name_map = convert.llama_map(config, convert.GGUF_LLAMA_NAMES, unpermute_qk=True)
    return convert.build_params(config, name_map, get_tensor, path, dtype or jnp.float32)


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
