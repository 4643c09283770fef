"""Foreign checkpoints -> Params, by declarative name maps with shape-checked reshapes.

A name map sends each of our parameter names ("blocks.wqkv": the same name for every layer) to
its sources: a tensor's name in the checkpoint ("{i}" is the layer index), the shape it must
have there, and the reshape into our layout ([out, in] matrices; see params.py). Fused
parameters (Q/K/V, gate/up) name several sources and how to join them. A missing or misshapen
tensor is an error that names it.
"""

import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import Config
from jaxkv.params import Params, gate_up_rows, init_params, kv_rows, qkv_rows


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model it claims to be."""


@dataclasses.dataclass(frozen=True)
class Src:
    name: str | None  # tensor name in the checkpoint ("{i}": layer index); None: zeros
    shape: tuple  # the shape the checkpoint must hold (or of the zeros)
    to_ours: Callable = lambda w: w  # reshape into our layout


@dataclasses.dataclass(frozen=True)
class Fused:
    parts: tuple  # of Src
    join: Callable  # join(*parts in our layout) -> the parameter


def bias_of(name: str | None) -> str | None:
    """The bias beside a weight: 'x.weight' -> 'x.bias', 'x/weight' -> 'x/bias'."""
    return None if name is None else name[: -len("weight")] + "bias"


def transpose(w):
    return w.T


def rows(j, n, then=lambda w: w):
    """The j-th block of n rows of a fused tensor (e.g. Q, K, V stacked on the out axis)."""
    return lambda w: then(w[j * n:(j + 1) * n])


def unpermute_rope_rows(w, n_heads: int):
    """Undo llama.cpp's Q/K row order (interleaved RoPE pairs) -> Hugging Face's rotate-half."""
    r = w.shape[0]
    return w.reshape(n_heads, r // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def qkv(c: Config, ours: str, q: Src, k: Src, v: Src, qb: Src, kb: Src, vb: Src) -> dict:
    """ours.wqkv / ours.bqkv fused from separate [out, in] Q, K, V sources (and biases)."""
    join = lambda *p: qkv_rows(c, *p)  # noqa: E731
    return {f"{ours}.wqkv": Fused((q, k, v), join), f"{ours}.bqkv": Fused((qb, kb, vb), join)}


def linear_qkv(c: Config, ours: str, q, k, v, biases="qkv", fix=None) -> dict:
    """qkv() from separately named [out, in] tensors; `biases` says which have a bias twin."""
    D, NH, KH = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    fix = fix or {}
    src = {}
    for part, name, n in (("q", q, NH), ("k", k, KH), ("v", v, KH)):
        f = fix.get(part, lambda w: w)
        src[part] = Src(name, (n, D), f)
        src[part + "b"] = Src(bias_of(name) if part in biases else None, (n,), f)
    return qkv(c, ours, src["q"], src["k"], src["v"], src["qb"], src["kb"], src["vb"])


def out_proj(c: Config, ours: str, name: str, bias=True, to_ours=lambda w: w) -> dict:
    D = c.d_model
    return {f"{ours}.wo": Src(name, (D, c.n_heads * c.head_dim), to_ours),
            f"{ours}.bo": Src(bias_of(name) if bias else None, (D,))}


def feed_forward(c: Config, ours: str, up, down, gate=None, to_ours=lambda w: w) -> dict:
    """ours.w_in (gate and up fused) / w_out (+ biases) from [out, in] tensors."""
    D, F = c.d_model, c.d_ff
    if gate:
        w_in = Fused((Src(gate, (F, D)), Src(up, (F, D))), gate_up_rows)
        b_in = Fused((Src(bias_of(gate), (F,)), Src(bias_of(up), (F,))), gate_up_rows)
    else:
        w_in, b_in = Src(up, (F, D)), Src(bias_of(up), (F,))
    return {f"{ours}.w_in": w_in, f"{ours}.b_in": b_in, f"{ours}.w_out": Src(down, (D, F)),
            f"{ours}.b_out": Src(bias_of(down), (D,))}


def norm(c: Config, ours: str, scale: str, bias: str | None = None, width=None) -> dict:
    """ours.scale (+ bias) of width d_model, or `width` (per-head norms: head_dim)."""
    width = width or c.d_model
    return {f"{ours}.scale": Src(scale, (width,)),
            f"{ours}.bias": Src(bias or bias_of(scale), (width,))}


def llama_map(c: Config, names: dict, unpermute_qk=False) -> dict:
    """Llama-family map (also Qwen2, Qwen3: their q/k/v biases and per-head q/k norms are read
    when the config has them); names gives the source tensor names (HF and GGUF differ only
    there)."""
    fix = {}
    if unpermute_qk:
        fix = {"q": lambda w: unpermute_rope_rows(w, c.n_heads),
               "k": lambda w: unpermute_rope_rows(w, c.n_kv_heads)}
    return {
        "embed": Src(names["embed"], (c.vocab_size, c.d_model)),
        "lm_head": Src(names["lm_head"], (c.vocab_size, c.d_model)),
        **norm(c, "blocks.attn_norm", names["attn_norm"]),
        **linear_qkv(c, "blocks", names["q"], names["k"], names["v"], fix=fix),
        **out_proj(c, "blocks", names["o"]),
        **norm(c, "blocks.q_norm", names["q_norm"], width=c.head_dim),
        **norm(c, "blocks.k_norm", names["k_norm"], width=c.head_dim),
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
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}

def one_plus(w):
    """Gemma's norms scale by 1 + weight: stored as that sum, made in float32 as transformers
    makes it on every call (so exact in float32; rounded once when loaded in a narrower
    dtype)."""
    return np.float32(1) + w


def gemma_map(c: Config) -> dict:
    """Hugging Face Gemma2ForCausalLM / Gemma3ForCausalLM: the Llama map with each sublayer's
    output normed too (post_attention_layernorm, post_feedforward_layernorm; the MLP's input
    norm is pre_feedforward_layernorm), every norm scaling by 1 + weight."""
    layer = "model.layers.{i}."
    names = {**HF_LLAMA_NAMES, "mlp_norm": layer + "pre_feedforward_layernorm.weight"}
    m = {**llama_map(c, names),
         **norm(c, "blocks.attn_out_norm", layer + "post_attention_layernorm.weight"),
         **norm(c, "blocks.mlp_out_norm", layer + "post_feedforward_layernorm.weight")}
    return {ours: dataclasses.replace(src, to_ours=one_plus) if ours.endswith("norm.scale")
            else src for ours, src in m.items()}


GGUF_LLAMA_NAMES = {
    "embed": "token_embd.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}


def gpt2_map(c: Config, prefix: str = "transformer.") -> dict:
    """GPT-2 map. Its Conv1D weights are stored [in, out]; c_attn fuses Q, K and V."""
    D, F = c.d_model, c.d_ff
    h = prefix + "h.{i}."
    w, b = h + "attn.c_attn.weight", h + "attn.c_attn.bias"
    return {
        "embed": Src(prefix + "wte.weight", (c.vocab_size, D)),
        "pos_embed": Src(prefix + "wpe.weight", (c.max_seq_len, D)),
        **norm(c, "blocks.attn_norm", h + "ln_1.weight"),
        **qkv(c, "blocks", *(Src(w, (D, 3 * D), lambda x, j=j: x.T[j * D:(j + 1) * D])
                             for j in range(3)),
              *(Src(b, (3 * D,), rows(j, D)) for j in range(3))),
        **out_proj(c, "blocks", h + "attn.c_proj.weight", to_ours=transpose),
        **norm(c, "blocks.mlp_norm", h + "ln_2.weight"),
        "blocks.w_in": Src(h + "mlp.c_fc.weight", (D, F), transpose),
        "blocks.b_in": Src(h + "mlp.c_fc.bias", (F,)),
        "blocks.w_out": Src(h + "mlp.c_proj.weight", (F, D), transpose),
        "blocks.b_out": Src(h + "mlp.c_proj.bias", (D,)),
        **norm(c, "final_norm", prefix + "ln_f.weight"),
    }


def t5_map(c: Config) -> dict:
    """Hugging Face T5ForConditionalGeneration."""
    R, N = c.relative_buckets, c.n_heads

    def stack(side, ours):
        b = f"{side}.block.{{i}}.layer."
        ff = 2 if side == "decoder" else 1
        dense = b + f"{ff}.DenseReluDense."
        a = b + "0.SelfAttention."
        return {**linear_qkv(c, ours, a + "q.weight", a + "k.weight", a + "v.weight", biases=""),
                **out_proj(c, ours, a + "o.weight", bias=False),
                **norm(c, f"{ours}.attn_norm", b + "0.layer_norm.weight"),
                **norm(c, f"{ours}.mlp_norm", b + f"{ff}.layer_norm.weight"),
                **(feed_forward(c, ours, dense + "wi_1.weight", dense + "wo.weight",
                                dense + "wi_0.weight") if c.gated_mlp else
                   feed_forward(c, ours, dense + "wi.weight", dense + "wo.weight"))}

    x = "decoder.block.{i}.layer.1.EncDecAttention."
    return {
        "embed": Src("shared.weight", (c.vocab_size, c.d_model)),
        "lm_head": Src("lm_head.weight", (c.vocab_size, c.d_model)),
        "rel_bias": Src("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                        (R, N)),
        "encoder.rel_bias": Src(
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", (R, N)),
        **stack("encoder", "encoder.blocks"), **stack("decoder", "blocks"),
        **cross(c, x + "q.weight", x + "k.weight", x + "v.weight", x + "o.weight", biases=""),
        **norm(c, "cross.norm", "decoder.block.{i}.layer.1.layer_norm.weight"),
        **norm(c, "encoder.final_norm", "encoder.final_layer_norm.weight"),
        **norm(c, "final_norm", "decoder.final_layer_norm.weight"),
    }


def cross(c: Config, q, k, v, o, biases="qvo", kv=None) -> dict:
    """cross.{wq, wkv, wo} (+ biases) from [out, in] tensors; kv: (k Src, v Src, kb, vb)
    given directly (fused checkpoints) instead of names k and v."""
    D, NH, KH = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    if kv is None:
        kv = (Src(k, (KH, D)), Src(v, (KH, D)),
              Src(bias_of(k) if "k" in biases else None, (KH,)),
              Src(bias_of(v) if "v" in biases else None, (KH,)))
    join = lambda k_, v_: kv_rows(c, k_, v_)  # noqa: E731
    m = {"cross.wq": Src(q, (NH, D)), "cross.bq": Src(bias_of(q) if "q" in biases else None, (NH,)),
         "cross.wkv": Fused(kv[:2], join), "cross.bkv": Fused(kv[2:], join)}
    return {**m, **out_proj(c, "cross", o, bias="o" in biases)}


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
        return {**linear_qkv(c, ours, *(b + f"self_attn.{p}_proj.weight" for p in "qkv"),
                             biases="qv"),
                **out_proj(c, ours, b + "self_attn.out_proj.weight"),
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
        **cross(c, *(x + f"{p}_proj.weight" for p in "qkv"), x + "out_proj.weight"),
        **norm(c, "cross.norm", "model.decoder.layers.{i}.encoder_attn_layer_norm.weight"),
        **norm(c, "encoder.final_norm", "model.encoder.layer_norm.weight"),
        **norm(c, "final_norm", "model.decoder.layer_norm.weight"),
    }


def ct2_whisper_map(c: Config) -> dict:
    """CTranslate2's WhisperSpec: self-attention Q/K/V fused in linear_0 ([3D, D]); cross
    attention Q in linear_0 and K/V fused in linear_1 ([2D, D]); norms are gamma/beta."""
    D = c.d_model

    def ln(ours, name):
        return norm(c, ours, name + "/gamma", name + "/beta")

    def parts(name, n):
        """The n [D, D] blocks of a fused [n * D, D] weight, then of its bias."""
        return (*(Src(name + "/weight", (n * D, D), rows(j, D)) for j in range(n)),
                *(Src(name + "/bias", (n * D,), rows(j, D)) for j in range(n)))

    def stack(side, ours):
        b = f"{side}/layer_{{i}}/"
        return {**qkv(c, ours, *parts(b + "self_attention/linear_0", 3)),
                **out_proj(c, ours, b + "self_attention/linear_1/weight"),
                **ln(f"{ours}.attn_norm", b + "self_attention/layer_norm"),
                **feed_forward(c, ours, b + "ffn/linear_0/weight", b + "ffn/linear_1/weight"),
                **ln(f"{ours}.mlp_norm", b + "ffn/layer_norm")}

    x = "decoder/layer_{i}/attention/"
    k, v, kb, vb = parts(x + "linear_1", 2)
    return {
        "embed": Src("decoder/embeddings/weight", (c.vocab_size, D)),
        "pos_embed": Src("decoder/position_encodings/encodings", (c.max_seq_len, D)),
        **audio_stem(c, "encoder/conv1/", "encoder/conv2/", "encoder/position_encodings/encodings"),
        **stack("encoder", "encoder.blocks"), **stack("decoder", "blocks"),
        **cross(c, x + "linear_0/weight", None, None, x + "linear_2/weight", kv=(k, v, kb, vb)),
        **ln("cross.norm", x + "layer_norm"),
        **ln("encoder.final_norm", "encoder/layer_norm"), **ln("final_norm", "decoder/layer_norm"),
    }


def path_name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
                    for k in path)


def split_layer(name: str):
    """'blocks.3.wqkv' -> ('blocks.wqkv', 3); names without a layer index -> (name, None)."""
    match = re.search(r"\.(\d+)\.", name)
    if match is None:
        return name, None
    return name[: match.start()] + "." + name[match.end():], int(match.group(1))


def build_params(config: Config, name_map: dict, get_tensor: Callable, source: str,
                 dtype=jnp.float32) -> Params:
    """Params for config, each leaf read through name_map; get_tensor(name) -> array or None."""
    skeleton = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(skeleton)

    def fetch(ours: str, src: Src, layer):
        if src.name is None:
            return np.zeros(src.shape, np.float32)
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
        ours, layer = split_layer(path_name(path))
        entry = name_map[ours]
        if isinstance(entry, Fused):
            w = entry.join(*(fetch(ours, part, layer) for part in entry.parts))
        else:
            w = fetch(ours, entry, layer)
        assert w.shape == leaf.shape, (ours, w.shape, leaf.shape)
        out.append(jnp.asarray(w, dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
