"""Training: next-token losses over jaxkv.forward, AdamW, a resumable TrainState.

Everything that decides a run's numbers is in the TrainState or follows from it: batch i of the
data stream is drawn from fold_in(state.key, i), so stopping, restoring a checkpoint and going on
gives bitwise the parameters of a run straight through. On a GPU that needs XLA's deterministic
ops (`deterministic`, which the training scripts call first thing).
"""

import dataclasses
import functools
import os
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct

from jaxkv.core.decoder import forward
from jaxkv.core.params import Params, init_params, path_name

# XLA:GPU adds a scatter's updates (the embedding lookup's gradient is one) with atomics, in the
# order its threads arrive, so a seed fixes a run's last bits only with this flag.
DETERMINISTIC = "--xla_gpu_deterministic_ops=true"


# ---- losses -------------------------------------------------------------------------------

def cross_entropy(logits_BTV, targets_BT, mask_BT=None):
    """Mean negative log-likelihood (nats) of targets [B, T] over the positions mask_BT keeps."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    if mask_BT is None:
        return nll_BT.mean()
    return (nll_BT * mask_BT).sum() / jnp.maximum(mask_BT.sum(), 1)


def lm_loss(params: Params, tokens_BT):
    """Decoder-only next-token loss: tokens [B, T], position t predicts token t + 1."""
    return cross_entropy(forward(params, tokens_BT[:, :-1]), tokens_BT[:, 1:])


@struct.dataclass
class Seq2SeqBatch:
    encoder_inputs: jax.Array  # [B, M] int32 source tokens, right-padded
    encoder_lengths: jax.Array  # [B] int32 real source lengths
    tokens: jax.Array  # [B, T + 1] int32: decoder start, target, EOS, padding
    mask: jax.Array  # [B, T] bool: which next-token targets (tokens[:, 1:]) count


def seq2seq_loss(params: Params, batch: Seq2SeqBatch):
    """Encoder-decoder next-token loss over the target positions batch.mask keeps."""
    logits_BTV = forward(params, batch.tokens[:, :-1], encoder_inputs=batch.encoder_inputs,
                         encoder_lengths=batch.encoder_lengths)
    return cross_entropy(logits_BTV, batch.tokens[:, 1:], batch.mask)


# ---- optimizer and state ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, cosine decay to final_lr, and global-norm gradient clipping."""

    steps: int  # the schedule's length
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    final_lr: float = 3e-4
    weight_decay: float = 0.1  # weight matrices and embeddings only (see `decayed`)
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95

    def __post_init__(self):
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"OptimConfig: warmup_steps must be in [0, steps = {self.steps}), "
                             f"got {self.warmup_steps}")


def optimizer(c: OptimConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, c.learning_rate, c.warmup_steps, c.steps,
                                                  c.final_lr)
    return optax.chain(optax.clip_by_global_norm(c.clip_norm),
                       optax.adamw(schedule, c.b1, c.b2, weight_decay=c.weight_decay,
                                   mask=decayed))


def decayed(params):
    """True at the leaves weight decay applies to: not norms, biases or position-bias tables."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim >= 2 and not path_name(path).endswith("rel_bias"), params)


@struct.dataclass
class TrainState:
    params: Params
    opt_state: Any  # optax state of `optimizer`: AdamW moments shaped like params, step count
    step: jax.Array  # [] int32: optimizer updates applied
    data_pos: jax.Array  # [] int32: batches drawn from the data stream; the next is this one
    key: jax.Array  # [] typed PRNG key of the data stream


def init_state(config, seed: int, optim: OptimConfig) -> TrainState:
    """Step 0: params from fold_in(key(seed), 0), the data stream's key fold_in(key(seed), 1)."""
    root = jax.random.key(seed)
    params = init_params(config, jax.random.fold_in(root, 0))
    step, data_pos = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)  # two buffers: donated
    state = TrainState(params, optimizer(optim).init(params), step, data_pos,
                       jax.random.fold_in(root, 1))
    # Committed to a device, as a restored state is, so both run the same compiled train_step.
    return jax.device_put(state, jax.devices()[0])


@functools.partial(jax.jit, static_argnames=("loss_fn", "optim"), donate_argnames="state")
def train_step(state: TrainState, batch, loss_fn, optim: OptimConfig):
    """One AdamW update on batch (consumes data position state.data_pos) -> (state, loss)."""
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    updates, opt_state = optimizer(optim).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                         data_pos=state.data_pos + 1), loss


@functools.partial(jax.jit, static_argnames="loss_fn")
def eval_loss(params, batch, loss_fn):
    """loss_fn(params, batch), compiled."""
    return loss_fn(params, batch)


def mean_loss(params, batches, loss_fn) -> float:
    """The mean of loss_fn over equal-size batches."""
    return float(np.mean([eval_loss(params, b, loss_fn) for b in batches]))


# ---- data ---------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("batch_size", "seq_len"))
def lm_batch(data, key, index, batch_size: int, seq_len: int):
    """Batch `index` of the stream: [B, seq_len + 1] windows of data (a [N] uint8 / int array)
    at offsets drawn from fold_in(key, index), so it depends on (key, index) only."""
    start_B = jax.random.randint(jax.random.fold_in(key, index), (batch_size,), 0,
                                 data.shape[0] - seq_len)
    return data[start_B[:, None] + jnp.arange(seq_len + 1)].astype(jnp.int32)


def lm_windows(data: np.ndarray, batch_size: int, seq_len: int) -> list:
    """Consecutive non-overlapping [B, seq_len + 1] windows of data (the remainder dropped)."""
    n = (len(data) // (seq_len + 1)) // batch_size * batch_size
    windows = np.asarray(data[: n * (seq_len + 1)], np.int32).reshape(-1, batch_size, seq_len + 1)
    return list(windows)


# ---- checkpoints --------------------------------------------------------------------------

def checkpoint_manager(directory, keep: int = 2) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options)


def _raw(state: TrainState) -> TrainState:
    return state.replace(key=jax.random.key_data(state.key))  # orbax stores plain arrays


def _flat(tree) -> dict:
    return {path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def save_state(manager: ocp.CheckpointManager, state: TrainState, meta: dict) -> None:
    """Checkpoint `state` (every leaf bitwise, the key as its raw data) and a JSON dict at
    step state.step."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(_flat(_raw(state))),
                              meta=ocp.args.JsonSave(meta))
    manager.save(int(state.step), args=args, force=True)


def restore_state(manager: ocp.CheckpointManager, like: TrainState):
    """(state, meta) from the latest checkpoint, with the structure of `like` (a state of the
    same config and optimizer); None when there is no checkpoint."""
    step = manager.latest_step()
    if step is None:
        return None
    abstract = jax.eval_shape(_raw, like)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(_flat(abstract)),
                              meta=ocp.args.JsonRestore())
    restored = manager.restore(step, args=args)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    raw = treedef.unflatten([restored.state[path_name(p)] for p, _ in leaves])
    return raw.replace(key=jax.random.wrap_key_data(raw.key)), restored.meta


def new_meta(run: dict) -> dict:
    """What a checkpoint keeps besides the state: the run's settings and its loss curves."""
    return {"run": run, "train": [], "val": [], "pending": []}


def start(config, seed: int, optim: OptimConfig, manager, run: dict, resume: bool):
    """(state, meta): step 0 with an empty history, or with `resume` the latest checkpoint's,
    which must have been made with the same `run` settings (whatever changes the numbers).
    Starting afresh deletes the manager's old checkpoints, so none is taken for this run's."""
    state = init_state(config, seed, optim)
    if not resume:
        for step in manager.all_steps():
            manager.delete(step)
        return state, new_meta(run)
    restored = restore_state(manager, state)
    if restored is None:
        raise FileNotFoundError(f"resume: no checkpoint in {manager.directory}")
    saved = restored[1]["run"]
    if saved != run:
        changed = {k: (saved.get(k), run.get(k)) for k in sorted({*saved, *run})
                   if saved.get(k) != run.get(k)}
        raise ValueError(f"resume: the checkpoint was made with other settings (then, now): "
                         f"{changed}")
    return restored


def deterministic() -> None:
    """Adds DETERMINISTIC to XLA_FLAGS, so that a seed fixes a run on a GPU as it does on a CPU or
    TPU. XLA reads its flags when the first computation starts a backend: call it before."""
    if not _deterministic_flag():
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DETERMINISTIC}".strip()


def warn_if_nondeterministic() -> None:
    """A warning on a GPU whose XLA_FLAGS lack DETERMINISTIC: the run's last bits vary."""
    if jax.default_backend() == "gpu" and not _deterministic_flag():
        warnings.warn(f"training on a GPU without {DETERMINISTIC} in XLA_FLAGS: two runs of one "
                      f"seed, or a resumed run, are not bitwise equal; call jaxkv.train."
                      f"deterministic() before jax's first computation", stacklevel=3)


def _deterministic_flag() -> bool:
    return DETERMINISTIC in os.environ.get("XLA_FLAGS", "").split()


# ---- the loop -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Loop:
    steps: int  # the schedule's length
    stop: int  # this run ends here (<= steps); a later run resumes from the checkpoint
    ckpt_every: int
    eval_every: int
    log_every: int = 10


def fit(state: TrainState, next_batch, loss_fn, optim: OptimConfig, loop: Loop, evaluate,
        manager, meta: dict) -> TrainState:
    """Trains from state.step to loop.stop with batches next_batch(key, data_pos).

    meta (a new_meta() or a checkpoint's) gets [step, mean train loss of the last log_every
    steps] in "train" and [step, evaluate(params)] in "val" every eval_every steps and at the
    end of the schedule; the losses since the last log wait in "pending", so a resumed run
    logs what one straight through would. Checkpoints state + meta every ckpt_every steps and
    at loop.stop.
    """
    warn_if_nondeterministic()
    began = time.perf_counter()
    while (step := int(state.step)) < loop.stop:
        state, loss = train_step(state, next_batch(state.key, state.data_pos), loss_fn, optim)
        loss = float(loss)
        meta["pending"].append(loss)
        step += 1
        if step % loop.log_every == 0 or step == loop.steps:
            meta["train"].append([step, float(np.mean(meta["pending"]))])
            meta["pending"] = []
        if step % loop.eval_every == 0 or step == loop.steps:
            meta["val"].append([step, evaluate(state.params)])
        if step % loop.ckpt_every == 0 or step == loop.stop:
            save_state(manager, state, meta)
        progress(step, loop.steps, loss, meta, time.perf_counter() - began)
    sys.stderr.write("\n")
    return state


def progress(step: int, total: int, loss: float, meta: dict, seconds: float) -> None:
    """A one-line bar on stderr, rewritten in place: this step's loss, the last validation."""
    done = 30 * step // total
    val = f" val {meta['val'][-1][1]:.3f}" if meta["val"] else ""
    sys.stderr.write(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{total} loss {loss:.3f}{val} "
                     f"{seconds:.0f}s")
