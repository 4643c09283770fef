"""Loading and saving parameters: Hugging Face directories, GGUF files, jaxkv's own format."""

import functools
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxkv import convert
from jaxkv.config import Config
from jaxkv.convert import CheckpointError
from jaxkv.params import Params, init_params

SAVED_CONFIG = "jaxkv_config.json"
HF_ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM")


def load(path, dtype=None) -> Params:
    """Params from a Hugging Face directory (config.json + *.safetensors), a .gguf file, or a
    directory written by jaxkv.save.

    dtype: what floating weights become; by default float32 for foreign formats and the saved
    dtype (bitwise as saved) for jaxkv's own.
    """
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return load_gguf(path, dtype)
    if os.path.isfile(os.path.join(path, SAVED_CONFIG)):
        return load_saved(path, dtype)
    if os.path.isfile(os.path.join(path, "config.json")):
        return load_hf(path, dtype)
    raise FileNotFoundError(f"load: {path!r} is neither a .gguf file nor a directory holding "
                            f"config.json (Hugging Face) or {SAVED_CONFIG} (jaxkv.save)")


# ---- Hugging Face -------------------------------------------------------------------------

def config_from_hf(hf: dict, source: str = "config.json") -> Config:
    """Our Config from a Hugging Face config.json dict (GPT-2 or Llama)."""
    arch = (hf.get("architectures") or [None])[0]
    common = dict(bos_id=_single_id(hf.get("bos_token_id")), eos_id=_single_id(hf.get("eos_token_id")))
    if arch == "GPT2LMHeadModel":
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise CheckpointError(f"{source}: GPT-2 attention variants are not supported")
        act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
               "relu": "relu"}.get(hf.get("activation_function", "gelu_new"))
        if act is None:
            raise CheckpointError(f"{source}: unsupported activation_function "
                                  f"{hf['activation_function']!r}")
        return Config.gpt2(vocab_size=hf["vocab_size"], d_model=hf["n_embd"],
                           n_layers=hf["n_layer"], n_heads=hf["n_head"],
                           max_seq_len=hf["n_positions"], d_ff=hf.get("n_inner"),
                           norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=act, **common)
    if arch == "LlamaForCausalLM":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CheckpointError(f"{source}: rope scaling {rope!r} is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: unsupported hidden_act {hf['hidden_act']!r}")
        n_heads = hf["num_attention_heads"]
        return Config.llama(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=hf.get("head_dim"),
            d_ff=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            attn_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
            tie_embeddings=hf.get("tie_word_embeddings", False), **common)
    raise CheckpointError(f"{source}: architecture {arch!r} is not supported; expected one of "
                          f"{', '.join(HF_ARCHITECTURES)}")


def _single_id(value):
    return value[0] if isinstance(value, list) and value else value


def load_hf(directory: str, dtype=None) -> Params:
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as f:
        config = config_from_hf(json.load(f), config_path)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights found")
    tensors = _safetensors_index(files)
    if "transformer.wte.weight" in tensors or config.position == "rope":
        prefix = "transformer."
    else:
        prefix = ""  # GPT2Model-style checkpoints without the LM wrapper's prefix
    name_map = (convert.gpt2_map(config, prefix) if config.position == "learned"
                else convert.llama_map(config, convert.HF_LLAMA_NAMES))
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
