"""suite: train, finetune, compress and export transformer language models."""

__version__ = "0.1.0"
