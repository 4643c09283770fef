"""A decode step's products in one GPU kernel each, with the work around them taken in.

At batch 1 XLA leaves every sublayer of a decode step as several kernels on a GPU: the norm's
sum of squares, the normed x, the product, the gated activation, the residual add. Each is a
launch and a trip through memory for a few thousand numbers, and they were most of the 17 kernels
a layer took on an H100. Here one Triton program per block of outputs reads the few rows of x
(a norm needs all of a row: each program sums its squares itself, x being tiny next to w's
block), then w's block in steps along the inputs, and applies the bias, the gated activation
(act(gate) * up, w_in's rows in blocks of t gate rows then t up rows) or the residual before it
stores its outputs. Each step's partial products are sums of x * w elementwise in float32 (a
tensor-core product needs 16 rows; a decode step has 1 to 8): what decides the time is reading
w once, as XLA's products do.

The numbers follow jaxkv.ops.xla's order of roundings: the normed x rounded to x's dtype before
the product, the product (+ bias) to the result's dtype before the activation or the residual.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkv.ops import xla
from jaxkv.ops.arrays import Int8
from jaxkv.ops.pallas.decode import triton_params

ROWS = (1, 2, 4, 8)  # rows (batch x tokens) a program takes
OUT_BLOCK = 16  # outputs per program (gated: units, each a gate and an up row of w)
ELEMENTS = 8192  # rows x outputs x inputs multiplied in one step of a program's loop
FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def takes(x_RI, w, gated) -> bool:
    """Whether a kernel takes x [R, I] @ w.T: float w [O, I] of x's dtype, R in ROWS, I and
    the outputs (gated: units, and t) whole blocks."""
    R, I = x_RI.shape
    if isinstance(w, Int8) or w.ndim != 2:
        return False
    outputs = w.shape[0] // 2 if gated else w.shape[0]
    return (R in ROWS and jnp.dtype(w.dtype) in FLOATS and w.dtype == x_RI.dtype
            and I % _in_block(R, I) == 0 and I >= 16 and outputs % OUT_BLOCK == 0
            and (gated is None or gated[1] % OUT_BLOCK == 0))


def _in_block(R: int, I: int) -> int:
    block = ELEMENTS // (R * OUT_BLOCK)
    while I % block:
        block //= 2
    return block


def product(x_RI, w_OI, b_O=None, *, dtype, norm=None, gated=None, residual_RO=None,
            interpret: bool = False):
    """jaxkv.ops.matmul's fused form for x [R, I] (see takes): norm = (scale, bias or None,
    kind, eps) applied to x first; gated = (activation, t); residual_RO added last."""
    R, I = x_RI.shape
    O = w_OI.shape[0] // 2 if gated else w_OI.shape[0]
    inputs = [x_RI, w_OI]
    has = {"bias": b_O is not None, "norm": norm is not None,
           "norm_bias": norm is not None and norm[1] is not None,
           "residual": residual_RO is not None}
    inputs += [] if b_O is None else [b_O]
    inputs += [] if norm is None else [n for n in norm[:2] if n is not None]
    inputs += [] if residual_RO is None else [residual_RO]
    kernel = functools.partial(
        _kernel, has=has, kind=None if norm is None else norm[2],
        eps=None if norm is None else norm[3], gated=gated, dtype=jnp.dtype(dtype),
        in_block=_in_block(R, I))
    whole = lambda x: pl.BlockSpec(x.shape, lambda j: (0,) * x.ndim)  # noqa: E731
    return pl.pallas_call(
        kernel, grid=(O // OUT_BLOCK,),
        in_specs=[whole(x) for x in inputs],
        out_specs=pl.BlockSpec((R, OUT_BLOCK), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((R, O), dtype),
        interpret=interpret, name="jaxkv_fused_product", compiler_params=triton_params(),
    )(*inputs)


def _kernel(x_ref, w_ref, *refs, has, kind, eps, gated, dtype, in_block):
    refs = list(refs)
    take = lambda flag: refs.pop(0) if has[flag] else None  # noqa: E731
    b_ref, scale_ref, shift_ref = take("bias"), take("norm"), take("norm_bias")
    residual_ref, out_ref = take("residual"), refs.pop(0)
    j = pl.program_id(0)
    R, I = x_ref.shape
    steps = I // in_block
    chunk = functools.partial(_chunk, in_block=in_block)

    normed = None
    if kind is not None:
        normed = _norm_of_rows(x_ref, scale_ref, shift_ref, kind, eps, chunk, steps)
    starts = _row_starts(j, gated)

    def step(c, accs):
        x_RC = normed(c) if normed else chunk(x_ref, c)
        return tuple(acc + jnp.sum(x_RC[:, None, :] * chunk(w_ref, c, pl.ds(s, OUT_BLOCK)),
                                   axis=2)
                     for acc, s in zip(accs, starts))

    zeros = jnp.zeros((R, OUT_BLOCK), jnp.float32)
    accs = jax.lax.fori_loop(0, steps, step, (zeros,) * len(starts))
    if b_ref is not None:
        accs = tuple(acc + b_ref[pl.ds(s, OUT_BLOCK)].astype(jnp.float32)[None, :]
                     for acc, s in zip(accs, starts))
    ys = [acc.astype(dtype).astype(jnp.float32) for acc in accs]
    y = ys[0]
    if gated:
        y = (xla.ACTIVATIONS[gated[0]](ys[0]) * ys[1]).astype(dtype).astype(jnp.float32)
    if residual_ref is not None:
        y = y + residual_ref[:, pl.ds(j * OUT_BLOCK, OUT_BLOCK)].astype(jnp.float32)
    out_ref[...] = y.astype(dtype)


def _chunk(ref, c, *rows, in_block):
    """ref's inputs [c in_block, (c + 1) in_block) (of its rows `rows`, default all) in float32."""
    rows = rows or (slice(None),) * (ref.ndim - 1)
    return ref[(*rows, pl.ds(c * in_block, in_block))].astype(jnp.float32)


def _row_starts(j, gated):
    """The first of w's rows each of program j's products reads: its block, or its units' gate
    and up rows (w_in's rows in blocks of t gate rows, then their t up rows)."""
    if not gated:
        return (j * OUT_BLOCK,)
    t = gated[1]
    unit = j * OUT_BLOCK
    gate = unit // t * 2 * t + unit % t
    return gate, gate + t


def _norm_of_rows(x_ref, scale_ref, shift_ref, kind, eps, chunk, steps):
    """A function of a step c giving x's chunk c normed as jaxkv.ops.xla.norm norms it, rounded
    to x's dtype; each row's mean (LayerNorm) and reciprocal deviation are summed first."""
    R, I = x_ref.shape
    total = lambda f: jax.lax.fori_loop(  # noqa: E731
        0, steps, lambda c, s: s + jnp.sum(f(chunk(x_ref, c)), axis=1),
        jnp.zeros((R,), jnp.float32))
    mean_R = total(lambda x: x) / I if kind == "layernorm" else jnp.zeros((R,), jnp.float32)
    centred = lambda x: x - mean_R[:, None]  # noqa: E731
    inverse_R = jax.lax.rsqrt(total(lambda x: centred(x) * centred(x)) / I + eps)

    def normed(c):
        y = centred(chunk(x_ref, c)) * inverse_R[:, None] * chunk(scale_ref, c)[None, :]
        if shift_ref is not None:
            y = y + chunk(shift_ref, c)[None, :]
        return y.astype(x_ref.dtype).astype(jnp.float32)
    return normed


