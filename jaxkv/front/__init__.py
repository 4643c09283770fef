"""The front ends: the command line, JSONL data-set jobs, chat, streaming text, transcription."""

from jaxkv import submodules

__getattr__ = submodules(__name__)
