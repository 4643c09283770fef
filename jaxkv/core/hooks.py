"""Hooks: read (capture) and edit activations at named sites of a decoder pass, inside the
compiled program.

Sites, each [B, T, D] (T: the positions this pass processes) but head_out:
  embed       the token (and learned position) embeddings entering layer 0
  resid_pre   per layer: the residual stream entering the layer
  head_out    per layer: each query head's attention output before the output projection,
              [B, T, N, H] (an edit that zeroes head n ablates it)
  attn_out    per layer: the self-attention sublayer's output, projected back to D (and normed,
              where the model norms sublayer outputs), before it joins the stream
  mlp_out     per layer: the MLP sublayer's output, likewise
  resid_post  per layer: the residual stream leaving the layer
  final       the final norm's output, which the head reads

Hooks(capture=("resid_post", ...), layers=None, edit={(site, layer): fn}): `layers` (None: all)
says which layers the per-layer captures take; an edit's layer None means every layer (and is
the only layer for embed and final). fn(x, pos_BT) -> x is traced JAX: it may close over
arrays (a steering vector), and a capture records x after the edit, as the rest of the model
reads it. A closure is part of the program's structure, so a new one compiles again; wrap
arrays as arguments with jax.tree_util.Partial(fn, array) to reuse the program for new values.
The captures come back as acts: {site: [L', B, T, D]} for the per-layer sites (L' the captured
layers in the model's order, each once; head_out [L', B, T, N, H]), {site: [B, T, D]} for
embed and final.
"""

import dataclasses
import functools
import math
import os

import jax

LAYER_SITES = ("resid_pre", "head_out", "attn_out", "mlp_out", "resid_post")
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

    def check_layers(self, n_layers: int):
        """An error naming any layer past the model's n_layers."""
        named = [*(self.layers or ()), *(k[1] for k in self.edit if k[1] is not None)]
        if any(i >= n_layers for i in named):
            raise ValueError(f"Hooks: the model has layers 0..{n_layers - 1}, got layer "
                             f"{max(named)}")

    def captures(self, site: str, layer: int | None) -> bool:
        """Whether (site, layer) is captured."""
        return site in self.capture and (layer is None or self.layers is None
                                         or layer in self.layers)

    def touches(self, site: str, layer: int | None) -> bool:
        """Whether (site, layer) is captured or edited."""
        return self.captures(site, layer) or (site, layer) in self.edit or (site, None) in self.edit


def _check_site(site, what):
    if site not in SITES:
        raise ValueError(f"Hooks {what}: unknown site {site!r}; the sites are {', '.join(SITES)}")


class Tap:
    """One pass's hooks at positions pos_BT, and the captures it has made (acts; none where
    record is False: edits only)."""

    def __init__(self, hooks: Hooks, pos_BT, record: bool = True):
        self.hooks, self.pos_BT, self.record, self.acts = hooks, pos_BT, record, {}

    def __call__(self, site: str, layer: int | None, x_BTD):
        """x at (site, layer) after the edit that applies there, recorded where captured."""
        edit = self.hooks.edit
        fn = edit.get((site, layer), edit.get((site, None)))
        if fn is not None:
            y = fn(x_BTD, self.pos_BT)
            if jax.numpy.shape(y) != x_BTD.shape:
                raise ValueError(f"Hooks edit at ({site!r}, {layer}): expected x's shape "
                                 f"{x_BTD.shape} back, got {jax.numpy.shape(y)}")
            x_BTD = y.astype(x_BTD.dtype)
        if self.record and self.hooks.captures(site, layer):
            self.acts.setdefault(site, []).append(x_BTD)
        return x_BTD

    def at(self, site: str, layer: int | None):
        """x -> self(site, layer, x), or None where nothing captures or edits (site, layer) (so
        the sublayer keeps its fused form)."""
        return functools.partial(self, site, layer) if self.hooks.touches(site, layer) else None

    def captured(self) -> dict:
        """acts: per-layer sites stacked on a leading axis of the captured layers."""
        return {site: (jax.numpy.stack(xs) if site in LAYER_SITES else xs[0])
                for site, xs in self.acts.items()}


def tap_for(hooks: Hooks | None, pos_BT, n_layers: int, record: bool = True):
    """A Tap for hooks (checked against the model's layers), or None for no hooks."""
    if hooks is None:
        return None
    if not isinstance(hooks, Hooks):
        raise TypeError(f"hooks: expected a jaxkv.Hooks, got {type(hooks).__name__}")
    hooks.check_layers(n_layers)
    return Tap(hooks, pos_BT, record)


def shape(site: str, config, B: int, T: int, n_layers: int | None = None) -> tuple:
    """A capture's shape over n_layers layers (default all) for the per-layer sites: [L', B, T,
    ...], else [B, T, D]; head_out's last two [N, H], the others' D."""
    tail = (config.n_heads, config.head_dim) if site == "head_out" else (config.d_model,)
    layers = (config.n_layers if n_layers is None else n_layers,)
    return (layers if site in LAYER_SITES else ()) + (B, T) + tail


def _t_axis(site: str, x) -> int:
    """The axis of positions in a capture x of site."""
    return x.ndim - (3 if site == "head_out" else 2)


def empty_acts(hooks: Hooks | None, config, B: int, T: int, dtype) -> dict:
    """Zeros for a loop's captures of T positions over the captured layers."""
    if hooks is None:
        return {}
    n = None if hooks.layers is None else len(hooks.layers)
    return {site: jax.numpy.zeros(shape(site, config, B, T, n), dtype) for site in hooks.capture}


def positions(acts: dict, end: int) -> dict:
    """acts at indices [0, end) of their positions, padded with zeros past what they hold."""
    def cut(site, x):
        axis = _t_axis(site, x)
        x = jax.lax.slice_in_dim(x, 0, min(end, x.shape[axis]), axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, end - x.shape[axis])
        return jax.numpy.pad(x, pad)
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
    """acts with one position's captures (T = 1) written at index t_B[b] of each row b."""
    def put(site, buf, x):
        axis, rows_B = _t_axis(site, x), jax.numpy.arange(t_B.shape[0])
        at = (slice(None),) * (axis - 1) + (rows_B, t_B)
        return buf.at[at].set(jax.numpy.take(x, 0, axis=axis).astype(buf.dtype))
    return {site: put(site, buf, captured[site]) if site in captured else buf
            for site, buf in acts.items()}


def check_fits(hooks: Hooks | None, config, B: int, T: int, dtype, device=None):
    """An error, before anything runs, where a loop's captures (empty_acts') would take more
    than half the memory of the device (its allocator's limit; the host's RAM on a CPU)."""
    if hooks is None or not hooks.capture:
        return
    n = config.n_layers if hooks.layers is None else len(hooks.layers)
    size = sum(math.prod(shape(site, config, B, T, n)) for site in hooks.capture)
    size *= jax.numpy.dtype(dtype).itemsize
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
    if size > limit // 2:
        raise ValueError(f"hooks: capturing {', '.join(hooks.capture)} over {n} layer(s) x {B} "
                         f"row(s) x {T} positions takes {size / 2**30:.1f} GiB, more than "
                         f"half of {device.platform}'s {limit / 2**30:.1f} GiB; capture fewer "
                         f"sites or layers, or run fewer rows or tokens at a time")
