"""The CPU kernels (dense.cc: products y = x @ w.T of a few rows of x, streaming w once over
every core; attend.cc: attention of a call's queries over a cache and their own keys),
registered with XLA's FFI.

They are compiled with the machine's C++ compiler for the CPU at hand (-march=native;
$JAXKV_CPU_MARCH names another) the first time a process needs them, and cached by the hash of
their sources, flags, jaxlib's version and the CPU's features: $JAXKV_CACHE (default
~/.cache/jaxkv)/kernels. Used only when JAX computes on the CPU and JAXKV_CPU_KERNELS is not 0;
without a compiler the products stay XLA's, with one warning saying why. Differentiable: their
derivatives are XLA's.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.ops import target
from jaxkv.ops.arrays import HalfKV, Int8KV, PagedKV, dequantize_rows

# Up to this many rows of x go to the product kernels, by weight format (dense.cc's kMaxRowsT
# is float32's); more rows (a prefill) go to XLA's GEMM.
ROWS = {"float32": 96, "bfloat16": 64, "int8": 64}
# From this many rows of x on, float32 weights go to the outer-product form (dense.cc, TileT)
# instead of the dot form.
OUTER_ROWS = 16
# Models with up to this many query heads per kv head go to the attention kernel, for any
# number of tokens: it takes a call's queries in tiles of at most this many (a tile's tokens x
# the query heads sharing a kv head).
ATTEND_ROWS = 64
# A paged cache goes to the attention kernel as its pools and table when a page holds whole
# blocks of the keys attend.cc reads at once (a vector's lanes: 4, 8 or 16 by instruction set).
PAGE_SLOTS = 16  # attend.cc checks the same (kPageSlots)
SOURCES = tuple(Path(__file__).with_name(name) for name in ("dense.cc", "attend.cc"))
HEADER = Path(__file__).with_name("common.h")
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-w")


def _march() -> str:
    """The instruction set the kernels are compiled for: $JAXKV_CPU_MARCH, default native (the
    CPU at hand). tests/test_kernels.py sets x86-64-v3 (AVX2) and x86-64 to check the kernels'
    narrower paths on a CPU that has AVX-512."""
    return f"-march={os.environ.get('JAXKV_CPU_MARCH', 'native')}"


def enabled() -> bool:
    """Whether products may use the kernels: the program is built for a CPU (one for a GPU or
    TPU neither builds them nor traces their branch) and JAXKV_CPU_KERNELS is not 0."""
    return (target.platform() == "cpu" and os.environ.get("JAXKV_CPU_KERNELS", "1") != "0"
            and registered())


@functools.cache
def _library():
    """The compiled kernels, loaded (built first where needed); None, with a warning, when they
    cannot be built here."""
    try:
        return ctypes.cdll.LoadLibrary(str(_build()))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        warnings.warn(f"jaxkv: CPU product kernels unavailable, using XLA's ({e})", stacklevel=3)
        return None


@functools.cache
def registered() -> bool:
    """Compile (or find compiled) and register the kernels once per process; False, with a
    warning, when they cannot be built here."""
    library = _library()
    if library is None:
        return False
    for name, symbol in (("jaxkv_dense", "JaxkvDense"), ("jaxkv_dense_t", "JaxkvDenseT"),
                         ("jaxkv_dense_int8", "JaxkvDenseInt8"),
                         ("jaxkv_dense_experts", "JaxkvDenseExperts"),
                         ("jaxkv_dense_int8_experts", "JaxkvDenseInt8Experts"),
                         ("jaxkv_attend", "JaxkvAttend"),
                         ("jaxkv_attend_int8", "JaxkvAttendInt8")):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
    return True


def _cpu_features() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
        return "\n".join(wanted[:2])
    except OSError:
        return platform.processor()


def _build() -> Path:
    """The compiled library for this source, compiler flags, jaxlib and CPU."""
    wanted = os.environ.get("CXX") or "g++"
    compiler = shutil.which(wanted) or (wanted == "g++" and shutil.which("c++"))
    if not compiler:
        raise RuntimeError(f"no C++ compiler: {wanted!r} not found (set CXX, or install g++)")
    include = jax.ffi.include_dir()
    texts = [path.read_text() for path in (*SOURCES, HEADER)]
    flags = (*FLAGS, _march())
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), jax.lib.__version__, compiler,
                                    _cpu_features()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("JAXKV_CACHE", Path.home() / ".cache" / "jaxkv")) / "kernels"
    target = cache / f"kernels-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then moved in whole
            objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
            logs = [obj.with_suffix(".log") for obj in objects]
            compiles = [_start([compiler, *flags, f"-I{include}", "-c", str(source), "-o",
                                str(obj)], log) for source, obj, log in zip(SOURCES, objects, logs)]
            for job, log in zip(compiles, logs):
                _check(compiler, flags, job.wait(), log.read_text())
            built = Path(tmp) / target.name
            run = subprocess.run([compiler, "-shared", *map(str, objects), "-o", str(built)],
                                 capture_output=True, text=True)
            _check(compiler, flags, run.returncode, run.stderr)
            os.replace(built, target)
    return target


def _start(command: list, log: Path) -> subprocess.Popen:
    """The compiler started on one source, its messages to `log` (the sources compile side by
    side)."""
    with log.open("w") as messages:
        return subprocess.Popen(command, stderr=messages)


def _check(compiler: str, flags: tuple, returncode: int, stderr: str):
    if returncode:
        raise RuntimeError(f"{compiler} {' '.join(flags)} failed on the kernels: "
                           f"{stderr[-2000:]}")


def outer_block_rows() -> int:
    """Rows of x that one block of the float32 outer-product form takes in this build: 96 with
    AVX-512, 24 with AVX2 (16 vector registers) and NEON (32 of 4 lanes), 12 with SSE2; more
    rows run as several blocks, each reading w's tile again from L1. 0 without the kernels."""
    library = _library() if enabled() else None
    if library is None:
        return 0
    library.JaxkvOuterBlockRows.restype = ctypes.c_int64
    return int(library.JaxkvOuterBlockRows())


def fits(rows: int, dtype) -> bool:
    """Whether a product over this many rows of x with weights of this dtype (int8 for
    ops.arrays.Int8) should go to the kernels."""
    return rows <= ROWS.get(jnp.dtype(dtype).name, 0) and enabled()


def int8_fits(q_OI, scale_OB) -> bool:
    """Whether product_int8 takes this layout: one scale per row, or blocks of 2^k >= 16 inputs."""
    K = q_OI.shape[1] // scale_OB.shape[1]
    return scale_OB.shape[1] == 1 or (K >= 16 and K & (K - 1) == 0)


@jax.custom_jvp
def product(x_RI, w_OI):
    """x @ w.T in float32, w float32 or bfloat16 [O, I]: the kernel on the CPU, XLA elsewhere."""
    return jax.lax.platform_dependent(
        x_RI, w_OI, cpu=_ffi("jaxkv_dense", outer="jaxkv_dense_t"),
        default=lambda x, w: _xla(x, w))


@jax.custom_jvp
def product_int8(x_RI, q_OI, scale_OB):
    """x @ (q * scale).T in float32: q int8 [O, I], scale [O, NB] per block of I / NB inputs."""
    return jax.lax.platform_dependent(
        x_RI, q_OI, scale_OB, cpu=_ffi("jaxkv_dense_int8"),
        default=lambda x, q, s: _xla(x, _dequantize(q, s)))


@jax.custom_jvp
def expert_product(x_XI, w_EOI, e_X):
    """Row j of x times expert e_X[j]'s w_EOI[e].T, in float32 [X, O]: w float32 or bfloat16
    [E, O, I] read where it lies, each chosen expert once (rows that chose it share the read,
    as dense products of up to 96 rows: from OUTER_ROWS rows on, float32 in the outer form).
    The kernel on the CPU, XLA elsewhere."""
    return jax.lax.platform_dependent(
        x_XI, w_EOI, e_X, cpu=_ffi("jaxkv_dense_experts", outer_rows=np.int64(OUTER_ROWS)),
        default=_by_expert)


@jax.custom_jvp
def expert_product_int8(x_XI, q_EOI, scale_EOB, e_X):
    """expert_product of int8 stacks: q int8 [E, O, I], scale [E, O, NB] (see product_int8)."""
    return jax.lax.platform_dependent(
        x_XI, q_EOI, scale_EOB, e_X, cpu=_ffi("jaxkv_dense_int8_experts"),
        default=lambda x, q, s, e: _by_expert(x, _dequantize(q, s), e))


def _ffi(target, outer=None, **attributes):
    """The kernel call; outer (float32 weights only): the target taking x transposed, used from
    OUTER_ROWS rows on; attributes: the target's."""
    def call(x_RI, *w):
        if not registered():
            raise RuntimeError("jaxkv: the CPU product kernels could not be built (see the "
                               "warning)")
        R = x_RI.shape[0]
        y = jax.ShapeDtypeStruct((R, w[0].shape[-2]), jnp.float32)  # w [O, I] or [E, O, I]
        if not (x_RI.dtype == w[0].dtype == jnp.bfloat16):  # bfloat16 pairs go as they are
            x_RI = x_RI.astype(jnp.float32)
        form = outer if outer and w[0].dtype == jnp.float32 and R >= OUTER_ROWS else target
        return jax.ffi.ffi_call(form, y, vmap_method="sequential")(x_RI, *w, **attributes)
    return call


def _xla(x_RI, w_OI):
    return jnp.einsum("RI,OI->RO", x_RI, w_OI, preferred_element_type=jnp.float32)


def _by_expert(x_XI, w_EOI, e_X):
    """expert_product in XLA: each row's expert's matrix taken out, then products."""
    return jnp.einsum("XI,XOI->XO", x_XI, w_EOI[e_X], preferred_element_type=jnp.float32)


def _dequantize(q_OI, scale_OB):
    return dequantize_rows(q_OI, scale_OB.astype(jnp.float32))


@product.defjvp
def _product_jvp(primals, tangents):
    (x_RI, w_OI), (dx_RI, dw_OI) = primals, tangents
    return product(x_RI, w_OI), _xla(dx_RI, w_OI) + _xla(x_RI, dw_OI)


@product_int8.defjvp
def _product_int8_jvp(primals, tangents):  # int8 weights are constants: only x moves
    (x_RI, q_OI, scale_OB), (dx_RI, _, _) = primals, tangents
    return product_int8(x_RI, q_OI, scale_OB), _xla(dx_RI, _dequantize(q_OI, scale_OB))


@expert_product.defjvp
def _expert_product_jvp(primals, tangents):
    return jax.jvp(_by_expert, primals, tangents)


@expert_product_int8.defjvp
def _expert_product_int8_jvp(primals, tangents):  # int8 weights are constants: only x moves
    (x_XI, q_EOI, scale_EOB, e_X), (dx_XI, _, _, _) = primals, tangents
    w_EOI = _dequantize(q_EOI, scale_EOB)
    return expert_product_int8(x_XI, q_EOI, scale_EOB, e_X), _by_expert(dx_XI, w_EOI, e_X)


def attend_fits(q_BTNH, k_BKSH) -> bool:
    """Whether attend takes these queries and cache keys (float32, bfloat16 as an array or
    HalfKV, or Int8KV; or a PagedKV of one, see reads_pages): any number of tokens, at most
    ATTEND_ROWS query heads per kv head."""
    G = q_BTNH.shape[2] // k_BKSH.shape[1]
    return (getattr(k_BKSH, "dtype", None) in (jnp.float32, jnp.bfloat16, jnp.int8)
            and G <= ATTEND_ROWS and enabled())


def reads_pages(k: PagedKV) -> bool:
    """Whether attend reads this paged cache through its table: pages of a multiple of
    PAGE_SLOTS slots."""
    return k.pool.shape[2] % PAGE_SLOTS == 0


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def attend(xla, scale: float, softcap, q_BTNH, k_BKSH, v_BKSH, mask_BTS, k_BKUH, v_BKUH,
           mask_BTU, kv_len):
    """Softmax attention of q over the cache's keys (those below kv_len that mask_BTS allows) and
    the call's own keys (mask_BTU) together: (output [B, T, N, H], log-sum-exp [B, T, N]), both
    float32. Int8KV keys and values (cache and own alike): their int8 numbers and scales. A
    PagedKV cache (k and v share its table; see reads_pages): its pools, read through the table.
    The kernel on the CPU; xla(q, k, v, mask, k_own, v_own, own_mask, kv_len), the same
    attention in XLA, on other platforms and for derivatives."""
    def kernel(q_BTNH, *rest):
        B, T, N, H = q_BTNH.shape
        result = (jax.ShapeDtypeStruct((B, T, N, H), jnp.float32),
                  jax.ShapeDtypeStruct((B, T, N), jnp.float32))
        *keys, kv_len = rest
        table_BM = jnp.zeros((B, 0), jnp.int32)  # no pages: the cache is [B, K, S, H]
        if isinstance(keys[0], PagedKV):
            table_BM, keys[:2] = keys[0].table, [x.pool for x in keys[:2]]
        int8 = isinstance(keys[0], Int8KV)
        keys = [x.bits if isinstance(x, HalfKV) else x for x in keys]  # bfloat16's bits as they are
        return jax.ffi.ffi_call("jaxkv_attend_int8" if int8 else "jaxkv_attend", result,
                                vmap_method="sequential")(
            q_BTNH.astype(jnp.float32), *jax.tree.leaves(keys), jnp.asarray(kv_len, jnp.int32),
            table_BM, scale=np.float32(scale), softcap=np.float32(softcap or 0.0))
    return jax.lax.platform_dependent(q_BTNH, k_BKSH, v_BKSH, mask_BTS, k_BKUH, v_BKUH, mask_BTU,
                                      kv_len, cpu=kernel, default=xla)


@attend.defjvp
def _attend_jvp(xla, scale, softcap, primals, tangents):
    return jax.jvp(xla, primals, tangents)
