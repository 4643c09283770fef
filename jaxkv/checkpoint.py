"""Loading and saving parameters: Hugging Face directories, GGUF files, jaxkv's own format."""

import functools
import glob
import json
import os
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxkv import convert
from jaxkv.config import Config
from jaxkv.convert import CheckpointError
from jaxkv.params import Params, init_params

SAVED_CONFIG = "jaxkv_config.json"


def load(path, dtype=None) -> Params:
    """Params from a Hugging Face directory (config.json + *.safetensors: GPT-2, Llama, T5,
    Whisper), a .gguf file (llama), a CTranslate2 Whisper directory, or a jaxkv.save directory.

    dtype: what floating weights become; by default float32 for foreign formats and the saved
    dtype (bitwise as saved) for jaxkv's own.
    """
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return load_gguf(path, dtype)
    if os.path.isfile(os.path.join(path, SAVED_CONFIG)):
        return load_saved(path, dtype)
    if os.path.isfile(os.path.join(path, "model.bin")) and not glob.glob(
            os.path.join(path, "*.safetensors")):
        return load_ct2_whisper(path, dtype)
    if os.path.isfile(os.path.join(path, "config.json")):
        return load_hf(path, dtype)
    raise FileNotFoundError(f"load: {path!r} is neither a .gguf file nor a directory holding "
                            f"config.json (Hugging Face), model.bin (CTranslate2 Whisper) or "
                            f"{SAVED_CONFIG} (jaxkv.save)")


# ---- Hugging Face -------------------------------------------------------------------------

def _gpt2_config(hf: dict, source: str) -> Config:
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise CheckpointError(f"{source}: GPT-2 attention variants are not supported")
    return Config.gpt2(vocab_size=hf["vocab_size"], d_model=hf["n_embd"], n_layers=hf["n_layer"],
                       n_heads=hf["n_head"], max_seq_len=hf["n_positions"], d_ff=hf.get("n_inner"),
                       norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                       activation=_activation(hf.get("activation_function", "gelu_new"), source),
                       **_special_ids(hf))


def _llama_config(hf: dict, source: str) -> Config:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"{source}: rope scaling {rope!r} is not supported")
    if _activation(hf.get("hidden_act", "silu"), source) != "silu":
        raise CheckpointError(f"{source}: unsupported hidden_act {hf['hidden_act']!r}")
    n_heads = hf["num_attention_heads"]
    return Config.llama(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim"), d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        attn_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
        tie_embeddings=hf.get("tie_word_embeddings", False), **_special_ids(hf))


def _t5_config(hf: dict, source: str, tensor_names=()) -> Config:
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in ("relu", "gated-gelu"):
        raise CheckpointError(f"{source}: feed_forward_proj {proj!r} is not supported; expected "
                              "'relu' or 'gated-gelu'")
    tied = "lm_head.weight" not in tensor_names
    # transformers 5 ties T5's head always and keeps the rescale as scale_decoder_outputs;
    # older configs said both with tie_word_embeddings.
    rescale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    return Config.t5(
        vocab_size=hf["vocab_size"], d_model=hf["d_model"],
        n_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        n_encoder_layers=hf["num_layers"], n_heads=hf["num_heads"], head_dim=hf["d_kv"],
        d_ff=hf["d_ff"], gated=proj == "gated-gelu", tie_embeddings=tied,
        max_source_len=hf.get("n_positions", 512), rescale_logits=rescale,
        norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        decoder_start_id=hf.get("decoder_start_token_id", 0), eos_id=_single_id(hf.get("eos_token_id")))


def _whisper_config(hf: dict, source: str) -> Config:
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
        d_ff=hf["decoder_ffn_dim"], n_mels=hf.get("num_mel_bins", 80),
        max_source_len=hf.get("max_source_positions", 1500),
        max_seq_len=hf.get("max_target_positions", 448),
        activation=_activation(hf.get("activation_function", "gelu"), source),
        decoder_start_id=hf.get("decoder_start_token_id"), eos_id=_single_id(hf.get("eos_token_id")),
        suppress_ids=ids("suppress_tokens"), begin_suppress_ids=ids("begin_suppress_tokens"))


HF_ARCHITECTURES = {
    "GPT2LMHeadModel": (_gpt2_config, lambda c, names: convert.gpt2_map(
        c, "transformer." if "transformer.wte.weight" in names else "")),
    "LlamaForCausalLM": (_llama_config, lambda c, names: convert.llama_map(
        c, convert.HF_LLAMA_NAMES)),
    "T5ForConditionalGeneration": (_t5_config, lambda c, names: convert.t5_map(c)),
    "WhisperForConditionalGeneration": (_whisper_config, lambda c, names: convert.whisper_map(c)),
}


def _activation(name: str, source: str) -> str:
    ours = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
            "relu": "relu", "silu": "silu", "swish": "silu"}.get(name)
    if ours is None:
        raise CheckpointError(f"{source}: unsupported activation {name!r}")
    return ours


def _special_ids(hf: dict) -> dict:
    return dict(bos_id=_single_id(hf.get("bos_token_id")), eos_id=_single_id(hf.get("eos_token_id")))


def _single_id(value):
    return value[0] if isinstance(value, list) and value else value


def config_from_hf(hf: dict, source: str = "config.json", tensor_names=()) -> Config:
    """Our Config from a Hugging Face config.json dict."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in HF_ARCHITECTURES:
        raise CheckpointError(f"{source}: architecture {arch!r} is not supported; expected one of "
                              f"{', '.join(HF_ARCHITECTURES)}")
    parse = HF_ARCHITECTURES[arch][0]
    return parse(hf, source, tensor_names) if parse is _t5_config else parse(hf, source)


def load_hf(directory: str, dtype=None) -> Params:
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as f:
        hf = json.load(f)
    generation_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation_path):
        with open(generation_path) as f:
            hf["generation"] = json.load(f)
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
    from safetensors import safe_open

    index = {}
    for file in files:
        handle = safe_open(file, framework="flax")  # flax: bfloat16 tensors load too
        index.update({name: handle for name in handle.keys()})
    return index


def _read(tensors, name):
    handle = tensors.get(name)
    return None if handle is None else np.asarray(handle.get_tensor(name), np.float32)


# ---- CTranslate2 (Whisper) ----------------------------------------------------------------

CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def read_ct2(path: str) -> dict:
    """{variable name: numpy array} from a CTranslate2 model.bin (format version 6), aliases
    resolved."""
    data = np.memmap(path, np.uint8, mode="r")
    offset = 0

    def take(fmt):
        nonlocal offset
        values = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string():
        nonlocal offset
        n = take("<H")
        text = bytes(data[offset:offset + n]).rstrip(b"\0").decode()
        offset += n
        return text

    version = take("<I")
    if version < 5:
        raise CheckpointError(f"{path}: CTranslate2 model format {version} is not supported")
    spec, _revision, count = string(), take("<I"), take("<I")
    variables = {"__spec__": spec}
    for _ in range(count):
        name, rank = string(), take("<B")
        shape = [take("<I") for _ in range(rank)]
        dtype, nbytes = take("<B"), take("<I")
        if dtype not in CT2_DTYPES:
            raise CheckpointError(f"{path}: variable {name!r} has unsupported dtype code {dtype}")
        variables[name] = np.frombuffer(data, CT2_DTYPES[dtype], nbytes // np.dtype(
            CT2_DTYPES[dtype]).itemsize, offset).reshape(shape)
        offset += nbytes
    for _ in range(take("<I")):
        alias, target = string(), string()
        variables[alias] = variables[target]
    return variables


def load_ct2_whisper(directory: str, dtype=None) -> Params:
    """A CTranslate2 Whisper directory (model.bin, config.json, tokenizer.json)."""
    from tokenizers import Tokenizer

    source = os.path.join(directory, "model.bin")
    variables = read_ct2(source)
    if variables["__spec__"] != "WhisperSpec":
        raise CheckpointError(f"{source}: CTranslate2 spec {variables['__spec__']!r} is not "
                              "supported; expected 'WhisperSpec'")
    with open(os.path.join(directory, "config.json")) as f:
        ct2_config = json.load(f)
    tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    vocab, d_model = variables["decoder/embeddings/weight"].shape
    layers = lambda side: len({m.group(1) for k in variables  # noqa: E731
                               if (m := re.match(rf"{side}/layer_(\d+)/", k))})
    config = Config.whisper(
        vocab_size=vocab, d_model=d_model, n_layers=layers("decoder"),
        n_encoder_layers=layers("encoder"), n_heads=int(variables["decoder/num_heads"]),
        d_ff=variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        n_mels=variables["encoder/conv1/weight"].shape[1],
        max_source_len=variables["encoder/position_encodings/encodings"].shape[0],
        max_seq_len=variables["decoder/position_encodings/encodings"].shape[0],
        decoder_start_id=tokenizer.token_to_id("<|startoftranscript|>"),
        eos_id=tokenizer.token_to_id("<|endoftext|>"),
        suppress_ids=tuple(ct2_config.get("suppress_ids", ())),
        begin_suppress_ids=tuple(ct2_config.get("suppress_ids_begin", ())))
    return convert.build_params(config, convert.ct2_whisper_map(config), variables.get, source,
                                dtype or jnp.float32)


# ---- GGUF ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _gguf_reader(path: str, mtime: float):
    import gguf

    return gguf.GGUFReader(path)


def gguf_reader(path: str):
    """A GGUFReader, kept for reuse: parsing a large vocabulary's metadata takes seconds, and
    weights, tokenizer and chat template all come from the same file."""
    path = os.path.abspath(path)
    return _gguf_reader(path, os.path.getmtime(path))


def gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader, source: str) -> Config:
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} is not supported; expected "
                              "'llama'")
    get = lambda key, default=None: gguf_field(reader, f"llama.{key}", default)  # noqa: E731
    n_heads, d_model = get("attention.head_count"), get("embedding_length")
    if get("rope.scaling.type", "none") not in ("none", "linear") or get("rope.scaling.factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: rope scaling is not supported")
    vocab = get("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    names = {t.name for t in reader.tensors}
    return Config.llama(
        vocab_size=vocab, d_model=d_model, n_layers=get("block_count"), n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        head_dim=get("attention.key_length", d_model // n_heads),
        d_ff=get("feed_forward_length"), max_seq_len=get("context_length", 2048),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in names,
        bos_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"))


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


# ---- jaxkv's own format (orbax) -----------------------------------------------------------

def _flat(params):
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {convert.path_name(path): leaf for path, leaf in leaves}


def save(params: Params, path, tokenizer=None, chat_template: str | None = None) -> None:
    """Writes params (bitwise) with orbax, plus the config; optionally the tokenizer too."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), _flat(params), force=True)
    meta = {"config": params.config.to_dict(), "dtype": str(params.dtype),
            "chat_template": chat_template}
    with open(os.path.join(path, SAVED_CONFIG), "w") as f:
        json.dump(meta, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(os.path.join(path, "tokenizer.json"))


def load_saved(path: str, dtype=None) -> Params:
    """Params written by save, bitwise as saved (dtype=None) or cast to dtype."""
    path = os.path.abspath(path)
    with open(os.path.join(path, SAVED_CONFIG)) as f:
        meta = json.load(f)
    config = Config.from_dict(meta["config"])
    skeleton = jax.eval_shape(lambda: init_params(config, jax.random.key(0),
                                                  jnp.dtype(meta["dtype"])))
    with ocp.StandardCheckpointer() as ckptr:
        flat = ckptr.restore(os.path.join(path, "params"), _flat(skeleton))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(skeleton)
    params = jax.tree_util.tree_unflatten(treedef, [flat[convert.path_name(p)] for p, _ in leaves])
    if dtype is not None and jnp.dtype(dtype) != params.dtype:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    return params
