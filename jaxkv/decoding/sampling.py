"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty.

Sampling parameters are arrays (traced under jit), one value per row, so changing them never
recompiles. Each row's randomness comes from its own key and the step number only, so a row's
sample does not depend on which other rows share its batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SamplingParams:
    temperature: jax.Array  # [B] float32; 0 means greedy
    top_k: jax.Array  # [B] int32; 0 means off
    top_p: jax.Array  # [B] float32; 1 means off
    min_p: jax.Array  # [B] float32; 0 means off
    repetition_penalty: jax.Array  # [B] float32; 1 means off


# name: (value meaning "off", dtype, predicate on valid values, what is expected)
_RULES = {
    "temperature": (0.0, jnp.float32, lambda x: np.isfinite(x) & (x >= 0),
                    "finite and >= 0 (0 means greedy)"),
    "top_k": (0, jnp.int32, lambda x: x >= 0, "an int >= 0 (0 or None means off)"),
    "top_p": (1.0, jnp.float32, lambda x: (x > 0) & (x <= 1), "in (0, 1]"),
    "min_p": (0.0, jnp.float32, lambda x: (x >= 0) & (x <= 1), "in [0, 1]"),
    "repetition_penalty": (1.0, jnp.float32, lambda x: x > 0, "> 0 (1 means off)"),
}


def sampling_params(batch_size: int, **values) -> SamplingParams:
    """Per-row parameters from scalars, per-row sequences, or None (off)."""
    fields = {}
    for name, (off, dtype, valid, expected) in _RULES.items():
        value = values.get(name)
        x = np.asarray(off if value is None else value)
        if x.dtype.kind not in "iuf":
            raise TypeError(f"{name} must be a number or one number per row, got {value!r}")
        if x.ndim > 1 or (x.ndim == 1 and x.shape[0] != batch_size):
            raise ValueError(f"{name} must be a scalar or have shape ({batch_size},), got "
                             f"shape {x.shape}")
        if not np.all(valid(x)) or (dtype == jnp.int32 and x.dtype.kind not in "iu"):
            raise ValueError(f"{name} must be {expected}, got {value!r}")
        fields[name] = jnp.broadcast_to(jnp.asarray(x, dtype), (batch_size,))
    return SamplingParams(**fields)


def base_key(key):
    """A typed PRNG key (or a batch of them) from a key, a legacy uint32 key or None (key 0)."""
    if key is None:
        return jax.random.key(0)
    dtype = getattr(key, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return _legacy_key(key)
    return key


def row_keys(key, batch_size: int):
    """[B] keys: a single key gives row b the key fold_in(key, b); a [B] batch of keys is kept."""
    key = base_key(key)
    if key.ndim == 0:
        return jax.vmap(lambda row: jax.random.fold_in(key, row))(jnp.arange(batch_size))
    if key.shape != (batch_size,):
        raise ValueError(f"key must be one key or {batch_size} keys (one per row), got key "
                         f"shape {key.shape}")
    return key


def _legacy_key(key):
    """A typed key from jax.random.PRNGKey's uint32 [2] data (or [B, 2]); anything else is an
    error."""
    data = np.asarray(key) if not isinstance(key, jax.Array) else key
    if data.dtype != np.uint32 or data.ndim not in (1, 2) or data.shape[-1] != 2:
        raise TypeError(f"key must be a JAX PRNG key such as jax.random.key(seed) (or [B] of "
                        f"them), got {key!r:.60}")
    return jax.random.wrap_key_data(data)


def apply_repetition_penalty(logits_BV, seen_BV, penalty_B):
    """Hugging Face's rule: a seen token's logit is divided by the penalty if > 0, else
    multiplied."""
    p_B1 = penalty_B[:, None]
    penalized_BV = jnp.where(logits_BV > 0, logits_BV / p_B1, logits_BV * p_B1)
    return jnp.where(seen_BV, penalized_BV, logits_BV)


def filter_logits(logits_BV, top_k_B, top_p_B, min_p_B):
    """Sets to -inf every logit outside the top-k, the top-p nucleus, or below min_p * max prob.

    The three filters apply in that order (as in Hugging Face), each on what the last kept.
    """
    V = logits_BV.shape[-1]
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    rank_V = jnp.arange(V)
    keep_BV = rank_V < jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)[:, None]
    probs_BV = jax.nn.softmax(jnp.where(keep_BV, sorted_BV, -jnp.inf), axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV &= (mass_before_BV < top_p_B[:, None]) | (rank_V == 0)
    keep_BV &= sorted_BV >= sorted_BV[:, :1] + jnp.log(min_p_B)[:, None]
    # keep_BV is a prefix of the sorted order; its last kept value is the threshold.
    threshold_B1 = jnp.take_along_axis(sorted_BV, keep_BV.sum(-1, keepdims=True) - 1, axis=-1)
    return jnp.where(logits_BV >= threshold_B1, logits_BV, -jnp.inf)


def argmax(x_BV):
    """numpy's argmax over the last axis ([B] int32: the first maximum, the first NaN counting
    as the largest), as a max and a min: XLA:CPU runs the pair faster than argmax's (value,
    index) reduction, and it holds on every platform (jnp.argmax on an H100 took a row's last
    NaN)."""
    max_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
    hit_BV = (x_BV == max_B1) | jnp.isnan(x_BV)
    return jnp.min(jnp.where(hit_BV, jnp.arange(x_BV.shape[-1]), x_BV.shape[-1]), -1).astype(
        jnp.int32)


def sample(logits_BV, params: SamplingParams, keys_B, step, seen_BV):
    """Next token [B] int32. step: the index of this token in its row's answer, one for all
    rows or one per row [B]; seen_BV marks the tokens the repetition penalty applies to."""
    if keys_B.shape != logits_BV.shape[:1]:
        raise ValueError(f"keys must be one key per row, shape {logits_BV.shape[:1]}, got "
                         f"{keys_B.shape} (jaxkv.sampling.row_keys makes them)")
    logits_BV = apply_repetition_penalty(logits_BV.astype(jnp.float32), seen_BV,
                                         params.repetition_penalty)
    greedy_B = argmax(logits_BV)

    def draw():
        temperature_B1 = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
        scaled_BV = logits_BV / temperature_B1
        filtering = jnp.any((params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0))
        scaled_BV = jax.lax.cond(filtering, filter_logits, lambda x, *_: x, scaled_BV,
                                 params.top_k, params.top_p, params.min_p)
        V = logits_BV.shape[-1]
        step_B = jnp.broadcast_to(step, keys_B.shape)
        gumbel_BV = jax.vmap(lambda k, t: jax.random.gumbel(jax.random.fold_in(k, t), (V,)))(
            keys_B, step_B)
        sampled_B = argmax(scaled_BV + gumbel_BV)
        return jnp.where(params.temperature > 0, sampled_B, greedy_B)

    return jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda: greedy_B)
