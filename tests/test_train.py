"""Training (jaxkv.train and the two training scripts): resuming from a checkpoint is bitwise the
run straight through; a seed fixes parameters and samples; a trained model samples each row as
it would alone; save/load is bitwise; the encoder-decoder task learns; run records are complete.
"""

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.training import train
import training_run  # scripts/

ROOT = Path(__file__).resolve().parents[1]
CONFIG = jaxkv.Config.llama(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=64, max_seq_len=32)
# What train_lm.py makes of TINY_LM's flags: its runs and this file's compute the same steps.
OPTIM = train.OptimConfig(steps=8, learning_rate=3e-3, warmup_steps=2, final_lr=3e-3 / 10)
TINY_LM = ["--steps", "8", "--warmup", "2", "--eval-every", "4", "--ckpt-every", "4",
           "--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--d-ff", "64",
           "--batch", "4", "--seq-len", "32", "--sample-len", "16"]
TEXT = b"First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
PROMPTS = [list(b"All:\n"), list(b"First Citizen"), list(b"Sp")]


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """(path of a small text file, its training bytes, its validation bytes)."""
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_bytes(TEXT * 64)
    return path, *script("train_lm").load_bytes(path)


def fit(state, text, ckpt_dir, stop, meta=None):
    """Trains the tiny model as train_lm.py with TINY_LM would, to step `stop` -> (state, meta)."""
    _, data, val = text
    meta = meta or train.new_meta({})
    loop = train.Loop(OPTIM.steps, stop, ckpt_every=4, eval_every=4)
    val_batches = train.lm_windows(val, 4, 32)
    state = train.fit(state, lambda key, i: train.lm_batch(data, key, i, 4, 32), train.lm_loss,
                      OPTIM, loop, lambda params: train.mean_loss(params, val_batches,
                                                                  train.lm_loss),
                      train.checkpoint_manager(ckpt_dir), meta)
    return state, meta


def leaves(state):
    """Every array of a TrainState, the PRNG key as its raw data."""
    return jax.tree.leaves(state.replace(key=jax.random.key_data(state.key)))


def assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(leaves(a), leaves(b)):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.fixture(scope="module")
def trained(text, tmp_path_factory):
    """(state, meta) of the tiny model after 8 steps straight through."""
    return fit(train.init_state(CONFIG, 0, OPTIM), text, tmp_path_factory.mktemp("straight"), 8)


def test_stop_restore_go_on_equals_straight_through(text, trained, tmp_path):
    fit(train.init_state(CONFIG, 0, OPTIM), text, tmp_path, 4)
    # A state of another seed: every value must come from the checkpoint.
    resumed, meta = train.restore_state(train.checkpoint_manager(tmp_path),
                                        train.init_state(CONFIG, 1, OPTIM))
    assert int(resumed.step) == int(resumed.data_pos) == 4
    resumed, meta = fit(resumed, text, tmp_path, 8, meta)
    assert_bitwise(resumed, trained[0])
    assert meta == trained[1]  # the loss curves too


def test_same_seed_same_params_and_samples(text, trained, tmp_path):
    again, _ = fit(train.init_state(CONFIG, 0, OPTIM), text, tmp_path, 8)
    assert_bitwise(again, trained[0])
    options = dict(temperature=1.0, key=jax.random.key(3))
    ours, _ = jaxkv.generate(trained[0].params, PROMPTS, 16, **options)
    theirs, _ = jaxkv.generate(again.params, PROMPTS, 16, **options)
    np.testing.assert_array_equal(ours, theirs)


def test_trained_model_samples_rows_as_alone(trained):
    params = trained[0].params
    keys = jax.random.split(jax.random.key(5), 3)
    batch, _ = jaxkv.generate(params, PROMPTS, 16, temperature=1.0, key=keys)
    for b, prompt in enumerate(PROMPTS):
        alone, _ = jaxkv.generate(params, [prompt], 16, temperature=1.0, key=keys[b:b + 1])
        np.testing.assert_array_equal(alone[0], batch[b])


def test_save_load_is_bitwise(trained, tmp_path):
    params = trained[0].params
    jaxkv.save(params, tmp_path)
    loaded = jaxkv.load(tmp_path)
    assert loaded.config == params.config
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def test_train_lm_stopped_then_resumed_in_a_new_process(text, trained, tmp_path):
    """train_lm.py --stop-at 4, then --resume in a fresh process, ends where the library run
    straight through ends: the same parameters and loss curves; its saved model loads back."""
    flags = [*TINY_LM, "--data", str(text[0]), "--out", str(tmp_path / "out"),
             "--ckpt-dir", str(tmp_path / "ckpt"), "--model-dir", str(tmp_path / "model")]
    assert script("train_lm").main([*flags, "--stop-at", "4"]) is None
    env = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    subprocess.run([sys.executable, ROOT / "scripts" / "train_lm.py", *flags, "--resume"],
                   check=True, capture_output=True, env=env, cwd=ROOT)
    record = json.loads((tmp_path / "out" / "run_record.json").read_text())
    state, meta = trained
    assert record["params_sha256"] == training_run.tree_sha256(state.params)
    assert record["results"]["curves"] == {"train": meta["train"], "val": meta["val"]}
    assert training_run.tree_sha256(jaxkv.load(tmp_path / "model")) == record["params_sha256"]
    assert_run_record(record)


def assert_run_record(record):
    assert {"config", "seed", "versions", "device_kind", "platform", "params_sha256",
            "sample_sha256", "results"} <= set(record)
    assert set(record["versions"]) == {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
                                       "numpy"}
    assert record["device_kind"] == jax.devices()[0].device_kind
    assert train.DETERMINISTIC in record["xla_flags"].split()  # the scripts set it first thing
    assert all(len(record[k]) == 64 for k in ("params_sha256", "sample_sha256"))
    json.dumps(record)


def test_deterministic_adds_its_flag_once(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    train.deterministic()
    train.deterministic()
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {train.DETERMINISTIC}"
    monkeypatch.delenv("XLA_FLAGS")
    train.deterministic()
    assert os.environ["XLA_FLAGS"] == train.DETERMINISTIC


def test_training_on_a_gpu_without_the_flag_warns(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.warns(UserWarning, match="xla_gpu_deterministic_ops=true in XLA_FLAGS: two runs"):
        train.warn_if_nondeterministic()
    monkeypatch.setenv("XLA_FLAGS", train.DETERMINISTIC)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train.warn_if_nondeterministic()


def test_seq2seq_task_batches():
    s2s = script("train_seq2seq")
    batch = s2s.make_batch(np.array([[2, 3, 4, 5] + [0] * 8]), np.array([4]))
    assert batch.tokens.tolist() == [[0, 5, 4, 3, 2, 1] + [0] * 8]
    assert batch.mask.tolist() == [[True] * 5 + [False] * 8]
    sources, lengths = s2s.random_sources(np.random.default_rng(0), 512)
    held_out = {row.tobytes() for row in sources[:256]}
    drawn = s2s.training_batch(jax.random.key(0), 3, 256, held_out)
    assert not {row.tobytes() for row in np.asarray(drawn.encoder_inputs)} & held_out
    again = s2s.training_batch(jax.random.key(0), 3, 256, held_out)
    np.testing.assert_array_equal(drawn.tokens, again.tokens)


def test_seq2seq_short_run_learns_and_decodes(tmp_path):
    s2s = script("train_seq2seq")
    record = s2s.main(["--steps", "60", "--warmup", "10", "--eval-every", "20",
                       "--ckpt-every", "60", "--batch", "32", "--test-size", "32",
                       "--d-model", "32", "--heads", "4", "--d-ff", "64", "--layers", "1",
                       "--encoder-layers", "1", "--out", str(tmp_path / "out"),
                       "--ckpt-dir", str(tmp_path / "ckpt")])
    val = [loss for _, loss in record["results"]["curves"]["val"]]
    assert val[-1] < val[0] < np.log(s2s.VOCAB)
    assert 0 <= record["results"]["held_out_exact_match"] <= 1  # the cached decode path ran
    assert_run_record(record)
