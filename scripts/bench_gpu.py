"""The GPU benchmark in one call: jaxkv against transformers, same weights, same prompts.

Per model shape (Llama-3.2-1B, Llama-3.1-8B: random bfloat16 weights made on the device by
transformers, and jaxkv's params read from those very tensors), greedy, prompts of 128 tokens:

  decode   ms/token = (t(N new) - t(1 new)) / (N - 1), best of --repeats, at batch 1, 64, 16:
           jaxkv generate (the XLA backend), jaxkv with JAXKV_OPS=pallas, jaxkv with int8
           weights (jaxkv.quantize), transformers with a static cache (which its generate
           compiles with torch.compile on an accelerator: what a PyTorch user picks), and
           transformers eager (its dynamic cache; batch 1)
  prefill  one prompt of 2,048 tokens: jaxkv.prefill against transformers' forward (sdpa)
  probe    the device's read rate (a jitted sum over 2 GiB): "read" = bytes a decode step must
           read (scripts/bench_decode.py's step_bytes) / step time / that rate

Every engine's tokens are compared with jaxkv's (XLA, bfloat16) at the same batch. Cells run in
order of importance until --budget-s is spent; the rest are listed as skipped. An engine that
fails records its error and the run goes on. --tiny runs the same at tiny sizes (on a CPU:
tests/test_scripts.py). Writes <out>.json and <out>.md naming the device.

  python scripts/bench_gpu.py                      # results/gpu/<chip>/bench_gpu
  python scripts/bench_gpu.py --tiny --out /tmp/bench_gpu
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.formats.hf import config_from_hf, hf_family
from jaxkv.models.maps import build_params

from bench_checks import cpu_name, results_dir  # scripts/
from bench_decode import step_bytes

LLAMA = dict(hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096)
SHAPES = {
    "llama-1b": dict(LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     head_dim=64, tie_word_embeddings=True),
    "llama-8b": dict(LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     head_dim=128, tie_word_embeddings=False),
    "tiny": dict(LLAMA, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=512, tie_word_embeddings=True),
}
FULL = dict(models=["llama-1b", "llama-8b"], batches=[1, 64, 16], prompt_len=128,
            new_tokens=256, prefill_len=2048, probe_mib=2048)
TINY = dict(models=["tiny"], batches=[1, 4], prompt_len=8, new_tokens=16, prefill_len=32,
            probe_mib=8)
ENGINES = ["jaxkv", "hf_static", "jaxkv_int8", "jaxkv_pallas", "hf_eager"]
EAGER_BATCHES = (1,)  # transformers eager is the slow reference: batch 1 says it


def read_rate(mib: int, repeats: int = 10) -> float:
    """Bytes per second a jitted sum reads from a bfloat16 array of mib MiB (best of repeats)."""
    x = jnp.ones((mib * 2**20 // 2,), jnp.bfloat16)
    total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    jax.block_until_ready(total(x))
    return x.nbytes / min(seconds(lambda: jax.block_until_ready(total(x)))
                          for _ in range(repeats))


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def make_models(shape: str):
    """(transformers' model in bfloat16 on the device, jaxkv's params in bfloat16 read from
    the same tensors)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[shape], torch_dtype=torch.bfloat16)
    with torch.device(torch_device()):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = transformers.LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(torch.float32)
    tensors = model.state_dict()
    hf = dict(config.to_dict(), architectures=["LlamaForCausalLM"])
    ours = config_from_hf(hf, shape, tensors)
    get = lambda name: (None if name not in tensors
                        else tensors[name].float().cpu().numpy())
    params = build_params(ours, hf_family(hf, shape).name_map(ours, tensors), get, shape,
                          jnp.bfloat16)
    return model, params


def torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def jaxkv_run(params, prompts, backend: str):
    """run(n) -> tokens [B, n] of jaxkv.generate on the backend (JAXKV_OPS)."""
    os.environ["JAXKV_OPS"] = backend
    if backend == "pallas" and jax.default_backend() == "cpu":
        os.environ["JAXKV_PALLAS_INTERPRET"] = "1"
    jax.clear_caches()  # the backend is chosen when generate is traced
    return lambda n: np.asarray(jax.block_until_ready(jaxkv.generate(params, prompts, n))[0])


def hf_run(model, prompts, static: bool):
    """run(n) -> tokens [B, n] of transformers' generate: a static cache (compiled by generate
    on an accelerator) or its default dynamic cache (eager)."""
    import torch

    ids = torch.tensor(prompts, device=model.device)

    def run(n):
        options = dict(cache_implementation="static") if static else {}
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0, **options)
        if out.is_cuda:
            torch.cuda.synchronize()
        return out[:, ids.shape[1]:].cpu().numpy()
    return run


def decode_cell(run, new_tokens: int, repeats: int) -> dict:
    """ms/token of run(n) from t(new_tokens) - t(1), each warmed up, best of repeats."""
    first = seconds(lambda: run(new_tokens))
    run(1)
    best = {n: min(seconds(lambda n=n: run(n)) for _ in range(repeats)) for n in (1, new_tokens)}
    ms = 1e3 * (best[new_tokens] - best[1]) / (new_tokens - 1)
    return dict(ms_per_token=ms, first_call_s=first, tokens=run(new_tokens))


def prefill_cell(model, params, length: int, repeats: int) -> dict:
    """ms of one prompt of `length` tokens: jaxkv.prefill (a fresh cache each call, outside
    the timing) and transformers' forward with sdpa."""
    import torch

    tokens = np.random.default_rng(1).integers(0, params.config.vocab_size, (1, length))
    prefill = jax.jit(jaxkv.prefill)
    caches = [jaxkv.init_cache(params, 1, length) for _ in range(repeats + 1)]
    jax.block_until_ready(prefill(params, caches[0], tokens))
    ours = min(seconds(lambda c=c: jax.block_until_ready(prefill(params, c, tokens)))
               for c in caches[1:])
    ids = torch.tensor(tokens, device=model.device)
    model.config._attn_implementation = "sdpa"

    def forward():
        with torch.inference_mode():
            model(ids, use_cache=False).logits[:, -1].float().cpu()
    forward()
    theirs = min(seconds(forward) for _ in range(repeats))
    return dict(tokens=length, jaxkv_ms=1e3 * ours, hf_sdpa_ms=1e3 * theirs,
                speedup=theirs / ours)


def decode_cells(shape, model, params, batch, args, sizes, rate, out_of_time):
    """One batch size's rows, engine by engine, each compared with jaxkv's tokens."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, params.config.vocab_size, (batch, sizes["prompt_len"])).tolist()
    int8 = jaxkv.quantize(params)
    runs = {"jaxkv": lambda: jaxkv_run(params, prompts, "xla"),
            "jaxkv_pallas": lambda: jaxkv_run(params, prompts, "pallas"),
            "jaxkv_int8": lambda: jaxkv_run(int8, prompts, "xla"),
            "hf_static": lambda: hf_run(model, prompts, static=True),
            "hf_eager": lambda: hf_run(model, prompts, static=False)}
    rows, reference = [], None
    for engine in ENGINES:
        row = dict(model=shape, batch=batch, engine=engine)
        if engine == "hf_eager" and batch not in EAGER_BATCHES:
            continue
        if out_of_time():
            rows.append(dict(row, skipped="time budget"))
            continue
        try:
            cell = decode_cell(runs[engine](), sizes["new_tokens"], args.repeats)
        except Exception as e:  # an engine's failure is a result; the others still run
            rows.append(dict(row, error=f"{type(e).__name__}: {e}"[:500]))
            continue
        tokens = cell.pop("tokens")
        reference = tokens if engine == "jaxkv" else reference
        agree = None if reference is None else float(np.mean(tokens == reference))
        weights = int8 if engine == "jaxkv_int8" else params
        nbytes = step_bytes(weights, batch, sizes["prompt_len"], sizes["new_tokens"])
        rows.append(dict(row, **cell, tokens_per_s=1e3 * batch / cell["ms_per_token"],
                         read=nbytes / (cell["ms_per_token"] / 1e3) / rate, agree=agree))
    os.environ["JAXKV_OPS"] = "xla"
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU test)")
    ap.add_argument("--models", nargs="+", choices=list(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="seconds after which the remaining cells are skipped (named)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = dict(TINY if args.tiny else FULL)
    sizes.update({k: v for k, v in (("models", args.models), ("batches", args.batches)) if v})
    out = args.out or f"{results_dir()}/bench_gpu"
    start = time.perf_counter()
    out_of_time = lambda: time.perf_counter() - start > args.budget_s
    rate = read_rate(sizes["probe_mib"])
    print(f"{device_name()}: reads {rate / 1e12:.3f} TB/s (jitted sum over "
          f"{sizes['probe_mib']} MiB)", flush=True)
    result = dict(device=device_name(), jax=jax.__version__, sizes=sizes, read_rate=rate,
                  decode=[], prefill=[])
    for shape in sizes["models"]:
        if out_of_time():
            result["decode"].append(dict(model=shape, skipped="time budget"))
            continue
        model, params = make_models(shape)
        result["prefill"].append(dict(model=shape, **prefill_cell(model, params,
                                                                  sizes["prefill_len"], 2)))
        for batch in sizes["batches"]:
            rows = decode_cells(shape, model, params, batch, args, sizes, rate, out_of_time)
            result["decode"] += rows
            print(markdown_rows(rows), flush=True)
        del model, params
    result["seconds"] = time.perf_counter() - start
    against_static(result["decode"])
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))


def device_name() -> str:
    """The accelerator's name (e.g. NVIDIA H100 80GB HBM3), or the CPU's."""
    device = jax.devices()[0]
    return cpu_name() if device.platform == "cpu" else device.device_kind


def markdown_rows(rows) -> str:
    lines = []
    for r in rows:
        if "ms_per_token" not in r:
            lines.append(f"| {r['model']} | {r.get('batch', '')} | {r.get('engine', '')} | "
                         f"{r.get('skipped') or r.get('error')} | | | | |")
            continue
        agree = "" if r["agree"] is None else f"{r['agree']:.3f}"
        vs_hf = f"{r['vs_hf']:.2f}x" if "vs_hf" in r else ""
        lines.append(f"| {r['model']} | {r['batch']} | {r['engine']} | {r['ms_per_token']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['read']:.2f} | {vs_hf} | {agree} |")
    return "\n".join(lines)


def against_static(rows):
    """Each timed row's speed against transformers' static compiled path at its model and batch
    (vs_hf: its ms / the row's)."""
    static = {(r["model"], r["batch"]): r["ms_per_token"] for r in rows
              if r.get("engine") == "hf_static" and "ms_per_token" in r}
    for r in rows:
        if "ms_per_token" in r and (r["model"], r["batch"]) in static:
            r["vs_hf"] = static[r["model"], r["batch"]] / r["ms_per_token"]


def markdown(result) -> str:
    """The decode table and the prefill table."""
    s = result["sizes"]
    lines = [f"# bench_gpu on {result['device']}", "",
             f"jax {result['jax']}; read rate {result['read_rate'] / 1e12:.3f} TB/s; prompts of "
             f"{s['prompt_len']} tokens, {s['new_tokens']} new, greedy; {result['seconds']:.0f} s",
             "", "| model | batch | engine | ms / token | tokens / s | read / rate | vs HF static "
             "| agree |", "|---|--:|---|--:|--:|--:|--:|--:|", markdown_rows(result["decode"]),
             "", "| model | prefill tokens | jaxkv ms | HF sdpa ms | speed-up |",
             "|---|--:|--:|--:|--:|"]
    lines += [f"| {r['model']} | {r['tokens']} | {r['jaxkv_ms']:.1f} | {r['hf_sdpa_ms']:.1f} | "
              f"{r['speedup']:.2f}x |" for r in result["prefill"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
