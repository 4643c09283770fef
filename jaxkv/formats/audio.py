"""Audio for Whisper: reading files, resampling to 16 kHz, and log-mel features computed with
the same filter bank and log / clamp / normalize steps as Whisper's reference."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core import checks

SAMPLE_RATE = 16000
N_FFT = 400  # 25 ms window
HOP = 160  # 10 ms hop
CHUNK_SECONDS = 30
N_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS  # 480000 samples -> 3000 frames


def load_audio(path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples at sample_rate from a wav / flac / ogg file (soundfile + soxr).
    A missing path or a directory is an error naming it (libsndfile would say "System
    error.")."""
    import soundfile
    import soxr

    sample_rate = checks.int_arg(sample_rate, "sample_rate")
    if isinstance(path, (str, os.PathLike)):  # (soundfile also reads open files)
        if not os.path.exists(path):
            raise FileNotFoundError(f"load_audio: no such audio file: {os.fspath(path)!r}")
        if os.path.isdir(path):
            raise IsADirectoryError(f"load_audio: {os.fspath(path)!r} is a directory, not an "
                                    "audio file")
    samples, rate = soundfile.read(path, dtype="float32", always_2d=True)
    samples = samples.mean(axis=1)
    if rate != sample_rate:
        samples = soxr.resample(samples, rate, sample_rate).astype(np.float32)
    return samples


def hz_to_mel(f):
    """Slaney's mel scale (librosa's default, used by Whisper): linear to 1 kHz, then log."""
    f = np.asarray(f, np.float64)
    linear = f / (200.0 / 3)
    log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log, linear)


def mel_to_hz(m):
    m = np.asarray(m, np.float64)
    linear = m * (200.0 / 3)
    log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0))
    return np.where(m >= 15.0, log, linear)


@functools.lru_cache(maxsize=4)
def mel_filters(n_mels: int = 80, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE):
    """Triangular mel filters [n_mels, n_fft // 2 + 1] with Slaney area normalization."""
    fft_hz = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    mel_hz = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2))
    ramps = mel_hz[:, None] - fft_hz[None, :]
    widths = np.diff(mel_hz)
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_hz[2:] - mel_hz[:-2]))[:, None]
    return weights.astype(np.float32)


def log_mel(audio, n_mels: int = 80):
    """Whisper's log-mel features [n_mels, 3000] of one clip (or [B, n_mels, 3000] of [B, n]).

    The clip is padded with silence to 30 s; longer audio is an error (no long-form splitting).
    """
    x = np.asarray(audio, np.float32) if not isinstance(audio, jax.Array) else audio
    if x.ndim not in (1, 2):
        raise ValueError(f"audio must be samples [n] or a batch [B, n], got shape "
                         f"{tuple(x.shape)}")
    n = x.shape[-1]
    if n == 0:
        raise ValueError("audio is empty: expected at least one sample")
    checks.finite(x, "audio", "samples")
    if n > N_SAMPLES:
        raise ValueError(f"audio is {n / SAMPLE_RATE:.1f} s long; Whisper takes at most "
                         f"{CHUNK_SECONDS} s per window and long-form splitting is not "
                         "implemented: cut the audio into pieces of at most 30 s")
    pad = [(0, 0)] * (x.ndim - 1) + [(0, N_SAMPLES - n)]
    return _log_mel(jnp.pad(jnp.asarray(x), pad), n_mels)


@functools.partial(jax.jit, static_argnames="n_mels")
def _log_mel(samples, n_mels):
    # STFT with a periodic Hann window, centred frames (reflect padding), as torch.stft does.
    padded = jnp.pad(samples, [(0, 0)] * (samples.ndim - 1) + [(N_FFT // 2, N_FFT // 2)],
                     mode="reflect")
    n_frames = 1 + (padded.shape[-1] - N_FFT) // HOP
    index_FW = HOP * jnp.arange(n_frames)[:, None] + jnp.arange(N_FFT)[None, :]
    window_W = 0.5 - 0.5 * jnp.cos(2 * jnp.pi * jnp.arange(N_FFT) / N_FFT)
    spectrum = jnp.fft.rfft(padded[..., index_FW] * window_W, axis=-1)
    power_FK = jnp.abs(spectrum[..., :-1, :]) ** 2  # Whisper drops the last frame
    mel_CF = jnp.einsum("CK,...FK->...CF", mel_filters(n_mels), power_FK,
                        precision=jax.lax.Precision.HIGHEST)
    log_CF = jnp.log10(jnp.maximum(mel_CF, 1e-10))
    peak = log_CF.max(axis=(-2, -1), keepdims=True)
    return (jnp.maximum(log_CF, peak - 8.0) + 4.0) / 4.0
