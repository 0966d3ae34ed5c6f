"""Plain single-device models; suite.parallel rewrites them for every layout."""

from suite.models.transformer import (
    KVCache,
    Transformer,
    build_model,
    flops_per_token,
    materialize,
    num_params,
)

__all__ = ["KVCache", "Transformer", "build_model", "flops_per_token", "materialize", "num_params"]
