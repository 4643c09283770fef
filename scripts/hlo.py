"""Reading compiled HLO text: the float copies of int8 weights a program stores (used by
scripts/check_int8_hlo.py and tests/test_quant.py)."""

import re

import jax
import numpy as np

from jaxkv.ops.arrays import Int8


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
