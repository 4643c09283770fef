"""Speculative decoding against generate, same run: tokens/s and tokens per target pass.

SmolLM2-135M-Instruct in float32 (the shipped GGUF), greedy, chat-formatted prompts of two
kinds: input-grounded (the model is given a tinyshakespeare passage and asked to copy it, or to
copy it with a light edit) and free-form (questions with no text to copy). Each kind runs at
batch 1 (every prompt alone) and batch 4 (the prompts together); for each, generate and
speculative_generate with n-gram lookup at several (n_draft, n_branches) trees (its default
n_draft among them), and with the
int8-quantized SmolLM2 as a draft model. Every speculative answer is checked equal to
generate's. Each configuration is compiled before it is timed; then every engine runs every
group of prompts in turn, --repeats rounds (best of them), so a slow spell of a shared machine
falls on all alike (runs before 2026-11-26 timed one engine's repeats after another's).

  python scripts/bench_speculative.py                       # the full table (~10 min)
  python scripts/bench_speculative.py --new-tokens 8 --prompts 1 --trees 2x1 --batches 1
  python scripts/bench_speculative.py --costs               # only what a tree pass costs

--costs times one tree pass over B rows x N nodes against the B-row one-node pass (a decode
step), and the model speculative.ROW_COST makes of it: what the rule for drafting assumes.
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
from jaxkv.decoding import speculative

from bench_checks import cpu_name, results_dir  # scripts/

SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                           "tinyshakespeare.txt")
ASKS = ["Copy the following passage exactly, word for word:\n\n{}",
        "Rewrite the following passage exactly as it is, but in lowercase:\n\n{}",
        "Repeat this text back to me without changes:\n\n{}",
        "Copy this passage, replacing every name with 'X':\n\n{}"]
FREE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a refrigerator works to a ten-year-old.",
        "What are three good habits for staying healthy? Explain each.",
        "Describe a walk through a forest in autumn."]


def prompts_of(kind, tokenizer, template, n, seed=0):
    """n chat-formatted prompt ids of one kind."""
    if kind == "free":
        texts = FREE[:n]
    else:
        rng = np.random.default_rng(seed)
        with open(SHAKESPEARE, encoding="utf-8") as f:
            text = f.read()[:200_000]
        starts = rng.integers(0, len(text) - 2000, n)
        texts = []
        for ask, start in zip(ASKS, starts):
            passage = text[start:start + 600]
            passage = passage[passage.index("\n\n") + 2:] if "\n\n" in passage else passage
            texts.append(ask.format(passage[:450].rsplit("\n", 1)[0]))
    return [tokenizer.encode(jaxkv.apply_chat_template(
        template, [{"role": "user", "content": t}])).ids for t in texts]


def timed(fn, repeats):
    """(best seconds of `repeats` runs after one warm-up run, the last result)."""
    out = jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best, out


def interleaved(engines, groups, repeats):
    """{name: (best seconds summed over groups, [result per group])}: each engine's call on each
    group of prompts, warmed up, then `repeats` rounds in which every engine runs every group
    in turn, so that a slow spell of the machine falls on all of them alike."""
    out = {name: [jax.block_until_ready(f(g)) for g in groups] for name, f in engines.items()}
    best = {name: [float("inf")] * len(groups) for name in engines}
    for _ in range(repeats):
        for i, g in enumerate(groups):
            for name, f in engines.items():
                start = time.perf_counter()
                jax.block_until_ready(f(g))
                best[name][i] = min(best[name][i], time.perf_counter() - start)
    return {name: (sum(best[name]), out[name]) for name in engines}


def run_case(params, draft, prompts, batch, new_tokens, trees, repeats, eos):
    """Rows for one (prompt kind, batch): generate, then each speculative configuration, timed
    in turn (interleaved)."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    # n_draft None: speculative_generate's default, recorded as its number at this batch size
    # (the loop takes it anew as the batch shrinks)
    configs = [("lookup" if d else "lookup default", "lookup", d, m) for d, m in trees]
    if draft is not None:
        configs.append(("int8 draft", draft, 4, 1))
    engines = {"generate": lambda rows: jaxkv.generate(params, rows, new_tokens, eos_id=eos)}
    for name, drafter, n_draft, M in configs:
        engines[name, n_draft, M] = lambda rows, drafter=drafter, n_draft=n_draft, M=M: \
            jaxkv.speculative_generate(params, rows, new_tokens, draft=drafter,
                                       n_draft=n_draft, n_branches=M, eos_id=eos)
    timings = interleaved(engines, groups, repeats)
    gen_s, reference = timings.pop("generate")
    tokens = sum(int(np.sum(lengths)) for _, lengths in reference)
    results = [dict(engine="generate", seconds=gen_s, tokens=tokens, tokens_per_pass=1.0)]
    for (name, n_draft, M), (spec_s, outs) in timings.items():
        equal = all(np.array_equal(out, want) and np.array_equal(lengths, want_len)
                    for (out, lengths, _), (want, want_len) in zip(outs, reference))
        passes = sum(int(np.sum(stats.passes)) for *_, stats in outs)
        committed = sum(int(np.sum(stats.passes + stats.accepted)) for *_, stats in outs)
        D = n_draft or speculative.default_n_draft(batch, M)
        results.append(dict(engine=name, n_draft=D, n_branches=M, seconds=spec_s,
                            tokens=tokens, tokens_per_pass=committed / max(passes, 1),
                            equal_to_generate=equal, speedup=gen_s / spec_s))
    return results


def pass_costs(params, batches, repeats, nodes, capacity=400, pos=250):
    """Rows: ms of one tree pass (nodes, logits) for B rows x N nodes at position `pos`, its
    ratio to the B-row pass of one node, and ROW_COST's model of that ratio."""
    rows = []
    for B in batches:
        cache = jaxkv.init_cache(params, B, capacity)
        pos_B = jnp.full((B,), pos, jnp.int32)
        base = None
        for N in nodes:
            tree = jax.jit(lambda c, t, N=N: speculative.tree_pass(
                params, c, t, pos_B, np.arange(N), 1, N - 1)[0][:, :, :1])
            seconds, _ = timed(lambda: tree(cache, jnp.zeros((B, N), jnp.int32)), repeats)
            base = base or seconds
            model = speculative.tree_cost(B, N)
            rows.append(dict(batch=B, nodes=N, rows=B * N, ms=seconds * 1e3,
                             vs_step=seconds / base, row_cost_model=model))
            print(f"batch {B} x {N:2d} nodes: {seconds * 1e3:6.1f} ms, {seconds / base:.2f} steps "
                  f"(ROW_COST model {model:.2f})", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="prompts of each kind (at most 4)")
    ap.add_argument("--kinds", nargs="+", default=["grounded", "free"],
                    choices=["grounded", "free"], help="prompt kinds")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--trees", nargs="+", default=["4x1", "8x1", "defaultx1"],
                    help="lookup trees, n_draft x n_branches; n_draft 'default': "
                    "speculative_generate's for the batch (15 at batch 1, 7 at 4)")
    ap.add_argument("--no-draft", action="store_true", help="skip the int8 draft model")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs (best kept) after one "
                    "warm-up run")
    ap.add_argument("--costs", action="store_true", help="only time tree passes (see above)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17],
                    help="--costs: tree nodes per row")
    ap.add_argument("--row-cost", type=float, help="speculative.ROW_COST for this run (default: "
                    "its own)")
    ap.add_argument("--out", help="path without extension (default: the machine's folder under "
                    "results/, bench_speculative, with --costs bench_speculative_costs)")
    args = ap.parse_args()
    args.out = args.out or (f"{results_dir()}/bench_speculative_costs" if args.costs else
                            f"{results_dir()}/bench_speculative")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    if args.row_cost is not None:
        speculative.ROW_COST = args.row_cost
    path = jaxkv.default_model()
    params, tokenizer = jaxkv.load(path), jaxkv.load_tokenizer(path)
    if args.costs:
        rows = pass_costs(params, args.batches, max(args.repeats, 5), args.nodes)
        with open(args.out + ".json", "w") as f:
            json.dump(dict(cpu=cpu_name(), jax=jax.__version__, row_cost=speculative.ROW_COST,
                           pass_costs=rows), f, indent=1)
        return
    template = jaxkv.chat_template(path)
    draft = None if args.no_draft else jaxkv.quantize(params)
    trees = [(None if d == "default" else int(d), int(m))
             for d, m in (t.split("x") for t in args.trees)]
    rows = []
    for kind in args.kinds:
        prompts = prompts_of(kind, tokenizer, template, args.prompts)
        for batch in args.batches:
            for r in run_case(params, draft, prompts, batch, args.new_tokens, trees, args.repeats,
                              params.config.eos_id):
                rows.append(dict(kind=kind, batch=batch, **r))
                print(summary(rows[-1]), flush=True)
    result = dict(cpu=cpu_name(), machine=platform.machine(), jax=jax.__version__,
                  row_cost=speculative.ROW_COST, new_tokens=args.new_tokens,
                  prompts=args.prompts, rows=rows)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out + ".png")


def summary(row):
    text = (f"{row['kind']:8s} batch {row['batch']} {row['engine']:10s} "
            f"{row['tokens'] / row['seconds']:6.1f} tokens/s")
    if row["engine"] != "generate":
        text += (f"  n_draft {row['n_draft']} x {row['n_branches']}: {row['speedup']:.2f}x, "
                 f"{row['tokens_per_pass']:.2f} tokens/pass, equal {row['equal_to_generate']}")
    return text


def plot(result, file):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["kind"], r["batch"]) for r in result["rows"]})
    fig, axes = plt.subplots(1, len(cases), figsize=(4.5 * len(cases), 4), squeeze=False)
    for ax, (kind, batch) in zip(axes[0], cases):
        rows = [r for r in result["rows"] if (r["kind"], r["batch"]) == (kind, batch)]
        labels = [r["engine"] if r["engine"] == "generate" else
                  f"{r['engine']}\n{r['n_draft']}x{r['n_branches']}" for r in rows]
        ax.bar(range(len(rows)), [r["tokens"] / r["seconds"] for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=45)
        ax.set(title=f"{kind}, batch {batch}", ylabel="tokens/s")
    fig.suptitle(f"SmolLM2-135M fp32 greedy, speculative vs generate, {result['cpu']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(file, dpi=100)


if __name__ == "__main__":
    main()
