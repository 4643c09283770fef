"""Training: losses, AdamW, a resumable TrainState (jaxkv.training.train)."""

from jaxkv import submodules

__getattr__ = submodules(__name__)
