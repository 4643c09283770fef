"""The CPU product kernels (jaxkv.ops.cpu.kernels) against XLA's products, one run: the products of one
SmolLM2-135M decode step (30 layers of wqkv 960x576, wo 576x576, w_in 3072x576, w_out 576x1536,
then the 49152x576 head: 121 distinct random matrices, as a step streams them) for R rows of x.

  python scripts/bench_kernels.py                       # float32, bfloat16, int8; R 1 .. 64
  python scripts/bench_kernels.py --dtypes int8 --rows 1 4 --repeats 3 --layers 2   # quick

Each cell is the best of --repeats runs of 10 calls of one jitted function holding every
product; kernel and XLA (the einsum kernels.product lowers to off the CPU) and a read-bandwidth
probe (a jitted sum of 512 MiB) run in turn in each round. GB/s = weight bytes / time; MBU =
that / the probe's. Writes <out>.json and <out>.png, naming the CPU. This is what chose
kernels.ROWS: the largest row count at which the kernel still beats XLA.
"""

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core import quant
from jaxkv.ops.arrays import Int8, dequantize_rows
from jaxkv.ops.cpu import kernels, pages

from bench_checks import cpu_name, results_dir  # scripts/

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [O, I] of one SmolLM2 layer
HEAD = (49152, 576)


def weights(dtype: str, layers: int):
    """SmolLM2's step matrices, random, in dtype (int8: jaxkv.quantize's per-row scales), on
    2 MiB pages as jaxkv.load puts a model's (runs before 2026-11-26 had them on 4 KiB pages)."""
    shapes = LAYER * layers + [HEAD]
    keys = jax.random.split(jax.random.key(0), len(shapes))
    ws = [jax.random.normal(k, s) / s[1] ** 0.5 for k, s in zip(keys, shapes)]
    if dtype == "int8":
        return pages.huge_pages([quant.quantize_matrix(w) for w in ws])
    return pages.huge_pages([w.astype(dtype) for w in ws])


def step(product):
    """A jitted function of (x [R, 1536], weights) running every product once, in order (each
    input depends on the previous output, as in a step). For bfloat16 weights x is bfloat16, as
    a bfloat16 model's activations are."""
    def run(x_RI, ws):
        total = jnp.zeros((), jnp.float32)
        for w in ws:
            y_RO = product((x_RI[:, :w.shape[1]] * (1 + 0 * total)).astype(x_RI.dtype), w)
            total = total + y_RO[0, 0]
        return total
    return jax.jit(run)


def kernel_product(x_RI, w):
    if isinstance(w, Int8):
        return kernels.product_int8(x_RI, w.q, w.scale)
    return kernels.product(x_RI, w)


def xla_product(x_RI, w):
    """What kernels.product lowers to off the CPU: one einsum with a float32 result."""
    if isinstance(w, Int8):
        w = dequantize_rows(w.q, w.scale)
    return jnp.einsum("RI,OI->RO", x_RI, w, preferred_element_type=jnp.float32)


def seconds(fn, *args, calls=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


@functools.cache
def read_probe():
    """(a jitted sum, the 512 MiB it reads), made once."""
    return jax.jit(jnp.sum), jnp.ones((128 << 20,), jnp.float32)


def against_xla(kernel_step, xla_step, inputs, nbytes: int, repeats: int) -> dict:
    """The best of `repeats` rounds of kernel_step(*inputs) (10 calls), xla_step (3) and a read
    probe (a jitted sum of 512 MiB) in turn: seconds a call, the probe's bytes a second, and
    MBU = nbytes / time / that."""
    probe, big = read_probe()
    best = {"kernel": np.inf, "xla": np.inf, "probe": np.inf}
    for _ in range(repeats):
        best["kernel"] = min(best["kernel"], seconds(kernel_step, *inputs))
        best["xla"] = min(best["xla"], seconds(xla_step, *inputs, calls=3))
        best["probe"] = min(best["probe"], seconds(probe, big))
    read = big.nbytes / best["probe"]
    return dict(read_bandwidth=read, kernel_s=best["kernel"], xla_s=best["xla"],
                kernel_mbu=nbytes / best["kernel"] / read, xla_mbu=nbytes / best["xla"] / read,
                speedup=best["xla"] / best["kernel"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30, help="SmolLM2 has 30")
    ap.add_argument("--out", default=f"{results_dir()}/bench_kernels")
    args = ap.parse_args()
    if not kernels.registered():
        raise SystemExit("the CPU kernels could not be built here (see the warning)")
    kernel_step, xla_step = step(kernel_product), step(xla_product)
    rows = []
    for dtype in args.dtypes:
        ws = weights(dtype, args.layers)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(ws))
        for R in args.rows:
            x_RI = jax.random.normal(jax.random.key(R), (R, 1536)).astype(
                jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
            t = against_xla(kernel_step, xla_step, (x_RI, ws), nbytes, args.repeats)
            read = t["read_bandwidth"]
            row = dict(dtype=dtype, rows=R, weight_bytes=nbytes, read_bandwidth=read,
                       kernel_ms=t["kernel_s"] * 1e3, xla_ms=t["xla_s"] * 1e3,
                       kernel_mbu=t["kernel_mbu"], xla_mbu=t["xla_mbu"], speedup=t["speedup"])
            rows.append(row)
            print(f"{dtype:9s} R={R:3d} kernel {row['kernel_ms']:8.2f} ms (MBU "
                  f"{row['kernel_mbu']:.2f})  XLA {row['xla_ms']:8.2f} ms (MBU "
                  f"{row['xla_mbu']:.2f})  {row['speedup']:5.2f}x  probe {read / 1e9:.1f} GB/s",
                  flush=True)
    save(args, plot, rows_limit=kernels.ROWS, rows=rows)


def save(args, plot, **fields):
    """<args.out>.json (the CPU, its cores, jax's version and fields) and plot(args, result)."""
    result = dict(cpu=cpu_name(), cpu_count=os.cpu_count(), jax=jax.__version__, **fields)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(args, result)


def plot(args, result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for dtype in args.dtypes:
        sel = [r for r in result["rows"] if r["dtype"] == dtype]
        line, = ax.plot([r["rows"] for r in sel], [r["speedup"] for r in sel], "o-", label=dtype)
        ax.axvline(result["rows_limit"][dtype], color=line.get_color(), linestyle="--",
                   label=f"kernels.ROWS for {dtype}")
    ax.axhline(1, color="gray", linestyle=":")
    ax.set(xscale="log", xlabel="rows of x (batch x tokens)", ylabel="XLA time / kernel time",
           title=f"SmolLM2 step products, {result['cpu']} x {result['cpu_count']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
