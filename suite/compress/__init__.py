"""Compression: `suite quantize` (post-training quantization through torchao) and `suite prune`
(structured pruning), measured before and after.

methods.py     applying the compress.method named to a model (which Linear layers; QAT's learned scales)
checks.py      the compress section's checks (run once, in the parent)
quantize.py    the verb: read, measure, quantize, write the run folder, measure again
prune.py       `suite prune`: the plan (what to keep), slicing the weights, the verb
importance.py  Minitron activation importance of MLP channels, heads, hidden channels and layers
report.py      what is measured and the table

The methods themselves are classes registered by name in suite.models.compression (with GPTQ's
algorithm, suite.models.gptq), below this package, because training needs their QAT half too. The
quantized checkpoint format (torchao tensors in safetensors) is suite.models.quantized, below the model
sources, so that generate and eval read it without importing this package.
"""
