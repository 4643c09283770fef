"""jaxkv: KV-cached transformer decoding in JAX.

The package in layers, each importing only those below it:
  ops/       the one door to a backend (XLA reference, CPU kernels)
  core/      the model: config, params, cache, attention, decoder, encoder
  models/    families: config keys and weight name maps
  formats/   checkpoints, tokenizers, audio
  decoding/  the loops: generate, batching, speculative, multidecode, beam search
  training/  losses, optimizer, resumable state
  front/     command line, JSONL jobs, chat, streaming, transcription
"""

import importlib
import importlib.abc
import importlib.util
import sys

from jaxkv.core.cache import KVCache
from jaxkv.core.checks import OutOfRange, set_value_checks
from jaxkv.core.config import Config, EncoderConfig
from jaxkv.core.decoder import decode_step, extend, forward, init_cache, prefill
from jaxkv.core.encoder import encode
from jaxkv.core.params import Params, cast, init_params
from jaxkv.core.quant import quantize
from jaxkv.core.tracecount import TRACE_COUNTS as trace_counts
from jaxkv.decoding.batching import generate_many, iter_many, iter_tokens
from jaxkv.decoding.beam import beam_search
from jaxkv.decoding.generate import generate
from jaxkv.decoding.likelihood import loglikelihood_many, loglikelihood_rolling
from jaxkv.decoding.multidecode import (Forest, Prefix, accept, accept_branch, accept_node,
                                        build_forest, decode_branches, forest_logits,
                                        forest_pass, generate_branches, make_prefix,
                                        score_continuations)
from jaxkv.decoding.sampling import SamplingParams, sample, sampling_params
from jaxkv.decoding.speculative import speculative_generate
from jaxkv.decoding.stops import StopStrings, stop_strings
from jaxkv.formats.audio import load_audio, log_mel
from jaxkv.formats.load import load
from jaxkv.formats.locate import default_model, default_whisper
from jaxkv.formats.saved import save
from jaxkv.formats.tokenizer import apply_chat_template, chat_template, load_tokenizer
from jaxkv.front.stream import stream
from jaxkv.models.maps import CheckpointError
from jaxkv.ops.arrays import Int8

# Modules the documentation names by these short paths (jaxkv.stops.cut, jaxkv.train.fit, ...).
from jaxkv.core import sharding  # noqa: E402,I001
from jaxkv.decoding import stops  # noqa: E402
from jaxkv.front import chat, jsonl, transcribe  # noqa: E402
from jaxkv.training import train  # noqa: E402

SHORT_PATHS = {f"jaxkv.{m.__name__.rpartition('.')[2]}": m.__name__
               for m in (sharding, stops, chat, jsonl, transcribe, train)}
SHORT_PATHS["jaxkv.lm_eval"] = "jaxkv.front.lm_eval"  # (imports the harness: only when used)


class _ShortPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import jaxkv.chat`, `from jaxkv.lm_eval import JaxkvLM`: a short path imports the
    module it names (the same module object), as attribute access does."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in SHORT_PATHS else None

    def create_module(self, spec):
        return importlib.import_module(SHORT_PATHS[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(f, _ShortPaths) for f in sys.meta_path):
    sys.meta_path.append(_ShortPaths())


def __getattr__(name):
    """jaxkv.lm_eval, the lm-evaluation-harness model, imported when first used."""
    if name == "lm_eval":
        return importlib.import_module(SHORT_PATHS["jaxkv.lm_eval"])
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")


__all__ = [
    "CheckpointError", "Config", "EncoderConfig", "Forest", "Int8", "KVCache", "OutOfRange",
    "Params", "Prefix", "SamplingParams", "StopStrings", "accept", "accept_branch",
    "accept_node", "apply_chat_template", "beam_search", "build_forest", "cast",
    "chat_template", "decode_branches", "decode_step", "default_model", "default_whisper",
    "encode", "extend", "forest_logits", "forest_pass", "forward", "generate",
    "chat", "generate_branches", "generate_many", "init_cache", "init_params", "iter_many",
    "iter_tokens", "jsonl", "load", "load_audio", "load_tokenizer", "log_mel",
    "loglikelihood_many", "loglikelihood_rolling", "make_prefix",
    "prefill", "quantize", "sample", "sampling_params", "save", "score_continuations",
    "set_value_checks", "sharding", "speculative_generate", "stop_strings", "stops", "stream",
    "trace_counts", "train", "transcribe",
]
