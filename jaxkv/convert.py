"""Foreign checkpoints -> Params, by declarative name maps with shape-checked reshapes.

A name map sends each of our parameter paths ("blocks.wq") to a source tensor: its name in the
checkpoint ("{i}" marks a per-layer tensor and is the layer index), the shape it must have
there, and the reshape into our layout. A missing or misshapen tensor is an error that names it.
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
    name: str | None  # tensor name in the checkpoint ("{i}": layer index); None: zeros
    shape: tuple  # the shape the checkpoint must hold
    to_ours: Callable = lambda w: w  # reshape into our layout


def bias_of(name: str) -> str:
    """The bias beside a weight: 'x.weight' -> 'x.bias', 'x/weight' -> 'x/bias'."""
    return name[: -len("weight")] + "bias"


def transpose(w):
    return w.T


def linear(in_dim, *out_shape):
    """A [out, in] matrix (torch Linear, GGUF, CTranslate2) -> [in, *out_shape]."""
    return lambda w: w.T.reshape(in_dim, *out_shape)


def rows(j, n, then=lambda w: w):
    """The j-th block of n rows of a fused tensor (e.g. Q, K, V stacked on the out axis)."""
    return lambda w: then(w[j * n:(j + 1) * n])


def unpermute_rope_rows(w, n_heads: int):
    """Undo llama.cpp's Q/K row order (interleaved RoPE pairs) -> Hugging Face's rotate-half."""
    r = w.shape[0]
    return w.reshape(n_heads, r // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def attention(c: Config, ours: str, q, k, v, o, biases=("q", "k", "v", "o"), fix=None) -> dict:
    """ours.{wq, wk, wv, wo} (+ biases) from separate [out, in] tensors named q, k, v, o.

    biases: which of them have a ".bias" twin (the others get zeros); fix: {"q": f, ...}
    applied to a tensor (and its bias) before the reshape.
    """
    D, N, K, H = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    fix = fix or {}
    heads = {"q": (N, H), "k": (K, H), "v": (K, H)}
    m = {}
    for part, name in (("q", q), ("k", k), ("v", v)):
        f = fix.get(part, lambda w: w)
        m[f"{ours}.w{part}"] = Src(name, (np.prod(heads[part]), D),
                                   lambda w, f=f, s=heads[part]: linear(D, *s)(f(w)))
        m[f"{ours}.b{part}"] = Src(bias_of(name) if part in biases else None,
                                   (np.prod(heads[part]),),
                                   lambda b, f=f, s=heads[part]: f(b).reshape(s))
    m[f"{ours}.wo"] = Src(o, (D, N * H), lambda w: w.T.reshape(N, H, D))
    m[f"{ours}.bo"] = Src(bias_of(o) if "o" in biases else None, (D,))
    return m


def feed_forward(c: Config, ours: str, up, down, gate=None) -> dict:
    """ours.{w_up, w_down, w_gate} (+ biases) from [out, in] tensors."""
    D, F = c.d_model, c.d_ff
    m = {f"{ours}.w_up": Src(up, (F, D), transpose), f"{ours}.w_down": Src(down, (D, F), transpose),
         f"{ours}.b_up": Src(bias_of(up), (F,)),
         f"{ours}.b_down": Src(bias_of(down), (D,))}
    if gate:
        m[f"{ours}.w_gate"] = Src(gate, (F, D), transpose)
        m[f"{ours}.b_gate"] = Src(bias_of(gate), (F,))
    return m


def norm(c: Config, ours: str, scale: str, bias: str | None = None) -> dict:
    return {f"{ours}.scale": Src(scale, (c.d_model,)),
            f"{ours}.bias": Src(bias or bias_of(scale), (c.d_model,))}


def llama_map(c: Config, names: dict, unpermute_qk=False) -> dict:
    """Llama-family map; names gives the source tensor names (HF and GGUF differ only there)."""
    fix = {}
    if unpermute_qk:
        fix = {"q": lambda w: unpermute_rope_rows(w, c.n_heads),
               "k": lambda w: unpermute_rope_rows(w, c.n_kv_heads)}
    return {
        "embed": Src(names["embed"], (c.vocab_size, c.d_model)),
        "lm_head": Src(names["lm_head"], (c.vocab_size, c.d_model), transpose),
        **norm(c, "blocks.attn_norm", names["attn_norm"]),
        **attention(c, "blocks", names["q"], names["k"], names["v"], names["o"], fix=fix),
        **norm(c, "blocks.mlp_norm", names["mlp_norm"]),
        **feed_forward(c, "blocks", names["up"], names["down"], names["gate"]),
        **norm(c, "final_norm", names["final_norm"]),
    }


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
        **norm(c, "blocks.attn_norm", h + "ln_1.weight"),
        "blocks.wq": Src(h + "attn.c_attn.weight", (D, 3 * D), part(0, (N, H))),
        "blocks.wk": Src(h + "attn.c_attn.weight", (D, 3 * D), part(1, (N, H))),
        "blocks.wv": Src(h + "attn.c_attn.weight", (D, 3 * D), part(2, (N, H))),
        "blocks.bq": Src(h + "attn.c_attn.bias", (3 * D,), part(0, (N, H))),
        "blocks.bk": Src(h + "attn.c_attn.bias", (3 * D,), part(1, (N, H))),
        "blocks.bv": Src(h + "attn.c_attn.bias", (3 * D,), part(2, (N, H))),
        "blocks.wo": Src(h + "attn.c_proj.weight", (D, D), lambda w: w.reshape(N, H, D)),
        "blocks.bo": Src(h + "attn.c_proj.bias", (D,)),
        **norm(c, "blocks.mlp_norm", h + "ln_2.weight"),
        "blocks.w_up": Src(h + "mlp.c_fc.weight", (D, F)),
        "blocks.b_up": Src(h + "mlp.c_fc.bias", (F,)),
        "blocks.w_down": Src(h + "mlp.c_proj.weight", (F, D)),
        "blocks.b_down": Src(h + "mlp.c_proj.bias", (D,)),
        **norm(c, "final_norm", prefix + "ln_f.weight"),
    }


def t5_map(c: Config) -> dict:
    """Hugging Face T5ForConditionalGeneration."""
    R, N = c.relative_buckets, c.n_heads

    def stack(side, ours, self_layer="SelfAttention"):
        b = f"{side}.block.{{i}}.layer."
        ff = 2 if side == "decoder" else 1
        dense = b + f"{ff}.DenseReluDense."
        a = b + f"0.{self_layer}."
        return {**attention(c, ours, a + "q.weight", a + "k.weight", a + "v.weight",
                            a + "o.weight", biases=()),
                **norm(c, f"{ours}.attn_norm", b + "0.layer_norm.weight"),
                **norm(c, f"{ours}.mlp_norm", b + f"{ff}.layer_norm.weight"),
                **(feed_forward(c, ours, dense + "wi_1.weight", dense + "wo.weight",
                                dense + "wi_0.weight") if c.gated_mlp else
                   feed_forward(c, ours, dense + "wi.weight", dense + "wo.weight"))}

    x = "decoder.block.{i}.layer.1.EncDecAttention."
    return {
        "embed": Src("shared.weight", (c.vocab_size, c.d_model)),
        "lm_head": Src("lm_head.weight", (c.vocab_size, c.d_model), transpose),
        "rel_bias": Src("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                        (R, N)),
        "encoder.rel_bias": Src(
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", (R, N)),
        **stack("encoder", "encoder.blocks"), **stack("decoder", "blocks"),
        **attention(c, "cross", x + "q.weight", x + "k.weight", x + "v.weight", x + "o.weight",
                    biases=()),
        **norm(c, "cross.norm", "decoder.block.{i}.layer.1.layer_norm.weight"),
        **norm(c, "encoder.final_norm", "encoder.final_layer_norm.weight"),
        **norm(c, "final_norm", "decoder.final_layer_norm.weight"),
    }


def audio_stem(c: Config, conv1, conv2, positions) -> dict:
    """Whisper's convolutions ([out, in, width] -> [width, in, out]) and position table."""
    D, e = c.d_model, c.encoder
    conv = lambda w: w.transpose(2, 1, 0)  # noqa: E731
    return {"encoder.conv1_w": Src(conv1 + "weight", (D, e.n_mels, 3), conv),
            "encoder.conv1_b": Src(conv1 + "bias", (D,)),
            "encoder.conv2_w": Src(conv2 + "weight", (D, D, 3), conv),
            "encoder.conv2_b": Src(conv2 + "bias", (D,)),
            "encoder.pos_embed": Src(positions, (e.max_len, D))}


def whisper_map(c: Config) -> dict:
    """Hugging Face WhisperForConditionalGeneration (its k_proj has no bias)."""
    def stack(side, ours):
        b = f"model.{side}.layers.{{i}}."
        return {**attention(c, ours, *(b + f"self_attn.{p}_proj.weight" for p in "qkv"),
                            b + "self_attn.out_proj.weight", biases=("q", "v", "o")),
                **norm(c, f"{ours}.attn_norm", b + "self_attn_layer_norm.weight"),
                **feed_forward(c, ours, b + "fc1.weight", b + "fc2.weight"),
                **norm(c, f"{ours}.mlp_norm", b + "final_layer_norm.weight")}

    x = "model.decoder.layers.{i}.encoder_attn."
    return {
        "embed": Src("model.decoder.embed_tokens.weight", (c.vocab_size, c.d_model)),
        "pos_embed": Src("model.decoder.embed_positions.weight", (c.max_seq_len, c.d_model)),
        **audio_stem(c, "model.encoder.conv1.", "model.encoder.conv2.",
                     "model.encoder.embed_positions.weight"),
        **stack("encoder", "encoder.blocks"), **stack("decoder", "blocks"),
        **attention(c, "cross", *(x + f"{p}_proj.weight" for p in "qkv"), x + "out_proj.weight",
                    biases=("q", "v", "o")),
        **norm(c, "cross.norm", "model.decoder.layers.{i}.encoder_attn_layer_norm.weight"),
        **norm(c, "encoder.final_norm", "model.encoder.layer_norm.weight"),
        **norm(c, "final_norm", "model.decoder.layer_norm.weight"),
    }


def ct2_whisper_map(c: Config) -> dict:
    """CTranslate2's WhisperSpec: self-attention Q/K/V fused in linear_0 ([3D, D]); cross
    attention Q in linear_0 and K/V fused in linear_1 ([2D, D]); norms are gamma/beta."""
    D, N, H = c.d_model, c.n_heads, c.head_dim

    def ln(ours, name):
        return {f"{ours}.scale": Src(name + "/gamma", (D,)), f"{ours}.bias": Src(name + "/beta", (D,))}

    def fused(ours, name, parts):
        """ours.w{p} / b{p} for the parts stacked in one [len(parts) * D, D] tensor."""
        n = len(parts)
        m = {}
        for j, p in enumerate(parts):
            m[f"{ours}.w{p}"] = Src(name + "/weight", (n * D, D), rows(j, D, linear(D, N, H)))
            m[f"{ours}.b{p}"] = Src(name + "/bias", (n * D,), rows(j, D, lambda b: b.reshape(N, H)))
        return m

    def out(ours, name):
        return {f"{ours}.wo": Src(name + "/weight", (D, D), lambda w: w.T.reshape(N, H, D)),
                f"{ours}.bo": Src(name + "/bias", (D,))}

    def stack(side, ours):
        b = f"{side}/layer_{{i}}/"
        return {**fused(ours, b + "self_attention/linear_0", "qkv"),
                **out(ours, b + "self_attention/linear_1"),
                **ln(f"{ours}.attn_norm", b + "self_attention/layer_norm"),
                **feed_forward(c, ours, b + "ffn/linear_0/weight", b + "ffn/linear_1/weight"),
                **ln(f"{ours}.mlp_norm", b + "ffn/layer_norm")}

    x = "decoder/layer_{i}/attention/"
    return {
        "embed": Src("decoder/embeddings/weight", (c.vocab_size, D)),
        "pos_embed": Src("decoder/position_encodings/encodings", (c.max_seq_len, D)),
        **audio_stem(c, "encoder/conv1/", "encoder/conv2/", "encoder/position_encodings/encodings"),
        **stack("encoder", "encoder.blocks"), **stack("decoder", "blocks"),
        **fused("cross", x + "linear_0", "q"), **fused("cross", x + "linear_1", "kv"),
        **out("cross", x + "linear_2"), **ln("cross.norm", x + "layer_norm"),
        **ln("encoder.final_norm", "encoder/layer_norm"), **ln("final_norm", "decoder/layer_norm"),
    }


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
        if src.name is None:
            w = np.zeros(leaf.shape, np.float32)
        elif "{i}" in src.name:
            n_layers = config.encoder.n_layers if ours.startswith("encoder.") else config.n_layers
            w = np.stack([fetch(ours, src, i) for i in range(n_layers)])
        else:
            w = fetch(ours, src)
        assert w.shape == leaf.shape, (ours, w.shape, leaf.shape)
        out.append(jnp.asarray(w, dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
