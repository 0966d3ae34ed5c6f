"""Parallelism applied from outside the models: degrees, mesh, parallelize."""

from suite.parallel.dims import ParallelDims

__all__ = ["ParallelDims"]
