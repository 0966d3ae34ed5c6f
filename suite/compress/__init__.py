"""Compression: `suite quantize` (post-training quantization through torchao), measured before and after.

methods.py   the compress.method table and applying one to a model
checks.py    the compress section's checks (run once, in the parent)
quantize.py  the verb: read, measure, quantize, write the run folder, measure again
report.py    what is measured and the table

The quantized checkpoint format (torchao tensors in safetensors) is suite.models.quantized, below
the model sources, so that generate and eval read it without importing this package.
"""
