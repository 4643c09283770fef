"""N sampled continuations of one long prompt: jaxkv branches (the prompt's K/V stored once, read
once per step) against three baselines, all measured in the same run.

  branches     make_prefix once + decode_branches (shared-prefix attention, LSE-merged)
  duplicated   generate with the prompt repeated N times (N prefills, N caches)
  copied       one prefill, its cache copied to N rows, then a scan of decode_step
  sequential   generate for one row, N times

Reports tokens/s (N * new tokens / wall time, prefill included) and peak memory (XLA's memory
analysis of the compiled programs: arguments + outputs + temporaries), writes JSON and a PNG.

  python scripts/bench_branches.py                       # the full grid (takes a while on CPU)
  python scripts/bench_branches.py --branches 1 4 --new-tokens 16 --prompt-len 128   # quick
"""

import argparse
import functools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.core import decoder
from jaxkv.decoding import multidecode as md
from jaxkv.decoding.generate import generate_args, generate_loop
from jaxkv.decoding.sampling import row_keys, sample, sampling_params

from bench_checks import results_dir  # scripts/

MODELS = {
    # Llama-shaped, ~32M parameters: big enough that weights dominate a step, small enough that
    # the whole grid (up to 64 x 1024 prefill tokens) runs on two CPU cores.
    "small-llama": dict(vocab_size=16384, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
                        d_ff=1536, max_seq_len=4096, tie_embeddings=True),
}


def load_model(name):
    if name == "smollm2":
        from jaxkv.formats.locate import default_model

        return jaxkv.load(default_model())
    return jaxkv.init_params(jaxkv.Config.llama(**MODELS[name]), jax.random.key(0))


def peak_bytes(jitted, *args, **static):
    """Arguments + outputs + temporaries of one compiled program (aliased buffers once)."""
    m = jitted.lower(*args, **static).compile().memory_analysis()
    if m is None:
        return float("nan")
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def copied_decode(params, prefix, sampling, keys_n, *, max_new_tokens):
    """Baseline: the prompt's cache copied into each of n rows, then ordinary decode_step."""
    n, P = keys_n.shape[0], prefix.cache.capacity
    cache = jaxkv.init_cache(params, n, P + max_new_tokens)
    copy = lambda full, one: full.at[:, :, :P].set(jnp.broadcast_to(one, (n,) + one.shape[1:]))  # noqa: E731
    cache = cache.replace(k=tuple(map(copy, cache.k, prefix.cache.k)),
                          v=tuple(map(copy, cache.v, prefix.cache.v)))
    V = params.config.vocab_size
    never_seen = jnp.zeros((n, V), bool)

    def step(carry, t):
        cache, logits_nV = carry
        token_n = sample(logits_nV, sampling, keys_n, t, never_seen)
        logits_nV, cache = jaxkv.decode_step(params, cache, token_n,
                                             jnp.broadcast_to(prefix.length[0] + t, (n,)))
        return (cache, logits_nV), token_n

    start = (cache, jnp.broadcast_to(prefix.logits[0], (n, V)))
    _, tokens_Tn = jax.lax.scan(step, start, jnp.arange(max_new_tokens))
    return tokens_Tn.T


def methods(params, prompt, n, T, key):
    """{name: (run() -> tokens, peak bytes)} for one (n, T) cell."""
    sampling = sampling_params(n, temperature=1.0)
    keys = row_keys(key, n)
    prefix = md.make_prefix(params, prompt)
    prefill_bytes = peak_bytes(decoder._prefill_jit, params,
                               jaxkv.init_cache(params, 1, prefix.cache.capacity),
                               jnp.zeros((1, prefix.cache.capacity), jnp.int32),
                               jnp.array([len(prompt)], jnp.int32), jnp.zeros(1, jnp.int32))

    def branches():
        p = md.make_prefix(params, prompt)
        return md._decode_branches(params, p, sampling, keys, max_new_tokens=T).tokens

    def copied():
        return copied_decode(params, md.make_prefix(params, prompt), sampling, keys,
                             max_new_tokens=T)

    dup_args, dup_static = generate_args(params, [prompt] * n, T, temperature=1.0, key=keys)
    one_args = [generate_args(params, [prompt], T, temperature=1.0, key=keys[b:b + 1])
                for b in range(n)]

    def duplicated():
        return generate_loop(*dup_args, **dup_static)[0]

    def sequential():
        return jnp.concatenate([generate_loop(*a, **s)[0] for a, s in one_args])

    return {
        "branches": (branches, max(prefill_bytes, peak_bytes(
            md._decode_branches, params, prefix, sampling, keys, max_new_tokens=T))),
        "duplicated": (duplicated, peak_bytes(generate_loop, *dup_args, **dup_static)),
        "copied": (copied, max(prefill_bytes, peak_bytes(
            copied_decode, params, prefix, sampling, keys, max_new_tokens=T))),
        "sequential": (sequential, peak_bytes(generate_loop, *one_args[0][0], **one_args[0][1])),
    }


def timed(run, repeats):
    jax.block_until_ready(run())  # compile
    counts = dict(jaxkv.trace_counts)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - start)
    assert dict(jaxkv.trace_counts) == counts, "recompiled after warm-up"
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="small-llama", choices=[*MODELS, "smollm2"])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--branches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=f"{results_dir()}/bench_branches")
    args = ap.parse_args()
    params = load_model(args.model)
    prompt = np.random.default_rng(0).integers(0, params.config.vocab_size,
                                               args.prompt_len).tolist()
    rows = []
    for T in args.new_tokens:
        for n in args.branches:
            cell = methods(params, prompt, n, T, jax.random.key(n * 1000 + T))
            for name, (run, peak) in cell.items():
                seconds = timed(run, args.repeats)
                rows.append(dict(method=name, branches=n, new_tokens=T, seconds=seconds,
                                 tokens_per_s=n * T / seconds, peak_bytes=peak))
                print(f"T={T:4d} N={n:3d} {name:10s} {seconds:8.3f} s "
                      f"{n * T / seconds:9.1f} tok/s  peak {peak / 2**20:8.1f} MiB", flush=True)
    report(args, params, rows)


def ratio(rows, n, T, a, b):
    get = {(r["method"], r["branches"], r["new_tokens"]): r["tokens_per_s"] for r in rows}
    return get[(a, n, T)] / get[(b, n, T)]


def report(args, params, rows):
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    summary = {f"N={n} T={T}": {"vs_duplicated": ratio(rows, n, T, "branches", "duplicated"),
                                "vs_copied": ratio(rows, n, T, "branches", "copied"),
                                "vs_sequential": ratio(rows, n, T, "branches", "sequential")}
               for T in args.new_tokens for n in args.branches}
    result = dict(model=args.model, config=params.config.to_dict(), prompt_len=args.prompt_len,
                  device=jax.devices()[0].device_kind, platform=platform.platform(),
                  jax=jax.__version__, rows=rows, branches_speedup=summary)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    for key, value in summary.items():
        print(key, " ".join(f"{k} {v:.2f}x" for k, v in value.items()))
    plot(args, rows)


def plot(args, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(args.new_tokens), figsize=(5 * len(args.new_tokens), 8),
                             squeeze=False)
    for col, T in enumerate(args.new_tokens):
        for name in ("branches", "duplicated", "copied", "sequential"):
            sel = [r for r in rows if r["method"] == name and r["new_tokens"] == T]
            n = [r["branches"] for r in sel]
            axes[0, col].plot(n, [r["tokens_per_s"] for r in sel], "o-", label=name)
            axes[1, col].plot(n, [r["peak_bytes"] / 2**20 for r in sel], "o-", label=name)
        axes[0, col].set_title(f"prompt {args.prompt_len}, {T} new tokens")
        for row, label in ((0, "tokens/s"), (1, "peak memory (MiB)")):
            axes[row, col].set(xscale="log", yscale="log", xlabel="branches N", ylabel=label)
            axes[row, col].grid(True, which="both", alpha=0.3)
    axes[0, 0].legend()
    fig.suptitle(f"{args.model} on {jax.devices()[0].device_kind}")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
