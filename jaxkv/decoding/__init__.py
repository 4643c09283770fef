"""The decoding loops over the core: generate, continuous batching, speculative decoding,
MultiDecode forests and branches, beam search; the row state, sampling and stop strings they
share."""

from jaxkv import submodules

__getattr__ = submodules(__name__)
