"""Inference: sampling with a KV cache."""
