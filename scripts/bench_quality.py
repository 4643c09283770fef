"""Perplexity of a model on tinyshakespeare for each weight and KV cache format: what int8 or
bfloat16 costs in quality, measured rather than assumed.

  fp32           the weights as loaded (SmolLM2-135M-Instruct: its GGUF's values in float32)
  bf16           jaxkv.cast(params, jnp.bfloat16)
  int8           jaxkv.quantize(params, "int8"): int8 matrices with one scale per row
  int8-kv        fp32 weights, KV cache int8 (init_cache(dtype=jnp.int8): one float32 scale per
                 token and kv head)
  int8+int8-kv   int8 weights and int8 KV cache
  llama.cpp-F32, llama.cpp-Q8_0, llama.cpp-Q8_0+q8_0-kv   (GGUF models, if llama_cpp imports)
                 llama-cpp-python on the GGUF files scripts/bench_decode.py writes with
                 llama.cpp's quantize (F32: the dequantized weights jaxkv's fp32 runs; Q8_0: int8
                 in blocks of 32 weights), KV cache F32, or Q8_0 (with flash attention, which
                 llama.cpp needs for a quantized V) in the last; all logits of a window from
                 one eval (logits_all)

The text's first --tokens tokens are cut into windows of --window tokens, each scored from a
fresh context (its first token has no prediction): perplexity = exp(mean negative
log-likelihood). Float caches: jaxkv.forward. An int8 cache: one cached pass (jaxkv.extend) of
the window into an empty int8 cache, in which every token reads the keys and values of the
ones before it as the cache stores them (quantized), which equals decoding the window token by
token (tests/test_kv_int8.py). Writes JSON, a Markdown table and a PNG.

  python scripts/bench_quality.py                         # SmolLM2, 4096 tokens, windows of 1024
  python scripts/bench_quality.py --tokens 256 --window 128 --formats fp32 int8-kv   # quick
"""

import argparse
import functools
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.core.attention import causal_mask
from jaxkv.core.decoder import logits as head_logits

from bench_checks import cpu_name, results_dir  # scripts/

TEXT = Path(__file__).resolve().parents[1] / "tests/data/tinyshakespeare.txt"
FORMATS = {  # name: (the weights from the loaded float32 params, KV cache dtype or None)
    "fp32": (lambda params: params, None),
    "bf16": (lambda params: jaxkv.cast(params, jnp.bfloat16), None),
    "int8": (lambda params: jaxkv.quantize(params, "int8"), None),
    "int8-kv": (lambda params: params, jnp.int8),
    "int8+int8-kv": (lambda params: jaxkv.quantize(params, "int8"), jnp.int8),
}
LLAMACPP = {  # name: (GGUF file type, KV cache type)
    "llama.cpp-F32": ("F32", "F32"),
    "llama.cpp-Q8_0": ("Q8_0", "F32"),
    "llama.cpp-Q8_0+q8_0-kv": ("Q8_0", "Q8_0"),
}


def window_logits(params, tokens_BW, kv_dtype):
    """Logits [B, W, V] of every position: the uncached forward (kv_dtype None), or one cached
    pass into an empty cache of kv_dtype (the tokens read each other as the cache holds them)."""
    if kv_dtype is None:
        return jaxkv.forward(params, tokens_BW)
    B, W = tokens_BW.shape
    pos_BW = jnp.broadcast_to(jnp.arange(W), (B, W))
    x_BWD, _ = jaxkv.extend(params, jaxkv.init_cache(params, B, W, kv_dtype), tokens_BW, pos_BW,
                            pos_BW, causal_mask(pos_BW, W))
    return head_logits(params, x_BWD)


@functools.partial(jax.jit, static_argnames="kv_dtype")
def window_nll(params, tokens_BW, kv_dtype=None):
    """Summed negative log-likelihood of tokens 1.. of each window given the ones before."""
    logits_BWV = window_logits(params, tokens_BW, kv_dtype).astype(jnp.float32)
    logp_BWV = jax.nn.log_softmax(logits_BWV[:, :-1], axis=-1)
    return -jnp.take_along_axis(logp_BWV, tokens_BW[:, 1:, None], axis=-1).sum()


def perplexity(params, windows_NW, kv_dtype=None) -> float:
    nll = sum(float(window_nll(params, w_W[None], kv_dtype)) for w_W in windows_NW)
    return math.exp(nll / (windows_NW.shape[0] * (windows_NW.shape[1] - 1)))


def llamacpp_perplexity(path, kv_type, windows_NW) -> float:
    """The same perplexity from llama-cpp-python: all logits of a window from one eval."""
    import llama_cpp

    W = windows_NW.shape[1]
    kv = getattr(llama_cpp, f"GGML_TYPE_{kv_type}")
    llm = llama_cpp.Llama(path, n_ctx=W, n_batch=W, n_ubatch=W, logits_all=True,
                          n_threads=os.cpu_count(), n_threads_batch=os.cpu_count(),
                          type_k=kv, type_v=kv, flash_attn=kv_type != "F32", verbose=False)
    nll = 0.0
    for w_W in windows_NW:
        llm.reset()
        llm.eval(w_W.tolist())
        logits_WV = np.asarray(llm.scores[:W - 1], np.float64)
        top_W1 = logits_WV.max(-1, keepdims=True)
        lse_W = top_W1[:, 0] + np.log(np.exp(logits_WV - top_W1).sum(-1))
        nll += float((lse_W - np.take_along_axis(logits_WV, w_W[1:, None], axis=-1)[:, 0]).sum())
    return math.exp(nll / (windows_NW.shape[0] * (W - 1)))


def llamacpp_paths(path, names, workdir):
    """{format: GGUF path} for the llama.cpp formats asked for; {} with the reason printed when
    they cannot run (no llama_cpp, or a model that is not SmolLM2's GGUF file)."""
    if not names:
        return {}
    from bench_decode import GGUF_MODELS, llamacpp_files  # scripts/: writes the files once

    if str(path) != str(GGUF_MODELS["smollm2"]()):
        print(f"llama.cpp rows skipped: {path} is not the SmolLM2 GGUF file bench_decode converts")
        return {}
    files = llamacpp_files("smollm2", workdir, sorted({LLAMACPP[n][0] for n in names}))
    return {n: files[LLAMACPP[n][0]] for n in names if LLAMACPP[n][0] in files}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a jaxkv / HF / GGUF path (default SmolLM2)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--formats", nargs="+", default=[*FORMATS, *LLAMACPP],
                    choices=[*FORMATS, *LLAMACPP])
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "jaxkv_bench"),
                    help="where the llama.cpp GGUF files are written (as bench_decode's)")
    ap.add_argument("--out", default=f"{results_dir()}/bench_quality")
    args = ap.parse_args()
    if args.tokens % args.window:
        ap.error("--tokens must be a multiple of --window")
    path = args.model or jaxkv.default_model()
    params = jaxkv.load(path)
    ids = jaxkv.load_tokenizer(path).encode(TEXT.read_text()).ids[:args.tokens]
    windows_NW = np.asarray(ids, np.int32).reshape(-1, args.window)
    gguf = llamacpp_paths(path, [n for n in args.formats if n in LLAMACPP], args.workdir)
    rows = []
    for name in args.formats:
        if name in LLAMACPP and name not in gguf:
            continue
        start = time.perf_counter()
        if name in LLAMACPP:
            ppl = llamacpp_perplexity(gguf[name], LLAMACPP[name][1], windows_NW)
        else:
            weights, kv_dtype = FORMATS[name]
            ppl = perplexity(weights(params), windows_NW, kv_dtype)
        rows.append(dict(format=name, perplexity=ppl, seconds=time.perf_counter() - start))
        print(json.dumps(rows[-1]))
    base = next((r["perplexity"] for r in rows if r["format"] == "fp32"), None)
    for r in rows:
        r["vs_fp32"] = base and r["perplexity"] / base
    report(args, path, rows)


def report(args, path, rows):
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    result = dict(model=os.path.basename(path), tokens=args.tokens, window=args.window,
                  text=TEXT.name, cpu=cpu_name(), device=jax.devices()[0].device_kind,
                  platform=platform.platform(), jax=jax.__version__, rows=rows)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(result))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.5 + 0.9 * len(rows), 3.8))
    base = rows[0]["perplexity"] / (rows[0]["vs_fp32"] or 1.0)  # fp32's, or the first row's
    change = [100 * (r["perplexity"] / base - 1) for r in rows]
    ax.bar([r["format"] for r in rows], change,
           color=["C1" if r["format"].startswith("llama.cpp") else "C0" for r in rows])
    for i, (r, y) in enumerate(zip(rows, change)):
        ax.text(i, max(y, 0), f"{r['perplexity']:.3f}\n{y:+.2f}%", ha="center", va="bottom",
                fontsize=7)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.tick_params(axis="x", labelsize=7, labelrotation=20)
    ax.set_ylim(min(0, *change) - 0.1, max(1.0, *change) * 1.35)
    ax.set(ylabel="perplexity vs fp32 (%); dashed: +1%",
           title=f"{result['model']}, {args.tokens} tokens of {TEXT.name}, windows of "
           f"{args.window} (perplexity, change vs fp32)")
    ax.title.set_fontsize(8)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


def markdown(result) -> str:
    """The rows as a Markdown table, with what was measured above it."""
    lines = [f"Perplexity of {result['model']} on the first {result['tokens']} tokens of "
             f"{result['text']} (windows of {result['window']}), {result['cpu']}.", "",
             "| format | perplexity | vs fp32 | seconds |", "|---|---:|---:|---:|"]
    for r in result["rows"]:
        ratio = f"{r['vs_fp32']:.4f}x" if r["vs_fp32"] else "-"
        lines.append(f"| {r['format']} | {r['perplexity']:.3f} | {ratio} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
