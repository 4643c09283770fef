"""Evaluation at scale on the CPU (issue 50), each figure against its baseline in the same run.

  loglikelihood  multiple-choice requests as lm-evaluation-harness makes them: --contexts
                 contexts of --context-len tokens of tinyshakespeare (tests/data), each with 4
                 choices of 2 to 8 tokens (the next tokens of the text, and three from
                 elsewhere), so 4 x --contexts requests: jaxkv.loglikelihood_many against the
                 harness's own Hugging Face model (HFLM._loglikelihood_tokens on the same token
                 requests, its --hf-batch-size), the same weights in float32 (--model, by
                 default SmolLM2-135M-Instruct's shipped GGUF, dequantized by each library).
                 Results compared (largest difference of a log-likelihood, greedy flags equal).

  prefix         --prompts prompts sharing a few-shot prefix of --prefix-len tokens (the text's
                 first), each ending in its own --question-len tokens, 16 new tokens each,
                 greedy: generate_many with its prefix cache against prefix_cache=False (both
                 compiled first on a few prompts); answers compared.
  memory         --rows rows of mixed lengths (one of --longest tokens, the rest of 20 to 100),
                 16 new tokens: the paged pool generate_many sizes for them against the contiguous
                 layout's batch x capacity slots; the answers (batch 16) against the contiguous
                 layout's (block_size=None).

Times are wall-clock seconds of the whole request list; jaxkv's is its second run (the first
compiles; both recorded). Writes <out>.json and <out>.md naming the CPU.

  python scripts/bench_eval.py                      # 250 contexts: 1,000 requests (~5 min)
  python scripts/bench_eval.py --parts prefix --prompts 64 --out results/cpu/<cpu>/bench_eval_prefix64
  python scripts/bench_eval.py --contexts 2 --context-len 16 --prompts 2 --prefix-len 32 \
      --question-len 4 --cache-tokens 512 --longest 128 --rows 4 --out /tmp/bench_eval
"""

import argparse
import json
import os
import time

import numpy as np

import jaxkv

from bench_checks import cpu_name, results_dir  # scripts/

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "tests", "data", "tinyshakespeare.txt")


def requests(tokenizer, contexts: int, context_len: int, seed: int = 0) -> list:
    """4 x contexts (context ids, continuation ids): the text's next tokens and three other
    spans as the choices of each context."""
    with open(TEXT, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read()[:400_000]).ids
    rng = np.random.default_rng(seed)
    out = []
    for start in rng.integers(0, len(ids) - context_len - 8, contexts):
        context = ids[start:start + context_len]
        for choice in range(4):
            n = int(rng.integers(2, 9))
            at = start + context_len if choice == 0 else int(rng.integers(0, len(ids) - n))
            out.append((context, ids[at:at + n]))
    return out


def seconds(run):
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def hf_model(path: str, batch_size: int):
    """lm-evaluation-harness's Hugging Face model over path (a GGUF file or a transformers
    directory), float32, CPU."""
    from lm_eval.models.huggingface import HFLM

    common = dict(dtype="float32", device="cpu", batch_size=batch_size)
    if os.path.isdir(path):
        return HFLM(pretrained=path, **common)
    folder = os.path.dirname(path)
    return HFLM(pretrained=folder, gguf_file=os.path.basename(path), **common,
                tokenizer=folder if os.path.exists(os.path.join(folder, "tokenizer.json"))
                else None)


def bench_loglikelihood(args, params, tokenizer, path) -> dict:
    reqs = requests(tokenizer, args.contexts, args.context_len)
    cold, ours = seconds(lambda: jaxkv.loglikelihood_many(params, reqs,
                                                          batch_size=args.batch_size))
    warm, again = seconds(lambda: jaxkv.loglikelihood_many(params, reqs,
                                                           batch_size=args.batch_size))
    assert again == ours
    hf = hf_model(path, args.hf_batch_size)
    theirs_s, theirs = seconds(lambda: hf._loglikelihood_tokens(
        [(None, list(c), list(x)) for c, x in reqs], disable_tqdm=True))
    diff = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs))
    return dict(requests=len(reqs), contexts=args.contexts, context_len=args.context_len,
                jaxkv_s=warm, jaxkv_first_s=cold, hf_s=theirs_s, speedup=theirs_s / warm,
                max_abs_diff=diff, greedy_equal=[a[1] for a in ours] == [b[1] for b in theirs],
                batch_size=args.batch_size, hf_batch_size=args.hf_batch_size)


def text_ids(tokenizer, n: int, at: int = 0) -> list[int]:
    with open(TEXT, encoding="utf-8") as f:
        return tokenizer.encode(f.read()[at:at + 8 * n]).ids[:n]


def bench_prefix(args, params, tokenizer) -> dict:
    prefix = text_ids(tokenizer, args.prefix_len)
    prompts = [prefix + text_ids(tokenizer, args.question_len, 20_000 + 300 * i)
               for i in range(args.prompts)]
    run = lambda some, cache: jaxkv.generate_many(  # noqa: E731
        params, some, 16, batch_size=16, prefix_cache=cache, cache_tokens=args.cache_tokens)
    for cache in (True, False):
        run(prompts[:2], cache)  # compiled (the pool is cache_tokens either way)
    with_s, with_cache = seconds(lambda: run(prompts, True))
    without_s, without = seconds(lambda: run(prompts, False))
    return dict(prompts=args.prompts, prefix_len=len(prefix), question_len=args.question_len,
                with_s=with_s, without_s=without_s, speedup=without_s / with_s,
                answers_equal=with_cache == without)


def bench_memory(params, tokenizer, longest: int, rows: int) -> dict:
    from jaxkv.decoding.batching import Schedule

    rng = np.random.default_rng(3)
    lengths = rng.integers(20, 101, rows - 1)
    prompts = [text_ids(tokenizer, longest)] + [text_ids(tokenizer, int(n), 1000 * i)
                                              for i, n in enumerate(lengths)]
    paged = Schedule(params, prompts, 16, rows).paging
    contiguous_slots = rows * Schedule(params, prompts, 16, rows, block_size=None).capacity
    pool_slots = paged.pool.blocks * paged.pool.size
    ours = jaxkv.generate_many(params, prompts, 16, batch_size=16)
    theirs = jaxkv.generate_many(params, prompts, 16, batch_size=16, block_size=None)
    return dict(rows=rows, longest=longest, pool_slots=pool_slots,
                contiguous_slots=contiguous_slots,
                fraction=pool_slots / contiguous_slots, answers_equal=ours == theirs)


def _table(columns, cells) -> list[str]:
    """A markdown table of one row: the first and last columns left-aligned, the rest right."""
    aligns = ["---"] + ["--:"] * (len(columns) - 2) + ["---"]
    return [f"| {' | '.join(columns)} |", f"|{'|'.join(aligns)}|",
            f"| {' | '.join(map(str, cells))} |", ""]


def markdown(result) -> str:
    lines = [f"# bench_eval on {result['cpu']}", ""]
    if "loglikelihood" in result:
        r = result["loglikelihood"]
        lines += _table(
            ["work", "requests", "jaxkv s (first)", "lm-eval HF s", "speed-up", "max diff",
             "greedy equal"],
            [f"loglikelihood, {r['contexts']} contexts of {r['context_len']} tokens x 4 choices",
             r["requests"], f"{r['jaxkv_s']:.2f} ({r['jaxkv_first_s']:.2f})", f"{r['hf_s']:.2f}",
             f"{r['speedup']:.2f}x", f"{r['max_abs_diff']:.1e}", r["greedy_equal"]])
    if "prefix" in result:
        p = result["prefix"]
        lines += _table(
            ["work", "with the prefix cache s", "without s", "speed-up", "answers equal"],
            [f"{p['prompts']} prompts: a {p['prefix_len']}-token prefix + {p['question_len']} "
             f"tokens, 16 new", f"{p['with_s']:.1f}", f"{p['without_s']:.1f}",
             f"{p['speedup']:.2f}x", p["answers_equal"]])
    if "memory" in result:
        m = result["memory"]
        lines += _table(
            ["work", "paged pool slots", "contiguous slots", "fraction", "answers equal"],
            [f"{m['rows']} rows, one of {m['longest']} tokens, the rest of 20-100",
             m["pool_slots"], m["contiguous_slots"], f"{m['fraction']:.3f}", m["answers_equal"]])
    return "\n".join(lines)


PARTS = {
    "loglikelihood": bench_loglikelihood,
    "prefix": lambda args, params, tokenizer, path: bench_prefix(args, params, tokenizer),
    "memory": lambda args, params, tokenizer, path: bench_memory(params, tokenizer,
                                                                 args.longest, args.rows),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contexts", type=int, default=250)
    ap.add_argument("--context-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16, help="jaxkv's contexts at once")
    ap.add_argument("--hf-batch-size", type=int, default=16, help="the harness's requests at once")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--cache-tokens", type=int, default=16 * 1104,
                    help="the pool of both prefix runs (so one compile serves each)")
    ap.add_argument("--longest", type=int, default=2048, help="the memory cell's long prompt")
    ap.add_argument("--rows", type=int, default=64, help="the memory cell's rows")
    ap.add_argument("--model", default=None, help="a GGUF file or transformers directory "
                    "(default: jaxkv.default_model(), SmolLM2-135M-Instruct)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS),
                    help="which measurements to run")
    ap.add_argument("--out", default=f"{results_dir()}/bench_eval")
    args = ap.parse_args()
    path = args.model or jaxkv.default_model()
    params, tokenizer = jaxkv.load(path), jaxkv.load_tokenizer(path)
    result = dict(cpu=cpu_name(), model=os.path.basename(path))
    result.update((part, PARTS[part](args, params, tokenizer, path)) for part in args.parts)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
