"""The one door between the model and a backend.

The model calls these functions only; the backend behind them follows the platform the program
is built for (jaxkv.ops.target: the device or mesh it runs on, or an explicit `on(...)`; not
the host's default): on a CPU jaxkv.ops.cpu, on a GPU or TPU jaxkv.ops.pallas (its kernels for
decode steps, JAX's XLA for the rest), anything else jaxkv.ops.xla, the portable reference.
JAXKV_OPS=xla|cpu|pallas forces one. The choice is made when a function is traced, so a process
that changes JAXKV_OPS calls jax.clear_caches() after. Every backend keeps the contracts below
and is tested against jaxkv.ops.xla.
"""

import importlib
import os

import jax.numpy as jnp

from jaxkv import submodules
from jaxkv.ops import xla
from jaxkv.ops.arrays import (HALF_DTYPES, HalfKV, Int8, Int8KV, PagedKV, half_kv, logical,
                               quantize_kv, write)
from jaxkv.ops.target import on, platform, platform_of
from jaxkv.ops.xla import ACTIVATIONS, merge_parts

BACKENDS = {"xla": "jaxkv.ops.xla", "cpu": "jaxkv.ops.cpu", "pallas": "jaxkv.ops.pallas"}
BY_PLATFORM = {"cpu": "cpu", "gpu": "pallas", "tpu": "pallas"}  # by default, on each platform
__getattr__ = submodules(__name__)  # jaxkv.ops.cpu ... imported when first used


def backend_name() -> str:
    """The backend in use: $JAXKV_OPS, else the one for the platform of the programs traced
    now (jaxkv.ops.target.platform)."""
    name = os.environ.get("JAXKV_OPS") or BY_PLATFORM.get(platform(), "xla")
    if name not in BACKENDS:
        raise ValueError(f"JAXKV_OPS must be one of {', '.join(BACKENDS)} (or unset), got "
                         f"{name!r}")
    return name


def backend():
    """The module of the backend in use (see backend_name)."""
    return importlib.import_module(BACKENDS[backend_name()])


def matmul(x_BTI, w, b_O=None, *, dtype=None, costly_x: bool = False, norm=None, gated=None,
           residual=None):
    """x @ w.T (+ b): x [B, T, I]; w [O, I] float32, bfloat16 or Int8 (read as int8, never
    copied to float); b [O] or None. Accumulates in float32; the result has dtype (default
    x's). costly_x says the work that made x is more than a product should redo per row of w
    (attention, a gated activation), for backends that fuse x's producers into the product.

    Around the product, in this order, and taken into its kernel where a backend can (the
    Pallas backend for a decode step's few rows on a GPU): norm = (scale [I], bias [I] or None,
    "rmsnorm" | "layernorm", eps) norms x first (as jaxkv.ops.norm, in x's dtype); gated =
    (activation, t) gives act(gate) * up [B, T, O / 2] of the result, w's rows in blocks of t
    gate rows then t up rows; residual [B, T, O'] is added last (residual + y)."""
    fused = getattr(backend(), "fused_matmul", None)
    if fused is not None and (norm or gated or residual is not None):
        y_BTO = fused(x_BTI, w, b_O, dtype, norm, gated, residual)
        if y_BTO is not None:
            return y_BTO
    if norm is not None:
        x_BTI = xla.norm(x_BTI, *norm)
    y_BTO = backend().matmul(x_BTI, w, b_O, dtype, costly_x)
    if gated is not None:
        y_BTO = xla.gated(y_BTO, *gated)
    return y_BTO if residual is None else residual + y_BTO


def norm(x_XD, scale_D, bias_D, kind: str, eps: float):
    """LayerNorm ("layernorm") or RMSNorm ("rmsnorm") of x's last axis (scale, and bias or
    None), computed in float32 and returned in x's dtype."""
    return xla.norm(x_XD, scale_D, bias_D, kind, eps)


def attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, *, bias_BNTS=None, kv_len=None,
              own=None, softcap=None, lengths=None, dtype=None, store_at=None):
    """Grouped-query attention: (output [B, T, N, H] in dtype (default float32), log-sum-exp
    [B, T, N] in float32); with store_at, (output, lse, keys, values) with own's keys and values
    stored in the cache.

    Keys and values are [B, K, S, H] in any float dtype, HalfKV or Int8KV (whose scales
    multiply the scores and the softmax weights: the cache is never dequantized); G = N // K
    query heads share each kv head. mask_BTS[b, t, s]: query t of row b may read key s.
    bias_BNTS (optional; its batch and T may be 1) is added to the scaled scores. kv_len
    (optional, traced): no query reads a slot >= kv_len, so work may follow the filled length.
    own (optional): a second key set (k_BKUH, v_BKUH, mask_BTU, bias_BNTU or None), e.g. the
    call's own tokens, read in the same softmax; over an Int8KV cache it is read quantized, as
    the cache will hold it. softcap (optional): scaled scores s become softcap tanh(s /
    softcap). lengths (optional, [B]): the cache slots row b's queries read are exactly [0,
    lengths[b]) (a decode step's), which a backend may read instead of the mask. A query with
    no visible key gets output 0 and lse -inf, never NaN. A PagedKV cache goes to a backend that
    reads pages (READS_PAGES) as it is; the others get it as its rows see it (arrays.logical).
    store_at (optional, [B, T] slots): own's keys and values [B, K, T, H] are also written into
    the cache there (arrays.write, after the cache is read), where a backend may store them from
    its attention kernel.
    """
    cache = (k_BKSH, v_BKSH)
    if isinstance(k_BKSH, PagedKV) and not backend().READS_PAGES:
        k_BKSH, v_BKSH = logical(k_BKSH), logical(v_BKSH)
    args = (q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, bias_BNTS, kv_len, own, softcap, lengths)
    storing = getattr(backend(), "attention_storing", None)
    if store_at is not None and storing is not None:
        result = storing(*args, dtype, store_at)
        if result is not None:
            return result
    out_BTNH, lse_BTN = backend().attention(*args)
    if store_at is None:
        return out_BTNH.astype(dtype or jnp.float32), lse_BTN
    # The writes come after the reads and depend on them (+ 0 * output), which lets XLA update
    # the cache in place; written while a read of it is pending, XLA copies the whole cache.
    after_BT11 = 0 * out_BTNH[:, :, :1, :1]
    k_new, v_new = (write(layer, jnp.swapaxes(new_BKTH, 1, 2) + after_BT11, store_at)
                    for layer, new_BKTH in zip(cache, own[:2]))
    return out_BTNH.astype(dtype or jnp.float32), lse_BTN, k_new, v_new


def attention_weights(q_BTNH, k_BKSH, mask_BTS, scale: float, *, bias_BNTS=None, own=None,
                      softcap=None):
    """The softmax weights [B, N, T, S] (float32) that `attention` with these arguments gives
    the cache's keys, and with own (k_BKUH, mask_BTU, bias_BNTU or None) the pair (cache's,
    own's [B, N, T, U]). Always computed by the portable XLA form (a backend's kernel keeps no
    weights): for reading them (hooks' attn_probs), not for attending.
    """
    return xla.attention_weights(q_BTNH, k_BKSH, mask_BTS, scale, bias_BNTS, own, softcap)


def experts(x_RD, w_in_EOD, w_out_EDF, expert_RK, weight_RK, *, activation: str):
    """A mixture of experts' MLP for rows x [R, D]: the sum over k of weight_RK[r, k] times
    expert expert_RK[r, k]'s down(act(gate x) * up x), w_in_EOD [E, 2F, D] (gate rows, then up
    rows), w_out_EDF [E, D, F], float or Int8 stacks; in x's dtype. Only the chosen experts are
    computed (and, for a decode step's few rows, only their weights read)."""
    fn = getattr(backend(), "experts", None) or xla.experts
    return fn(x_RD, w_in_EOD, w_out_EDF, expert_RK, weight_RK, activation)


def kv_layer(x_XH, dtype):
    """Keys or values [..., H] as a cache layer of dtype stores them: Int8KV for int8; for
    bfloat16 / float16, HalfKV (their bits) where the backend stores them so, else an array."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return quantize_kv(x_XH)
    if dtype in HALF_DTYPES and backend().HALF_KV_BITS:
        return half_kv(x_XH, dtype)
    return x_XH.astype(dtype)


def empty_kv_layer(shape, dtype):
    """An empty cache layer [B, K, S, H] of dtype, stored as kv_layer stores it."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return Int8KV(jnp.zeros(shape, jnp.int8), jnp.zeros(shape[:-1], jnp.float32))
    if dtype in HALF_DTYPES and backend().HALF_KV_BITS:
        return HalfKV(jnp.zeros(shape, jnp.uint16), dtype)
    return jnp.zeros(shape, dtype)


def placed(tree):
    """tree with its weights placed where the backend reads them best (on the CPU: 2 MiB
    pages); what load, cast and quantize return."""
    return backend().placed(tree)


def materialized(x):
    """x computed once, as arrays, where the backend would otherwise recompute it inside each
    of its consumers (RoPE's factors, shared by every head of every layer)."""
    return backend().materialized(x)


def prefill_chunk(w_qkv, rows: int, tokens: int) -> int:
    """Prompt tokens per prefill pass for `rows` rows padded to `tokens`, given the model's
    first fused Q/K/V matrix (its dtype says which products the pass runs)."""
    return backend().prefill_chunk(w_qkv, rows, tokens)


__all__ = ["ACTIVATIONS", "HALF_DTYPES", "HalfKV", "Int8", "Int8KV", "PagedKV", "attention",
           "backend", "backend_name", "empty_kv_layer", "kv_layer", "matmul", "materialized",
           "merge_parts", "norm", "on", "placed", "platform", "platform_of", "prefill_chunk"]
