"""A paged decode step against a contiguous one on the CPU, one run.

SmolLM2-135M-Instruct (the default model; a random Llama of its shape where it is not
installed), each row's cache filled to each context length, three caches:
  contiguous  init_cache(..., block_size=None)
  gather      block_size=16 (generate_many's default), read as arrays.logical gives it
              (jaxkv.ops.cpu.READS_PAGES off: the CPU backend before its attention kernel read
              pages)
  kernel      the same paged cache, its pools and table handed to the attention kernel
the paged ones with each row's blocks in two orders in the pool (--orders): `ascending` (as a
fresh BlockPool gives them since 2026-11-28) and `descending` (as it gave them before). Each is
one compiled jax.jit(decode_step, donate_argnames="cache"), timed in turn, round after round:
--steps steps at position `context`, ms a step, best over --rounds. Ratios to contiguous: best
against best, and paired (the median over rounds of each round's own pair), so a slow spell of
a shared machine falls on all of them. Writes <out>.json and <out>.md.

  python scripts/bench_paged.py                                      # ~7 min on 2 cores
  python scripts/bench_paged.py --contexts 256 --rounds 2 --steps 5  # quick
"""

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.core.cache import with_table
from jaxkv.ops import cpu as cpu_ops

from bench_checks import cpu_name, results_dir  # scripts/

PAGED = ("gather", "kernel")
BLOCK = 16
SMOLLM2 = dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
               max_seq_len=8192)


def model():
    """(name, float32 params): the default model, else a random Llama of its shape."""
    try:
        return "SmolLM2-135M-Instruct", jaxkv.load(jaxkv.default_model())
    except FileNotFoundError:
        return "random SmolLM2-135M shape", jaxkv.init_params(jaxkv.Config.llama(**SMOLLM2),
                                                              jax.random.key(0))


def cache_for(variant: str, order: str, params, B: int, capacity: int, dtype):
    """An empty cache of the variant's layout; paged: pages of BLOCK slots, each row's blocks in
    ascending or descending order."""
    if variant == "contiguous":
        return jaxkv.init_cache(params, B, capacity, dtype)
    cache = jaxkv.init_cache(params, B, capacity, dtype, block_size=BLOCK)
    blocks = np.arange(B * capacity // BLOCK)
    table_BM = (blocks if order == "ascending" else blocks[::-1]).reshape(B, -1)
    return with_table(cache, jnp.asarray(table_BM, jnp.int32))


def timed_step(variant: str, order: str, params, B: int, context: int, steps: int, dtype):
    """A function timing `steps` decode steps of the variant at position `context`: ms a step."""
    cache = cache_for(variant, order, params, B, context + BLOCK, dtype)
    token_B, pos_B = jnp.zeros(B, jnp.int32), jnp.full(B, context, jnp.int32)
    def decode_step(params, cache, token, pos):  # a function of its own: JAX keeps traces by
        return jaxkv.decode_step(params, cache, token, pos)  # function, READS_PAGES aside
    cpu_ops.READS_PAGES = variant != "gather"  # read when decode_step is traced, here
    try:
        step = jax.jit(decode_step, donate_argnames="cache").lower(
            params, cache, token_B, pos_B).compile()
    finally:
        cpu_ops.READS_PAGES = True
    state = [cache]

    def run() -> float:
        start, cache = time.perf_counter(), state[0]
        for _ in range(steps):
            logits_BV, cache = step(params, cache, token_B, pos_B)
        jax.block_until_ready(logits_BV)
        state[0] = cache
        return (time.perf_counter() - start) / steps * 1e3
    run()
    return run


def bench(params, dtype: str, B: int, context: int, args) -> dict:
    """One row of results: each variant's steps with a cache of dtype (int8: float32 weights)."""
    if dtype == "bfloat16":
        params = jaxkv.cast(params, jnp.bfloat16)
    variants = [("contiguous", None)] + [(v, o) for o in args.orders for v in PAGED]
    names = ["contiguous"] + [f"{v}_{o}" for o in args.orders for v in PAGED]
    runs = {name: timed_step(*vo, params, B, context, args.steps, dtype)
            for name, vo in zip(names, variants)}
    ms = {name: [] for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            ms[name].append(runs[name]())
    row = dict(dtype=dtype, batch=B, context=context, ms=ms,
               **{f"{name}_ms": min(ms[name]) for name in names})
    for name in names[1:]:
        row[f"{name}_ratio"] = row[f"{name}_ms"] / row["contiguous_ms"]
        row[f"{name}_paired"] = statistics.median(
            p / c for p, c in zip(ms[name], ms["contiguous"]))
    print(f"{dtype:8s} batch {B} context {context:5d}: contiguous {row['contiguous_ms']:6.2f} ms"
          + "".join(f", {name} {row[name + '_ratio']:.3f}x ({row[name + '_paired']:.3f})"
                    for name in names[1:]), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16", "int8"], help="the cache's (and weights')")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048],
                    help="filled positions of each row (multiples of 16)")
    ap.add_argument("--orders", nargs="+", default=["descending", "ascending"],
                    choices=["descending", "ascending"], help="of each row's blocks in the pool")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=f"{results_dir()}/bench_paged")
    args = ap.parse_args()
    name, base = model()
    rows = []
    for dtype in args.dtypes:
        for B in args.batches:
            for context in args.contexts:
                rows.append(bench(base, dtype, B, context, args))
    save(args, name, rows)


def save(args, name: str, rows: list):
    result = dict(cpu=cpu_name(), cpu_count=os.cpu_count(), jax=jax.__version__, model=name,
                  block_size=BLOCK, orders=args.orders, steps=args.steps, rounds=args.rounds,
                  rows=rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    paged = [f"{v}_{o}" for o in args.orders for v in PAGED]
    lines = [f"{name} decode steps, paged (blocks of {BLOCK}) against contiguous: gather = read "
             f"as arrays.logical gives it (before), kernel = the attention kernel reads the pools "
             f"through the table (after); each row's blocks in descending or ascending order. "
             f"Ratio to contiguous, best of {args.rounds} "
             f"alternating rounds of {args.steps} steps (paired median in brackets); "
             f"{result['cpu']}, {result['cpu_count']} cores, jax {result['jax']}", "",
             "| cache | batch | context | contiguous ms | " + " | ".join(paged) + " |",
             "|---|--:|--:|--:|" + "--:|" * len(paged)]
    lines += [f"| {r['dtype']} | {r['batch']} | {r['context']} | {r['contiguous_ms']:.2f} | "
              + " | ".join(f"{r[p + '_ratio']:.3f} ({r[p + '_paired']:.3f})" for p in paged)
              + " |" for r in rows]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
