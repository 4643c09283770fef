"""The CPU attention kernel (jaxkv.ops.cpu.kernels.attend) against XLA's attention, one run: a decode
step's attention (one new token a row, its own key and value attended with the cache's) over
every layer of a model's shape, each layer its own cache, as a step reads them from memory.

  python scripts/bench_attention.py                     # SmolLM2's heads, 128 .. 8,192 keys
  python scripts/bench_attention.py --shapes smollm2 gemma3 --caches bfloat16 int8
  python scripts/bench_attention.py --contexts 64 256 --repeats 1 --layers 2     # quick

Each cell is the best of --repeats runs of 10 calls of one jitted function holding every
layer's attention (jaxkv.ops.cpu.attention, as decode_step calls it on the CPU); kernel, XLA
(the portable backend: jaxkv.ops.xla.attention) and a read-bandwidth probe (a
jitted sum of 512 MiB) run in turn in each round. GB/s = the keys' and values' bytes below the
filled length (int8: with their scales) / time; MBU = that / the probe's. Writes <out>.json and
<out>.png, naming the CPU.
"""

import argparse

import jax
import jax.numpy as jnp

from jaxkv.ops import cpu as cpu_ops
from jaxkv.ops import xla
from jaxkv.ops.arrays import half_kv, quantize_kv
from jaxkv.ops.cpu import kernels, pages

from bench_checks import results_dir  # scripts/
from bench_kernels import against_xla, save  # scripts/

# kv heads, query heads per kv head, head size, layers of the model whose shape it is
SHAPES = {"smollm2": (3, 3, 64, 30), "gemma3": (1, 4, 256, 18), "qwen2.5-0.5b": (2, 7, 64, 24),
          "llama-1b": (8, 4, 64, 16)}


def caches(shape, dtype: str, layers: int, S: int):
    """Per layer (keys, values) [1, K, S, H] in the cache's form (bfloat16: HalfKV, int8: Int8KV),
    random, on 2 MiB pages as a model's cache is."""
    K, _, H, _ = shape
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    xs = [jax.random.normal(k, (1, K, S, H)) for k in keys]
    form = {"float32": lambda x: x, "bfloat16": lambda x: half_kv(x, jnp.bfloat16),
            "int8": quantize_kv}[dtype]
    xs = pages.huge_pages([form(x) for x in xs])
    return list(zip(xs[::2], xs[1::2]))


def step(attend, shape, L: int):
    """A jitted function of (q [1, 1, N, H], layers' caches) attending every layer once, each
    query depending on the previous layer's output, as in a step."""
    K, G, H, _ = shape

    def run(q_BTNH, kvs):
        S = kvs[0][0].shape[2]
        mask_BTS = (jnp.arange(S) < L)[None, None, :]
        total = jnp.zeros((), jnp.float32)
        for k_BKSH, v_BKSH in kvs:
            q = q_BTNH * (1 + 0 * total)
            own = (q[:, :, :K].swapaxes(1, 2), q[:, :, :K].swapaxes(1, 2),
                   jnp.ones((1, 1, 1), bool), None)
            out_BTNH, _ = attend(q, k_BKSH, v_BKSH, mask_BTS, H ** -0.5, None, L, own, None)
            total = total + out_BTNH[0, 0, 0, 0]
        return total
    return jax.jit(run)


def read_bytes(kvs, L: int) -> int:
    """Bytes of keys and values (and int8 scales) below the filled length L, every layer."""
    leaves = jax.tree.leaves(kvs)
    return sum(x.nbytes * L // x.shape[2] for x in leaves)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["smollm2"], choices=sorted(SHAPES))
    ap.add_argument("--caches", nargs="+", default=["float32", "bfloat16", "int8"],
                    choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192],
                    help="filled length of the cache (keys read)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="default: the model's")
    ap.add_argument("--out", default=f"{results_dir()}/bench_attention")
    args = ap.parse_args()
    if not kernels.registered():
        raise SystemExit("the CPU kernels could not be built here (see the warning)")
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        K, G, H, model_layers = shape
        layers = args.layers or model_layers
        q_BTNH = jax.random.normal(jax.random.key(1), (1, 1, K * G, H))
        for dtype in args.caches:
            for L in args.contexts:
                kvs = caches(shape, dtype, layers, S=L + 16)
                nbytes = read_bytes(kvs, L)
                kernel_step = step(cpu_ops.attention, shape, L)
                xla_step = step(xla.attention, shape, L)
                t = against_xla(kernel_step, xla_step, (q_BTNH, kvs), nbytes, args.repeats)
                read = t["read_bandwidth"]
                row = dict(shape=name, kv_heads=K, group=G, head=H, layers=layers, cache=dtype,
                           keys=L, kv_bytes=nbytes, read_bandwidth=read,
                           kernel_us=t["kernel_s"] / layers * 1e6,
                           xla_us=t["xla_s"] / layers * 1e6, kernel_mbu=t["kernel_mbu"],
                           xla_mbu=t["xla_mbu"], speedup=t["speedup"])
                rows.append(row)
                print(f"{name:13s} {dtype:8s} {L:5d} keys: kernel {row['kernel_us']:8.1f} us a "
                      f"layer (MBU {row['kernel_mbu']:.2f})  XLA {row['xla_us']:8.1f} us (MBU "
                      f"{row['xla_mbu']:.2f})  {row['speedup']:5.2f}x  probe {read / 1e9:.1f} "
                      f"GB/s", flush=True)
    save(args, plot, rows=rows)


def plot(args, result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in args.shapes:
        for dtype in args.caches:
            sel = [r for r in result["rows"] if r["shape"] == name and r["cache"] == dtype]
            ax.plot([r["keys"] for r in sel], [r["kernel_mbu"] for r in sel], "o-",
                    label=f"{name}, {dtype} cache")
    ax.axhline(1, color="gray", linestyle=":")
    ax.set(xscale="log", xlabel="keys in the cache", ylabel="kernel MBU (vs the read probe)",
           title=f"Decode attention, {result['cpu']} x {result['cpu_count']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
