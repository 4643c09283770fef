"""Mistral: Llama whose every layer reads a sliding window: config.json keys and defaults.
Weights use Llama's names (llama.hf_map)."""

from jaxkv.core.config import Config
from jaxkv.models import llama
from jaxkv.models.common import window, with_defaults

# transformers' MistralConfig defaults
HF_DEFAULTS = dict(intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=None, hidden_act="silu",
                   max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, rope_theta=10000.0,
                   tie_word_embeddings=False, sliding_window=4096, bos_token_id=1,
                   eos_token_id=2)


def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    """Every layer windowed (sliding_window null: none)."""
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "hidden_size"), source)
    return llama.rope_decoder_config(hf, source, **window(hf, 0))
