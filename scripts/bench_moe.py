"""Does a mixture of experts' decode step read only its chosen experts? Its step time (and a
prefill's, of a prompt of --prompt tokens, 0 for none) against
two dense models of the same shape: one whose MLP is as wide as the experts a token uses (the
active size), one as wide as all the experts (the total size); and against itself with its
experts in XLA's portable form (jaxkv.ops.xla.experts: each row's experts copied out, then
products; named xla_form) where the backend has its own. Random weights in each dtype
(int8: jaxkv.quantize); a jitted loop of decode steps each, best of repeats, alternating.

    python scripts/bench_moe.py [--d-model 512] [--layers 8] [--experts 32] [--top-k 4]
        [--expert-ff 512] [--steps 32] [--repeats 5] [--dtypes float32 bfloat16 int8]
        [--batches 1] [--prompt 512] [--out PATH]

Writes PATH.json (default results/<machine>/bench_moe.json): a row per dtype and batch with
step ms of each model and the ratios moe / dense_active (near 1 at batch 1: only the chosen
experts read), moe / dense_total and moe / moe_xla_form; the same of the prefill at batch 1
(prefill_ms, prefill_moe_over_*)."""

import argparse
import contextlib
import json
import os
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxkv  # noqa: E402
from bench_checks import cpu_name, results_dir  # noqa: E402 - scripts/


def step_loop(params, steps: int, batch: int):
    """A jitted loop of `steps` greedy decode steps of `batch` rows from position 0 (each row
    its own first token, so rows choose different experts)."""
    def run(cache):
        def body(t, carry):
            cache, token_B = carry
            logits_BV, cache = jaxkv.decode_step(params, cache, token_B, jnp.full((batch,), t))
            return cache, jnp.argmax(logits_BV, -1).astype(jnp.int32)
        first_B = jnp.arange(batch, dtype=jnp.int32) * 7
        return jax.lax.fori_loop(0, steps, body, (cache, first_B))[1]
    return jax.jit(run)


def in_dtype(params, dtype: str):
    return jaxkv.quantize(params) if dtype == "int8" else jaxkv.cast(params, dtype)


def prefill(params, prompt: int):
    """A jitted prefill of one row of `prompt` tokens (as jaxkv.prefill runs it), its logits."""
    tokens_BT = (jnp.arange(prompt, dtype=jnp.int32) * 7 % params.config.vocab_size)[None]

    def run(cache):
        return jaxkv.core.decoder.prefill_padded(params, cache, tokens_BT, jnp.full((1,), prompt),
                                                 jnp.zeros((1,), jnp.int32))[0]
    return jax.jit(run)


def best_times(runs: dict, repeats: int) -> dict:
    """{name: best seconds of fn(cache)} over repeats, the runs alternating."""
    best = {}
    for _ in range(repeats):
        for name, (fn, cache) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(cache))
            seconds = time.perf_counter() - start
            best[name] = min(best.get(name, seconds), seconds)
    return best


def ratios(ms: dict, prefix: str = "") -> dict:
    return {f"{prefix}moe_over_{name}": ms["moe"] / ms[name]
            for name in ("dense_active", "dense_total", "xla_form")}


def measure(configs, args, dtype: str, batch: int) -> dict:
    """One row: each model's best step time in ms (and prefill's at batch 1), alternating over
    repeats, and the ratios."""
    steps, fills = {}, {}
    for name, config in configs.items():
        params = in_dtype(jaxkv.init_params(config, jax.random.key(0)), dtype)
        cache = jaxkv.init_cache(params, batch, args.prompt + args.steps + 16)
        fns = {"step": step_loop(params, args.steps, batch)}
        if args.prompt and batch == 1:
            fns["prefill"] = prefill(params, args.prompt)
        portable = mock.patch.object(jaxkv.ops.backend(), "experts", jaxkv.ops.xla.experts,
                                     create=True)
        with portable if name == "xla_form" else contextlib.nullcontext():
            for fn in fns.values():
                jax.block_until_ready(fn(cache))  # compiled (the form is fixed from here on)
        steps[name] = (fns["step"], cache)
        if "prefill" in fns:
            fills[name] = (fns["prefill"], cache)
    ms = {name: s / args.steps * 1e3 for name, s in best_times(steps, args.repeats).items()}
    row = dict(dtype=dtype, batch=batch, step_ms=ms, **ratios(ms))
    if fills:
        ms = {name: s * 1e3 for name, s in best_times(fills, args.repeats).items()}
        row.update(prefill_ms=ms, **ratios(ms, "prefill_"))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("--d-model", 512), ("--layers", 8), ("--experts", 32), ("--top-k", 4),
                          ("--expert-ff", 512), ("--steps", 32), ("--repeats", 5),
                          ("--prompt", 512)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shape = dict(vocab_size=4096, d_model=args.d_model, n_layers=args.layers, n_heads=8,
                 n_kv_heads=8, max_seq_len=args.prompt + args.steps + 16)
    moe = jaxkv.Config.llama(d_ff=args.expert_ff, n_experts=args.experts,
                             experts_per_token=args.top_k, norm_topk=True, **shape)
    configs = {
        "moe": moe,
        "xla_form": moe,
        "dense_active": jaxkv.Config.llama(d_ff=args.expert_ff * args.top_k, **shape),
        "dense_total": jaxkv.Config.llama(d_ff=args.expert_ff * args.experts, **shape),
    }
    rows = [measure(configs, args, dtype, batch) for dtype in args.dtypes
            for batch in args.batches]
    result = dict(cpu=cpu_name(), backend=jaxkv.ops.backend_name(), **vars(args), rows=rows)
    print(json.dumps(result, indent=1))
    out = args.out or os.path.join(results_dir(), "bench_moe")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
