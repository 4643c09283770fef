"""Hooks: read (capture) and edit activations at named sites of a decoder pass, inside the
compiled program.

Sites, each [B, T, D] (T: the positions this pass processes) but head_out and attn_probs:
  embed       the token (and learned position) embeddings entering layer 0
  resid_pre   per layer: the residual stream entering the layer
  attn_probs  per layer: each query head's softmax weights over the keys it reads, by key
              position: [B, N, T, S], index s the key at position s (S: T in the uncached
              forward, the cache's capacity in cached passes; 0 where a query does not read
              position s, as outside a sliding window). Capture only: recomputed beside the
              attention in XLA, float32 (a backend's kernel keeps no weights)
  head_out    per layer: each query head's attention output before the output projection,
              [B, T, N, H] (an edit that zeroes head n ablates it)
  attn_out    per layer: the self-attention sublayer's output, projected back to D (and normed,
              where the model norms sublayer outputs), before it joins the stream
  router      per layer, mixtures of experts only: the router's logits over the experts, [B, T,
              E], float32, before its softmax and top k (an edit changes which experts a token
              takes and their weights: -inf bans one); a dense layer of a mixture (Qwen3-MoE's
              mlp_only_layers) records zeros and ignores edits
  mlp_out     per layer: the MLP sublayer's output, likewise
  resid_post  per layer: the residual stream leaving the layer
  final       the final norm's output, which the head reads

Hooks(capture=("resid_post", ...), layers=None, edit={(site, layer): fn}): `layers` (None: all)
says which layers the per-layer captures take; an edit's layer None means every layer (and is
the only layer for embed and final). fn(x, pos_BT) -> x is traced JAX: it may close over
arrays (a steering vector), and a capture records x after the edit, as the rest of the model
reads it. An edit that takes a third argument is also given the layer (an int; None at embed
and final): one edit keyed (site, None) can then act at a layer chosen by an array, so a sweep
over layers (activation patching) runs one compiled program. A closure is part of the
program's structure, so a new one compiles again; wrap arrays as arguments with
jax.tree_util.Partial(fn, array) to reuse the program for new values.
The captures come back as acts: {site: [L', B, T, D]} for the per-layer sites (L' the captured
layers in the model's order, each once; head_out [L', B, T, N, H], attn_probs [L', B, N, T,
S], router [L', B, T, E]), {site: [B, T, D]} for embed and final.
"""

import dataclasses
import functools
import inspect
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import ops

LAYER_SITES = ("resid_pre", "attn_probs", "head_out", "attn_out", "router", "mlp_out",
               "resid_post")
SITES = ("embed", *LAYER_SITES, "final")


def _as_tree(fn):
    """fn as a pytree: a Partial's arrays are its leaves; any other callable a leafless Partial."""
    if not callable(fn):
        raise TypeError(f"Hooks edit: expected a function fn(x, pos) -> x, got {type(fn).__name__}")
    return fn if isinstance(fn, jax.tree_util.Partial) else jax.tree_util.Partial(fn)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Hooks:
    """Which sites a pass captures and edits (see the module's docstring)."""
    capture: tuple = ()
    layers: tuple | None = None
    edit: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        capture = (self.capture,) if isinstance(self.capture, str) else tuple(self.capture)
        for site in capture:
            _check_site(site, "capture")
        layers = None if self.layers is None else tuple(sorted({int(i) for i in self.layers}))
        if layers is not None and any(i < 0 for i in layers):
            raise ValueError(f"Hooks layers: expected layer indices >= 0, got {layers}")
        edit = {}
        for key, fn in dict(self.edit).items():
            site, layer = key if isinstance(key, tuple) else (key, None)
            _check_site(site, "edit")
            if site == "attn_probs":
                raise ValueError("Hooks edit: 'attn_probs' can be captured, not edited (the "
                                 "attention that reads it runs in the backend's kernel); edit "
                                 "'head_out' to change what a head writes")
            if layer is not None and site not in LAYER_SITES:
                raise ValueError(f"Hooks edit: {site!r} has no layers; key it ({site!r}, None)")
            edit[(site, None if layer is None else int(layer))] = _as_tree(fn)
        object.__setattr__(self, "capture", capture)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "edit", edit)

    def tree_flatten(self):
        keys = tuple(sorted(self.edit, key=lambda k: (k[0], -1 if k[1] is None else k[1])))
        return tuple(self.edit[k] for k in keys), (self.capture, self.layers, keys)

    @classmethod
    def tree_unflatten(cls, aux, fns):
        hooks = object.__new__(cls)
        capture, layers, keys = aux
        object.__setattr__(hooks, "capture", capture)
        object.__setattr__(hooks, "layers", layers)
        object.__setattr__(hooks, "edit", dict(zip(keys, fns)))
        return hooks

    def check_model(self, config):
        """An error naming any layer past the model's, or the router of a model without
        experts."""
        named = [*(self.layers or ()), *(k[1] for k in self.edit if k[1] is not None)]
        if any(i >= config.n_layers for i in named):
            raise ValueError(f"Hooks: the model has layers 0..{config.n_layers - 1}, got layer "
                             f"{max(named)}")
        if not config.n_experts and any(self.touches("router", i) for i in range(config.n_layers)):
            raise ValueError("Hooks: 'router' is a mixture of experts' site, and this model has "
                             "no experts (Config.n_experts is 0)")

    def captures(self, site: str, layer: int | None) -> bool:
        """Whether (site, layer) is captured."""
        return site in self.capture and (layer is None or self.layers is None
                                         or layer in self.layers)

    def touches(self, site: str, layer: int | None) -> bool:
        """Whether (site, layer) is captured or edited."""
        return self.captures(site, layer) or (site, layer) in self.edit or (site, None) in self.edit


def _takes_layer(fn) -> bool:
    """Whether an edit takes a third argument, the layer it is applied at."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # (a builtin without a signature)
        return False
    kinds = [p.kind for p in params]
    return inspect.Parameter.VAR_POSITIONAL in kinds or sum(
        k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for k in kinds) >= 3


def _check_site(site, what):
    if site not in SITES:
        raise ValueError(f"Hooks {what}: unknown site {site!r}; the sites are {', '.join(SITES)}")


class Tap:
    """One pass's hooks at positions pos_BT, and the captures it has made (acts; none where
    record is False: edits only); n_keys: the key positions attn_probs spans (S)."""

    def __init__(self, hooks: Hooks, pos_BT, record: bool = True, n_keys: int | None = None):
        self.hooks, self.pos_BT, self.record, self.acts = hooks, pos_BT, record, {}
        self.n_keys = n_keys

    def __call__(self, site: str, layer: int | None, x_BTD):
        """x at (site, layer) after the edit that applies there, recorded where captured."""
        edit = self.hooks.edit
        fn = edit.get((site, layer), edit.get((site, None)))
        if fn is not None:
            y = fn(x_BTD, self.pos_BT, layer) if _takes_layer(fn) else fn(x_BTD, self.pos_BT)
            if jnp.shape(y) != x_BTD.shape:
                raise ValueError(f"Hooks edit at ({site!r}, {layer}): expected x's shape "
                                 f"{x_BTD.shape} back, got {jnp.shape(y)}")
            x_BTD = y.astype(x_BTD.dtype)
        if self.record and self.hooks.captures(site, layer):
            self.acts.setdefault(site, []).append(x_BTD)
        return x_BTD

    def absent(self, site: str, layer: int, x):
        """Records x, no edit applied, where (site, layer) is captured: what a layer without
        the site (a mixture's dense layer, for its router) stands in with."""
        if self.record and self.hooks.captures(site, layer):
            self.acts.setdefault(site, []).append(x)

    def at(self, site: str, layer: int | None):
        """x -> self(site, layer, x), or None where nothing captures or edits (site, layer) (so
        the sublayer keeps its fused form)."""
        return functools.partial(self, site, layer) if self.hooks.touches(site, layer) else None

    def probs(self, layer: int):
        """A function recording attn_probs at layer from the attention's arguments (see
        _record_probs), or None where it is not captured."""
        if self.record and self.hooks.captures("attn_probs", layer):
            return self._record_probs
        return None

    def _record_probs(self, q_BTNH, k_BKSH, mask_BTS, scale, bias_BNTS, own, softcap,
                      key_pos_BS=None):
        """attn_probs of attention over the cache's keys k_BKSH (their positions key_pos_BS;
        None: key s at position s) and own = (k_BKTH, mask_BTT, bias_BNTT) at pos_BT, or None."""
        w = ops.attention_weights(q_BTNH, k_BKSH, mask_BTS, scale, bias_BNTS=bias_BNTS, own=own,
                                  softcap=softcap)
        parts = [(w, key_pos_BS)] if own is None else [(w[0], key_pos_BS), (w[1], self.pos_BT)]
        probs_BNTS = sum(by_position(w_BNTX, pos_BX, self.n_keys) for w_BNTX, pos_BX in parts)
        self.acts.setdefault("attn_probs", []).append(probs_BNTS)

    def captured(self) -> dict:
        """acts: per-layer sites stacked on a leading axis of the captured layers."""
        return {site: (jnp.stack(xs) if site in LAYER_SITES else xs[0])
                for site, xs in self.acts.items()}


def by_position(w_BNTX, key_pos_BX, n_keys: int):
    """Weights over X keys at positions key_pos_BX (None: key x at position x, X == n_keys) as
    weights over positions [B, N, T, n_keys]; keys at no position in [0, n_keys) (an empty ring
    slot's -1) are dropped."""
    if key_pos_BX is None:
        return w_BNTX
    B, N, T, X = w_BNTX.shape
    at_BX = jnp.where((key_pos_BX >= 0) & (key_pos_BX < n_keys), key_pos_BX, n_keys)
    w_BXNT = jnp.transpose(w_BNTX, (0, 3, 1, 2))
    out_BSNT = jnp.zeros((B, n_keys, N, T), w_BNTX.dtype).at[
        jnp.arange(B)[:, None], jnp.broadcast_to(at_BX, (B, X))].add(w_BXNT, mode="drop")
    return jnp.transpose(out_BSNT, (0, 2, 3, 1))


def tap_for(hooks: Hooks | None, pos_BT, config, record: bool = True,
            n_keys: int | None = None):
    """A Tap for hooks (checked against the model's config), or None for no hooks."""
    if hooks is None:
        return None
    if not isinstance(hooks, Hooks):
        raise TypeError(f"hooks: expected a jaxkv.Hooks, got {type(hooks).__name__}")
    hooks.check_model(config)
    return Tap(hooks, pos_BT, record, n_keys)


def shape(site: str, config, B: int, T: int, n_layers: int | None = None,
          n_keys: int | None = None) -> tuple:
    """A capture's shape over n_layers layers (default all) for the per-layer sites: [L', B, T,
    ...], else [B, T, D]; head_out's last two [N, H], router's E, the others' D; attn_probs
    [L', B, N, T, n_keys]."""
    layers = (config.n_layers if n_layers is None else n_layers,)
    if site == "attn_probs":
        return layers + (B, config.n_heads, T, n_keys)
    tail = {"head_out": (config.n_heads, config.head_dim),
            "router": (config.n_experts,)}.get(site, (config.d_model,))
    return (layers if site in LAYER_SITES else ()) + (B, T) + tail


def _t_axis(site: str, x) -> int:
    """The axis of positions in a capture x of site."""
    return x.ndim - (3 if site == "head_out" else 2)


def _b_axis(site: str, x) -> int:
    """The axis of rows in a capture x of site."""
    return x.ndim - (4 if site in ("head_out", "attn_probs") else 3)


def _dtype(site: str, dtype):
    """What a capture of site is kept as: attn_probs and router float32, the others the model's
    dtype."""
    return jnp.float32 if site in ("attn_probs", "router") else dtype


def empty_acts(hooks: Hooks | None, config, B: int, T: int, dtype,
               n_keys: int | None = None) -> dict:
    """Zeros for a loop's captures of T positions over the captured layers (attn_probs over
    n_keys key positions)."""
    if hooks is None:
        return {}
    n = None if hooks.layers is None else len(hooks.layers)
    return {site: jnp.zeros(shape(site, config, B, T, n, n_keys), _dtype(site, dtype))
            for site in hooks.capture}


def positions(acts: dict, end: int) -> dict:
    """acts at indices [0, end) of their positions, padded with zeros past what they hold."""
    def cut(site, x):
        axis = _t_axis(site, x)
        x = jax.lax.slice_in_dim(x, 0, min(end, x.shape[axis]), axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, end - x.shape[axis])
        return jnp.pad(x, pad)
    return {site: cut(site, x) for site, x in acts.items()}


def put_at(acts: dict, captured: dict, t0):
    """acts with the captures of T positions written from index t0 (a scalar, the same for
    every row) on."""
    def put(site, buf, x):
        start = [0] * x.ndim
        start[_t_axis(site, x)] = t0
        return jax.lax.dynamic_update_slice(buf, x.astype(buf.dtype), start)
    return {site: put(site, buf, captured[site]) if site in captured else buf
            for site, buf in acts.items()}


def put_rows(acts: dict, captured: dict, t_B):
    """acts with one position's captures (T = 1) written at index t_B[b] of each row b (an
    index outside the buffer: not written)."""
    return put_positions(acts, captured, jnp.arange(t_B.shape[0]), t_B[:, None])


def put_positions(acts: dict, captured: dict, rows_R, t_RU):
    """acts with captures of R rows x U positions written at rows rows_R, indices t_RU
    (indices outside the buffer: not written)."""
    def put(site, buf, x):
        b, t = _b_axis(site, x), _t_axis(site, x)
        at = [slice(None)] * x.ndim
        at[b], at[t] = rows_R[:, None], t_RU
        # (advanced indices apart, as attn_probs' B and T, index the result's first axes)
        x = x if t == b + 1 else jnp.moveaxis(x, (b, t), (0, 1))
        return buf.at[tuple(at)].set(x.astype(buf.dtype), mode="drop")
    return {site: put(site, buf, captured[site]) if site in captured else buf
            for site, buf in acts.items()}


def joined(acts_list: list) -> dict:
    """Captures of consecutive passes (each {site: [.., B, T_i, ..]}) joined along positions."""
    return {site: jnp.concatenate([a[site] for a in acts_list], axis=_t_axis(site, x))
            for site, x in (acts_list[0].items() if acts_list else ())}


def row_acts(acts: dict, row: int, end: int) -> dict:
    """Row `row`'s captures at indices [0, end), as numpy arrays without the row axis."""
    def take(site, x):
        x = jnp.take(x, row, axis=_b_axis(site, x))
        return np.asarray(jax.lax.slice_in_dim(x, 0, end, axis=_t_axis(site, x)))
    return {site: take(site, x) for site, x in acts.items()}


def gathered(acts: dict, t_U) -> dict:
    """acts at indices t_U of their positions, in that order."""
    return {site: jnp.take(x, jnp.asarray(t_U, jnp.int32), axis=_t_axis(site, x))
            for site, x in acts.items()}


def check_fits(hooks: Hooks | None, config, B: int, T: int, dtype, device=None,
               n_keys: int | None = None):
    """An error, before anything runs, where a loop's captures (empty_acts') would take more
    than half the memory of the device (its allocator's limit; the host's RAM on a CPU)."""
    if hooks is None or not hooks.capture:
        return
    n = config.n_layers if hooks.layers is None else len(hooks.layers)
    size = sum(math.prod(shape(site, config, B, T, n, n_keys)) *
               jnp.dtype(_dtype(site, dtype)).itemsize for site in hooks.capture)
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
    if size > limit // 2:
        raise ValueError(f"hooks: capturing {', '.join(hooks.capture)} over {n} layer(s) x {B} "
                         f"row(s) x {T} positions takes {size / 2**30:.1f} GiB, more than "
                         f"half of {device.platform}'s {limit / 2**30:.1f} GiB; capture fewer "
                         f"sites or layers, or run fewer rows or tokens at a time")
