"""Reading compiled HLO text: its computations, the float copies of int8 weights a program
stores (scripts/check_int8_hlo.py, tests/test_quant.py), the bytes a step moves in a device's
main memory (scripts/compile_targets.py)."""

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


ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
              "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
ARRAY = re.compile(r"\b(" + "|".join(ITEM_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
              "conditional", "call", "after-all", "opt-barrier", "partition-id", "replica-id"}


def hbm_bytes(hlo: str, names) -> tuple[int, int]:
    """(bytes read, bytes written) in a device's main memory by the instructions of the
    computations `names` of compiled HLO text, each counted once: arrays whose layout names
    another memory space (`S(1)`: a TPU's VMEM) are on-chip and not counted; an asynchronous
    copy reads its source when it starts and writes its destination when it is done; a fusion
    that updates a buffer in place (its root a dynamic-update-slice or scatter) moves only the
    update; a slice, or a fusion with a gather, reads only what it gives. An estimate from shapes: a kernel's operand
    counts whole, read or not."""
    computations = hlo_computations(hlo)
    read = written = 0
    for name in names:
        shapes = {}
        for line in computations[name].splitlines():
            m = INSTRUCTION.match(line)
            if not m:
                continue
            target, shape, op, rest = m.groups()
            shapes[target] = shape
            if op in NO_TRAFFIC:
                continue
            operands = [shapes.get(o, "") for o in re.findall(r"%[\w.\-]+", rest.split(")")[0])]
            if op.endswith("-done"):
                written += _in_hbm(shape)
                continue
            root, body = _fused(computations, line) if op == "fusion" else (op, "")
            if root in ("dynamic-update-slice", "scatter"):
                update = sum(_in_hbm(s) for s in operands if s.split("{")[0] != shape.split("{")[0])
                read, written = read + update, written + update
            elif (op in ("slice", "dynamic-slice", "slice-start") or " gather(" in body
                  or root in ("slice", "dynamic-slice")):
                arrays = ARRAY.findall(shape)  # a slice-start's: ((operand), slice, context)
                dtype, dims, _ = arrays[1 if op == "slice-start" else 0]
                read += _nbytes(f"{dtype}[{dims}]")
                written += 0 if op.endswith("-start") else _in_hbm(shape)
            else:
                read += sum(_in_hbm(s) for s in operands)
                written += 0 if op.endswith("-start") else _in_hbm(shape)
    return read, written


def _in_hbm(shape: str) -> int:
    """Bytes of the arrays in an HLO shape that live in main memory (no S(n) in the layout)."""
    return _nbytes(shape, hbm=True)


def _nbytes(shape: str, hbm: bool = False) -> int:
    """Bytes of the arrays in an HLO shape (with hbm: only those in main memory)."""
    return sum(ITEM_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
               for dtype, dims, layout in ARRAY.findall(shape)
               if not (hbm and "S(" in layout))


def _fused(computations: dict, line: str) -> tuple:
    """(the opcode of its root, its text) of the computation a fusion calls."""
    called = re.search(r"calls=(%[\w.\-]+)", line)
    body = computations.get(called.group(1), "") if called else ""
    root = re.search(r"ROOT %[\w.\-]+ = .*? ([a-z][a-z0-9\-]*)\(", body)
    return (root.group(1) if root else None), body
