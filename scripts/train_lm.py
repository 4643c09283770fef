"""Trains a small byte-level Llama-style model on Tiny Shakespeare, reproducibly.

The first 90% of the bytes train, the last 10% validate. AdamW with warmup + cosine decay and
gradient clipping; batch i is drawn from (seed, i) only, and the whole TrainState (params,
optimizer state, step, data position, PRNG key) is checkpointed with orbax every --ckpt-every
steps, so a run stopped and resumed with --resume gives bitwise the same model as one straight
through. At the end: a sample decoded with jaxkv.generate, the model saved with jaxkv.save (and
checked to load back bitwise), a loss-curve PNG and a run record (config, versions, device,
checksums). Small outputs go to --out; checkpoints and the saved model to --ckpt-dir / --model-dir.

  python scripts/train_lm.py                      # the default run: a few minutes on 2 CPU cores
  python scripts/train_lm.py --stop-at 300        # stop early (as if preempted) ...
  python scripts/train_lm.py --resume             # ... and go on from the latest checkpoint
"""

import argparse
import hashlib
import json
import time
from pathlib import Path

import jax
import numpy as np

import jaxkv
from jaxkv.training import train

import training_run  # scripts/

DATA = Path(__file__).resolve().parents[1] / "tests/data/tinyshakespeare.txt"
# Flags that change the numbers: a resumed run must use the same ones.
RUN_FLAGS = ("data", "seed", "steps", "batch", "seq_len", "d_model", "layers", "heads",
             "kv_heads", "d_ff", "lr", "warmup", "eval_every")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA), help="a text file, read as bytes")
    ap.add_argument("--out", help="loss PNG, run record, sample (default: the machine's folder "
                    "under results/, train_lm)")
    ap.add_argument("--model-dir", default="runs/train_lm/model", help="the final jaxkv.save")
    training_run.add_run_flags(ap, steps=600, lr=3e-3, warmup=50, every=200,
                        ckpt_dir="runs/train_lm/ckpt")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--d-ff", type=int, default=384)
    ap.add_argument("--prompt", default="ROMEO:")
    ap.add_argument("--sample-len", type=int, default=300, help="bytes to sample")
    ap.add_argument("--temperature", type=float, default=0.8)
    args = ap.parse_args(argv)
    if args.out is None:  # imported here: tests load this file without scripts/ on the path
        from bench_checks import results_dir
        args.out = f"{results_dir()}/train_lm"
    return args


def model_config(args) -> jaxkv.Config:
    return jaxkv.Config.llama(vocab_size=256, d_model=args.d_model, n_layers=args.layers,
                              n_heads=args.heads, n_kv_heads=args.kv_heads, d_ff=args.d_ff,
                              max_seq_len=args.seq_len)


def load_bytes(path: str):
    """(train, validation) uint8 arrays: the first 90% of the file's bytes, then the rest."""
    data = np.frombuffer(Path(path).read_bytes(), np.uint8)
    split = len(data) * 9 // 10
    return data[:split], data[split:]


def sample(params, args):
    """--sample-len bytes after --prompt, with a fixed key: (tokens, text).

    The model knows positions below --seq-len only, so jaxkv.generate runs in chunks of
    seq_len // 2 bytes, each continuing the last seq_len // 2 bytes (at most) so far.
    """
    chunk, prompt = args.seq_len // 2, list(args.prompt.encode())
    text = list(prompt)
    for i in range(-(-args.sample_len // chunk)):
        tokens, _ = jaxkv.generate(params, [text[-chunk:]], chunk, temperature=args.temperature,
                                   key=jax.random.fold_in(jax.random.key(args.seed), i))
        text += np.asarray(tokens[0]).tolist()
    tokens = np.asarray(text[len(prompt):len(prompt) + args.sample_len], np.int32)
    return tokens, (bytes(prompt) + bytes(tokens.astype(np.uint8))).decode(errors="replace")


def save_model(params, path):
    """jaxkv.save, then check jaxkv.load gives every leaf back bitwise."""
    jaxkv.save(params, path)
    loaded = jaxkv.load(path)
    same = jax.tree.structure(loaded) == jax.tree.structure(params) and all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)))
    if not same:
        raise RuntimeError(f"jaxkv.load({path!r}) differs from the params saved")


def main(argv=None):
    train.deterministic()  # before the first computation: a seed fixes the run on a GPU too
    args = parse_args(argv)
    started = time.perf_counter()
    train_bytes, val_bytes = load_bytes(args.data)
    data = jax.device_put(train_bytes)
    val_batches = train.lm_windows(val_bytes, args.batch, args.seq_len)
    run = {name: getattr(args, name) for name in RUN_FLAGS}
    trained = training_run.train_from_flags(
        args, model_config(args), run,
        lambda key, i: train.lm_batch(data, key, i, args.batch, args.seq_len), train.lm_loss,
        lambda params: train.mean_loss(params, val_batches, train.lm_loss))
    if trained is None:
        return None
    state, meta = trained
    return finish(args, state.params, meta, time.perf_counter() - started)


def finish(args, params, meta, seconds):
    """Sample, save and check the model, write the loss PNG, sample and run record."""
    tokens, text = sample(params, args)
    print(text)
    save_model(params, args.model_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sample.txt").write_text(text)
    training_run.plot_losses(out / "loss.png", meta, "byte-level Llama on Tiny Shakespeare")
    val = meta["val"][-1][1]
    results = dict(data_sha256=hashlib.sha256(Path(args.data).read_bytes()).hexdigest(),
                   steps=args.steps, seconds=round(seconds, 1), train_loss=meta["train"][-1][1],
                   val_loss=val, val_bits_per_byte=val / np.log(2), sample=text,
                   curves={"train": meta["train"], "val": meta["val"]})
    record = training_run.run_record(vars(args), args.seed, params, tokens, results)
    (out / "run_record.json").write_text(json.dumps(record, indent=2))
    print(f"validation loss {val:.3f} nats/byte ({val / np.log(2):.3f} bits/byte) after "
          f"{args.steps} steps, {seconds:.0f} s")
    return record


if __name__ == "__main__":
    main()
