"""jaxkv compiled for accelerators this host does not have (scripts/compile_targets.py): every
Pallas kernel form and a tiny model's programs, for an H100 and a TPU v5e, through the default
backend. A kernel that does not compile there fails here. Needs the CUDA plugin and libtpu (the
test extra installs both); nothing runs, only XLA's and Mosaic's / Triton's compilers."""

import functools
import os

import jax
import jax.numpy as jnp
import pytest

from compile_targets import Case, abstract_params, compile_one, programs, step_counts
import jaxkv
from jaxkv import ops
from jaxkv.ops.arrays import Int8KV, PagedKV
from jaxkv.ops.pallas import mosaic_gpu
from targets import target_devices

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # (libtpu: no cluster to look up)
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
TARGETS = ["h100", "v5e"]
KERNEL_CALL = {"h100": "__gpu$xla.gpu.triton", "v5e": "tpu_custom_call"}
B, K, G, S, H = 2, 2, 4, 256, 64


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _cache(form):
    """Abstract keys (values alike) of a kernel form: float, int8 or a paged pool of float."""
    if form == "int8":
        return Int8KV(_sds((B, K, S, H), jnp.int8), _sds((B, K, S), jnp.float32))
    if form == "paged":
        return PagedKV(_sds((K, B * S // 16, 16, H)), _sds((B, S // 16), jnp.int32))
    return _sds((B, K, S, H))


FORMS = {  # name: (cache form, options of ops.attention beyond the decode step's lengths)
    "dense": ("float", {}), "ring": ("float", {"ring": True}), "int8": ("int8", {}),
    "paged": ("paged", {}), "softcapped": ("float", {"softcap": 30.0}),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_kernel_form_compiles(target, form):
    """ops.attention for one decode-step query per row and its own key, as the default backend
    on target takes it: the kernel is in the compiled program (on a GPU its Mosaic GPU form, or
    its Triton form with the kernel merging its parts and the own key), with no host sync."""
    kind, options = FORMS[form]
    device = target_devices(target)[0]
    ring = options.pop("ring", False) if options else False
    args = [_sds((B, 1, K * G, H)), _cache(kind), _cache(kind), _sds((B, 1, S), jnp.bool_),
            _sds((B,), jnp.int32), _sds((B, K, 1, H)), _sds((B, K, 1, H)),
            _sds((B, 1, 1), jnp.bool_)]

    def step(q, k, v, mask, lengths, own_k, own_v, own_mask):
        return ops.attention(q, k, v, mask, 0.125, lengths=None if ring else lengths,
                             kv_len=jnp.max(lengths), own=(own_k, own_v, own_mask, None),
                             **options)

    with ops.on(device):
        assert ops.backend_name() == "pallas"
        compiled, *_ = compile_one(step, args, (), device)
    text = compiled.as_text()
    # (on jax 0.11 and newer a 16-bit cache read in blocks of 64 takes the Mosaic GPU form)
    mosaic = target == "h100" and kind == "float" and mosaic_gpu.takes(_cache(kind))
    if mosaic:
        assert "mosaic_gpu" in text and KERNEL_CALL[target] not in text
    else:
        assert KERNEL_CALL[target] in text or "jaxkv_decode_attention" in text
        assert ("jaxkv_decode_merge" in text) == (target == "h100")
    assert step_counts(text, ops.platform_of(device))["host_syncs"] == 0


@pytest.mark.parametrize("form", ["dense", "paged", "softcapped"])
def test_the_mosaic_gpu_form_compiles_for_an_h100(form):
    """The decode kernel's Mosaic GPU form (what jax 0.11 and newer take for 16-bit caches with
    heads and blocks of 64) compiles for an H100 on every jax the suite runs, 0.10 included."""
    device = target_devices("h100")[0]
    R, P = mosaic_gpu.ROWS, 64
    pools = form == "paged"
    cache = _sds((K, B * S // P, P, H)) if pools else _sds((B, K, S, H))
    args = [_sds((B,), jnp.int32), _sds((B, K, R, H)), cache, cache,
            *([_sds((B, S // P), jnp.int32)] if pools else [])]

    def parts(bound, q, k, v, table=None):
        return mosaic_gpu.parts(bound, q, k, v, scale=0.125, block_k=P, k_splits=2,
                                softcap=30.0 if form == "softcapped" else None, table_BM=table)

    with ops.on(device):
        compiled, *_ = compile_one(parts, args, (), device)
    assert "mosaic_gpu" in compiled.as_text()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_a_tiny_models_programs_compile(target, kv):
    """decode_step, generate's loop and generate_many's paged step of a tiny Llama, bfloat16
    weights: each compiles for target; the decode step has no host sync and reads its cache
    through a kernel."""
    device = target_devices(target)[0]
    case = Case("tiny", batch=2, context=256, kv=kv)
    with ops.on(device):
        params = abstract_params(case)
        made = programs(case, params, ("decode_step", "generate", "paged_step"))
    for name, (fn, args, donate) in made.items():
        compiled, *_ = compile_one(fn, args, donate, device)
        if name == "decode_step":
            text = compiled.as_text()
            assert KERNEL_CALL[target] in text or "jaxkv_decode_attention" in text
            assert step_counts(text, ops.platform_of(device))["host_syncs"] == 0
            if target == "h100":  # the products fused, the cache stored by the merge
                assert "jaxkv_fused_product" in text
                assert ("dynamic-update-slice(" in text or "scatter(" in text) == (kv == "int8")


@pytest.mark.parametrize("target", TARGETS)
def test_a_mixture_of_experts_compiles(target):
    """A tiny mixture of experts with int8 experts (ops.experts: a decode step's rows slicing
    out their experts, a prefill chunk's tiles of one expert each): its decode step and prefill
    chunk compile for target, the step with no host sync."""
    device = target_devices(target)[0]
    case = Case("tiny-moe", batch=2, context=256, chunk=64, weights="int8")
    with ops.on(device):
        params = abstract_params(case)
        made = programs(case, params, ("decode_step", "prefill_chunk"))
    for name, (fn, args, donate) in made.items():
        compiled, *_ = compile_one(fn, args, donate, device)
        if name == "decode_step":
            assert step_counts(compiled.as_text(), ops.platform_of(device))["host_syncs"] == 0


@pytest.mark.parametrize("target", TARGETS)
def test_constrained_generate_adds_no_host_round_trip(target):
    """generate's loop with a regular expression's automaton (one row free) compiles for target,
    and its loop's step makes no more host syncs than the plain loop's: the mask and the
    automaton's step run on the device."""
    from jaxkv.decoding import generate
    from tests.conftest import char_tokenizer

    device = target_devices(target)[0]
    case = Case("tiny", batch=2, context=64)
    regex = jaxkv.constraints.Regex("[0-9]{2,8}(-[a-c]+)?", char_tokenizer(97))
    counts = {}
    with ops.on(device):
        params = abstract_params(case)
    for name, constraint in (("plain", None), ("constrained", [regex, None])):
        with ops.on(jax.devices("cpu")[0]):  # its checks run eagerly, on the host
            args, static = generate.generate_args(params, [[1] * 16] * 2, 32,
                                                  constraint=constraint)
        fn = functools.partial(generate.generate_loop, **static)
        compiled, *_ = compile_one(fn, jax.eval_shape(lambda: args), (), device)
        counts[name] = step_counts(compiled.as_text(), ops.platform_of(device), looped=True)
    print(target, {k: (v["host_syncs"], v["kernels"]) for k, v in counts.items()})
    assert counts["constrained"]["host_syncs"] == counts["plain"]["host_syncs"], counts
    assert counts["constrained"]["callbacks"] == 0


PRODUCTS = {  # name: (rows, dtype, options of products.product)
    "rmsnorm_gated": (1, jnp.bfloat16, {"norm": "rmsnorm", "gated": ("silu", 128)}),
    "layernorm_bias": (8, jnp.bfloat16, {"norm": "layernorm", "bias": True}),
    "residual": (2, jnp.bfloat16, {"residual": True}),
    "float32_gelu": (4, jnp.float32, {"gated": ("gelu_tanh", 128)}),
}


@pytest.mark.parametrize("form", sorted(PRODUCTS))
def test_each_fused_product_compiles_for_an_h100(form):
    """The decode step's products with their norm, bias, gated activation or residual in one
    kernel (jaxkv.ops.pallas.products: Mosaic GPU's form on jax 0.11 and newer, Triton's
    before) compile for an H100, 1 to 8 rows, bfloat16 and float32 (Triton's form only)."""
    from jaxkv.ops.pallas import products

    R, dtype, options = PRODUCTS[form]
    I, O = 256, 512
    device = target_devices("h100")[0]
    kind = options.get("norm")
    args = [_sds((R, I), dtype), _sds((O, I), dtype), _sds((O,), dtype), _sds((I,), dtype),
            _sds((I,), dtype), _sds((R, O // 2 if options.get("gated") else O), dtype)]

    def product(x, w, b, scale, shift, residual):
        norm = None if kind is None else (scale, shift if kind == "layernorm" else None, kind,
                                          1e-5)
        return products.product(x, w, b if options.get("bias") else None, dtype=dtype,
                                norm=norm, gated=options.get("gated"),
                                residual_RO=residual if options.get("residual") else None)

    taken = products.takes(args[0], args[1], options.get("gated"))
    assert taken == (dtype != jnp.float32 or not mosaic_gpu.AVAILABLE)
    if taken:
        with ops.on(device):
            compiled, *_ = compile_one(product, args, (), device)
        assert "jaxkv_fused_product" in compiled.as_text()


def test_the_script_writes_its_table(tmp_path):
    """scripts/compile_targets.py on a tiny model for a v5e: its JSON and table, with the bytes
    read in HBM (estimated from the program) and the TPU cost model's against weights + cache."""
    import json

    from compile_targets import main

    main(["--targets", "v5e", "--models", "tiny", "--backends", "default", "--weights",
          "int8", "--kv", "bfloat16", "--programs", "decode_step", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "compile_targets.json").read_text())
    assert row["compiled"] and row["host_syncs"] == 0 and row["read_over_weights_cache"] > 0
    assert 0 < row["hbm_read"] and 0 < row["hbm_read_over_weights_cache"] < row[
        "read_over_weights_cache"]  # (the cost model counts on-chip traffic too)
    assert "| v5e | decode_step | default | tiny |" in (tmp_path / "compile_targets.md").read_text()
