"""Training: losses, AdamW, a resumable TrainState (jaxkv.training.train)."""
