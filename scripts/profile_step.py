"""Where a decode step's time goes: the compiled decode_step run under jax.profiler, its time
summed by operation kind and, for the matrix products, by the weight each one reads.

  python scripts/profile_step.py                         # SmolLM2-135M, float32, batch 1
  python scripts/profile_step.py --dtype bfloat16 --batch 8 --capacity 2048 --pos 1000
  python scripts/profile_step.py --model path/to/hf_dir

The step is decode_step under jax.jit with the cache donated, run --steps times at position
--pos after a warm-up. Profiling slows every operation a little; read the shares, not the
totals. The time between operations, when no thread runs one, is summed as idle. Writes
<out>.json (per-kind and per-weight tables), <out>.hlo.txt (the optimized HLO,
to look up an operation by name) and keeps the raw trace under <out>_trace/ (Perfetto or
TensorBoard can open it).
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv

from bench_checks import results_dir  # scripts/

WEIGHT_OPERAND = re.compile(r"%params_(?:blocks_\d+__)?(\w+?)(?:\.\d+)?[,)]")


def weights_read(hlo_text):
    """{instruction name: the weight it reads} for every instruction of the entry computation
    that takes a parameter array as operand (per-layer names lose their layer index)."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    found = {}
    for line in entry.splitlines():
        match = re.match(r"\s*(?:ROOT )?%([\w.-]+) = [^=]*?(?:fusion|dot|custom-call)\((.*)", line)
        if match:
            weights = WEIGHT_OPERAND.findall(match.group(2))
            weights = [w for w in weights if not w.endswith(("norm_scale", "norm_bias"))]
            if weights:
                found[match.group(1)] = weights[0]
    return found


def trace_events(trace_dir, hlo_text):
    """Complete events ('X') of the perfetto trace jax.profiler wrote for the instructions of
    hlo_text (not the runtime's own spans, such as ThunkExecutor::Execute around them)."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = set(re.findall(r"^\s*(?:ROOT )?%([\w.-]+) =", hlo_text, re.MULTILINE))
    return [e for e in events if e.get("ph") == "X" and e["name"] in names]


def summarize(events, weights, n_steps, weight_bytes):
    """Count and ms per step by kind (the name without its numeric suffix), by matrix product
    (kind and the weight it reads) and by single instruction."""
    tables = [collections.defaultdict(lambda: [0, 0.0]) for _ in range(3)]
    for e in events:
        kind = re.sub(r"\.\d+$", "", e["name"])
        keys = [kind, (kind, weights[e["name"]]) if e["name"] in weights else None, e["name"]]
        for table, key in zip(tables, keys):
            if key is not None:
                table[key][0] += 1
                table[key][1] += e.get("dur", 0.0)
    by_kind, by_weight, by_name = (sorted(t.items(), key=lambda kv: -kv[1][1]) for t in tables)
    rows = lambda items, **extra: [  # noqa: E731
        dict(name=k, per_step=c / n_steps, ms_per_step=us / n_steps / 1e3, us_each=us / c)
        for k, (c, us) in items]
    by_weight = [dict(r, name=r["name"][0], weight=r["name"][1]) for r in rows(by_weight)]
    for r in by_weight:  # a product reads its whole weight once per call (a lookup does not)
        product = any(word in r["name"] for word in ("dot", "gemm", "ynn", "matmul", "ffi_call"))
        r["gb_per_s"] = (weight_bytes.get(r["weight"], np.nan) / (r["us_each"] * 1e-6) / 1e9
                         if product else np.nan)
    return rows(by_kind), by_weight, rows(by_name[:20])


def idle(events, n_steps, longest_us=200.0):
    """The step's time in no instruction: gaps between one instruction's end and the next one's
    start (on any thread), per step and by the kind that follows. Gaps over longest_us are the
    host's between steps, left out (SmolLM2 bfloat16, 2-core Zen 5: 0.31 ms of a step, 0.3-0.4
    us before each of its ~1,050 instructions)."""
    gaps = collections.defaultdict(lambda: [0, 0.0])
    end = None
    for e in sorted(events, key=lambda e: e["ts"]):
        if end is not None and 0 < e["ts"] - end <= longest_us:
            kind = re.sub(r"\.\d+$", "", e["name"])
            gaps[kind][0] += 1
            gaps[kind][1] += e["ts"] - end
        end = e["ts"] + e.get("dur", 0.0) if end is None else max(end, e["ts"] + e.get("dur", 0.0))
    items = sorted(gaps.items(), key=lambda kv: -kv[1][1])
    return [dict(name=f"before {k}", per_step=c / n_steps, ms_per_step=us / n_steps / 1e3,
                 us_each=us / c) for k, (c, us) in items]


def array_bytes(params):
    """{weight name as weights_read gives it: bytes of one such array}."""
    sizes = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        sizes[re.sub(r"^blocks\.\d+\.", "", name).replace(".", "_")] = leaf.nbytes
    return sizes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint path (default: SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--capacity", type=int, default=160)
    ap.add_argument("--pos", type=int, default=96)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=f"{results_dir()}/profile_step")
    args = ap.parse_args()
    from jaxkv.formats.locate import default_model

    params = jaxkv.cast(jaxkv.load(args.model or default_model()), getattr(jnp, args.dtype))
    cache = jaxkv.init_cache(params, args.batch, args.capacity)
    token_B = jnp.zeros((args.batch,), jnp.int32)
    pos_B = jnp.full((args.batch,), args.pos, jnp.int32)
    step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
    compiled = step.lower(params, cache, token_B, pos_B).compile()
    for _ in range(5):
        logits_BV, cache = compiled(params, cache, token_B, pos_B)
    jax.block_until_ready(logits_BV)
    trace_dir = args.out + "_trace"
    shutil.rmtree(trace_dir, ignore_errors=True)
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            logits_BV, cache = compiled(params, cache, token_B, pos_B)
            jax.block_until_ready(logits_BV)
    profiled_ms = (time.perf_counter() - start) / args.steps * 1e3
    hlo = compiled.as_text()
    events = trace_events(trace_dir, hlo)
    tables = summarize(events, weights_read(hlo), args.steps, array_bytes(params))
    report(args, params, profiled_ms, hlo, *tables, idle(events, args.steps))


def report(args, params, profiled_ms, hlo, by_kind, by_weight, by_name, gaps):
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".hlo.txt", "w") as f:
        f.write(hlo)
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, model=args.model,
                  dtype=args.dtype, batch=args.batch, capacity=args.capacity, pos=args.pos,
                  weight_bytes=int(sum(x.nbytes for x in jax.tree.leaves(params))),
                  profiled_ms_per_step=profiled_ms, by_kind=by_kind, by_weight=by_weight,
                  top_instructions=by_name, idle=gaps)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"{profiled_ms:.2f} ms per step under the profiler ({result['device']})")
    _table("operation kind", by_kind[:20])
    _table("matrix product: weight", [dict(r, name=f"{r['name']}: {r['weight']}")
                                      for r in by_weight], gb_per_s="GB/s")
    _table("single instruction", by_name)
    _table(f"idle: {sum(r['ms_per_step'] for r in gaps):.3f} ms/step, by the next instruction",
           gaps[:10])


def _table(title, rows, **extra):
    print(f"\n{title:48s} {'per step':>8s} {'ms/step':>8s} {'us each':>8s}" +
          "".join(f" {v:>6s}" for v in extra.values()))
    for r in rows:
        print(f"{r['name'][:48]:48s} {r['per_step']:8.1f} {r['ms_per_step']:8.3f} "
              f"{r['us_each']:8.1f}" + "".join(f" {r[k]:6.1f}" for k in extra))


if __name__ == "__main__":
    main()
