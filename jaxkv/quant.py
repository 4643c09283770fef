"""int8 weights: a matrix [out, in] kept as int8 with float scales, read as int8 by every
product (jaxkv.quantize).

On the CPU a product of up to kernels.ROWS rows goes to jaxkv.kernels (int8 converted to float
in registers, scales per row or per power-of-two block; SmolLM2 batch 1 on a 2-core Xeon: 6.2
ms/token per row, 7.4 with GGUF's 32-blocks, against 15.5 for the XLA loops below). What
follows is the XLA path, used elsewhere and with JAXKV_CPU_KERNELS=0.

Scales are per output row (what quantize makes) or per block of 32 inputs along a row (how
GGUF's Q8_0 holds them; jaxkv.load(path, int8=True) keeps them). Chosen by measurement on
XLA:CPU (a 2-core Intel Xeon, batch-1 product x @ w.T): with one scale per row the int8 loop ran
3-6x faster than float32 (SmolLM2's 49152 x 576 head: 1.5-1.9 vs 5.7-9.8 ms). Per 32-block
scales multiply each weight by its scale inside the same loop: 1.04-1.13x the per-row time in a
SmolLM2 decode step (lax.scan of 32 steps, 4 interleaved runs on a loaded machine; 1.2-1.3x
for a cache-resident 3072 x 576 matrix alone). Slower on the same machine, so not used: partial
sums per block as a batched einsum (15-30x), int8 x int8 dots with int32 accumulation, x
quantized as llama.cpp does (7-10x: XLA:CPU loops over integers without vectorizing), w stored
transposed [I, O] (3-10x), reductions over 8-32-wide lanes (4-10x), --xla_cpu_enable_fast_math
(no change in a step).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv import kernels, pages

Q8_BLOCK = 32  # inputs per scale in GGUF's Q8_0
MATRICES = ("embed", "lm_head", "blocks.wqkv", "blocks.wo", "blocks.w_in", "blocks.w_out")
LOOP_ROWS = 16  # up to this many rows (decode steps) run as one int8 loop each


@struct.dataclass
class Int8:
    """w ~= q * scale, row by row: q [O, I] int8, scale [O, NB] (NB blocks of I / NB inputs)."""

    q: jax.Array  # [O, I] int8
    scale: jax.Array  # [O, NB], float32 (or the dtype the model computes in)

    @property
    def shape(self):
        return self.q.shape

    @property
    def dtype(self):
        """The float dtype this matrix stands for."""
        return self.scale.dtype

    def __getitem__(self, rows):
        """Rows dequantized (an embedding lookup): [..., I]."""
        return dequantize_rows(self.q[rows], self.scale[rows])


def dequantize_rows(q_RI, scale_RB):
    """q [..., I] int8 times its scales [..., NB] -> [..., I] in the scales' dtype."""
    *rows, I = q_RI.shape
    NB = scale_RB.shape[-1]
    blocks = q_RI.reshape(*rows, NB, I // NB).astype(scale_RB.dtype) * scale_RB[..., None]
    return blocks.reshape(*rows, I)


def quantize_matrix(w_OI, block: int | None = None) -> Int8:
    """One int8 scale per row, or per block of `block` inputs: max |w| of the row (block) maps
    to 127 (round to nearest)."""
    w_OI = jnp.asarray(w_OI)
    O, I = w_OI.shape
    K = block or I
    if I % K:
        raise ValueError(f"quantize: block must divide each matrix's input width; got block "
                         f"{block} for a matrix of shape {(O, I)}")
    w_OBK = w_OI.astype(jnp.float32).reshape(O, I // K, K)
    scale_OB = jnp.max(jnp.abs(w_OBK), axis=2) / 127
    safe_OB1 = jnp.where(scale_OB > 0, scale_OB, 1.0)[..., None]
    q_OI = jnp.clip(jnp.round(w_OBK / safe_OB1), -127, 127).astype(jnp.int8).reshape(O, I)
    return Int8(q_OI, scale_OB.astype(w_OI.dtype))


def quantize_blocks_np(w_OI, blocks: int) -> Int8:
    """numpy: one scale per block of I / blocks inputs, as GGUF's Q8_0 (max |w| -> 127)."""
    O, I = w_OI.shape
    w_OBK = np.asarray(w_OI, np.float32).reshape(O, blocks, I // blocks)
    scale_OB = np.abs(w_OBK).max(axis=2) / 127
    safe_OB1 = np.where(scale_OB > 0, scale_OB, 1)[..., None]
    q_OBK = np.clip(np.round(w_OBK / safe_OB1), -127, 127).astype(np.int8)
    return Int8(q_OBK.reshape(O, I), scale_OB)


def from_q8_0(data_OX) -> Int8:
    """numpy views of GGUF Q8_0 bytes [O, NB * 34] (per block: a float16 scale, 32 int8) ->
    Int8(q [O, NB * 32] int8, scale [O, NB] float16); nothing is converted to float."""
    data_OX = np.asarray(data_OX, np.uint8)
    O, X = data_OX.shape
    if X % 34:
        raise ValueError(f"from_q8_0: rows of {X} bytes are not whole 34-byte Q8_0 blocks")
    blocks_OBX = data_OX.reshape(O, X // 34, 34)
    scale_OB = np.ascontiguousarray(blocks_OBX[..., :2]).view(np.float16)[..., 0]
    q_OBK = np.ascontiguousarray(blocks_OBX[..., 2:]).view(np.int8)
    return Int8(q_OBK.reshape(O, -1), scale_OB)


def quantize(params, kind: str = "int8", block: int | None = None):
    """params with every decoder matrix int8: attention and MLP weights, the embedding and the
    head. Norms, biases, position tables and an encoder stay as they are.

    block: inputs per scale; None (one scale per row, the faster product) or e.g. 32 (GGUF
    Q8_0's layout: closer to the float weights)."""
    if kind != "int8":
        raise ValueError(f"quantize: kind must be 'int8', got {kind!r}")
    if block is not None and not (isinstance(block, int) and block > 0):
        raise ValueError(f"quantize: block must be a positive int or None, got {block!r}")
    q = lambda w: w if w is None or isinstance(w, Int8) else quantize_matrix(w, block)  # noqa: E731
    blocks = tuple(b.replace(wqkv=q(b.wqkv), wo=q(b.wo), w_in=q(b.w_in), w_out=q(b.w_out))
                   for b in params.blocks)
    return pages.huge_pages(params.replace(embed=q(params.embed), lm_head=q(params.lm_head),
                                           blocks=blocks))


def kernel_takes(rows: int, w: Int8) -> bool:
    """Whether a product of this many rows of x with w goes to the CPU kernel (dense_int8)."""
    return kernels.fits(rows, jnp.int8) and kernels.int8_fits(w.q, w.scale)


def dense(x_BTI, w: Int8, b_O=None, dtype=None):
    """x @ w.T (+ b) reading w as int8: the CPU kernel (see above); else on XLA:CPU up to
    LOOP_ROWS rows each run one loop over w's rows that converts as it goes (XLA:CPU fuses the
    conversion into the product, so no float copy of w is made); otherwise (more rows, a GPU or
    TPU) one product of x and w converted to x's dtype (converted_product)."""
    B, T, I = x_BTI.shape
    x_RI = x_BTI.reshape(B * T, I).astype(w.dtype)
    loops = jax.default_backend() == "cpu" and B * T <= LOOP_ROWS
    if kernel_takes(B * T, w):
        y_RO = kernels.dense_int8(x_RI, w.q, w.scale)
    elif loops and B * T == 1:
        y_RO = row_product(x_RI[0], w)[None]
    elif loops:
        y_RO = jax.lax.map(lambda x_I: row_product(x_I, w), x_RI)
    else:
        y_RO = converted_product(x_RI, w)
    y_BTO = y_RO.reshape(B, T, -1)
    y_BTO = y_BTO if b_O is None else y_BTO + b_O
    return y_BTO.astype(dtype or x_BTI.dtype)


def converted_product(x_RI, w: Int8):
    """x @ w.T, accumulated in float32, with w converted to x's dtype as the product's operand.
    One scale per row multiplies the product's outputs. Per-block scales: for fewer rows than a
    block has inputs, one product per block ([NB, R, O] partial sums, fewer values than w),
    each block's scale applied as they are summed; else the weights dequantized first.

    The form for GPUs and TPUs: the loops of row_product (a lax.map of rows, a conditional in
    each) ran 34.7 ms/token on an H200 (1B Llama, batch 16) against 1.7 for this. There XLA:GPU
    converts the int8 operand inside its product kernels (Triton), so the decode loop makes no
    float copy of w (scripts/check_int8_hlo.py); with per-block scales dequantized first it made
    one of every large matrix at every step. XLA:CPU makes one (its own loops and kernels
    avoid it)."""
    R, I = x_RI.shape
    O, NB = w.scale.shape
    if NB == 1:
        y_RO = jnp.einsum("RI,OI->RO", x_RI, w.q.astype(x_RI.dtype),
                          preferred_element_type=jnp.float32)
        return y_RO * w.scale[:, 0].astype(jnp.float32)
    if R < I // NB:
        y_BRO = jnp.einsum("RBK,OBK->BRO", x_RI.reshape(R, NB, -1),
                           w.q.reshape(O, NB, -1).astype(x_RI.dtype),
                           preferred_element_type=jnp.float32)
        return jnp.einsum("BRO,OB->RO", y_BRO, w.scale.astype(jnp.float32))
    return jnp.einsum("RI,OI->RO", x_RI, dequantize_rows(w.q, w.scale),
                      preferred_element_type=jnp.float32)


def row_product(x_I, w: Int8):
    """One row times w.T: [O], accumulated in float32.

    The row and the weights pass a barrier together first, so nothing that converts w can be
    hoisted out of a loop of rows or of steps."""
    x_I, w = jax.lax.optimization_barrier((x_I, w))
    # XLA fuses no producer across a conditional (the barrier alone did not stop it): without
    # this the attention before wo and the gating before w_out ran inside the loop, once per
    # weight row. SmolLM2, Intel Xeon, lax.scan of steps: 31.5 -> 13.6 ms (fp32: 30.8).
    x_I = jax.lax.cond(jnp.isnan(x_I[0]), lambda x: x * 1, lambda x: x, x_I)
    x_1I = x_I[None].astype(jnp.float32)
    if w.scale.shape[1] == 1:  # the scale leaves the loop: one multiply per output
        return (x_1I @ w.q.T.astype(jnp.float32))[0] * w.scale[:, 0].astype(jnp.float32)
    return (x_1I @ dequantize_rows(w.q, w.scale.astype(jnp.float32)).T)[0]


def float_copies(params, hlo: str) -> list:
    """[(shape of an int8 matrix of params, computation)] for each float array that compiled HLO
    text (`jax.jit(f).lower(...).compile().as_text()`, any backend) stores holding as many
    values as one of the matrices, one of its dimensions the matrix's rows: a float copy of the
    weights, e.g. [O, I], [I, O] or [O, NB, I / NB]. Values inside a fusion (XLA:CPU's loops,
    XLA:GPU's loop, reduction and Triton product kernels) are never stored, so the
    computations that fusions call are skipped."""
    shapes = {w.shape for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int8))
              if isinstance(w, Int8)}
    fused = set(re.findall(r" fusion\(.*?calls=(%[\w.\-]+)", hlo))
    copies = set()
    for name, computation in hlo_computations(hlo).items():
        if name in fused:
            continue
        for dims in re.findall(r"(?:f64|f32|bf16|f16)\[(\d+(?:,\d+)+)\]", computation):
            dims = tuple(map(int, dims.split(",")))
            copies |= {(s, name) for s in shapes
                       if len(dims) <= 3 and s[0] in dims and np.prod(dims) == np.prod(s)}
    return sorted(copies)


def hlo_computations(hlo: str) -> dict:
    """{name: text} of the computations in HLO text (blocks apart by blank lines)."""
    named = ((re.match(r"\s*(?:ENTRY\s+)?(%[\w.\-]+) ", c), c) for c in hlo.split("\n\n"))
    return {m.group(1): c for m, c in named if m}
