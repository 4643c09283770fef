"""Decode speed of two commits, measured alternately in one run: did a change keep the step?

Each commit is checked out in a temporary git worktree and served by a worker process of its
own (this file run with --worker), which loads SmolLM2-135M-Instruct (or --model tiny) once, as
float32, bfloat16 (jaxkv.cast) and int8 (jaxkv.quantize), and compiles generate for two answer
lengths. The parent
then asks the workers in turn, round after round, the first commit asked alternating between
rounds, so a slow spell of a shared machine falls on both: a step's time is
(t(N2) - t(N1)) / (N2 - N1) for greedy generates of one 32-token prompt with no end id (the
prefill and the call's fixed costs cancel), best of --repeats in each measurement. Only the
public API is used, so any two commits compare. Per dtype it reports each commit's best step,
and the median over rounds of new / old (paired: each round's two figures were taken minutes
apart at most). With --prefill N it times instead the prefill of one N-token prompt (a
generate of one token, best of --repeats: the prefill's products and chunk attention, which a
decode step does not run). Writes <out>.json and <out>.md, naming the CPU.

  python scripts/bench_commits.py --old HEAD~3 --new HEAD                  # 7 rounds
  python scripts/bench_commits.py --old main --new HEAD --rounds 3 --dtypes float32   # quick
  python scripts/bench_commits.py --old HEAD~3 --new HEAD --prefill 2048 --dtypes float32
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

DTYPES = ("float32", "bfloat16", "int8")
N1, N2 = 33, 161  # answer lengths: 32 and 160 decode steps


def worker(root: str, model: str, dtypes, prefill: int):
    """Serves one commit: reads a dtype per line, answers its step (or prefill) in ms."""
    sys.path.insert(0, root)
    import jax
    import jax.numpy as jnp

    import jaxkv

    assert os.path.dirname(os.path.abspath(jaxkv.__file__)) == os.path.join(root, "jaxkv")
    base = jaxkv.load(jaxkv.default_model()) if model == "smollm2" else jaxkv.init_params(
        jaxkv.Config.llama(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           d_ff=96, max_seq_len=256), jax.random.key(0))
    make = {"float32": lambda: base, "bfloat16": lambda: jaxkv.cast(base, jnp.bfloat16),
            "int8": lambda: jaxkv.quantize(base)}
    models = {dtype: make[dtype]() for dtype in dtypes}
    prompt = [[(7 * i) % (base.config.vocab_size - 10) + 10 for i in range(prefill or 32)]]

    def seconds(params, n):
        t0 = time.perf_counter()
        jax.block_until_ready(jaxkv.generate(params, prompt, n))
        return time.perf_counter() - t0

    def measure(params):
        if prefill:
            return seconds(params, 1)
        return (seconds(params, N2) - seconds(params, N1)) / (N2 - N1)

    for params in models.values():  # compile before any timing
        measure(params)
    print("ready", flush=True)
    for line in sys.stdin:
        dtype, repeats = line.split()
        best = min(measure(models[dtype]) for _ in range(int(repeats)))
        print(f"{1000 * best:.4f}", flush=True)


def start(commit: str, folder: str, model: str, dtypes, prefill: int):
    """A worktree of commit under folder and its worker, once ready."""
    subprocess.run(["git", "worktree", "add", "--detach", folder, commit], check=True,
                   capture_output=True)
    process = subprocess.Popen([sys.executable, __file__, "--worker", folder, "--model", model,
                                "--dtypes", *dtypes, "--prefill", str(prefill)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "ready":
        raise SystemExit(f"the worker for {commit} failed")
    return process


def ask(process, dtype: str, repeats: int) -> float:
    process.stdin.write(f"{dtype} {repeats}\n")
    process.stdin.flush()
    return float(process.stdout.readline())


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="a commit (or any git ref): the baseline")
    ap.add_argument("--new", help="the commit compared with it")
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"],
                    help="SmolLM2-135M-Instruct, or a tiny random Llama (a quick check)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="time the prefill of an N-token prompt instead of a decode step")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="default: the machine's folder under results/, bench_commits")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.dtypes, args.prefill)
    if not (args.old and args.new):
        ap.error("--old and --new are required")
    from bench_checks import cpu_name, results_dir  # scripts/

    commits = {name: subprocess.run(["git", "rev-parse", "--short", ref], check=True, text=True,
                                    capture_output=True).stdout.strip()
               for name, ref in (("old", args.old), ("new", args.new))}
    steps = {name: {d: [] for d in args.dtypes} for name in commits}
    with tempfile.TemporaryDirectory() as tmp:
        workers = {}
        try:
            for name, commit in commits.items():
                workers[name] = start(commit, os.path.join(tmp, name), args.model, args.dtypes,
                                      args.prefill)
            for r in range(args.rounds):
                for dtype in args.dtypes:
                    for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                        steps[name][dtype].append(ask(workers[name], dtype, args.repeats))
                print(f"round {r + 1}: " + ", ".join(
                    f"{d} {steps['old'][d][-1]:.2f} / {steps['new'][d][-1]:.2f} ms"
                    for d in args.dtypes), flush=True)
        finally:
            for process in workers.values():
                process.stdin.close()
                process.wait()
            for name in commits:
                subprocess.run(["git", "worktree", "remove", "--force", os.path.join(tmp, name)],
                               capture_output=True)
    what = f"prefill of {args.prefill} tokens" if args.prefill else "decode step"
    result = dict(cpu=cpu_name(), cpu_count=os.cpu_count(), model=args.model, commits=commits,
                  measured=what, rounds=args.rounds,
                  repeats=args.repeats, steps_ms=steps, summary={
                      d: dict(old_best_ms=min(steps["old"][d]), new_best_ms=min(steps["new"][d]),
                              new_over_old_paired=statistics.median(
                                  n / o for n, o in zip(steps["new"][d], steps["old"][d])))
                      for d in args.dtypes})
    out = args.out or os.path.join(results_dir(), "bench_commits")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"{args.model} {what}, batch 1: {commits['new']} (new) against "
             f"{commits['old']} (old), {args.rounds} alternating rounds, best of {args.repeats}; "
             f"{result['cpu']}, {os.cpu_count()} cores", "",
             "| dtype | old best ms | new best ms | new / old, paired median |",
             "|---|--:|--:|--:|"]
    lines += [f"| {d} | {s['old_best_ms']:.2f} | {s['new_best_ms']:.2f} | "
              f"{s['new_over_old_paired']:.3f} |" for d, s in result["summary"].items()]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
