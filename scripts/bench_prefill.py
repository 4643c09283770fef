"""Prefill time and peak memory vs prompt length: jaxkv.prefill against transformers' forward.

SmolLM2-135M-Instruct in float32 (the shipped GGUF, dequantized by each library), batch 1, a
prompt of random token ids per length, a cache of exactly that many slots:
  jaxkv        jaxkv.prefill (the prompt in chunks of jaxkv.ops.prefill_chunk tokens; logits of
               the last token only)
  hf           transformers' model(input_ids) under torch.no_grad(): logits at every position,
               as the issue's baseline measured it
  hf_last      the same forward with logits_to_keep=1, the last position's logits only, as
               transformers' generate prefills (the fairer match of what jaxkv computes)
Time: all of them in turn, round after round in this one process (a slow spell of the shared
machine falls on all alike); the best round is reported, compile excluded (jaxkv's warm-up).

Peak memory: each (engine, length) in a fresh subprocess, which loads the model, compiles
(jaxkv), hands what it freed back (malloc_trim), then samples its resident set
(/proc/self/statm) every 5 ms during the measured call: extra = the peak during the call - the
resident set just before it (weights, cache and compiled program already there). maxrss is
not used: it is process-wide and monotone, so compile or loading would hide the call. For
jaxkv the compiled program's own accounting is recorded beside it (memory_analysis: XLA's
temporaries, and the output cache).
The issue's bound: extra <= 1 GB (weights and input cache are there before the call).

  python scripts/bench_prefill.py                                 # 512, 2048, 8192 (~25 min)
  python scripts/bench_prefill.py --lengths 512 2048 --chunks 256 512 1024   # chunk sweep
"""

import argparse
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time

import jax
import numpy as np

import jaxkv
from jaxkv import ops
from jaxkv.core import checks, decoder

from bench_checks import cpu_name, results_dir  # scripts/


def load(engine):
    """The model for one engine: jaxkv Params or a transformers model, float32, eval mode."""
    path = jaxkv.default_model()
    if engine == "jaxkv":
        return jaxkv.load(path)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype="float32")
    return model.eval()


def prompt(length, vocab=49152, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (1, length)).astype(np.int32)


def jaxkv_call(params, length, chunk):
    """A call of jaxkv.prefill on a fresh cache of `length` slots -> last logits [V] (numpy);
    with a chunk (not None), the same prefill compiled with that chunk."""
    cache = jaxkv.init_cache(params, 1, length)
    tokens = jax.numpy.asarray(prompt(length))
    if chunk is None:
        return lambda: np.asarray(jaxkv.prefill(params, cache, tokens)[0][0])
    tokens = checks.pad_to_bucket(tokens)
    lengths, start = jax.numpy.array([length]), jax.numpy.array([0])
    fn = jax.jit(decoder.prefill_padded, static_argnames="chunk")
    return lambda: np.asarray(fn(params, cache, tokens, lengths, start, chunk=chunk)[0][0])


def hf_call(model, length, last_only):
    import torch

    ids = torch.from_numpy(prompt(length).astype(np.int64))
    extra = {"logits_to_keep": 1} if last_only else {}

    def call():
        with torch.no_grad():
            return model(ids, **extra).logits[0, -1].numpy()
    return call


def calls(engine, model, length, chunk=None):
    if engine == "hf":
        return hf_call(model, length, False)
    if engine == "hf_last":
        return hf_call(model, length, True)
    return jaxkv_call(model, length, chunk)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_during(fn, every_s=0.005):
    """(fn's result, peak resident bytes while it ran - resident bytes before)."""
    before, peak, done = rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(every_s)
    thread = threading.Thread(target=sample)
    thread.start()
    try:
        out = fn()
    finally:
        done.set()
        thread.join()
    return out, max(peak[0], rss_bytes()) - before


def memory_here(engine, length):
    """Run in the subprocess: one engine at one length, warm, then measured."""
    model = load(engine)
    call = calls(engine, model, length)
    if engine == "jaxkv":
        call()  # compile
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the warm-up freed goes back to the system
    _, extra = peak_during(call)
    result = {"extra_bytes": extra, "rss_before_bytes": rss_bytes()}
    if engine == "jaxkv":
        params = model
        cache = jaxkv.init_cache(params, 1, length)
        tokens = checks.pad_to_bucket(jax.numpy.asarray(prompt(length)))
        one = jax.numpy.array([length])
        analysis = jax.jit(decoder.prefill_padded).lower(
            params, cache, tokens, one, one * 0).compile().memory_analysis()
        result.update(xla_temp_bytes=analysis.temp_size_in_bytes,
                      xla_output_bytes=analysis.output_size_in_bytes,
                      xla_argument_bytes=analysis.argument_size_in_bytes)
    return result


def memory(engine, length):
    """memory_here in a fresh process (its numbers are the call's own)."""
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-of", engine,
                          str(length)], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def time_rounds(runs, rounds):
    """({name: best seconds}, {name: output}): every run called once per round, in turn; the
    jaxkv ones warm up first (compile), torch runs need none."""
    outputs = {name: run() for name, run in runs.items() if name.startswith("jaxkv")}
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            outputs[name] = run()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}, outputs


def bench_length(length, engines, models, chunks, rounds, measure_memory):
    runs = {}
    for engine in engines:
        for chunk in (chunks if engine == "jaxkv" else [None]):
            name = engine if chunk is None else f"jaxkv_chunk{chunk}"
            runs[name] = calls(engine, models[engine], length, chunk)
    best, outputs = time_rounds(runs, rounds)
    row = {"length": length, "seconds": best}
    if "hf" in runs and "jaxkv" in runs:
        row["max_abs_logit_diff_vs_hf"] = float(np.max(np.abs(outputs["jaxkv"] - outputs["hf"])))
        row["jaxkv_speedup_vs_hf"] = best["hf"] / best["jaxkv"]
    if "hf_last" in runs and "jaxkv" in runs:
        row["jaxkv_speedup_vs_hf_last"] = best["hf_last"] / best["jaxkv"]
    if measure_memory:
        row["memory"] = {engine: memory(engine, length) for engine in engines}
    print(json.dumps(row), flush=True)
    return row


def plot(rows, out, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    lengths = [r["length"] for r in rows]
    for name in rows[0]["seconds"]:
        ax_t.plot(lengths, [r["seconds"][name] for r in rows], "o-", label=name)
    ax_t.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="seconds (best round)",
             title="prefill time")
    if "memory" in rows[0]:
        for engine in rows[0]["memory"]:
            ax_m.plot(lengths, [r["memory"][engine]["extra_bytes"] / 2**20 for r in rows], "o-",
                      label=f"{engine}: peak RSS during call - before")
        if "xla_temp_bytes" in rows[0]["memory"].get("jaxkv", {}):
            ax_m.plot(lengths, [r["memory"]["jaxkv"]["xla_temp_bytes"] / 2**20 for r in rows],
                      "x--", label="jaxkv: XLA temporaries")
    ax_m.set(xscale="log", xlabel="prompt tokens", ylabel="MiB",
             title="memory added during the call")
    for ax in (ax_t, ax_m):
        ax.minorticks_off()  # log-axis minor labels would overprint the lengths
        ax.set_xticks(lengths, [str(n) for n in lengths])
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--engines", nargs="+", default=["jaxkv", "hf", "hf_last"],
                        choices=["jaxkv", "hf", "hf_last"])
    parser.add_argument("--chunks", type=int, nargs="+", default=[],
                        help="jaxkv chunk sizes to time besides prefill's own "
                             "(jaxkv.ops.prefill_chunk)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own, one per core); on a "
                             "shared machine its OpenMP threads may wait on each other")
    parser.add_argument("--memory-of", nargs=2, metavar=("ENGINE", "LENGTH"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--out", default=f"{results_dir()}/bench_prefill")
    args = parser.parse_args()
    if args.memory_of:
        print(json.dumps(memory_here(args.memory_of[0], int(args.memory_of[1]))))
        return
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    models = {"jaxkv": load("jaxkv")}
    if {"hf", "hf_last"} & set(args.engines):
        models["hf"] = models["hf_last"] = load("hf")
    rows = [bench_length(n, args.engines, models, [None, *args.chunks], args.rounds,
                         not args.no_memory) for n in args.lengths]
    cpu = cpu_name()
    chunk = {n: ops.prefill_chunk(models["jaxkv"].blocks[0].wqkv, 1, checks.bucket_len(n))
             for n in args.lengths}  # tokens a pass of jaxkv.prefill, by length
    title = (f"SmolLM2-135M float32, batch 1, jaxkv chunks {sorted(set(chunk.values()))}; "
             f"{cpu}, {os.cpu_count()} cores")
    result = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
              "load_average_after": os.getloadavg(), "torch_threads": args.torch_threads,
              "chunk": chunk, "rounds": args.rounds, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, args.out, title)


if __name__ == "__main__":
    main()
