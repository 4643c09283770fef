"""Foreign checkpoints -> Params, by declarative name maps with shape-checked reshapes.

A name map sends each of our parameter paths ("blocks.wq") to a source tensor: its name in the
checkpoint ("{i}" is the layer index for per-layer fields), the shape it must have there, and
the reshape into our layout. A missing or misshapen tensor is an error that names it.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import Config
from jaxkv.params import Params, init_params


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model it claims to be."""


@dataclasses.dataclass(frozen=True)
class Src:
    name: str  # tensor name in the checkpoint; "{i}" is the layer index
    shape: tuple  # the shape the checkpoint must hold
    to_ours: Callable = lambda w: w  # reshape into our layout


def linear(out_shape, in_dim):
    """A [out, in] matrix (torch Linear, GGUF) -> [in, *out_shape]."""
    return lambda w: w.T.reshape(in_dim, *out_shape)


def linear_out(in_shape, out_dim):
    """A [out, in] matrix -> [*in_shape, out] (e.g. o_proj -> [N, H, D])."""
    return lambda w: w.T.reshape(*in_shape, out_dim)


def llama_map(c: Config, names: dict, unpermute_qk=False) -> dict:
    """Llama-family map; names gives the source tensor names (HF and GGUF differ only there)."""
    D, N, K, H, F, V = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size
    q_fix = (lambda w: unpermute_rope_rows(w, N)) if unpermute_qk else (lambda w: w)
    k_fix = (lambda w: unpermute_rope_rows(w, K)) if unpermute_qk else (lambda w: w)
    m = {
        "embed": Src(names["embed"], (V, D)),
        "blocks.attn_norm.scale": Src(names["attn_norm"], (D,)),
        "blocks.wq": Src(names["q"], (N * H, D), lambda w: linear((N, H), D)(q_fix(w))),
        "blocks.wk": Src(names["k"], (K * H, D), lambda w: linear((K, H), D)(k_fix(w))),
        "blocks.wv": Src(names["v"], (K * H, D), linear((K, H), D)),
        "blocks.wo": Src(names["o"], (D, N * H), linear_out((N, H), D)),
        "blocks.mlp_norm.scale": Src(names["mlp_norm"], (D,)),
        "blocks.w_gate": Src(names["gate"], (F, D), lambda w: w.T),
        "blocks.w_up": Src(names["up"], (F, D), lambda w: w.T),
        "blocks.w_down": Src(names["down"], (D, F), lambda w: w.T),
        "final_norm.scale": Src(names["final_norm"], (D,)),
        "lm_head": Src(names["lm_head"], (V, D), lambda w: w.T),
    }
    for ours, theirs, shape in (("bq", "q", (N, H)), ("bk", "k", (K, H)), ("bv", "v", (K, H)),
                                ("bo", "o", (D,))):
        fix = {"bq": q_fix, "bk": k_fix}.get(ours, lambda b: b)
        m[f"blocks.{ours}"] = Src(names[theirs].replace(".weight", ".bias"), (int(np.prod(shape)),),
                                  lambda b, fix=fix, shape=shape: fix(b).reshape(shape))
    for ours, theirs, n in (("b_up", "up", F), ("b_gate", "gate", F), ("b_down", "down", D)):
        m[f"blocks.{ours}"] = Src(names[theirs].replace(".weight", ".bias"), (n,))
    return m


HF_LLAMA_NAMES = {
    "embed": "model.embed_tokens.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}

GGUF_LLAMA_NAMES = {
    "embed": "token_embd.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}


def gpt2_map(c: Config, prefix: str = "transformer.") -> dict:
    """GPT-2 map. Its Conv1D weights are stored [in, out]; c_attn fuses Q, K and V."""
    D, N, H, F, V = c.d_model, c.n_heads, c.head_dim, c.d_ff, c.vocab_size
    h = prefix + "h.{i}."

    def part(j, shape):  # the j-th of c_attn's three [.., D] blocks
        return lambda w: w[..., j * D:(j + 1) * D].reshape(*w.shape[:-1], *shape)

    return {
        "embed": Src(prefix + "wte.weight", (V, D)),
        "pos_embed": Src(prefix + "wpe.weight", (c.max_seq_len, D)),
        "blocks.attn_norm.scale": Src(h + "ln_1.weight", (D,)),
        "blocks.attn_norm.bias": Src(h + "ln_1.bias", (D,)),
        "blocks.wq": Src(h + "attn.c_attn.weight", (D, 3 * D), part(0, (N, H))),
        "blocks.wk": Src(h + "attn.c_attn.weight", (D, 3 * D), part(1, (N, H))),
        "blocks.wv": Src(h + "attn.c_attn.weight", (D, 3 * D), part(2, (N, H))),
        "blocks.bq": Src(h + "attn.c_attn.bias", (3 * D,), part(0, (N, H))),
        "blocks.bk": Src(h + "attn.c_attn.bias", (3 * D,), part(1, (N, H))),
        "blocks.bv": Src(h + "attn.c_attn.bias", (3 * D,), part(2, (N, H))),
        "blocks.wo": Src(h + "attn.c_proj.weight", (D, D), lambda w: w.reshape(N, H, D)),
        "blocks.bo": Src(h + "attn.c_proj.bias", (D,)),
        "blocks.mlp_norm.scale": Src(h + "ln_2.weight", (D,)),
        "blocks.mlp_norm.bias": Src(h + "ln_2.bias", (D,)),
        "blocks.w_up": Src(h + "mlp.c_fc.weight", (D, F)),
        "blocks.b_up": Src(h + "mlp.c_fc.bias", (F,)),
        "blocks.w_down": Src(h + "mlp.c_proj.weight", (F, D)),
        "blocks.b_down": Src(h + "mlp.c_proj.bias", (D,)),
        "final_norm.scale": Src(prefix + "ln_f.weight", (D,)),
        "final_norm.bias": Src(prefix + "ln_f.bias", (D,)),
    }


def unpermute_rope_rows(w, n_heads: int):
    """Undo llama.cpp's Q/K row order (interleaved RoPE pairs) -> Hugging Face's rotate-half."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def path_name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path)


def build_params(config: Config, name_map: dict, get_tensor: Callable, source: str,
                 dtype=jnp.float32) -> Params:
    """Params for config, each leaf read through name_map; get_tensor(name) -> array or None."""
    skeleton = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(skeleton)

    def fetch(ours: str, src: Src, layer=None):
        name = src.name.format(i=layer)
        w = get_tensor(name)
        if w is None:
            raise CheckpointError(f"{source}: missing tensor '{name}' (for {ours})")
        if tuple(w.shape) != tuple(src.shape):
            raise CheckpointError(f"{source}: tensor '{name}' has shape {tuple(w.shape)}, "
                                  f"expected {tuple(src.shape)}")
        return src.to_ours(np.asarray(w, np.float32))

    out = []
    for path, leaf in leaves:
        ours = path_name(path)
        src = name_map[ours]
        if ours.startswith("blocks."):
            w = np.stack([fetch(ours, src, i) for i in range(config.n_layers)])
        else:
            w = fetch(ours, src)
        assert w.shape == leaf.shape, (ours, w.shape, leaf.shape)
        out.append(jnp.asarray(w, dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
