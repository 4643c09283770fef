"""int8 weights: jaxkv.quantize turns a model's matrices into Int8 (int8 numbers with float
scales per row, or per block of inputs), which every backend's products read as int8
(jaxkv.ops.matmul): 1 byte a weight instead of 2 or 4."""

import jax.numpy as jnp
import numpy as np

from jaxkv import ops
from jaxkv.core import checks
from jaxkv.core.params import Params
from jaxkv.ops.arrays import Int8

MATRICES = ("embed", "lm_head", "blocks.wqkv", "blocks.wo", "blocks.w_in", "blocks.w_out",
            "blocks.experts_in", "blocks.experts_out")


def quantize_matrix(w_OI, block: int | None = None) -> Int8:
    """One int8 scale per row, or per block of `block` inputs: max |w| of the row (block) maps
    to 127 (round to nearest). Leading axes (a stack of experts' matrices) are kept."""
    w_OI = jnp.asarray(w_OI)
    *lead, I = w_OI.shape
    K = block or I
    if I % K:
        raise ValueError(f"quantize: block must divide each matrix's input width; got block "
                         f"{block} for a matrix of shape {w_OI.shape}")
    w_OBK = w_OI.astype(jnp.float32).reshape(*lead, I // K, K)
    scale_OB = jnp.max(jnp.abs(w_OBK), axis=-1) / 127
    safe_OB1 = jnp.where(scale_OB > 0, scale_OB, 1.0)[..., None]
    q_OI = jnp.clip(jnp.round(w_OBK / safe_OB1), -127, 127).astype(jnp.int8).reshape(*lead, I)
    return Int8(q_OI, scale_OB.astype(w_OI.dtype))


def quantize_blocks_np(w_OI, blocks: int) -> Int8:
    """numpy: one scale per block of I / blocks inputs, as GGUF's Q8_0 (max |w| -> 127)."""
    O, I = w_OI.shape
    w_OBK = np.asarray(w_OI, np.float32).reshape(O, blocks, I // blocks)
    scale_OB = np.abs(w_OBK).max(axis=2) / 127
    safe_OB1 = np.where(scale_OB > 0, scale_OB, 1)[..., None]
    q_OBK = np.clip(np.round(w_OBK / safe_OB1), -127, 127).astype(np.int8)
    return Int8(q_OBK.reshape(O, I), scale_OB)


def quantize(params, kind: str = "int8", block: int | None = None):
    """params with every decoder matrix int8: attention and MLP weights (a mixture's experts
    too), the embedding and the head. Norms, biases, routers, position tables and an encoder
    stay as they are.

    block: inputs per scale; None (one scale per row, the faster product) or e.g. 32 (GGUF
    Q8_0's layout: closer to the float weights)."""
    if not isinstance(params, Params):
        raise TypeError(f"quantize: params must be jaxkv Params (jaxkv.load, jaxkv.init_params), "
                        f"got {type(params).__name__}")
    if kind != "int8":
        raise ValueError(f"quantize: kind must be 'int8', got {kind!r}")
    block = checks.int_arg(block, "quantize: block", or_none=True)
    q = lambda w: w if w is None or isinstance(w, Int8) else quantize_matrix(w, block)  # noqa: E731
    blocks = tuple(b.replace(wqkv=q(b.wqkv), wo=q(b.wo), w_in=q(b.w_in), w_out=q(b.w_out),
                             experts_in=q(b.experts_in), experts_out=q(b.experts_out))
                   for b in params.blocks)
    return ops.placed(params.replace(embed=q(params.embed), lm_head=q(params.lm_head),
                               blocks=blocks))
