"""jaxkv: KV-cached transformer decoding in JAX."""

from jaxkv.audio import load_audio, log_mel
from jaxkv.batching import generate_many, iter_many, iter_tokens
from jaxkv.cache import KVCache, init_cache
from jaxkv.checks import OutOfRange, set_value_checks
from jaxkv.checkpoint import load, save
from jaxkv.config import Config, EncoderConfig
from jaxkv.convert import CheckpointError
from jaxkv.decoder import decode_step, extend, forward, prefill
from jaxkv.encoder import encode
from jaxkv.generate import generate
from jaxkv.locate import default_model, default_whisper
from jaxkv.multidecode import (Forest, Prefix, accept, accept_branch, accept_node, beam_search,
                               build_forest, decode_branches, forest_logits, forest_pass,
                               generate_branches, make_prefix, score_continuations)
from jaxkv.params import Params, cast, init_params
from jaxkv.quant import Int8, quantize
from jaxkv.sampling import SamplingParams, sample, sampling_params
from jaxkv.speculative import speculative_generate
from jaxkv.stops import StopStrings, stop_strings
from jaxkv.stream import stream
from jaxkv.tokenizer import apply_chat_template, chat_template, load_tokenizer
from jaxkv.tracecount import TRACE_COUNTS as trace_counts

__all__ = [
    "CheckpointError", "Config", "EncoderConfig", "Forest", "Int8", "KVCache", "OutOfRange",
    "Params", "Prefix", "SamplingParams", "StopStrings", "accept", "accept_branch",
    "accept_node", "apply_chat_template", "beam_search", "build_forest", "cast",
    "chat_template", "decode_branches", "decode_step", "default_model", "default_whisper",
    "encode", "extend", "forest_logits", "forest_pass", "forward", "generate",
    "generate_branches", "generate_many", "init_cache", "init_params", "iter_many",
    "iter_tokens", "load", "load_audio", "load_tokenizer", "log_mel", "make_prefix", "prefill",
    "quantize", "sample", "sampling_params", "save", "score_continuations", "set_value_checks",
    "speculative_generate", "stop_strings", "stream", "trace_counts",
]
