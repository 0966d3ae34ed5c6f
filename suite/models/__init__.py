"""Plain single-device models; suite.parallel rewrites them for every layout."""

# the model families: each registers itself in suite.models.family (add a family here, one line)
from suite.models import deepseek_v3, gpt, llama, qwen3  # noqa: F401
from suite.models.transformer import (
    KVCache,
    Transformer,
    build_model,
    flops_per_token,
    materialize,
    num_params,
)

__all__ = ["KVCache", "Transformer", "build_model", "flops_per_token", "materialize", "num_params"]
