"""A decode step's products in one GPU kernel each, with the work around them taken in.

At batch 1 XLA leaves every sublayer of a decode step as several kernels on a GPU: the norm's
sum of squares, the normed x, the product, the gated activation, the residual add. Each is a
launch and a trip through memory for a few thousand numbers, and they were most of the 17 kernels
a layer took on an H100. Here one program per block of outputs (Triton's on jax 0.10, a Mosaic
GPU warpgroup on 0.11 and newer, whose Triton backend is deprecated) reads the few rows of x
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
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.ops import xla
from jaxkv.ops.arrays import HALF_DTYPES, Int8
from jaxkv.ops.pallas import mosaic_gpu
from jaxkv.ops.pallas.decode import triton_params

ROWS = (1, 2, 4, 8)  # rows (batch x tokens) a program takes
OUT_BLOCK = 16  # outputs per Triton program (gated: units, each a gate and an up row of w)
IN_BLOCKS = (256, 128, 64, 32, 16)  # inputs per step of a program's loop: the largest of these
MOSAIC_OUT = 64  # outputs per Mosaic GPU program: a warpgroup's tile of w is 64 rows
MOSAIC_IN = (128, 64)  # inputs per step there
FLOATS = (jnp.float32, *HALF_DTYPES)


def takes(x_RI, w, gated) -> bool:
    """Whether a kernel takes x [R, I] @ w.T: float w [O, I] of x's dtype (16-bit on jax 0.11
    and newer, whose form is Mosaic GPU's: Triton's is deprecated there), R in ROWS, I and the
    outputs (gated: units, and t) whole blocks, fewer than 2^31 numbers in w (Triton's offsets
    are int32)."""
    R, I = x_RI.shape
    if isinstance(w, Int8) or w.ndim != 2:
        return False
    outputs = w.shape[0] // 2 if gated else w.shape[0]
    out_block, in_block, dtypes = ((MOSAIC_OUT, MOSAIC_IN[-1], HALF_DTYPES) if mosaic_gpu.AVAILABLE
                                   else (OUT_BLOCK, IN_BLOCKS[-1], FLOATS))
    return (R in ROWS and jnp.dtype(w.dtype) in dtypes and w.dtype == x_RI.dtype
            and I % in_block == 0 and outputs % out_block == 0 and w.size < 2 ** 31
            and (gated is None or gated[1] % out_block == 0))


def product(x_RI, w_OI, b_O=None, *, dtype, norm=None, gated=None, residual_RO=None,
            interpret: bool = False):
    """jaxkv.ops.matmul's fused form for x [R, I] (see takes): norm = (scale, bias or None,
    kind, eps) applied to x first; gated = (activation, t); residual_RO added last. Mosaic
    GPU's form on jax 0.11 and newer, Triton's before."""
    R, I = x_RI.shape
    O = w_OI.shape[0] // 2 if gated else w_OI.shape[0]
    inputs = [x_RI, w_OI]
    has = {"bias": b_O is not None, "norm": norm is not None,
           "norm_bias": norm is not None and norm[1] is not None,
           "residual": residual_RO is not None}
    inputs += [] if b_O is None else [b_O]
    inputs += [] if norm is None else [n for n in norm[:2] if n is not None]
    inputs += [] if residual_RO is None else [residual_RO]
    options = dict(has=has, kind=None if norm is None else norm[2],
                   eps=None if norm is None else norm[3], gated=gated, dtype=jnp.dtype(dtype))
    out = jax.ShapeDtypeStruct((R, O), dtype)
    if mosaic_gpu.AVAILABLE:
        def jaxkv_fused_product(*refs):  # (the kernel's name in the program)
            _mosaic_kernel(*refs, in_block=next(n for n in MOSAIC_IN if I % n == 0), **options)
        return plgpu.kernel(jaxkv_fused_product, out_type=out, grid=(O // MOSAIC_OUT,),
                            grid_names=("j",),
                            interpret=plgpu.InterpretGPUParams() if interpret else None)(*inputs)
    kernel = functools.partial(_kernel, in_block=next(n for n in IN_BLOCKS if I % n == 0),
                               **options)
    whole = lambda x: pl.BlockSpec(x.shape, lambda j: (0,) * x.ndim)  # noqa: E731
    return pl.pallas_call(
        kernel, grid=(O // OUT_BLOCK,),
        in_specs=[whole(x) for x in inputs],
        out_specs=pl.BlockSpec((R, OUT_BLOCK), lambda j: (0, j)), out_shape=out,
        interpret=interpret, name="jaxkv_fused_product", compiler_params=triton_params(),
    )(*inputs)


def _kernel(x_ref, w_ref, *refs, has, kind, eps, gated, dtype, in_block):
    """Triton's program j: its outputs for every row, each row's sums in the same order
    whatever the number of rows (a row's result does not depend on the batch it is in)."""
    b_ref, scale_ref, shift_ref, residual_ref, out_ref = _refs(refs, has)
    j = pl.program_id(0)
    R, I = x_ref.shape
    steps = I // in_block
    chunk = functools.partial(_chunk, in_block=in_block)
    rows = [functools.partial(lambda r, c: chunk(x_ref, r, c=c), r) for r in range(R)]
    if kind is not None:
        stats = _norm_stats(rows, I, kind, eps, steps)
        shift = None if shift_ref is None else (lambda c: chunk(shift_ref, c=c))
        rows = [functools.partial(_normed, row, mean, inverse, lambda c: chunk(scale_ref, c=c),
                                  shift, x_ref.dtype)
                for row, mean, inverse in zip(rows, *stats)]
    starts = _row_starts(j, gated, OUT_BLOCK)

    def step(c, accs):
        w_OCs = [chunk(w_ref, pl.ds(s, OUT_BLOCK), c=c) for s in starts]
        return tuple(tuple(acc + jnp.sum(row(c)[None, :] * w_OC, axis=1)
                           for acc, w_OC in zip(row_accs, w_OCs))
                     for row, row_accs in zip(rows, accs))

    zeros = (jnp.zeros((OUT_BLOCK,), jnp.float32),) * len(starts)
    accs = jax.lax.fori_loop(0, steps, step, (zeros,) * R)
    biases = None if b_ref is None else [b_ref[pl.ds(s, OUT_BLOCK)].astype(jnp.float32)
                                         for s in starts]
    for r, row_accs in enumerate(accs):
        residual = None if residual_ref is None else residual_ref[
            r, pl.ds(j * OUT_BLOCK, OUT_BLOCK)].astype(jnp.float32)
        out_ref[r, :] = _finish(row_accs, biases, residual, gated, dtype)


def _mosaic_kernel(x_ref, w_ref, *refs, has, kind, eps, gated, dtype, in_block):
    """Mosaic GPU's program j (one warpgroup): w's tiles of 64 rows and x's chunk copied in by
    the TMA at each step, then the rows' sums as Triton's program makes them."""
    b_ref, scale_ref, shift_ref, residual_ref, out_ref = _refs(refs, has)
    j = jax.lax.axis_index("j")
    R, I = x_ref.shape
    starts = _row_starts(j, gated, MOSAIC_OUT)
    bits = jnp.finfo(w_ref.dtype).bits
    swizzle = plgpu.find_swizzle(in_block * bits)
    tiles = (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))
    vectors = [ref for ref in (scale_ref, shift_ref) if ref is not None]
    chunk_in = lambda ref, c: ref.at[(*(slice(None),) * (ref.ndim - 1),  # noqa: E731
                                      pl.ds(c * in_block, in_block))]

    def scoped(x_smem, out_smem, ends_smem, barriers, *smem):
        w_smem, vec_smem = smem[:len(starts)], smem[len(starts):]

        def fetch(c, with_w=True):
            copies = [(chunk_in(x_ref, c), x_smem)]
            copies += [(chunk_in(ref, c), buf) for ref, buf in zip(vectors, vec_smem)]
            copies += [(w_ref.at[pl.ds(s, MOSAIC_OUT), pl.ds(c * in_block, in_block)], buf)
                       for s, buf in zip(starts, w_smem)] if with_w else []
            for n, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst, barriers.at[n])
            for n in range(len(copies)):
                plgpu.barrier_wait(barriers.at[n])

        along = plgpu.Layout.WGMMA.reduce(0)
        load = lambda ref: plgpu.load(ref, layout=along).astype(jnp.float32)  # noqa: E731
        rows = [functools.partial(lambda r, c: load(x_smem.at[r]), r) for r in range(R)]
        if kind is not None:
            stats = _norm_stats(rows, I, kind, eps, I // in_block,
                                lambda c: fetch(c, with_w=False))
            shift = None if shift_ref is None else (lambda c: load(vec_smem[1]))
            rows = [functools.partial(_normed, row, mean, inverse, lambda c: load(vec_smem[0]),
                                      shift, x_ref.dtype)
                    for row, mean, inverse in zip(rows, *stats)]

        def step(c, accs):
            fetch(c)
            w_OCs = [plgpu.load(buf, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                     for buf in w_smem]
            return tuple(tuple(
                acc + jnp.sum(w_OC * jax.lax.broadcast_in_dim(row(c), w_OC.shape, [1]), axis=1)
                for acc, w_OC in zip(row_accs, w_OCs)) for row, row_accs in zip(rows, accs))

        across = plgpu.Layout.WGMMA.reduce(1)
        zero = plgpu.layout_cast(jnp.zeros((MOSAIC_OUT,), jnp.float32), across)
        accs = jax.lax.fori_loop(0, I // in_block, step, ((zero,) * len(starts),) * R)
        ends = [(b_ref.at[pl.ds(s, MOSAIC_OUT)], ends_smem.at[R + i])
                for i, s in enumerate(starts)] if b_ref is not None else []
        ends += [(residual_ref.at[:, pl.ds(j * MOSAIC_OUT, MOSAIC_OUT)],
                  ends_smem.at[pl.ds(0, R)])] if residual_ref is not None else []
        for n, (src, dst) in enumerate(ends):
            plgpu.copy_gmem_to_smem(src, dst, barriers.at[n])
        for n in range(len(ends)):
            plgpu.barrier_wait(barriers.at[n])
        final = lambda ref: plgpu.load(ref, layout=across).astype(jnp.float32)  # noqa: E731
        biases = None if b_ref is None else [final(ends_smem.at[R + i])
                                             for i in range(len(starts))]
        for r, row_accs in enumerate(accs):
            residual = None if residual_ref is None else final(ends_smem.at[r])
            out_smem[r] = _finish(row_accs, biases, residual, gated, dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[:, pl.ds(j * MOSAIC_OUT, MOSAIC_OUT)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped, plgpu.SMEM((R, in_block), x_ref.dtype), plgpu.SMEM((R, MOSAIC_OUT), dtype),
        plgpu.SMEM((R + 2, MOSAIC_OUT), x_ref.dtype), plgpu.Barrier(num_barriers=5),
        *[plgpu.SMEM((MOSAIC_OUT, in_block), w_ref.dtype, transforms=tiles) for _ in starts],
        *[plgpu.SMEM((in_block,), ref.dtype) for ref in vectors])


def _refs(refs, has):
    """(bias, norm's scale, norm's bias, residual, output) of a kernel's refs after x and w:
    None for those `has` says are not there."""
    refs = list(refs)
    take = lambda flag: refs.pop(0) if has[flag] else None  # noqa: E731
    return take("bias"), take("norm"), take("norm_bias"), take("residual"), refs.pop(0)


def _finish(accs, biases, residual, gated, dtype):
    """A row's outputs from its sums (one per start of _row_starts): the bias added, rounded to
    dtype, act(gate) * up rounded again where gated, the residual added, in dtype."""
    if biases is not None:
        accs = [acc + bias for acc, bias in zip(accs, biases)]
    ys = [acc.astype(dtype).astype(jnp.float32) for acc in accs]
    y = ys[0]
    if gated:
        y = (xla.ACTIVATIONS[gated[0]](ys[0]) * ys[1]).astype(dtype).astype(jnp.float32)
    return (y if residual is None else y + residual).astype(dtype)


def _chunk(ref, *at, c, in_block):
    """ref[at] (default all its rows) at inputs [c in_block, (c + 1) in_block), in float32."""
    at = at or (slice(None),) * (ref.ndim - 1)
    return ref[(*at, pl.ds(c * in_block, in_block))].astype(jnp.float32)


def _row_starts(j, gated, block: int):
    """The first of w's rows each of program j's products reads: its block of `block`, or its
    units' gate and up rows (w_in's rows in blocks of t gate rows, then their t up rows)."""
    if not gated:
        return (j * block,)
    t = gated[1]
    unit = j * block
    gate = unit // t * 2 * t + unit % t
    return gate, gate + t


def _norm_stats(rows, I: int, kind: str, eps: float, steps: int, fetch=None):
    """Each row's mean (LayerNorm; else 0) and reciprocal deviation as jaxkv.ops.xla.norm
    computes them, summed chunk by chunk: rows[r](c) is row r's chunk c (after fetch(c))."""
    def total(f):
        def step(c, sums):
            if fetch is not None:
                fetch(c)
            return tuple(s + jnp.sum(f(row(c), r)) for r, (s, row) in enumerate(zip(sums, rows)))
        return jax.lax.fori_loop(0, steps, step, (jnp.zeros((), jnp.float32),) * len(rows))

    means = ([t / I for t in total(lambda x, r: x)] if kind == "layernorm"
             else [0.0] * len(rows))
    centred = lambda x, r: (x - means[r]) * (x - means[r])  # noqa: E731
    return means, [jax.lax.rsqrt(t / I + eps) for t in total(centred)]


def _normed(row, mean, inverse, scale, shift, dtype, c):
    """Chunk c of a row (row(c)) normed with its mean and reciprocal deviation, scale(c) and
    shift(c) (or None), rounded to dtype (as jaxkv.ops.xla.norm returns it)."""
    y = (row(c) - mean) * inverse * scale(c)
    if shift is not None:
        y = y + shift(c)
    return y.astype(dtype).astype(jnp.float32)
