"""What the training scripts share besides jaxkv.train: their flags, a driver that trains from
them (fresh or resumed), loss plots, and run records (config, seed, versions, checksums)."""

import hashlib
import importlib.metadata
import os
import platform

import jax
import numpy as np

from jaxkv.training import train

VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def plot_losses(path, meta: dict, title: str) -> None:
    """The train and validation curves of meta to a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("train", "val"):
        if meta[name]:
            ax.plot(*zip(*meta[name]), label=name, marker="." if name == "val" else None)
    ax.set(xlabel="step", ylabel="loss (nats / token)", title=title, yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_run_flags(ap, *, steps: int, lr: float, warmup: int, every: int, ckpt_dir: str) -> None:
    """The flags every training script takes: schedule, checkpoints, stop and resume."""
    ap.add_argument("--ckpt-dir", default=ckpt_dir, help="orbax TrainState checkpoints")
    ap.add_argument("--steps", type=int, default=steps, help="optimizer steps (the schedule)")
    ap.add_argument("--stop-at", type=int, help="end this run after this step (default --steps)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--eval-every", type=int, default=every)
    ap.add_argument("--ckpt-every", type=int, default=every)


def train_from_flags(args, config, run: dict, next_batch, loss_fn, evaluate):
    """Trains config as add_run_flags' flags say (fresh, or --resume from the latest checkpoint,
    up to --stop-at) -> (state, meta); None, after saying how to go on, when the run stopped
    before --steps. run: the settings a resumed run must share (see jaxkv.train.start)."""
    optim = train.OptimConfig(steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup,
                        final_lr=args.lr / 10)
    loop = train.Loop(args.steps, args.stop_at or args.steps, args.ckpt_every, args.eval_every)
    manager = train.checkpoint_manager(args.ckpt_dir)
    state, meta = train.start(config, args.seed, optim, manager, run, args.resume)
    state = train.fit(state, next_batch, loss_fn, optim, loop, evaluate, manager, meta)
    manager.close()
    if int(state.step) < args.steps:
        print(f"stopped at step {int(state.step)} of {args.steps}; go on with --resume")
        return None
    return state, meta


def tree_sha256(tree) -> str:
    """sha256 over the raw bytes of every leaf, in tree order."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def run_record(config: dict, seed: int, params, sample_tokens, results: dict) -> dict:
    """What reproduces a run and what it gave: config, seed, versions, device, checksums."""
    device = jax.devices()[0]
    return dict(
        config=config, seed=seed,
        versions={name: importlib.metadata.version(name) for name in VERSIONED},
        python=platform.python_version(), os=platform.platform(),
        device_kind=device.device_kind, platform=device.platform,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        params_sha256=tree_sha256(params),
        sample_sha256=hashlib.sha256(np.asarray(sample_tokens, np.int32).tobytes()).hexdigest(),
        results=results)
