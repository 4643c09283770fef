"""Log-mel features match Whisper's reference steps (as transformers' feature extractor does)."""

import os

import numpy as np
import pytest
import soundfile
from transformers import WhisperFeatureExtractor

import jaxkv
from jaxkv.formats import audio

JFK = os.path.join(os.path.dirname(__file__), "data", "jfk.flac")


def test_mel_filters_match_transformers():
    theirs = WhisperFeatureExtractor(feature_size=80).mel_filters.T
    np.testing.assert_allclose(audio.mel_filters(80), theirs, atol=1e-7, rtol=0)


def test_log_mel_matches_transformers():
    samples = jaxkv.load_audio(JFK)
    assert samples.dtype == np.float32 and samples.shape == (176000,)  # 11 s at 16 kHz
    theirs = WhisperFeatureExtractor(feature_size=80)(samples, sampling_rate=16000,
                                                      return_tensors="np").input_features[0]
    ours = np.asarray(jaxkv.log_mel(samples))
    assert ours.shape == (80, 3000)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_batched_log_mel_equals_one_by_one():
    rng = np.random.default_rng(0)
    clips = rng.normal(0, 0.1, (2, 32000)).astype(np.float32)
    batched = np.asarray(jaxkv.log_mel(clips))
    for b in range(2):
        np.testing.assert_allclose(batched[b], jaxkv.log_mel(clips[b]), atol=1e-6)


def test_load_audio_resamples_to_16k(tmp_path):
    rate, seconds, hz = 44100, 1.0, 440.0
    t = np.arange(int(rate * seconds)) / rate
    soundfile.write(tmp_path / "a.wav", np.stack([np.sin(2 * np.pi * hz * t)] * 2, 1), rate)
    samples = jaxkv.load_audio(tmp_path / "a.wav")
    assert samples.shape == (16000,)
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.argmax(spectrum) * 16000 / len(samples) - hz) <= 1.0


@pytest.mark.parametrize("samples, match", [
    (np.zeros((1, 2, 100)), r"audio must be samples \[n\] or a batch \[B, n\]"),
    (np.zeros((0,)), "audio is empty"),
    (np.zeros((16000 * 31,)), "audio is 31.0 s long; Whisper takes at most 30 s"),
    (np.array([0.0, np.nan, 1.0]), r"audio holds nan at \[1\]: samples must be finite"),
    (np.array([[0.0, 1.0], [np.inf, 0.0]]), r"audio holds inf at \[1, 0\]"),
])
def test_bad_audio_is_a_clear_error(samples, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.log_mel(samples)
