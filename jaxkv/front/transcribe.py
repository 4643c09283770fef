"""Speech to text with a Whisper model: log-mel features, the decoder prompt, greedy decoding."""

import numpy as np

from jaxkv.decoding.generate import generate
from jaxkv.formats.audio import load_audio, log_mel

MULTILINGUAL_VOCAB = 51865  # English-only Whisper models have one token fewer


def whisper_prompt(params, tokenizer, language: str = "en") -> list[int]:
    """<|startoftranscript|> [<|lang|> <|transcribe|>] <|notimestamps|>: the decoder's prefix."""
    ids = [params.config.decoder_start_id]
    if params.config.vocab_size >= MULTILINGUAL_VOCAB:
        for token in (f"<|{language}|>", "<|transcribe|>"):
            if tokenizer.token_to_id(token) is None:
                raise ValueError(f"the tokenizer has no {token} token")
            ids.append(tokenizer.token_to_id(token))
    ids.append(tokenizer.token_to_id("<|notimestamps|>"))
    return ids


def transcribe(params, tokenizer, clips, max_new_tokens: int = 224, **options) -> list[str]:
    """Texts of audio clips (file paths or 16 kHz float arrays, each at most 30 s), decoded
    together in one batch (greedy unless options say otherwise)."""
    if params.config.encoder is None or params.config.encoder.input != "audio":
        raise ValueError("transcribe needs a Whisper model (an encoder of audio)")
    audio = [load_audio(c) if isinstance(c, str) else np.asarray(c, np.float32) for c in clips]
    mel_BCF = np.stack([np.asarray(log_mel(a, params.config.encoder.n_mels)) for a in audio])
    prompt = whisper_prompt(params, tokenizer)
    tokens, lengths = generate(params, [prompt] * len(audio), max_new_tokens,
                               encoder_inputs=mel_BCF, eos_id=params.config.eos_id, **options)
    return [tokenizer.decode(row[:n].tolist(), skip_special_tokens=True).strip()
            for row, n in zip(np.asarray(tokens), np.asarray(lengths))]
