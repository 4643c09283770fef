"""Trains a tiny T5-style encoder-decoder to reverse digit strings, reproducibly.

Sources are 4-12 random digits; the target is the same digits reversed, then EOS. A held-out
set of --test-size strings is drawn first and never trained on (training batches skip it). At
the end the held-out sources are decoded greedily with jaxkv.generate (the encoder and the
cross-attention K/V run once, then cached decode steps) and scored by exact match. Results,
loss-curve PNG and run record go to --out; orbax checkpoints of the whole TrainState to
--ckpt-dir (continue a stopped run with --resume).

  python scripts/train_seq2seq.py                 # the default run: a few minutes on 2 CPU cores
"""

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

import jaxkv
from jaxkv.training import train

import training_run  # scripts/

PAD, EOS, DIGIT0 = 0, 1, 2  # T5's convention: PAD is also the decoder's start token
VOCAB = DIGIT0 + 10
MIN_LEN, MAX_LEN = 4, 12
RUN_FLAGS = ("seed", "steps", "batch", "d_model", "layers", "encoder_layers", "heads", "d_ff",
             "lr", "warmup", "eval_every", "test_size")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="results, PNG, run record (default: the machine's folder "
                    "under results/, train_seq2seq)")
    training_run.add_run_flags(ap, steps=5000, lr=1e-2, warmup=100, every=500,
                        ckpt_dir="runs/train_seq2seq/ckpt")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--encoder-layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--test-size", type=int, default=2000, help="held-out strings")
    args = ap.parse_args(argv)
    if args.out is None:  # imported here: tests load this file without scripts/ on the path
        from bench_checks import results_dir
        args.out = f"{results_dir()}/train_seq2seq"
    return args


def model_config(args) -> jaxkv.Config:
    # 64 relative-position buckets keep every distance below 16 exact (T5's 32 merge distances
    # 8-11 into one bucket); max_source_len 16: generate pads encoder inputs to a bucket of 16.
    return jaxkv.Config.t5(vocab_size=VOCAB, d_model=args.d_model, n_layers=args.layers,
                           n_encoder_layers=args.encoder_layers, n_heads=args.heads,
                           head_dim=args.d_model // args.heads, d_ff=args.d_ff,
                           max_source_len=16, relative_buckets=64, eos_id=EOS)


def random_sources(rng: np.random.Generator, n: int):
    """(sources [n, MAX_LEN] of digit tokens, right-padded with PAD; lengths [n])."""
    lengths_n = rng.integers(MIN_LEN, MAX_LEN + 1, n)
    digits_nM = rng.integers(0, 10, (n, MAX_LEN)) + DIGIT0
    return np.where(np.arange(MAX_LEN) < lengths_n[:, None], digits_nM, PAD), lengths_n


def make_batch(sources_BM, lengths_B) -> train.Seq2SeqBatch:
    """Decoder tokens [start, reversed source, EOS, PAD...] and the target mask."""
    B = len(lengths_B)
    back_BM = lengths_B[:, None] - 1 - np.arange(MAX_LEN)
    reversed_BM = np.where(back_BM >= 0, np.take_along_axis(sources_BM, np.maximum(back_BM, 0),
                                                            axis=1), PAD)
    tokens_BT = np.concatenate([np.full((B, 1), PAD), reversed_BM, np.full((B, 1), PAD)], axis=1)
    tokens_BT[np.arange(B), lengths_B + 1] = EOS
    mask_BT = np.arange(MAX_LEN + 1) < (lengths_B + 1)[:, None]
    return train.Seq2SeqBatch(np.int32(sources_BM), np.int32(lengths_B), np.int32(tokens_BT),
                              mask_BT)


def training_batch(key, index, batch_size: int, held_out: set) -> train.Seq2SeqBatch:
    """Batch `index` of the stream: depends on (key, index) only, never holds a held-out source."""
    seed = np.asarray(jax.random.key_data(jax.random.fold_in(key, index)))
    sources, lengths = random_sources(np.random.default_rng(seed), 2 * batch_size)
    fresh = np.flatnonzero([row.tobytes() not in held_out for row in sources])[:batch_size]
    if len(fresh) < batch_size:
        raise RuntimeError(f"batch {index}: too few sources outside the held-out set")
    return make_batch(sources[fresh], lengths[fresh])


def decode(params, sources, lengths) -> np.ndarray:
    """Greedy outputs [n, MAX_LEN + 1] by jaxkv.generate: the encoder and the cross-attention
    K/V run once, then cached decode steps; after EOS a row holds EOS."""
    tokens, _ = jaxkv.generate(params, [[PAD]] * len(lengths), MAX_LEN + 1, eos_id=EOS,
                               encoder_inputs=sources, encoder_lengths=lengths)
    return np.asarray(tokens)


def exact_match(tokens, sources, lengths) -> float:
    """The fraction of outputs that are exactly the reversed digits + EOS."""
    expected = make_batch(sources, lengths)
    right = (tokens == expected.tokens[:, 1:]) | ~expected.mask
    return float(right.all(axis=1).mean())


def digits(row) -> str:
    return "".join(str(t - DIGIT0) for t in row if t >= DIGIT0)


def main(argv=None):
    train.deterministic()  # before the first computation: a seed fixes the run on a GPU too
    args = parse_args(argv)
    started = time.perf_counter()
    sources, lengths = random_sources(np.random.default_rng([args.seed, 1]), args.test_size)
    held_out = {row.tobytes() for row in sources}
    test_batches = [make_batch(sources[i:i + args.batch], lengths[i:i + args.batch])
                    for i in range(0, args.test_size - args.batch + 1, args.batch)]
    run = {name: getattr(args, name) for name in RUN_FLAGS}
    trained = training_run.train_from_flags(
        args, model_config(args), run,
        lambda key, i: training_batch(key, i, args.batch, held_out), train.seq2seq_loss,
        lambda params: train.mean_loss(params, test_batches, train.seq2seq_loss))
    if trained is None:
        return None
    state, meta = trained
    return finish(args, state.params, meta, sources, lengths, time.perf_counter() - started)


def finish(args, params, meta, sources, lengths, seconds):
    """Score the held-out set; write results, loss PNG and run record."""
    tokens = decode(params, sources, lengths)
    match = exact_match(tokens, sources, lengths)
    examples = [f"{digits(s)} -> {digits(t)}" for s, t in zip(sources[:4], tokens[:4])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    training_run.plot_losses(out / "loss.png", meta, "T5-style reversal of 4-12 digits")
    results = dict(steps=args.steps, seconds=round(seconds, 1), train_loss=meta["train"][-1][1],
                   held_out_loss=meta["val"][-1][1], held_out_exact_match=match,
                   held_out_size=args.test_size, examples=examples,
                   curves={"train": meta["train"], "val": meta["val"]})
    (out / "results.json").write_text(json.dumps(results, indent=2))
    record = training_run.run_record(vars(args), args.seed, params, tokens, results)
    (out / "run_record.json").write_text(json.dumps(record, indent=2))
    print("\n".join(examples))
    print(f"held-out exact match {match:.4f} ({args.test_size} strings) after {args.steps} steps, "
          f"{seconds:.0f} s")
    return record


if __name__ == "__main__":
    main()
