"""Does a mixture of experts' decode step read only its chosen experts? Its step time at batch 1
against two dense models of the same shape: one whose MLP is as wide as the experts a token
uses (the active size), one as wide as all the experts (the total size). Random float32
weights; a jitted loop of decode steps each, best of repeats, alternating.

    python scripts/bench_moe.py [--d-model 512] [--layers 8] [--experts 32] [--top-k 4]
        [--expert-ff 512] [--steps 32] [--repeats 5] [--out PATH]

Writes PATH.json (default results/<machine>/bench_moe.json): step ms of each and the ratios
moe / dense_active (near 1: only the chosen experts read) and moe / dense_total."""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxkv  # noqa: E402
from bench_checks import cpu_name, results_dir  # noqa: E402 - scripts/


def step_loop(params, steps: int):
    """A jitted loop of `steps` greedy decode steps of one row from position 0."""
    def run(cache):
        def body(t, carry):
            cache, token_B = carry
            logits_BV, cache = jaxkv.decode_step(params, cache, token_B, jnp.full((1,), t))
            return cache, jnp.argmax(logits_BV, -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((1,), jnp.int32)))[1]
    return jax.jit(run)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("--d-model", 512), ("--layers", 8), ("--experts", 32), ("--top-k", 4),
                          ("--expert-ff", 512), ("--steps", 32), ("--repeats", 5)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shape = dict(vocab_size=4096, d_model=args.d_model, n_layers=args.layers, n_heads=8,
                 n_kv_heads=8, max_seq_len=args.steps + 16)
    configs = {
        "moe": jaxkv.Config.llama(d_ff=args.expert_ff, n_experts=args.experts,
                                  experts_per_token=args.top_k, norm_topk=True, **shape),
        "dense_active": jaxkv.Config.llama(d_ff=args.expert_ff * args.top_k, **shape),
        "dense_total": jaxkv.Config.llama(d_ff=args.expert_ff * args.experts, **shape),
    }
    runs = {}
    for name, config in configs.items():
        params = jaxkv.init_params(config, jax.random.key(0))
        cache = jaxkv.init_cache(params, 1, args.steps + 16)
        fn = step_loop(params, args.steps)
        jax.block_until_ready(fn(cache))  # compiled
        runs[name] = (fn, cache)
    best = {}
    for _ in range(args.repeats):
        for name, (fn, cache) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(cache))
            seconds = time.perf_counter() - start
            best[name] = min(best.get(name, seconds), seconds)
    ms = {name: seconds / args.steps * 1e3 for name, seconds in best.items()}
    result = dict(cpu=cpu_name(), backend=jaxkv.ops.backend_name(), **vars(args),
                  step_ms=ms, moe_over_dense_active=ms["moe"] / ms["dense_active"],
                  moe_over_dense_total=ms["moe"] / ms["dense_total"])
    print(json.dumps(result, indent=1))
    out = args.out or os.path.join(results_dir(), "bench_moe")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
