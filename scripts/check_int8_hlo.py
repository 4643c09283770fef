"""Does the compiled generate read int8 weights as int8 on the backend at hand?

For each model x dtype x batch: compiles the program jaxkv.generate runs (prefill of a 32-token
prompt, then the while loop of decode steps) for random int8 weights, lists every float array it
stores that holds as many values as an int8 matrix, one of its dimensions the matrix's rows
(scripts/hlo.py float_copies: a float copy of weights), and saves the optimized HLO. A copy the
decode loop uses is in the loop's computations: made there at every step, or made once before
the loop and carried into it (its tuple then holds the copy). Other copies belong to the
prefill (a product of many rows). Models: the shapes of bench_decode.RANDOM_MODELS. dtypes:
int8 (float32 activations and scales), int8_bf16 (bfloat16). --blocks: inputs per scale, 0
for one per row (jaxkv.quantize's default), 32 for GGUF Q8_0's blocks. Writes <out>.json and the HLO
texts under <out>_hlo/; prints one line per program. Exits 1 when the loop uses a copy.

  python scripts/check_int8_hlo.py --models smollm2-shapes --batches 1 16    # on the CPU
  python scripts/check_int8_hlo.py --models smollm2-shapes llama-1b --blocks 0 32 \
      --out results/gpu/h200/int8_hlo_h200                                    # on a GPU
"""

import argparse
import json
import os
import re

import jax
import jax.numpy as jnp

import jaxkv
from jaxkv.decoding.generate import generate_args, generate_loop
from jaxkv.formats.hf import config_from_hf

from bench_checks import cpu_name, results_dir  # scripts/
from bench_decode import RANDOM_MODELS
from hlo import float_copies, hlo_computations

DTYPES = {"int8": jnp.float32, "int8_bf16": jnp.bfloat16}


def random_int8(name: str, dtype, block: int | None):
    """Random params of the named model's shapes, cast to dtype, then quantized: one scale per
    row (block None, jaxkv.quantize's default) or per `block` inputs (GGUF Q8_0's 32)."""
    _, hf = RANDOM_MODELS[name]
    config = config_from_hf({"architectures": ["LlamaForCausalLM"], **hf}, name)
    params = jaxkv.init_params(config, jax.random.key(0))
    return jaxkv.quantize(jaxkv.cast(params, dtype), block=block)


def compiled_generate(params, batch: int, prompt_len: int, new_tokens: int) -> str:
    """The optimized HLO text of generate's program for `batch` prompts of prompt_len tokens."""
    prompts = [[1] * prompt_len] * batch
    args, static = generate_args(params, prompts, new_tokens)
    return generate_loop.lower(*args, **static).compile().as_text()


def loop_computations(hlo: str) -> set:
    """Names of the computations that while loops run (bodies and conditions) and those they
    call: a copy in one of them is made at every step."""
    calls = {name: {n.strip() for group in re.findall(
                 r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)", text)
                 for n in group.split(",")}
             for name, text in hlo_computations(hlo).items()}
    looped = set(re.findall(r"(?:body|condition)=(%[\w.\-]+)", hlo))
    frontier = set(looped)
    while frontier:
        frontier = {c for n in frontier for c in calls.get(n, ())} - looped
        looped |= frontier
    return looped


def check(params, batch: int, args, name: str) -> dict:
    """Compiles generate's program for `batch` prompts, saves its HLO as <out>_hlo/<name>, and
    returns the float copies of params' int8 matrices it holds, in the loop and outside it."""
    hlo = compiled_generate(params, batch, args.prompt_len, args.new_tokens)
    with open(os.path.join(args.out + "_hlo", name + ".hlo.txt"), "w") as f:
        f.write(hlo)
    looped = loop_computations(hlo)
    copies = float_copies(params, hlo)
    return dict(hlo=name, int8_arrays=len(re.findall(r"s8\[\d+,\d+\]", hlo)),
                loop_copies=[list(s) + [c] for s, c in copies if c in looped],
                prefill_copies=[list(s) + [c] for s, c in copies if c not in looped])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-shapes"], choices=list(RANDOM_MODELS))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--blocks", type=int, nargs="+", default=[0],
                    help="inputs per scale; 0: one scale per row")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", default=f"{results_dir()}/int8_hlo")
    args = ap.parse_args()
    os.makedirs(args.out + "_hlo", exist_ok=True)
    rows = []
    for model in args.models:
        for dtype in args.dtypes:
            for block in args.blocks:
                params = random_int8(model, DTYPES[dtype], block or None)
                for batch in args.batches:
                    rows.append(check(params, batch, args, f"{model}_{dtype}_k{block}_b{batch}"))
                    rows[-1].update(model=model, dtype=dtype, block=block, batch=batch)
                    print(json.dumps(rows[-1]), flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(),
                       host=cpu_name(), jax=jax.__version__, rows=rows), f, indent=1)
    raise SystemExit(1 if any(r["loop_copies"] for r in rows) else 0)


if __name__ == "__main__":
    main()
