"""The complexity claim, measured: total time to generate n tokens greedily from a 1-token
prompt, n = 16 .. 1024.

  cached    jaxkv.generate: prefill + decode_step per token (K/V cached; a step reads the
            filled cache once: O(n) per step, O(n^2) per generation)
  uncached  jaxkv.forward over the whole sequence so far for every new token (O(n^2) attention
            per step, O(n^3) per generation). The sequence is padded to the next power of two
            so that it compiles log2(n) programs up front, not one per length.

Both produce the same tokens (checked). Fits log-log slopes of time vs n, prints them, writes
JSON + PNG. Warm-up compiles everything first; a recompile afterwards is an assertion error.

  python scripts/bench_complexity.py                          # n = 16 .. 1024
  python scripts/bench_complexity.py --lengths 16 32 64       # quick
"""

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.core.tracecount import count_trace

from bench_checks import results_dir  # scripts/

MODEL = dict(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768,
             max_seq_len=4096)


def cached(params, n):
    return np.asarray(jaxkv.generate(params, [[1]], n)[0][0])


@jax.jit
def next_token(params, tokens_1T, length):
    count_trace("uncached next_token")
    logits_1TV = jaxkv.forward(params, tokens_1T)
    return jnp.argmax(logits_1TV[0, length - 1]).astype(jnp.int32)


def uncached(params, n):
    tokens = np.zeros((1, _bucket(n + 1)), np.int32)
    tokens[0, 0] = 1
    for t in range(1, n + 1):
        T = _bucket(t)
        tokens[0, t] = int(next_token(params, jnp.asarray(tokens[:, :T]), t))
    return tokens[0, 1:n + 1]


def _bucket(t):
    return max(16, 1 << (t - 1).bit_length())


def best_seconds(run, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - start)
    return best, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=f"{results_dir()}/bench_complexity")
    args = ap.parse_args()
    params = jaxkv.init_params(jaxkv.Config.llama(**MODEL), jax.random.key(0))
    for n in args.lengths:  # warm-up: every program either method will run
        cached(params, n)
    uncached(params, max(args.lengths))
    counts = dict(jaxkv.trace_counts)
    rows = []
    for n in args.lengths:
        t_cached, ours = best_seconds(lambda: cached(params, n), args.repeats)
        t_uncached, plain = best_seconds(lambda: uncached(params, n), args.repeats)
        assert (ours == plain).all(), f"cached and uncached greedy tokens differ at n={n}"
        rows.append(dict(n=n, cached_s=t_cached, uncached_s=t_uncached,
                         speedup=t_uncached / t_cached))
        print(json.dumps(rows[-1]), flush=True)
    assert dict(jaxkv.trace_counts) == counts, "recompiled after warm-up"
    report(args, params, rows)


def slope(rows, key, lo=0):
    n = np.log([r["n"] for r in rows[lo:]])
    return float(np.polyfit(n, np.log([r[key] for r in rows[lo:]]), 1)[0])


def report(args, params, rows):
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    half = len(rows) // 2
    slopes = {"cached": slope(rows, "cached_s"), "uncached": slope(rows, "uncached_s"),
              "cached_upper_half": slope(rows, "cached_s", half),
              "uncached_upper_half": slope(rows, "uncached_s", half)}
    result = dict(config=params.config.to_dict(), device=jax.devices()[0].device_kind,
                  platform=platform.platform(), jax=jax.__version__, rows=rows,
                  loglog_slopes=slopes)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print("log-log slopes of total time vs n:",
          ", ".join(f"{k} {v:.2f}" for k, v in slopes.items()))
    plot(args, rows, slopes)


def plot(args, rows, slopes):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    n = [r["n"] for r in rows]
    for key, label in (("cached_s", "cached"), ("uncached_s", "uncached")):
        ax.plot(n, [r[key] for r in rows], "o-",
                label=f"{label} (slope {slopes[label]:.2f}, upper half "
                      f"{slopes[label + '_upper_half']:.2f})")
    ax.set(xscale="log", yscale="log", xlabel="tokens generated n", ylabel="total seconds",
           title=f"greedy generation from 1 token, {jax.devices()[0].device_kind}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
