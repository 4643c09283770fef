"""Qwen2 / Qwen2.5 (Llama with q/k/v biases) and Qwen3 (Llama with per-head q/k RMSNorm and an
explicit head_dim): config.json keys and defaults, GGUF metadata (llama.cpp's qwen2, qwen3).
Weights use Llama's names; llama.cpp does not permute their Q/K rows."""

from jaxkv.core.config import Config
from jaxkv.models import llama
from jaxkv.models.common import window, with_defaults

# transformers' Qwen2Config / Qwen3Config defaults: q/k/v biases always (Qwen2) or as
# attention_bias says (Qwen3)
QWEN2_DEFAULTS = dict(intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, head_dim=None, hidden_act="silu",
                      max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
                      max_window_layers=28, bos_token_id=None, eos_token_id=None)
QWEN3_DEFAULTS = {**QWEN2_DEFAULTS, "head_dim": 128, "attention_bias": False}


def qwen2_config(hf: dict, source: str, tensor_names=()) -> Config:
    """Qwen2 / Qwen2.5: Llama with q/k/v biases (none on the output projection)."""
    hf = with_defaults(hf, QWEN2_DEFAULTS, ("vocab_size", "hidden_size"), source)
    return llama.rope_decoder_config(hf, source, attn_bias=True, attn_out_bias=False,
                                     **window(hf, hf["max_window_layers"]))


def qwen3_config(hf: dict, source: str, tensor_names=()) -> Config:
    """Qwen3: Llama with per-head RMSNorm of queries and keys."""
    hf = with_defaults(hf, QWEN3_DEFAULTS, ("vocab_size", "hidden_size"), source)
    return llama.rope_decoder_config(hf, source, attn_bias=hf["attention_bias"], qk_norm=True,
                                     **window(hf, hf["max_window_layers"]))


def qwen2_gguf_config(reader, source: str) -> Config:
    """llama.cpp's qwen2: q/k/v biases (blk.N.attn_q.bias ...); no sliding window (llama.cpp
    reads none for qwen2)."""
    return Config.llama(**llama.gguf_decoder_fields(reader, source), attn_bias=True,
                        attn_out_bias=False)


def qwen3_gguf_config(reader, source: str) -> Config:
    """llama.cpp's qwen3: per-head q/k norms (blk.N.attn_q_norm ...), head_dim from
    qwen3.attention.key_length, no biases."""
    return Config.llama(**llama.gguf_decoder_fields(reader, source), qk_norm=True)


def gguf_map(c: Config, tensor_names=()) -> dict:
    return llama.name_map(c, llama.GGUF_NAMES)
