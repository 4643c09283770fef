"""jaxkv: KV-cached transformer decoding in JAX."""

from jaxkv.audio import load_audio, log_mel
from jaxkv.cache import KVCache, init_cache
from jaxkv.checkpoint import load, save
from jaxkv.config import Config, EncoderConfig
from jaxkv.convert import CheckpointError
from jaxkv.decoder import decode_step, extend, forward, prefill
from jaxkv.encoder import encode
from jaxkv.generate import generate
from jaxkv.params import Params, cast, init_params
from jaxkv.sampling import SamplingParams, sample, sampling_params
from jaxkv.tokenizer import apply_chat_template, chat_template, load_tokenizer
from jaxkv.tracecount import TRACE_COUNTS as trace_counts

__all__ = [
    "CheckpointError", "Config", "EncoderConfig", "KVCache", "Params", "SamplingParams",
    "apply_chat_template", "cast", "chat_template", "decode_step", "encode", "extend", "forward",
    "generate", "init_cache", "init_params", "load", "load_audio", "load_tokenizer", "log_mel",
    "prefill", "sample", "sampling_params", "save", "trace_counts",
]
