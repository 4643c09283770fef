"""Throughput over a data set: continuous batching (jaxkv.generate_many) against static batching
(jaxkv.generate on consecutive batches, each running until its longest answer ends) and
transformers' batched generate (left-padded), all in this one run.

SmolLM2-135M-Instruct in float32 (the shipped GGUF), greedy, EOS ignored so that every answer
has exactly its budget: prompts are passages of tinyshakespeare of 10-300 tokens; answer budgets
are long-tailed (most 8-32 tokens, one in six 8-16x longer). Tokens/s counts answer tokens only.
Static batching's answers are checked equal to generate_many's (and transformers' agreement is
reported). Busy rows over time: continuous batching logs each decoding call; static batching's
rows are busy for their own budget's share of their batch's time.

  python scripts/bench_throughput.py                              # 256 prompts, batch 16 and 32
  python scripts/bench_throughput.py --prompts 48 --batches 8 --no-hf   # quick
"""

import argparse
import json
import os
import platform
import time

import jax
import numpy as np

import jaxkv
from jaxkv.decoding import batching

from bench_checks import cpu_name, results_dir  # scripts/

SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                           "tinyshakespeare.txt")


def data_set(tokenizer, n, seed=0):
    """n (prompt ids, budget): passages of 10-300 tokens, budgets long-tailed."""
    rng = np.random.default_rng(seed)
    with open(SHAKESPEARE, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read()[:400_000]).ids
    lengths = rng.integers(10, 301, n)
    starts = rng.integers(0, len(ids) - 300, n)
    long = rng.random(n) < 1 / 6
    budgets = np.where(long, rng.integers(128, 257, n), rng.integers(8, 33, n))
    return [ids[s: s + n_] for s, n_ in zip(starts, lengths)], budgets.tolist()


class Recorder:
    """Wraps batching.decode: (seconds since start, busy rows) at each call."""

    def __init__(self):
        self.decode, self.log, self.start = batching.decode, [], None

    def __call__(self, params, rows, *args):
        self.log.append((time.perf_counter() - self.start, int((~rows.answers.done).sum())))
        return self.decode(params, rows, *args)


def run_continuous(params, prompts, budgets, batch_size, max_len):
    recorder = Recorder()
    batching.decode = recorder
    try:
        recorder.start = time.perf_counter()
        answers = jaxkv.generate_many(params, prompts, budgets, batch_size=batch_size,
                                      max_len=max_len)
        return answers, time.perf_counter() - recorder.start, recorder.log
    finally:
        batching.decode = recorder.decode


def run_static(params, prompts, budgets, batch_size, max_len):
    """Consecutive batches through generate, each run to its longest budget and each row cut
    at its own; a batch whose max_new_tokens compiled a new program runs again (compile is not
    counted, as a long job would have it cached)."""
    answers, busy, elapsed = [], [], 0.0
    for i in range(0, len(prompts), batch_size):
        group, wanted = prompts[i: i + batch_size], budgets[i: i + batch_size]
        def run():
            return np.asarray(jaxkv.generate(params, group, max(wanted), max_len=max_len)[0])

        traces = jaxkv.trace_counts["generate"]
        seconds, tokens_BN = timed(run)
        if jaxkv.trace_counts["generate"] != traces:
            seconds, tokens_BN = timed(run)
        answers += [row[:n].tolist() for row, n in zip(tokens_BN, wanted)]
        for f in np.linspace(0, 1, 20, endpoint=False):  # rows still busy at each time
            busy.append((elapsed + f * seconds, int(sum(n > f * max(wanted) for n in wanted))))
        elapsed += seconds
    return answers, elapsed, busy


def timed(run):
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def run_hf(model, prompts, budgets, batch_size, pad_id):
    import torch

    answers, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        group, wanted = prompts[i: i + batch_size], budgets[i: i + batch_size]
        T = max(map(len, group))
        ids = torch.tensor([[pad_id] * (T - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(wanted),
                                 min_new_tokens=max(wanted), do_sample=False,
                                 pad_token_id=pad_id)
        answers += [row[T: T + n].tolist() for row, n in zip(out, wanted)]
    return answers, time.perf_counter() - start


def load_hf(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype="float32")
    return model.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--out", default=f"{results_dir()}/bench_throughput")
    args = ap.parse_args()
    path = jaxkv.default_model()
    params, tokenizer = jaxkv.load(path), jaxkv.load_tokenizer(path)
    prompts, budgets = data_set(tokenizer, args.prompts)
    max_len = 512 + 256
    hf = None if args.no_hf else load_hf(path)
    warm = prompts[:4], [2] * 3 + [max(budgets)]  # the same answer buffer: nothing left to compile
    rows = []
    for batch in args.batches:
        run_continuous(params, *warm, batch, max_len)  # compile (every shape is fixed)
        cont, cont_s, cont_busy = run_continuous(params, prompts, budgets, batch, max_len)
        stat, stat_s, stat_busy = run_static(params, prompts, budgets, batch, max_len)
        row = dict(batch=batch, tokens=int(sum(budgets)), continuous_s=cont_s, static_s=stat_s,
                   equal_to_static=cont == stat, busy_continuous=cont_busy,
                   busy_static=stat_busy)
        if hf is not None:
            theirs, hf_s = run_hf(hf, prompts, budgets, batch, params.config.eos_id or 0)
            row.update(hf_s=hf_s, hf_agreement=float(np.mean(
                [np.mean(np.array(a) == np.array(b)) for a, b in zip(cont, theirs)])))
        rows.append(row)
        print(summary(row), flush=True)
    result = dict(cpu=cpu_name(), machine=platform.machine(), jax=jax.__version__,
                  prompts=args.prompts, budgets=budgets, rows=earlier_rows(args, budgets) + rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out + ".png")


def earlier_rows(args, budgets):
    """Rows of the other batch sizes from an earlier run of the same data set on the same CPU,
    kept so that `--batches 32` adds to a file holding batch 16 instead of replacing it."""
    try:
        with open(args.out + ".json") as f:
            old = json.load(f)
    except (OSError, ValueError):
        return []
    if (old.get("cpu"), old.get("budgets")) != (cpu_name(), budgets):
        return []
    return [row for row in old["rows"] if row["batch"] not in args.batches]


def summary(row):
    n = row["tokens"]
    text = (f"batch {row['batch']}: continuous {n / row['continuous_s']:.1f} tokens/s, static "
            f"{n / row['static_s']:.1f} ({row['static_s'] / row['continuous_s']:.2f}x), equal "
            f"{row['equal_to_static']}")
    if "hf_s" in row:
        text += (f", transformers {n / row['hf_s']:.1f} ({row['hf_s'] / row['continuous_s']:.2f}x,"
                 f" agreement {row['hf_agreement']:.2f})")
    return text


def plot(result, file):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        for name in ("continuous", "static"):
            t, busy = zip(*row["busy_" + name])
            ax.step(t, busy, where="post", label=f"{name} ({row['tokens'] / row[name + '_s']:.0f}"
                    " tokens/s)")
        ax.set(title=f"batch {row['batch']}", xlabel="seconds", ylabel="busy rows",
               ylim=(0, row["batch"] + 1))
        ax.legend()
    fig.suptitle(f"SmolLM2-135M fp32, {result['prompts']} prompts, {result['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(file, dpi=100)


if __name__ == "__main__":
    main()
