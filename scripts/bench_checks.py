"""What the compiled value checks cost: decode with them on vs off, same process, same rounds.

Two ways a researcher decodes, each compiled twice (checks on, then off) and timed in turn,
round after round, so a slow spell of a shared machine falls on both:
  generate     jaxkv.generate's one compiled program (prefill + while loop of decode_step),
               ms/token = (t(N new) - t(1 new)) / (N - 1)
  step loop    docs/guide.md's loop: jax.jit(decode_step, donate_argnames="cache") called from
               Python for N steps, ms/step
Greedy, prompt 32 tokens, N = 128, on SmolLM2-135M-Instruct (the real default model) and on a
tiny random Llama (width 64, 3 layers), whose step takes a fraction of a millisecond, so that
the checks' own cost per step (a lax.cond on a few integers) shows in microseconds rather than
in SmolLM2's run-to-run noise. Rounds alternate which variant runs first. Writes JSON + PNG;
on / off is the cost (issue 13: at most 1.02 at batch 1).

  python scripts/bench_checks.py                       # ~6 min on 2 cores
  python scripts/bench_checks.py --models tiny --batches 1 --rounds 3
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
from jaxkv.core import checks
from jaxkv.decoding.generate import generate_args, generate_loop


def _cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in
            (line.split(":", 1) for line in first.splitlines() if ":" in line)}


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers: a VM may name only the maker's
    line ("AMD EPYC"), and the family tells its generation (AMD 25: Zen 3/4, 26: Zen 5)."""
    info = _cpuinfo()
    name = info.get("model name", platform.processor())
    if "cpu family" in info:
        name += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    if os.environ.get("JAXKV_BENCH_EMULATING"):  # set by bench_cpu.sh's EMULATE
        name += f", emulating {os.environ['JAXKV_BENCH_EMULATING']}"
    return name


def results_dir(backend: str | None = None) -> str:
    """The folder a script writes to unless --out says otherwise: one per machine or device,
    results/cpu/<vendor>_f<family>_m<model> (amd_f26_m2, intel_f6_m207) for the CPU and
    results/<platform>/<chip> (gpu/h100) for an accelerator; the default device's, or
    `backend`'s if given. bench_cpu.sh, bench_gpu.sh and gpu_tests.sh ask here too."""
    if (backend or jax.default_backend()) == "cpu":
        info = _cpuinfo()
        vendor = info.get("vendor_id", platform.machine())
        vendor = vendor.replace("Authentic", "").replace("Genuine", "").lower()
        return f"results/cpu/{vendor}_f{info.get('cpu family', '')}_m{info.get('model', '')}"
    device = jax.devices(backend)[0]
    words = [w for w in device.device_kind.split() if w.lower() not in ("nvidia", "tpu")]
    return f"results/{device.platform}/{(words or ['unknown'])[0].split('-')[0].lower()}"


MODELS = {
    "smollm2": lambda: jaxkv.load(jaxkv.default_model()),
    "tiny": lambda: jaxkv.init_params(jaxkv.Config.llama(
        vocab_size=97, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96,
        max_seq_len=512), jax.random.key(0)),
}


def compiled_generate(params, prompts, n):
    args, static = generate_args(params, prompts, n)
    program = generate_loop.lower(*args, **static).compile()
    return lambda: jax.block_until_ready(program(*args))


def step_loop(params, prompts, n):
    """docs/guide.md's loop over n steps, compiled now (its first call is made here)."""
    step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
    tokens_BT = jnp.array(prompts)
    B, T = tokens_BT.shape

    def run():
        cache = jaxkv.init_cache(params, B, T + n)
        logits_BV, cache = jaxkv.prefill(params, cache, tokens_BT)
        token_B, pos_B = logits_BV.argmax(-1), jnp.full((B,), T)
        start = time.perf_counter()
        for _ in range(n):
            logits_BV, cache = step(params, cache, token_B, pos_B)
            token_B, pos_B = logits_BV.argmax(-1), pos_B + 1
        jax.block_until_ready(token_B)
        return time.perf_counter() - start

    run()
    return run


def programs(params, prompts, n):
    """{variant: timing function} compiled with the checks on, then off."""
    out = {}
    for on in (True, False):
        checks.set_value_checks(on)
        tag = "on" if on else "off"
        gen = {k: compiled_generate(params, prompts, k) for k in (1, n)}
        out[f"generate_{tag}"] = lambda gen=gen: _seconds(gen[n]) - _seconds(gen[1])
        out[f"steps_{tag}"] = step_loop(params, prompts, n)
    checks.set_value_checks(True)
    return out


def _seconds(run):
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def bench_batch(model, params, batch, args):
    prompts = np.random.default_rng(batch).integers(
        0, params.config.vocab_size, (batch, args.prompt_len)).tolist()
    runs = programs(params, prompts, args.new_tokens)
    best = {name: float("inf") for name in runs}
    for i in range(args.rounds):
        for name in sorted(runs, reverse=i % 2 == 1):
            best[name] = min(best[name], runs[name]())
    ms = {name: 1e3 * s / (args.new_tokens - (1 if name.startswith("generate") else 0))
          for name, s in best.items()}
    row = dict(model=model, batch=batch, ms=ms)
    for way in ("generate", "steps"):
        row[f"{way}_ratio"] = ms[f"{way}_on"] / ms[f"{way}_off"]
        row[f"{way}_us_per_step"] = 1e3 * (ms[f"{way}_on"] - ms[f"{way}_off"])
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "tiny"], choices=list(MODELS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=f"{results_dir()}/bench_checks")
    args = ap.parse_args()
    rows = [bench_batch(name, MODELS[name](), b, args) for name in args.models
            for b in args.batches]
    result = dict(cpu=cpu_name(), device=jax.devices()[0].device_kind, cpu_count=os.cpu_count(),
                  jax=jax.__version__, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                  rows=rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out + ".png")


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = result["rows"]
    x = np.arange(len(rows))
    ways = (("generate", "generate"), ("steps", "jit(decode_step) loop"))
    for i, (way, label) in enumerate(ways):
        ax.bar(x + 0.4 * i - 0.2, [r[f"{way}_ratio"] for r in rows], 0.35, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.02, color="r", lw=0.8, ls="--", label="+2%")
    ax.set_xticks(x, [f"{r['model']}\nbatch {r['batch']}" for r in rows])
    ax.set_ylabel("time per token, checks on / off")
    ax.set_ylim(0.8, 1.2)
    ax.set_title(f"Compiled value checks: cost (fp32)\n{result['cpu']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
