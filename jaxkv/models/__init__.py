"""Model families: each file holds one family's config reading (config.json keys and defaults,
GGUF metadata) and weight name maps; this registry says which reads what. Adding a family is
its file, a line here, and its tests; the format readers stay in checkpoint.py."""

from jaxkv import submodules
from jaxkv.models import (gemma, gpt2, gptneox, llama, mistral, mixtral, olmo2, olmoe, phi3, qwen,
                          qwen3moe, t5, whisper)
from jaxkv.models.common import Family

__getattr__ = submodules(__name__)

# Hugging Face config.json "architectures"[0] -> its reader
HF_ARCHITECTURES = {
    "GPT2LMHeadModel": Family(gpt2.hf_config, gpt2.hf_map),
    "GPTNeoXForCausalLM": Family(gptneox.hf_config, gptneox.hf_map),
    "LlamaForCausalLM": Family(llama.hf_config, llama.hf_map),
    "Qwen2ForCausalLM": Family(qwen.qwen2_config, llama.hf_map),
    "Qwen3ForCausalLM": Family(qwen.qwen3_config, llama.hf_map),
    "MistralForCausalLM": Family(mistral.hf_config, llama.hf_map),
    "MixtralForCausalLM": Family(mixtral.hf_config, mixtral.hf_map),
    "Qwen3MoeForCausalLM": Family(qwen3moe.hf_config, qwen3moe.hf_map),
    "OlmoeForCausalLM": Family(olmoe.hf_config, olmoe.hf_map),
    "Olmo2ForCausalLM": Family(olmo2.hf_config, olmo2.hf_map),
    "Phi3ForCausalLM": Family(phi3.hf_config, phi3.hf_map),
    "Gemma2ForCausalLM": Family(gemma.gemma2_config, gemma.hf_map),
    "Gemma3ForCausalLM": Family(gemma.gemma3_config, gemma.hf_map),
    "T5ForConditionalGeneration": Family(t5.hf_config, t5.hf_map),
    "WhisperForConditionalGeneration": Family(whisper.hf_config, whisper.hf_map),
}

# GGUF general.architecture (llama.cpp's names) -> its reader
GGUF_ARCHITECTURES = {
    "llama": Family(llama.gguf_config, llama.gguf_map),
    "qwen2": Family(qwen.qwen2_gguf_config, qwen.gguf_map),
    "qwen3": Family(qwen.qwen3_gguf_config, qwen.gguf_map),
    "gemma2": Family(gemma.gemma2_gguf_config, gemma.gguf_map),
    "gemma3": Family(gemma.gemma3_gguf_config, gemma.gguf_map),
    "gptneox": Family(gptneox.gguf_config, gptneox.gguf_map),
    "olmo2": Family(olmo2.gguf_config, olmo2.gguf_map),
    "phi3": Family(phi3.gguf_config, phi3.gguf_map),
    "qwen3moe": Family(qwen3moe.gguf_config, qwen3moe.gguf_map),
    "olmoe": Family(olmoe.gguf_config, olmoe.gguf_map),
}

# CTranslate2 model.bin spec name -> its reader
CT2_SPECS = {
    "WhisperSpec": Family(whisper.ct2_config, whisper.ct2_map),
}
