"""Reading and writing what lies outside the model: checkpoints (one module per format),
tokenizers and chat templates, model locations, audio."""

from jaxkv import submodules

__getattr__ = submodules(__name__)
