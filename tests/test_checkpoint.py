"""Loading Hugging Face checkpoints (parity with transformers) and jaxkv's own save/load."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import jaxkv
from jaxkv.core import quant
from jaxkv.formats import gguf as gguf_format
from jaxkv.formats import saved
from jaxkv.models.maps import tensor_shapes
from jaxkv.ops.arrays import Int8, dequantize_rows
from tests.conftest import CONFIGS, encoder_inputs, finish_gguf, random_tokens

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


@pytest.mark.parametrize("chunk_bytes", [1 << 10, 1 << 30])
def test_leaves_in_chunks_of_any_size_load_bitwise(tmp_path, llama, monkeypatch, chunk_bytes):
    """A leaf is stored in chunks of at most CHUNK_BYTES (a process reading its share decodes
    little more than the share); saves whose chunks are whole leaves (as jaxkv wrote them
    before) load the same."""
    monkeypatch.setattr(saved, "CHUNK_BYTES", chunk_bytes)
    jaxkv.save(llama, tmp_path / "m")
    store = saved._store(str(tmp_path / "m" / "params"), "embed", llama.embed)
    chunk = store.chunk_layout.read_chunk.shape
    assert chunk == llama.embed.shape if chunk_bytes > llama.embed.nbytes else (
        np.prod(chunk) * llama.embed.dtype.itemsize <= chunk_bytes), chunk
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 llama, jaxkv.load(tmp_path / "m"))


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


def test_gguf_reader_reads_what_gguf_reads(tmp_path):
    """checkpoint's reader (gguf's, over a plain view of the file: faster) parses every field and
    tensor as gguf.GGUFReader does: strings, arrays of strings and numbers, Q8_0 and float32."""
    import gguf

    path, q8_0 = str(tmp_path / "fields.gguf"), gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(["a", "bc", "\u2202x"])
    writer.add_token_scores([0.5, -1.0, 2.0])
    writer.add_block_count(3)
    writer.add_tensor("q", gguf.quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32)
                                                .reshape(2, 64), q8_0), raw_dtype=q8_0)
    writer.add_tensor("f", np.arange(6, dtype=np.float32).reshape(2, 3))
    finish_gguf(writer)
    ours, theirs = gguf_format.gguf_reader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for a, b in zip(ours.fields.values(), theirs.fields.values()):
        assert (a.types, a.data) == (b.types, b.data) and a.contents() == b.contents()
    assert [t.name for t in ours.tensors] == ["q", "f"] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.data_offset == b.data_offset
        np.testing.assert_array_equal(a.data, b.data)


# ---- GGUF Q8_0 loaded as int8 ---------------------------------------------------------------

def write_q8_0_gguf(path, float_names=()):
    """A llama GGUF for CONFIGS['llama_gqa'] (untied head, Q/K rows in llama.cpp's order), random
    weights; every matrix Q8_0 except those in float_names (float32), norms float32."""
    import gguf

    from jaxkv.models import llama

    config, rng = CONFIGS["llama_gqa"], np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(block_count=3, context_length=128, embedding_length=64,
                           feed_forward_length=96, head_count=4, head_count_kv=2,
                           layer_norm_rms_eps=1e-5, vocab_size=97).items():
        getattr(writer, f"add_{key}")(value)
    for name, shape in sorted(tensor_shapes(config, llama.gguf_map(config)).items()):
        w = rng.normal(size=shape).astype(np.float32) * 0.1
        if w.ndim == 2 and name not in float_names:
            writer.add_tensor(name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, w if w.ndim == 2 else 1 + 0.1 * w)
    finish_gguf(writer)
    return path


@pytest.fixture(scope="module")
def q8_0_gguf(tmp_path_factory):
    return write_q8_0_gguf(tmp_path_factory.mktemp("q8_0") / "tiny-q8_0.gguf")


def test_q8_0_loads_as_int8_blocks_equal_to_gguf_dequantize(q8_0_gguf):
    """Every matrix an Int8 with one scale per 32 inputs whose values are exactly those of
    gguf.dequantize, rows moved as the float load moves them (llama.cpp's Q/K order undone,
    Q/K/V and gate/up fused)."""
    ints, floats = jaxkv.load(q8_0_gguf, int8=True), jaxkv.load(q8_0_gguf)
    for ours in quant.MATRICES:
        for w, f in zip(leaves_named(ints, ours), leaves_named(floats, ours)):
            assert isinstance(w, Int8) and w.q.dtype == np.int8
            assert w.scale.shape == (w.shape[0], w.shape[1] // 32) and w.scale.dtype == np.float32
            np.testing.assert_array_equal(dequantize_rows(w.q, w.scale), f)


def leaves_named(params, ours: str) -> list:
    """The leaves of params at quant.MATRICES name ours ('blocks.wo': one per layer; none for
    experts in a dense model)."""
    if ours.startswith("blocks."):
        leaves = (getattr(b, ours.removeprefix("blocks.")) for b in params.blocks)
        return [w for w in leaves if w is not None]
    return [getattr(params, ours)]


def test_q8_0_int8_decodes_as_the_dequantized_float_model(q8_0_gguf):
    ints, floats = jaxkv.load(q8_0_gguf, int8=True), jaxkv.load(q8_0_gguf)
    tokens_BT = random_tokens(5, (2, 16))
    reference_BTV = jaxkv.forward(floats, tokens_BT)
    cache = jaxkv.init_cache(ints, 2, 16)
    logits_BV, cache = jaxkv.prefill(ints, cache, tokens_BT[:, :6])
    np.testing.assert_allclose(logits_BV, reference_BTV[:, 5], atol=1e-5, rtol=0)
    step = jax.jit(jaxkv.decode_step)
    for t in range(6, 16):  # batch 2: one int8 loop per row
        logits_BV, cache = step(ints, cache, tokens_BT[:, t], jax.numpy.full(2, t))
        np.testing.assert_allclose(logits_BV, reference_BTV[:, t], atol=1e-5, rtol=0)
    prompts = random_tokens(6, (1, 5)).tolist()
    np.testing.assert_array_equal(jaxkv.generate(ints, prompts, 24)[0],
                                  jaxkv.generate(floats, prompts, 24)[0])


def test_q8_0_blocks_are_never_dequantized(q8_0_gguf, monkeypatch):
    """No float copy of a Q8_0 matrix is made: gguf.dequantize only sees the norms."""
    import gguf

    seen = []
    dequantize = gguf.dequantize
    monkeypatch.setattr(gguf, "dequantize", lambda data, kind: seen.append(kind) or
                        dequantize(data, kind))
    jaxkv.load(q8_0_gguf, int8=True)
    assert seen and set(seen) == {gguf.GGMLQuantizationType.F32}


def test_float_matrices_of_a_q8_0_file_are_quantized(tmp_path):
    """A float32 head gets one scale per row (as jaxkv.quantize); a float32 up projection fused
    with a Q8_0 gate is quantized in blocks of 32 like its partner."""
    path = write_q8_0_gguf(tmp_path / "mixed.gguf", ("output.weight", "blk.1.ffn_up.weight"))
    ints, floats = jaxkv.load(path, int8=True), jaxkv.load(path)
    assert ints.lm_head.scale.shape == (97, 1)
    reference = quant.quantize_matrix(floats.lm_head)
    np.testing.assert_array_equal(ints.lm_head.q, reference.q)
    np.testing.assert_array_equal(ints.lm_head.scale, reference.scale)
    w_in, f_in = ints.blocks[1].w_in, floats.blocks[1].w_in
    assert w_in.scale.shape == (192, 2)
    np.testing.assert_array_equal(dequantize_rows(w_in.q, w_in.scale)[0::2], f_in[0::2])  # gate
    up = quant.quantize_blocks_np(np.asarray(f_in[1::2]), 2)
    np.testing.assert_array_equal(w_in.q[1::2], up.q)


def test_int8_load_of_other_formats_quantizes(tmp_path, llama):
    jaxkv.save(llama, tmp_path / "model")
    loaded, reference = jaxkv.load(tmp_path / "model", int8=True), jaxkv.quantize(llama)
    jax.tree.map(np.testing.assert_array_equal, loaded, reference)


def test_int8_must_be_a_bool(q8_0_gguf):
    with pytest.raises(TypeError, match="load: int8 must be True or False, got 'yes'"):
        jaxkv.load(q8_0_gguf, int8="yes")


def test_int8_blocks_with_a_transposing_map_are_refused():
    """GPT-2 stores [in, out]: turning that around would break the 32-input blocks."""
    from jaxkv.models import maps as convert
    from jaxkv.models import gpt2

    config, rng = CONFIGS["gpt2"], np.random.default_rng(0)
    name_map = gpt2.name_map(config)
    shapes = {part.name.format(i=i): part.shape for e in name_map.values()
              for part in getattr(e, "parts", (e,)) if part.name for i in range(3)}

    def get_tensor(name):  # every matrix in blocks of 32, as a Q8_0 file would hold it
        w = rng.normal(size=shapes[name]).astype(np.float32)
        return quant.quantize_blocks_np(w, w.shape[1] // 32) if w.ndim == 2 else w

    with pytest.raises(jaxkv.CheckpointError, match="attn.c_attn.weight.*can only have their "
                                                    "rows reordered"):
        convert.build_params(config, name_map, get_tensor, "gpt2.bin", int8=True)


def test_a_save_with_gate_up_rows_one_by_one_loads_in_todays_blocks(tmp_path):
    """jaxkv.save wrote a gated w_in's gate and up rows one by one before it wrote
    gate_up_block (now blocks of 128 units where d_ff allows): such a save loads as the same
    model."""
    from jaxkv.core.params import gate_up_block

    config = dataclasses.replace(CONFIGS["llama_gqa"], d_ff=256)
    params = jaxkv.init_params(config, jax.random.key(3))
    assert gate_up_block(config.d_ff) == 128
    F, D = config.d_ff, config.d_model
    unit_by_unit = lambda w: w.reshape(F // 128, 2, 128, D).swapaxes(0, 1).reshape(  # noqa: E731
        2, F, D).swapaxes(0, 1).reshape(2 * F, D)
    old = params.replace(blocks=tuple(b.replace(w_in=unit_by_unit(b.w_in))
                                      for b in params.blocks))
    jaxkv.save(old, tmp_path / "old")
    meta_file = tmp_path / "old" / saved.SAVED_CONFIG
    meta = json.loads(meta_file.read_text())
    del meta["gate_up_block"]
    meta_file.write_text(json.dumps(meta))
    saved._write_manifest(str(tmp_path / "old"), [saved.SAVED_CONFIG, *saved._files_under(
        str(tmp_path / "old"), "params")])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, jaxkv.load(tmp_path / "old"))


@pytest.mark.parametrize("block, dtype", [(None, None), (32, None), (None, "bfloat16")])
def test_int8_params_save_and_load_as_they_were(tmp_path, llama, block, dtype):
    """A save of jaxkv.quantize's params loads as those params (int8 numbers and scales,
    bitwise); loaded in another dtype, the numbers stay int8 and only the scales turn."""
    params = jaxkv.quantize(llama, block=block)
    jaxkv.save(params, tmp_path / "int8")
    loaded = jaxkv.load(tmp_path / "int8", dtype=dtype)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    assert isinstance(loaded.blocks[0].wqkv, Int8) and loaded.blocks[0].wqkv.q.dtype == np.int8
    expected = params if dtype is None else jaxkv.cast(params, dtype)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 expected, loaded)
