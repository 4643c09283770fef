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
from jaxkv.ops.pallas import mosaic_gpu
from jaxkv.ops.pallas.decode import triton_params

ROWS = (1, 2, 4, 8)  # rows (batch x tokens) a program takes
OUT_BLOCK = 16  # outputs per program (gated: units, each a gate and an up row of w)
IN_BLOCKS = (256, 128, 64, 32, 16)  # inputs per step of a program's loop: the largest of these
FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def takes(x_RI, w, gated) -> bool:
    """Whether a kernel takes x [R, I] @ w.T: float w [O, I] of x's dtype, R in ROWS, I and
    the outputs (gated: units, and t) whole blocks, fewer than 2^31 numbers in w (Triton's
    offsets are int32), on a jax whose Triton form is not deprecated (before 0.11: this form
    has no Mosaic GPU twin yet)."""
    R, I = x_RI.shape
    if mosaic_gpu.AVAILABLE or isinstance(w, Int8) or w.ndim != 2:
        return False
    outputs = w.shape[0] // 2 if gated else w.shape[0]
    return (R in ROWS and jnp.dtype(w.dtype) in FLOATS and w.dtype == x_RI.dtype
            and I % IN_BLOCKS[-1] == 0 and outputs % OUT_BLOCK == 0 and w.size < 2 ** 31
            and (gated is None or gated[1] % OUT_BLOCK == 0))


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
        in_block=next(n for n in IN_BLOCKS if I % n == 0))
    whole = lambda x: pl.BlockSpec(x.shape, lambda j: (0,) * x.ndim)  # noqa: E731
    return pl.pallas_call(
        kernel, grid=(O // OUT_BLOCK,),
        in_specs=[whole(x) for x in inputs],
        out_specs=pl.BlockSpec((R, OUT_BLOCK), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((R, O), dtype),
        interpret=interpret, name="jaxkv_fused_product", compiler_params=triton_params(),
    )(*inputs)


def _kernel(x_ref, w_ref, *refs, has, kind, eps, gated, dtype, in_block):
    """Program j: its outputs for every row, each row's sums in the same order whatever the
    number of rows (a row's result does not depend on the batch it is in)."""
    refs = list(refs)
    take = lambda flag: refs.pop(0) if has[flag] else None  # noqa: E731
    b_ref, scale_ref, shift_ref = take("bias"), take("norm"), take("norm_bias")
    residual_ref, out_ref = take("residual"), refs.pop(0)
    j = pl.program_id(0)
    R, I = x_ref.shape
    steps = I // in_block
    chunk = functools.partial(_chunk, in_block=in_block)
    rows = [functools.partial(lambda r, c: chunk(x_ref, r, c=c), r) for r in range(R)]
    if kind is not None:
        rows = [_normed(row, I, scale_ref, shift_ref, kind, eps, chunk, steps, x_ref.dtype)
                for row in rows]
    starts = _row_starts(j, gated)

    def step(c, accs):
        w_OCs = [chunk(w_ref, pl.ds(s, OUT_BLOCK), c=c) for s in starts]
        return tuple(tuple(acc + jnp.sum(row(c)[None, :] * w_OC, axis=1)
                           for acc, w_OC in zip(row_accs, w_OCs))
                     for row, row_accs in zip(rows, accs))

    zeros = (jnp.zeros((OUT_BLOCK,), jnp.float32),) * len(starts)
    accs = jax.lax.fori_loop(0, steps, step, (zeros,) * R)
    for r, row_accs in enumerate(accs):
        if b_ref is not None:
            row_accs = [acc + b_ref[pl.ds(s, OUT_BLOCK)].astype(jnp.float32)
                        for acc, s in zip(row_accs, starts)]
        ys = [acc.astype(dtype).astype(jnp.float32) for acc in row_accs]
        y = ys[0]
        if gated:
            y = (xla.ACTIVATIONS[gated[0]](ys[0]) * ys[1]).astype(dtype).astype(jnp.float32)
        if residual_ref is not None:
            y = y + residual_ref[r, pl.ds(j * OUT_BLOCK, OUT_BLOCK)].astype(jnp.float32)
        out_ref[r, :] = y.astype(dtype)


def _chunk(ref, *at, c, in_block):
    """ref[at] (default all its rows) at inputs [c in_block, (c + 1) in_block), in float32."""
    at = at or (slice(None),) * (ref.ndim - 1)
    return ref[(*at, pl.ds(c * in_block, in_block))].astype(jnp.float32)


def _row_starts(j, gated):
    """The first of w's rows each of program j's products reads: its block, or its units' gate
    and up rows (w_in's rows in blocks of t gate rows, then their t up rows)."""
    if not gated:
        return (j * OUT_BLOCK,)
    t = gated[1]
    unit = j * OUT_BLOCK
    gate = unit // t * 2 * t + unit % t
    return gate, gate + t


def _normed(row, I: int, scale_ref, shift_ref, kind, eps, chunk, steps, dtype):
    """row (a function of a step c giving x's chunk c of one row) normed as jaxkv.ops.xla.norm
    norms it, rounded to x's dtype: the row's mean (LayerNorm) and deviation summed first."""
    total = lambda f: jax.lax.fori_loop(  # noqa: E731
        0, steps, lambda c, s: s + jnp.sum(f(row(c))), jnp.zeros((), jnp.float32))
    mean = total(lambda x: x) / I if kind == "layernorm" else 0.0
    inverse = jax.lax.rsqrt(total(lambda x: (x - mean) * (x - mean)) / I + eps)

    def normed(c):
        y = (row(c) - mean) * inverse * chunk(scale_ref, c=c)
        if shift_ref is not None:
            y = y + chunk(shift_ref, c=c)
        return y.astype(dtype).astype(jnp.float32)
    return normed


