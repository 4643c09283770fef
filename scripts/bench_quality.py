"""Perplexity of a model on tinyshakespeare for each weight format: what int8 or bfloat16 costs
in quality, measured rather than assumed.

  fp32   the weights as loaded (SmolLM2-135M-Instruct: its GGUF's values in float32)
  bf16   jaxkv.cast(params, jnp.bfloat16)
  int8   jaxkv.quantize(params, "int8"): int8 matrices with one scale per row

The text's first --tokens tokens are cut into windows of --window tokens, each scored from a
fresh context with jaxkv.forward (its first token has no prediction): perplexity = exp(mean
negative log-likelihood). Writes JSON + PNG.

  python scripts/bench_quality.py                         # SmolLM2, 4096 tokens, windows of 1024
  python scripts/bench_quality.py --tokens 256 --window 128 --formats fp32 int8   # quick
"""

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv

from bench_checks import cpu_name  # scripts/

TEXT = Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"
FORMATS = {
    "fp32": lambda params: params,
    "bf16": lambda params: jaxkv.cast(params, jnp.bfloat16),
    "int8": lambda params: jaxkv.quantize(params, "int8"),
}


@jax.jit
def window_nll(params, tokens_BW):
    """Summed negative log-likelihood of tokens 1.. of each window given the ones before."""
    logits_BWV = jaxkv.forward(params, tokens_BW).astype(jnp.float32)
    logp_BWV = jax.nn.log_softmax(logits_BWV[:, :-1], axis=-1)
    return -jnp.take_along_axis(logp_BWV, tokens_BW[:, 1:, None], axis=-1).sum()


def perplexity(params, windows_NW) -> float:
    nll = sum(float(window_nll(params, w_W[None])) for w_W in windows_NW)
    return math.exp(nll / (windows_NW.shape[0] * (windows_NW.shape[1] - 1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a jaxkv / HF / GGUF path (default SmolLM2)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--out", default="results/bench_quality")
    args = ap.parse_args()
    if args.tokens % args.window:
        ap.error("--tokens must be a multiple of --window")
    path = args.model or jaxkv.default_model()
    params = jaxkv.load(path)
    ids = jaxkv.load_tokenizer(path).encode(TEXT.read_text()).ids[:args.tokens]
    windows_NW = np.asarray(ids, np.int32).reshape(-1, args.window)
    rows = []
    for name in args.formats:
        start = time.perf_counter()
        ppl = perplexity(FORMATS[name](params), windows_NW)
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([r["format"] for r in rows], [r["perplexity"] for r in rows], color="C0")
    for i, r in enumerate(rows):
        label = f"{r['perplexity']:.3f}" + (f"\n({r['vs_fp32']:.4f}x)" if r["vs_fp32"] else "")
        ax.text(i, r["perplexity"], label, ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="perplexity", title=f"{result['model']}, {args.tokens} tokens of "
           f"{TEXT.name}, windows of {args.window}")
    ax.title.set_fontsize(8)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
