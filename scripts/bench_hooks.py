"""What capturing activations costs while decoding: generate with hooks against without, same run.

SmolLM2-135M-Instruct in float32 (the shipped GGUF), greedy, batch 1 by default: `generate` of
--new-tokens tokens after a short prompt, plain and with jaxkv.Hooks capturing each --sites
site at every layer (default resid_post), alternating, --repeats rounds (best of each). The
ratio is the hooked run's time over the plain one's; the hooked answer is checked equal to the
plain one's (capturing edits nothing), and the two programs are checked to call jaxkv's CPU
kernels (the products and attention) the same number of times: hooks keep them in use.

  python scripts/bench_hooks.py
  python scripts/bench_hooks.py --sites resid_post attn_out mlp_out --batch 4
"""

import argparse
import json
import os
import time

import jax
import numpy as np

import jaxkv

from bench_checks import cpu_name, results_dir  # scripts/


def timed(fn):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t0, out


def kernel_call_count(params, prompts, new_tokens, hooks) -> int:
    """Calls of jaxkv's CPU kernels (FFI targets jaxkv_*) in generate's compiled program."""
    from jaxkv.decoding.generate import generate_args, generate_loop

    args, static = generate_args(params, prompts, new_tokens, hooks=hooks)
    return generate_loop.lower(*args, **static).as_text().count("custom_call @jaxkv_")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sites", nargs="+", default=["resid_post"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    path = jaxkv.default_model()
    params, tokenizer = jaxkv.load(path), jaxkv.load_tokenizer(path)
    prompts = [tokenizer.encode("Write a short story about a lighthouse keeper.").ids] * args.batch
    hooks = jaxkv.Hooks(capture=args.sites)
    engines = {"plain": lambda: jaxkv.generate(params, prompts, args.new_tokens),
               "hooks": lambda: jaxkv.generate(params, prompts, args.new_tokens, hooks=hooks)}
    outs = {name: fn() for name, fn in engines.items()}  # compile
    kernel_calls = {name: kernel_call_count(params, prompts, args.new_tokens, h)
                    for name, h in (("plain", None), ("hooks", hooks))}
    assert kernel_calls["plain"] == kernel_calls["hooks"], kernel_calls
    assert np.array_equal(outs["plain"][0], outs["hooks"][0]), "capturing changed the answer"
    seconds = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, fn in engines.items():
            seconds[name].append(timed(fn)[0])
    best = {name: min(s) for name, s in seconds.items()}
    acts = outs["hooks"][2]
    result = dict(cpu=cpu_name(), backend=jax.default_backend(), batch=args.batch,
                  new_tokens=args.new_tokens, sites=args.sites, seconds=seconds,
                  ms_per_token={k: 1e3 * v / args.new_tokens for k, v in best.items()},
                  hooks_over_plain=best["hooks"] / best["plain"],
                  captured_mib=sum(x.nbytes for x in acts.values()) / 2 ** 20,
                  kernel_calls=kernel_calls)
    print(json.dumps(result))
    out = args.out or os.path.join(results_dir(), "bench_hooks")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
