"""What every decoding loop checks and prepares before it compiles: prompts (ragged lists or
a padded array), cache capacity, end ids, padding, token masks and encoder inputs."""

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core import checks
from jaxkv.decoding.sampling import SamplingParams, sampling_params


def prepare_prompts(config, prompts, lengths=None):
    """Right-padded tokens [B, bucket(T)] and lengths [B] from ragged lists or a [B, T] array."""
    if isinstance(prompts, (list, tuple)) and not (prompts and isinstance(prompts[0], str)):
        if lengths is not None:
            raise ValueError("lengths is only for a [B, T] prompts array, not a list of lists")
        prompts, lengths = pad_rows(config, prompts)
    elif prompts is None:
        raise TypeError("prompts must be a list of token-id lists or a [B, T] array, got None")
    tokens_BT = checks.int_array(prompts, "prompts", 2)
    B, T = tokens_BT.shape
    if B == 0 or T == 0:
        raise ValueError(f"prompts is empty: expected [B, T] token ids with B, T >= 1, got shape "
                         f"{(B, T)}")
    lengths_B = jnp.full((B,), T, jnp.int32) if lengths is None else checks.int_array(
        lengths, "lengths", 1, (1, T + 1),
        f"is not a prompt length: expected 1 <= length <= {T}")
    if lengths_B.shape != (B,):
        raise ValueError(f"lengths must have shape ({B},), got {lengths_B.shape}")
    lengths = np.asarray(lengths_B)
    for b in range(B):
        checks.token_ids(config, tokens_BT[b, : lengths[b]], f"prompts[{b}]", 1)
    return checks.pad_to_bucket(tokens_BT), lengths_B


def pad_rows(config, prompts):
    """(tokens [B, T] right-padded with 0, lengths [B]) from a list of token-id lists."""
    if not prompts:
        raise ValueError("prompts is empty: expected at least one prompt")
    if np.ndim(prompts[0]) == 0:
        raise TypeError(f"prompts must be a list of token-id lists (one per row), got "
                        f"{prompts!r:.60}; for one prompt p, pass [p]")
    rows = [checks.token_ids(config, p, f"prompts[{i}]", 1) for i, p in enumerate(prompts)]
    lengths = np.array([row.shape[0] for row in rows], np.int32)
    tokens = np.zeros((len(rows), lengths.max()), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : row.shape[0]] = row
    return tokens, lengths


SLOT_MULTIPLE = 16  # default capacities are whole blocks of the attention kernels


def capacity_for(config, padded_len: int, new_tokens: int, max_len=None) -> int:
    """Cache slots for prompts padded to padded_len followed by new_tokens: max_len when given
    (a positive int), else padded_len + new_tokens, at most the model's max_seq_len."""
    if max_len is None:
        return min(padded_len + new_tokens, config.max_seq_len)
    return checks.int_arg(max_len, "max_len")


def whole_blocks(slots: int, limit: int) -> int:
    """slots rounded up to a multiple of SLOT_MULTIPLE (the block the attention kernels read a
    cache in), unless that passes limit: then slots as they are."""
    rounded = -(-slots // SLOT_MULTIPLE) * SLOT_MULTIPLE
    return rounded if rounded <= limit else slots


def check_room(config, lengths_B, max_new_tokens: int, capacity: int, max_len=None):
    """The longest prompt and max_new_tokens must fit the model's max_seq_len and the cache."""
    longest = int(np.max(np.asarray(lengths_B)))
    need = f"{longest} + {max_new_tokens} = {longest + max_new_tokens} positions"
    if longest + max_new_tokens > config.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens = {need}, more than the model's max_seq_len "
                         f"({config.max_seq_len})")
    if max_len is not None and longest + max_new_tokens > capacity:
        raise ValueError(f"prompt + max_new_tokens = {need}, over the cache capacity (max_len: "
                         f"{capacity})")


def token_mask(config, ids, name: str):
    """A [V] bool mask of ids."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ((ids < 0) | (ids >= config.vocab_size)).any():
        raise ValueError(f"{name} must hold token ids in [0, {config.vocab_size}), got "
                         f"{ids[(ids < 0) | (ids >= config.vocab_size)].tolist()}")
    return jnp.zeros((config.vocab_size,), bool).at[ids].set(True)


def padded_encoder_inputs(config, encoder_inputs, encoder_lengths, batch_size: int):
    """(inputs, lengths) for generate_loop, checked (checks.encoder_args); token inputs padded
    to a length bucket, so a new length within it does not recompile. (None, None) for a
    decoder-only model given none."""
    if not config.is_encoder_decoder and encoder_inputs is None:
        return None, None
    inputs, lengths_B = checks.encoder_args(config, encoder_inputs, encoder_lengths, batch_size)
    if config.encoder.input == "tokens":
        B, M = inputs.shape
        lengths_B = jnp.full((B,), M, jnp.int32) if lengths_B is None else lengths_B
        padded = min(checks.bucket_len(M), config.encoder.max_input_len)
        inputs = jnp.pad(inputs, ((0, 0), (0, padded - M)))
    return inputs, lengths_B


def eos_ids(config, eos_id):
    """[E] int32 end-of-sequence ids ([-1]: none) from None, an id or a list of ids, each a token
    of the model's vocabulary."""
    if eos_id is None:
        return jnp.array([-1], jnp.int32)
    ids = np.asarray(eos_id)
    if ids.ndim > 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise ValueError(f"eos_id must be a token id or a non-empty list of token ids, got "
                         f"{eos_id!r}")
    checks.in_range(ids, "eos_id", 0, config.vocab_size, "is not a token id: expected 0 <= id "
                    f"< vocab_size ({config.vocab_size})")
    return jnp.atleast_1d(jnp.asarray(ids, jnp.int32))


def pad_value(config, pad_id, eos_id, eos_E) -> int:
    """pad_id, a token of the model's vocabulary; by default the first EOS id, or 0 without
    one."""
    if pad_id is None:
        pad_id = 0 if eos_id is None else int(eos_E[0])
    pad_id = checks.int_arg(pad_id, "pad_id", minimum=0)
    if pad_id >= config.vocab_size:
        raise ValueError(f"pad_id = {pad_id} is not a token id: expected 0 <= id < vocab_size "
                         f"({config.vocab_size})")
    return pad_id


class PerPrompt:
    """Sampling options given for every prompt (a scalar) or one per prompt (a sequence):
    prompt i's, as scalars."""

    def __init__(self, count, **values):
        """count: how many prompts there are (None: not known ahead)."""
        self.lengths = {k: len(v) for k, v in values.items() if np.ndim(v) == 1}
        for name, n in self.lengths.items():
            if count is not None and n != count:
                raise ValueError(f"{name} has {n} values for {count} prompts: expected one per "
                                 "prompt, or one for all")
        self.table = sampling_params(max(self.lengths.values(), default=1), **values)

    def __call__(self, i: int) -> SamplingParams:
        for name, n in self.lengths.items():
            if i >= n:
                raise ValueError(f"{name} has {n} values, but there are more prompts (prompt "
                                 f"{i})")
        return jax.tree.map(lambda x: x[i if self.lengths else 0], self.table)


def budget_list(max_new_tokens, count=None):
    """(prompt index -> max_new_tokens, the largest) from an int or one int per prompt (count of
    them, when the number of prompts is known)."""
    if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
        values = [checks.int_arg(n, f"max_new_tokens[{i}]") for i, n in enumerate(max_new_tokens)]
        if not values:
            raise ValueError("max_new_tokens is an empty list: expected one int per prompt")
        if count is not None and len(values) != count:
            raise ValueError(f"max_new_tokens has {len(values)} values for {count} prompts: "
                             "expected one per prompt")

        def budget(i):
            if i >= len(values):
                raise ValueError(f"max_new_tokens has {len(values)} values, but there are "
                                 f"more prompts (prompt {i})")
            return values[i]

        return budget, max(values)
    n = checks.int_arg(max_new_tokens, "max_new_tokens")
    return lambda i: n, n


def cache_capacity(config, prompts, max_new_tokens, max_len=None) -> int:
    """The positions each row's cache holds for these prompts (see iter_many)."""
    return sized(config, prompts, checks.bucket_len(budget_list(max_new_tokens)[1]), max_len)[1]


def sized(config, prompts, N, max_len):
    """(prompts, cache capacity): a list or a [B, T] array (taken as its B rows, its ids
    checked whole) sizes it; other iterables need max_len."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        prompts = array_rows(config, prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be an iterable of token-id lists or a [B, T] array, got "
                        f"{type(prompts).__name__}")
    if max_len is not None:
        capacity = capacity_for(config, 0, N, max_len)
        if capacity > config.max_seq_len:
            raise ValueError(f"max_len={capacity} exceeds the model's max_seq_len "
                             f"({config.max_seq_len})")
    elif isinstance(prompts, (list, tuple)):
        longest = max((np.size(p) for p in prompts), default=1)
        capacity = capacity_for(config, checks.bucket_len(longest), N)
    else:
        raise ValueError(f"prompts is an iterator ({type(prompts).__name__}), so generate_many "
                         "cannot size the cache ahead: pass max_len (longest prompt + "
                         "max_new_tokens), or pass a list or a [B, T] array")
    return prompts, capacity


def array_rows(config, prompts_BT) -> list:
    """The B rows of a [B, T] array of prompts (numpy or jax), every id checked."""
    if np.ndim(prompts_BT) != 2:
        raise ValueError(f"prompts as an array must be [B, T] token ids (one row per prompt), "
                         f"got shape {tuple(np.shape(prompts_BT))}"
                         f"{'; for one prompt p, pass [p]' if np.ndim(prompts_BT) == 1 else ''}")
    return list(np.asarray(checks.token_ids(config, prompts_BT, "prompts", 2)))
