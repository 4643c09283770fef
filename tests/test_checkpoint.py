"""Loading Hugging Face checkpoints (parity with transformers) and jaxkv's own save/load."""

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import jaxkv
from tests.conftest import encoder_inputs, random_tokens

HF_NAMES = ["gpt2", "llama_gqa", "llama_mqa_bias"]
HF_ENCDEC = ["t5_relu", "t5_gated", "whisper"]


@pytest.mark.parametrize("name", HF_NAMES)
def test_logits_match_hugging_face(hf_models, name):
    model, path = hf_models[name]
    params = jaxkv.load(path)
    tokens_BT = np.asarray(random_tokens(0, (2, 24)))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens_BT)).logits.numpy()
    np.testing.assert_allclose(jaxkv.forward(params, tokens_BT), theirs, atol=1e-4, rtol=0)
    cache = jaxkv.init_cache(params, 2, 32)
    logits_BV, _ = jaxkv.prefill(params, cache, tokens_BT)
    np.testing.assert_allclose(logits_BV, theirs[:, -1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", HF_NAMES)
def test_greedy_tokens_match_hugging_face_generate(hf_models, name):
    model, path = hf_models[name]
    params = jaxkv.load(path)
    prompts = np.asarray(random_tokens(1, (2, 9)))
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompts), attention_mask=torch.ones(2, 9, dtype=int),
                                max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                pad_token_id=0)[:, 9:].numpy()
    ours, lengths = jaxkv.generate(params, prompts.tolist(), 32)
    np.testing.assert_array_equal(ours, theirs)
    assert lengths.tolist() == [32, 32]


def hf_encoder_kwargs(model, enc):
    key = "input_features" if "Whisper" in type(model).__name__ else "input_ids"
    return {key: torch.tensor(np.asarray(enc))}


@pytest.mark.parametrize("name", HF_ENCDEC)
def test_encoder_decoder_logits_match_hugging_face(hf_models, name):
    model, path = hf_models[name]
    params = jaxkv.load(path)
    enc = encoder_inputs(params.config, 0, 2)
    tokens_BT = np.asarray(random_tokens(1, (2, 12)))
    with torch.no_grad():
        theirs = model(**hf_encoder_kwargs(model, enc),
                       decoder_input_ids=torch.tensor(tokens_BT)).logits.numpy()
    ours = jaxkv.forward(params, tokens_BT, encoder_inputs=enc)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", HF_ENCDEC)
def test_encoder_decoder_greedy_matches_hugging_face(hf_models, name):
    from transformers import GenerationMixin

    model, path = hf_models[name]
    params = jaxkv.load(path)
    enc = encoder_inputs(params.config, 2, 2)
    start = params.config.decoder_start_id
    # The plain greedy loop (Whisper's own generate adds its prompts). use_cache=False:
    # transformers sizes T5's cache by the encoder's layer count, wrong when they differ.
    with torch.no_grad():
        theirs = GenerationMixin.generate(
            model, **hf_encoder_kwargs(model, enc), decoder_input_ids=torch.full((2, 1), start),
            max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
            use_cache=False)[:, 1:]
    ours, _ = jaxkv.generate(params, [[start]] * 2, 32, encoder_inputs=enc)
    np.testing.assert_array_equal(ours, theirs.numpy())


def test_save_load_round_trip_is_bitwise(tmp_path, llama):
    jaxkv.save(llama, tmp_path / "model")
    loaded = jaxkv.load(tmp_path / "model")
    assert loaded.config == llama.config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 llama, loaded)
    assert jax.tree.structure(loaded) == jax.tree.structure(llama)
    before, _ = jaxkv.generate(llama, [[3, 1, 4, 1, 5]], 12)
    after, _ = jaxkv.generate(loaded, [[3, 1, 4, 1, 5]], 12)
    np.testing.assert_array_equal(before, after)


def test_save_load_bfloat16_stays_bfloat16(tmp_path, gpt2):
    params = jaxkv.cast(gpt2, jax.numpy.bfloat16)
    jaxkv.save(params, tmp_path / "m")
    loaded = jaxkv.load(tmp_path / "m")
    assert loaded.embed.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(loaded.embed, np.float32),
                                  np.asarray(params.embed, np.float32))


def copy_hf(hf_models, name, tmp_path):
    path = tmp_path / name
    shutil.copytree(hf_models[name][1], path)
    return path


def test_unknown_architecture_is_an_error(hf_models, tmp_path):
    path = copy_hf(hf_models, "gpt2", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(jaxkv.CheckpointError, match="architecture 'BertForMaskedLM' is not "
                                                    "supported"):
        jaxkv.load(path)


@pytest.mark.parametrize("name, tensor", [("llama_gqa", "model.layers.2.self_attn.k_proj.weight"),
                                          ("gpt2", "transformer.ln_f.bias")])
def test_missing_tensor_is_named(hf_models, tmp_path, name, tensor):
    path = copy_hf(hf_models, name, tmp_path)
    weights = load_file(path / "model.safetensors")
    del weights[tensor]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(jaxkv.CheckpointError, match=f"missing tensor '{tensor}'"):
        jaxkv.load(path)


def test_misshapen_tensor_is_named(hf_models, tmp_path):
    path = copy_hf(hf_models, "llama_gqa", tmp_path)
    weights = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = weights[name][:, :-1].copy()
    save_file(weights, path / "model.safetensors")
    with pytest.raises(jaxkv.CheckpointError,
                       match=rf"tensor '{name}' has shape \(96, 63\), expected \(96, 64\)"):
        jaxkv.load(path)


def test_not_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a .gguf file nor a directory"):
        jaxkv.load(tmp_path)


def test_gpt2_checkpoint_without_lm_prefix(hf_models, tmp_path):
    """The original GPT-2 checkpoints name tensors 'h.0.attn...' without 'transformer.'."""
    path = copy_hf(hf_models, "gpt2", tmp_path)
    weights = load_file(path / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in weights.items()},
              path / "model.safetensors")
    reference = jaxkv.load(hf_models["gpt2"][1])
    jax.tree.map(np.testing.assert_array_equal, jaxkv.load(path), reference)
