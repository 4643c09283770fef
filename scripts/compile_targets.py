"""Compiles jaxkv's programs for accelerators on a host without one (deviceless ahead-of-time
compilation) and reports what each program would be there.

    python scripts/compile_targets.py [--targets h100 v5e ...] [--models llama-1b ...]
        [--backends default xla] [--weights bfloat16 int8] [--kv bfloat16 int8]
        [--programs decode_step prefill_chunk generate paged_step tree_pass] [--out DIR]

Targets are XLA's own descriptions of the chips (targets.py beside this file): the H100 and
H200 through the CUDA plugin with a GPU target spec, TPU v5e / v6e / v5p through libtpu's
topologies. Every program is built from abstract arrays (no weights are made) placed on one
device of the target, under jaxkv.ops.on(that device), so jaxkv's backend, kernels and checks
are the target's. Per program: compiled or the error; HBM needed (arguments, temporaries);
kernels (a GPU's launches: the non-fused instructions of the program, per layer for a step);
host syncs per step (on a GPU: conditionals, loops whose trip count XLA does not know, host
callbacks; on a TPU, which runs control flow on the chip: host callbacks); on a TPU, the
cost model's bytes read against weights + cache. Results: results/targets/jax-<version>/.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

from targets import TARGETS, target_devices  # (first: it sets how JAX starts)

from hlo import hbm_bytes, hlo_computations  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import ops  # noqa: E402
from jaxkv.decoding import blocks, drafts, generate, prompts, serving, stops  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA = dict(vocab_size=128256, n_heads=32, n_kv_heads=8, max_seq_len=131072, rope_theta=5e5,
             norm_eps=1e-5)
MODELS = {
    "llama-1b": jaxkv.Config.llama(**LLAMA, d_model=2048, n_layers=16, d_ff=8192, head_dim=64,
                                   tie_embeddings=True),
    "llama-8b": jaxkv.Config.llama(**LLAMA, d_model=4096, n_layers=32, d_ff=14336,
                                   head_dim=128, tie_embeddings=False),
    "tiny": jaxkv.Config.llama(vocab_size=512, n_heads=4, n_kv_heads=2, max_seq_len=4096,
                               d_model=64, n_layers=2, d_ff=128, head_dim=16),
    "tiny-moe": jaxkv.Config.llama(vocab_size=512, n_heads=4, n_kv_heads=2, max_seq_len=4096,
                                   d_model=64, n_layers=2, d_ff=128, head_dim=16, n_experts=8,
                                   experts_per_token=2, norm_topk=True),
}
PROGRAMS = ("decode_step", "prefill_chunk", "generate", "paged_step", "tree_pass")
BLOCK_SIZE = 16  # generate_many's pages
TREE = (1, 4)  # speculative's tree: M chains of D drafted tokens
LOOPED = ("generate", "paged_step")  # programs whose step is a loop's body


@dataclasses.dataclass(frozen=True)
class Case:
    """One program's shapes: batch rows, cache positions, prompt chunk, weights and cache."""
    model: str
    batch: int = 1
    context: int = 1024
    chunk: int = 256
    weights: str = "bfloat16"
    kv: str = "bfloat16"


def abstract(tree, device):
    """tree's arrays as jax.ShapeDtypeStructs placed on device (abstract: nothing allocated)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        tree)


def abstract_params(case: Case):
    """Params of case's model in its weights' dtype ("int8": quantized from bfloat16)."""
    def make():
        params = jaxkv.cast(jaxkv.init_params(MODELS[case.model], jax.random.key(0)),
                            jnp.bfloat16)
        return jaxkv.quantize(params) if case.weights == "int8" else params
    return jax.eval_shape(make)


def programs(case: Case, params, names=PROGRAMS) -> dict:
    """{name: (function to jit, its abstract arguments, donated argument names)}."""
    c, B, S = params.config, case.batch, case.context
    kv = jnp.dtype(case.kv)
    cache = jax.eval_shape(lambda p: jaxkv.init_cache(p, B, S, kv), params)
    rows_B = jax.ShapeDtypeStruct((B,), jnp.int32)
    made = {}
    if "decode_step" in names:
        made["decode_step"] = (jaxkv.decode_step, (params, cache, rows_B, rows_B), ("cache",))
    if "prefill_chunk" in names:
        chunk = jax.ShapeDtypeStruct((B, case.chunk), jnp.int32)
        made["prefill_chunk"] = (functools.partial(jaxkv.core.decoder.prefill_padded,
                                                   chunk=case.chunk),
                                 (params, cache, chunk, rows_B, rows_B), ("cache",))
    if "generate" in names:
        with ops.on(jax.devices("cpu")[0]):  # its checks run eagerly, on the host
            args, static = generate.generate_args(params, [[1] * 16] * B, S - 16, kv_dtype=kv)
        made["generate"] = (functools.partial(generate.generate_loop, **static),
                            jax.eval_shape(lambda: args), ())
    if "paged_step" in names:
        paging = blocks.Paging(B, S, BLOCK_SIZE, B * S // BLOCK_SIZE, False, False)
        rows = jax.eval_shape(lambda p: serving.empty_rows(p, B, S, 256, paging=paging),
                              params)
        eos_stop = jax.eval_shape(lambda: (prompts.eos_ids(c, None), stops.tables(c, None)))
        made["paged_step"] = (serving.decode, (params, rows, *eos_stop,
                                                jax.ShapeDtypeStruct((), jnp.int32)), ("rows",))
    if "tree_pass" in names:
        M, D = TREE
        tree = jax.ShapeDtypeStruct((B, 1 + M * D), jnp.int32)
        made["tree_pass"] = (lambda p, cache, tree_BN, pos_B: drafts.tree_pass(
            p, cache, tree_BN, pos_B, np.arange(1 + M * D), M, D), (params, cache, tree, rows_B),
            ())
    return made


# What XLA:GPU cannot do without the device: autotune its Triton products (jax 0.12's finds no
# configuration for some shapes; jax 0.10's takes its default) and size CUB's radix sort's
# scratch (it loads CUDA's runtime library). A program that needs either compiles again with
# products on cuBLAS, untuned, and XLA's own sort: close to, not exactly, the device's program.
DEVICELESS_GPU = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False,
                  "xla_gpu_enable_cub_radix_sort": False}


def compile_one(fn, args, donate, device):
    """(compiled, seconds, whether it took DEVICELESS_GPU) of fn on args placed on device,
    built for device's platform."""
    lowered_at = time.perf_counter()
    with ops.on(device):
        lowered = jax.jit(fn, donate_argnames=donate).lower(*abstract(args, device))
        try:
            compiled, fallback = lowered.compile(), False
        except jax.errors.JaxRuntimeError as e:
            if ops.platform_of(device) != "gpu" or not (
                    "configs" in str(e) or "CUDA Runtime error" in str(e)):
                raise
            compiled, fallback = lowered.compile(compiler_options=DEVICELESS_GPU), True
    return compiled, time.perf_counter() - lowered_at, fallback


NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
               "conditional", "call", "after-all", "opt-barrier", "partition-id", "replica-id",
               "add-dependency", "domain"}
OPCODE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = .*? ([a-z][a-z0-9\-]*)\(")
CALLED = re.compile(r"(?:body|condition|to_apply|true_computation|false_computation)="
                    r"(%[\w.\-]+)|branch_computations=\{([^}]*)\}")


def step_counts(text: str, platform: str, looped: bool = False) -> dict:
    """A step's kernels (instructions that launch work, outside fusions), conditionals, loops,
    host callbacks, the host syncs they make on platform, and the bytes it reads and writes in
    main memory (hlo.hbm_bytes), in compiled HLO text. The step is the program, or for a looped
    one (a decode loop) the body of its largest loop, whose own trip count counts as a sync
    where XLA does not know it."""
    computations = hlo_computations(text)
    entry = next(n for n, c in computations.items() if c.lstrip().startswith("ENTRY"))
    ops_ = {n: _instructions(c) for n, c in computations.items()}
    loops = [(line, body) for n in _reached(entry, ops_) for op, line in ops_[n]
             if op == "while" for body in re.findall(r"body=(%[\w.\-]+)", line)]
    counts = lambda root: _tally(ops_, _reached(root, ops_))  # noqa: E731
    step, loop = entry, None
    if loops and looped:
        loop, step = max(loops, key=lambda lb: counts(lb[1])["kernels"])
    c = counts(step)
    c["hbm_read"], c["hbm_written"] = hbm_bytes(text, _reached(step, ops_))
    c["loop_sync"] = int(loop is not None and "known_trip_count" not in loop)
    c["host_syncs"] = c["callbacks"] + (
        c["conditionals"] + c["unknown_trip_loops"] + c["loop_sync"] if platform == "gpu"
        else 0)
    return c


def _instructions(computation: str) -> list:
    """[(opcode, line)] of a computation's instructions."""
    found = ((OPCODE.match(line), line) for line in computation.splitlines())
    return [(m.group(1), line) for m, line in found if m]


def _reached(root: str, ops_: dict) -> set:
    """root and the computations its instructions run (loops' bodies, branches, reducers'
    callers), transitively; fusions' insides are not separate launches and are left out."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in ops_:
            continue
        seen.add(name)
        for op, line in ops_[name]:
            if op == "fusion":
                continue
            for one, many in CALLED.findall(line):
                todo += [one] if one else re.findall(r"%[\w.\-]+", many)
    return seen


def _tally(ops_: dict, names) -> dict:
    c = dict(kernels=0, conditionals=0, unknown_trip_loops=0, callbacks=0)
    for name in names:
        for op, line in ops_[name]:
            c["kernels"] += op not in NOT_KERNELS
            c["conditionals"] += op == "conditional"
            c["unknown_trip_loops"] += op == "while" and "known_trip_count" not in line
            c["callbacks"] += ("callback" in line and op == "custom-call") or (
                "is_host_transfer=true" in line and op in ("send", "recv"))
    return c


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def measure(case: Case, name: str, target: str, backend: str) -> dict:
    """One program compiled for target: a row of the results."""
    device = target_devices(target)[0]
    platform = ops.platform_of(device)
    row = dict(target=target, program=name, backend=backend, **dataclasses.asdict(case))
    with ops.on(device):
        params = abstract_params(case)
        fn, args, donate = programs(case, params, (name,))[name]
    try:
        compiled, seconds, fallback = compile_one(fn, args, donate, device)
    except Exception as e:  # a program that does not compile there is a result, not a crash
        return dict(row, compiled=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    counts = step_counts(compiled.as_text(), platform, looped=name in LOOPED)
    weights = nbytes(params)
    cache = None if name == "generate" else nbytes(getattr(args[1], "cache", args[1]))
    row.update(compiled=True, compile_s=round(seconds, 1), deviceless_gpu_options=fallback,
               argument_bytes=memory.argument_size_in_bytes,
               temp_bytes=memory.temp_size_in_bytes, weights_bytes=weights, cache_bytes=cache,
               **counts, kernels_per_layer=round(counts["kernels"] / MODELS[case.model].n_layers,
                                                 1))
    if cache is not None:
        row["hbm_read_over_weights_cache"] = round(counts["hbm_read"] / (weights + cache), 2)
    if platform == "tpu" and cost and cache is not None:
        row["bytes_read"] = int(cost.get("bytes accessed", 0))
        row["read_over_weights_cache"] = round(row["bytes_read"] / (weights + cache), 2)
    return row


def table(rows) -> str:
    columns = ["target", "program", "backend", "model", "batch", "context", "weights", "kv",
               "compiled", "compile_s", "kernels", "kernels_per_layer", "host_syncs",
               "argument_bytes", "temp_bytes", "hbm_read_over_weights_cache",
               "read_over_weights_cache"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [r.get(c, "") if r.get("compiled") or c in columns[:9] else "" for c in columns]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
        if not r.get("compiled"):
            lines.append(f"|  | error: {r['error'][:200].replace('|', '/')} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--models", nargs="+", default=["llama-1b", "llama-8b"], choices=list(MODELS))
    p.add_argument("--backends", nargs="+", default=["default", "xla"],
                   choices=["default", "xla", "pallas"])
    p.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
    p.add_argument("--weights", nargs="+", default=["bfloat16", "int8"])
    p.add_argument("--kv", nargs="+", default=["bfloat16", "int8"])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--out", default=str(ROOT / "results" / "targets" / f"jax-{jax.__version__}"))
    a = p.parse_args(argv)
    rows = []
    for target in a.targets:
        for backend in a.backends:
            for case in (Case(m, b, a.context, weights=w, kv=k) for m in a.models
                         for b in a.batch for w in a.weights for k in a.kv):
                for name in a.programs:
                    with forced(backend):
                        rows.append(measure(case, name, target, backend))
                    print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_targets.json").write_text(json.dumps(rows, indent=1))
    command = " ".join(["python scripts/compile_targets.py", *(argv or sys.argv[1:])])
    (out / "compile_targets.md").write_text(
        f"jax {jax.__version__}, `{command}`\n\n{table(rows)}\n")
    return rows


@contextlib.contextmanager
def forced(backend: str):
    """JAXKV_OPS set to backend inside (default: unset), JAX's caches cleared around it."""
    was = os.environ.pop("JAXKV_OPS", None)
    if backend != "default":
        os.environ["JAXKV_OPS"] = backend
    jax.clear_caches()
    try:
        yield
    finally:
        os.environ.pop("JAXKV_OPS", None)
        if was is not None:
            os.environ["JAXKV_OPS"] = was
        jax.clear_caches()


if __name__ == "__main__":
    main()
