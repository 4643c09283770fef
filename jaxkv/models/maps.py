"""Foreign checkpoints -> Params, by declarative name maps with shape-checked reshapes.

A name map sends each of our parameter names ("blocks.wqkv": the same name for every layer) to
its sources: a tensor's name in the checkpoint ("{i}" is the layer index), the shape it must
have there, and the reshape into our layout ([out, in] matrices; see params.py). Fused
parameters (Q/K/V, gate/up) name several sources and how to join them. A missing or misshapen
tensor is an error that names it.

The helpers here build the pieces every family's map shares (fused Q/K/V, output projection,
feed-forward, norms, cross-attention); each family's own map is in its file beside this one.
"""

import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core import quant
from jaxkv.core.config import Config
from jaxkv.core.params import Params, gate_up_rows, kv_rows, path_name, qkv_rows, skeleton
from jaxkv.ops.arrays import Int8, dequantize_rows


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model it claims to be."""


def as_is(w):
    """The layout of a tensor the checkpoint holds as we do."""
    return w


@dataclasses.dataclass(frozen=True)
class Src:
    name: str | None  # tensor name in the checkpoint ("{i}": layer index); None: zeros
    shape: tuple  # the shape the checkpoint must hold (or of the zeros)
    to_ours: Callable = as_is  # reshape into our layout


@dataclasses.dataclass(frozen=True)
class Fused:
    parts: tuple  # of Src
    join: Callable  # join(*parts in our layout) -> the parameter


def bias_of(name: str | None) -> str | None:
    """The bias beside a weight: 'x.weight' -> 'x.bias', 'x/weight' -> 'x/bias'."""
    return None if name is None else name[: -len("weight")] + "bias"


def transpose(w):
    return w.T


def rows(j, n, then=as_is):
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
        f = fix.get(part, as_is)
        src[part] = Src(name, (n, D), f)
        src[part + "b"] = Src(bias_of(name) if part in biases else None, (n,), f)
    return qkv(c, ours, src["q"], src["k"], src["v"], src["qb"], src["kb"], src["vb"])


def out_proj(c: Config, ours: str, name: str, bias=True, to_ours=as_is) -> dict:
    D = c.d_model
    return {f"{ours}.wo": Src(name, (D, c.n_heads * c.head_dim), to_ours),
            f"{ours}.bo": Src(bias_of(name) if bias else None, (D,))}


def feed_forward(c: Config, ours: str, up, down, gate=None, to_ours=as_is) -> dict:
    """ours.w_in (gate and up fused) / w_out (+ biases) from [out, in] tensors."""
    D, F = c.d_model, c.d_ff
    if gate:
        w_in = Fused((Src(gate, (F, D)), Src(up, (F, D))), gate_up_rows)
        b_in = Fused((Src(bias_of(gate), (F,)), Src(bias_of(up), (F,))), gate_up_rows)
    else:
        w_in, b_in = Src(up, (F, D)), Src(bias_of(up), (F,))
    return {f"{ours}.w_in": w_in, f"{ours}.b_in": b_in, f"{ours}.w_out": Src(down, (D, F)),
            f"{ours}.b_out": Src(bias_of(down), (D,))}


def experts(c: Config, router: str, gate: str, up: str, down: str) -> dict:
    """A mixture-of-experts layer's router [E, D] and experts ([E, 2F, D] gate rows then up
    rows, [E, D, F]) from one [out, in] tensor per expert; gate / up / down name expert e's
    with "{e}"."""
    E, D, F = c.n_experts, c.d_model, c.expert_d_ff or c.d_ff
    each = lambda name, shape: tuple(Src(name.replace("{e}", str(e)), shape)  # noqa: E731
                                     for e in range(E))
    gates, ups = each(gate, (F, D)), each(up, (F, D))
    return {"blocks.router": Src(router, (E, D)),
            "blocks.experts_in": Fused(gates + ups, lambda *w: np.stack(
                [np.concatenate([g, u]) for g, u in zip(w[:E], w[E:])])),
            "blocks.experts_out": Fused(each(down, (D, F)), lambda *w: np.stack(w))}


def stacked_experts(c: Config, router: str, gate: str, up: str, down: str) -> dict:
    """experts() from tensors that stack every expert's matrix (llama.cpp's ffn_*_exps):
    gate and up [E, F, D], down [E, D, F]."""
    E, D, F = c.n_experts, c.d_model, c.expert_d_ff or c.d_ff
    return {"blocks.router": Src(router, (E, D)),
            "blocks.experts_in": Fused((Src(gate, (E, F, D)), Src(up, (E, F, D))),
                                       lambda g, u: np.concatenate([g, u], axis=1)),
            "blocks.experts_out": Src(down, (E, D, F))}


def norm(c: Config, ours: str, scale: str, bias: str | None = None, width=None) -> dict:
    """ours.scale (+ bias) of width d_model, or `width` (per-head norms: head_dim)."""
    width = width or c.d_model
    return {f"{ours}.scale": Src(scale, (width,)),
            f"{ours}.bias": Src(bias or bias_of(scale), (width,))}


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


def split_layer(name: str):
    """'blocks.3.wqkv' -> ('blocks.wqkv', 3); names without a layer index -> (name, None)."""
    match = re.search(r"\.(\d+)\.", name)
    if match is None:
        return name, None
    return name[: match.start()] + "." + name[match.end():], int(match.group(1))


def build_params(config: Config, name_map: dict, get_tensor: Callable, source: str,
                 dtype=jnp.float32, int8=False, names=None, shardings=None,
                 get_slice=None) -> Params:
    """Params for config, each leaf read through name_map; get_tensor(name) -> array, None, or
    an Int8 of numpy arrays (a matrix the file holds as int8 blocks).

    int8: every decoder matrix (quant.MATRICES) becomes an Int8: one read as Int8 keeps its
    blocks (its rows moved as the map says), a float one is quantized with one scale per row,
    as jaxkv.quantize does. Without int8, an Int8 read is dequantized. names (the file's
    tensor names): every one must be read, or be a copy or buffer the family's config derives
    (UNREAD): a tensor the config has no place for is an error naming it.

    shardings (a NamedSharding per leaf, on a mesh that may span processes): each leaf is made
    from this process's devices' shares only. A tensor the checkpoint holds as we do is read
    share by share through get_slice(name) (an object with get_shape() and [index], as
    safetensors' get_slice gives, or None), a fused one from the same share of each source;
    one the map reshapes is read whole, one at a time, and cut."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(skeleton(config))
    per_leaf = [None] * len(leaves) if shardings is None else treedef.flatten_up_to(shardings)
    read = set()

    def named(ours: str, src: Src, layer, shape):
        """The tensor's name in the file, its shape checked (None: missing)."""
        name = src.name.format(i=layer)
        read.add(name)
        if shape is None:
            raise CheckpointError(f"{source}: missing tensor '{name}' (for {ours})")
        if tuple(shape) != tuple(src.shape):
            raise CheckpointError(f"{source}: tensor '{name}' has shape {tuple(shape)}, "
                                  f"expected {tuple(src.shape)}")
        return name

    def fetch(ours: str, src: Src, layer):
        if src.name is None:
            return np.zeros(src.shape, np.float32)
        w = get_tensor(src.name.format(i=layer))
        name = named(ours, src, layer, None if w is None else w.shape)
        if isinstance(w, Int8):
            return _int8_rows(w, src.to_ours, f"{source}: tensor '{name}' (for {ours})")
        return src.to_ours(np.asarray(w, np.float32))

    def share(ours: str, entry, layer, shape, index):
        """The leaf at index, read from the file's shares of its sources: a fused leaf's rows
        split over the model axis keep heads / units whole, so they are the join of the same
        share of each source."""
        rows = range(shape[0])[index[0]]
        pieces = []
        for src in entry.parts if isinstance(entry, Fused) else (entry,):
            part = get_slice(src.name.format(i=layer))
            named(ours, src, layer, None if part is None else part.get_shape())
            n = src.shape[0]
            pieces.append(part[rows.start * n // shape[0]: rows.stop * n // shape[0]])
        joined = entry.join(*pieces) if isinstance(entry, Fused) else pieces[0]
        return joined[(slice(None), *index[1:])]

    out = []
    for (path, leaf), sharding in zip(leaves, per_leaf):
        ours, layer = split_layer(path_name(path))
        entry = name_map[ours]
        if sharding is not None and get_slice is not None and _as_held(entry):
            out.append(_from_shares(functools.partial(share, ours, entry, layer, leaf.shape),
                                    leaf.shape, dtype, sharding))
            continue
        if isinstance(entry, Fused):
            w = _join(entry.join, [fetch(ours, part, layer) for part in entry.parts])
        else:
            w = fetch(ours, entry, layer)
        assert w.shape == leaf.shape, (ours, w.shape, leaf.shape)
        out.append(_leaf(w, dtype, int8 and ours in quant.MATRICES) if sharding is None else
                   _from_shares(w.__getitem__, leaf.shape, dtype, sharding))
    unread = sorted(n for n in set(names or ()) - read if not UNREAD.search(n))
    if unread:
        raise CheckpointError(f"{source}: {len(unread)} tensor(s) this config does not use, e.g. "
                              f"{', '.join(map(repr, unread[:4]))}: the config (its layer count, "
                              "its tied head, ...) does not describe this checkpoint")
    return jax.tree_util.tree_unflatten(treedef, out)


def _as_held(entry) -> bool:
    """Whether every source of a leaf is a tensor the file holds as we do (joins aside)."""
    parts = entry.parts if isinstance(entry, Fused) else (entry,)
    return all(p.name is not None and p.to_ours is as_is for p in parts)


def _from_shares(share: Callable, shape: tuple, dtype, sharding):
    """A global array of dtype built from share(index) -> the part of the leaf at index, asked
    only for the parts this process's devices hold."""
    return jax.make_array_from_callback(
        shape, sharding, lambda index: np.asarray(share(index)).astype(dtype, copy=False))


# Tensors a checkpoint may hold that no parameter reads: buffers derived from the config
# (RoPE's inverse frequencies, GPT-2's causal mask) and the copies a tied head or a shared
# embedding leaves (T5's per-stack embeddings; Whisper's head: proj_out in Hugging Face's
# files, decoder/projection in CTranslate2's).
UNREAD = re.compile(r"rotary_emb\.inv_freq$|\.attn\.(masked_)?bias$|position_ids$|"
                    r"^(encoder|decoder)\.embed_tokens\.weight$|^proj_out\.weight$|"
                    r"^decoder/projection/weight$")


def tensor_shapes(config: Config, name_map: dict) -> dict:
    """{tensor name: shape} of every tensor build_params reads for config through name_map:
    what a checkpoint of this model holds."""
    shapes = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(skeleton(config))[0]:
        ours, layer = split_layer(path_name(path))
        entry = name_map[ours]
        for src in entry.parts if isinstance(entry, Fused) else (entry,):
            if src.name is not None:
                shapes[src.name.format(i=layer)] = tuple(src.shape)
    return shapes


def _leaf(w, dtype, int8: bool):
    """A numpy leaf (float, or Int8 of numpy arrays) as a jax one: int8 says whether it is to
    be an Int8."""
    if isinstance(w, Int8) and int8:
        return Int8(jnp.asarray(w.q), jnp.asarray(w.scale, dtype))
    if isinstance(w, Int8):
        w = dequantize_rows(w.q, w.scale.astype(np.float32))
    w = jnp.asarray(w, dtype)
    return quant.quantize_matrix(w) if int8 else w


def _int8_rows(w: Int8, to_ours: Callable, what: str) -> Int8:
    """to_ours applied to an int8 matrix (numpy q [O, I], scale [O, NB]) as a move of whole
    rows: it is applied to the row numbers, and q's and scale's rows are taken in the order it
    gives. A map that does anything else to the rows (a transpose, arithmetic on the values)
    would break the blocks and is refused."""
    O = w.shape[0]
    rows_R1 = to_ours(np.arange(O)[:, None])
    if (rows_R1.ndim != 2 or rows_R1.shape[1] != 1 or rows_R1.dtype.kind not in "iu"
            or rows_R1.size and not 0 <= rows_R1.min() <= rows_R1.max() < O):
        raise CheckpointError(f"{what}: int8 blocks can only have their rows reordered, but "
                              "this model's name map transforms the matrix otherwise; load "
                              "it without int8")
    if np.array_equal(rows_R1[:, 0], np.arange(O)):
        return w  # rows in place: no copy
    return Int8(w.q[rows_R1[:, 0]], w.scale[rows_R1[:, 0]])


def _join(join: Callable, parts: list):
    """join(*parts); where any part is int8, every part is (a float part quantized in blocks
    of the same size) and join moves whole rows of their concatenation."""
    int8 = [p for p in parts if isinstance(p, Int8)]
    if not int8:
        return join(*parts)
    blocks = int8[0].scale.shape[1]
    parts = [p if isinstance(p, Int8) else quant.quantize_blocks_np(p, blocks)
             for p in parts]
    starts = np.cumsum([0] + [p.shape[0] for p in parts[:-1]])
    rows_R1 = join(*(np.arange(p.shape[0])[:, None] + s for p, s in zip(parts, starts)))
    return Int8(np.concatenate([p.q for p in parts])[rows_R1[:, 0]],
                      np.concatenate([p.scale for p in parts])[rows_R1[:, 0]])
