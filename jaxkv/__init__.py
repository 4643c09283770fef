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

# The public names and the module each lives in, imported when first used: `import jaxkv` (and
# the command line's --help) does not import JAX until a name is asked for.
PUBLIC = {
    "jaxkv.core.cache": "KVCache",
    "jaxkv.core.checks": "OutOfRange set_value_checks",
    "jaxkv.core.config": "Config EncoderConfig",
    "jaxkv.core.decoder": "decode_step extend forward init_cache prefill",
    "jaxkv.core.encoder": "encode",
    "jaxkv.core.hooks": "Hooks",
    "jaxkv.core.params": "Params cast init_params",
    "jaxkv.core.quant": "quantize",
    "jaxkv.decoding.batching": "generate_many iter_many iter_tokens",
    "jaxkv.decoding.beam": "beam_search",
    "jaxkv.decoding.generate": "generate",
    "jaxkv.decoding.likelihood": "loglikelihood_many loglikelihood_rolling",
    "jaxkv.decoding.multidecode": "Forest Prefix accept accept_branch accept_node build_forest "
                                  "decode_branches forest_logits forest_pass generate_branches "
                                  "make_prefix score_continuations",
    "jaxkv.decoding.sampling": "SamplingParams sample sampling_params",
    "jaxkv.decoding.speculative": "speculative_generate",
    "jaxkv.decoding.stops": "StopStrings stop_strings",
    "jaxkv.formats.audio": "load_audio log_mel",
    "jaxkv.formats.load": "load",
    "jaxkv.formats.locate": "default_model default_whisper",
    "jaxkv.formats.saved": "save",
    "jaxkv.formats.tokenizer": "apply_chat_template chat_template load_tokenizer",
    "jaxkv.front.stream": "stream",
    "jaxkv.models.maps": "CheckpointError",
    "jaxkv.ops.arrays": "Int8",
}
WHERE = {name: module for module, names in PUBLIC.items() for name in names.split()}
WHERE["trace_counts"] = "jaxkv.core.tracecount"  # its TRACE_COUNTS

# Modules the documentation names by these short paths (jaxkv.stops.cut, jaxkv.train.fit, ...);
# jaxkv.lm_eval imports the harness, so it is left out of __all__.
SHORT_PATHS = {f"jaxkv.{m.rpartition('.')[2]}": m for m in (
    "jaxkv.core.sharding", "jaxkv.decoding.constraints", "jaxkv.decoding.stops",
    "jaxkv.front.chat", "jaxkv.front.jsonl",
    "jaxkv.front.transcribe", "jaxkv.training.train", "jaxkv.front.lm_eval")}


class _ShortPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import jaxkv.chat`, `from jaxkv.lm_eval import JaxkvLM`: a short path imports the
    module it names (the same module object), as attribute access does."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in SHORT_PATHS else None

    def create_module(self, spec):
        return importlib.import_module(SHORT_PATHS[spec.name])

    def exec_module(self, module):
        pass


LAYERS = ("ops", "core", "models", "formats", "decoding", "front", "training")


def submodules(package: str):
    """A package's module __getattr__: its modules as attributes, each imported when first
    used (jaxkv.core.decoder works after `import jaxkv` alone)."""
    def __getattr__(name):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    return __getattr__


if not any(isinstance(f, _ShortPaths) for f in sys.meta_path):
    sys.meta_path.append(_ShortPaths())


def __getattr__(name):
    """A public name or short-path module, imported when first used (then kept here)."""
    if name in WHERE:
        value = getattr(importlib.import_module(WHERE[name]),
                        "TRACE_COUNTS" if name == "trace_counts" else name)
    elif f"jaxkv.{name}" in SHORT_PATHS:
        value = importlib.import_module(SHORT_PATHS[f"jaxkv.{name}"])
    elif name in LAYERS:  # jaxkv.core.decoder ... after `import jaxkv` alone
        value = importlib.import_module(f"jaxkv.{name}")
    else:
        raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})


__all__ = sorted([*WHERE, *(p.rpartition(".")[2] for p in SHORT_PATHS if p != "jaxkv.lm_eval")])
