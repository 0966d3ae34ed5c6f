"""fp8 training (`train.precision=fp8`): torchao's float8 training recipe on the meta-device model.

Before the model is placed (first thing in suite.parallel.parallelize, so the trainer and the
benchmarks' standalone step both get it), torchao.float8.convert_to_float8_training swaps each eligible nn.Linear
for a Float8Linear: its matmuls (forward and both backward products) cast their inputs to float8
with dynamic per-tensor scales and run on the fp8 tensor cores; everything else (attention,
norms, the loss) runs in bf16 autocast, as with train.precision=bf16. Parameters, optimizer state
and checkpoints stay as they are (the swap keeps parameter names), so a run resumes or exports
like a bf16 one. Left in bf16: the output head (its logits feed the loss directly; fp8 there costs
accuracy for little time) and any Linear whose dimensions are not multiples of 16 (the fp8 GEMM's
alignment). Needs CUDA compute capability 8.9+ (Ada L4/L40S, Hopper H100/H200), checked by
suite.runtime.check_precision before anything starts.
"""

from __future__ import annotations

from torch import nn

from suite.models.quantized import quiet_torchao

SKIPPED_NAMES = ("head", "lm_head", "output")


def float8_eligible(module: nn.Module, name: str) -> bool:
    if not isinstance(module, nn.Linear):
        return True  # containers: descend
    if name.rsplit(".", 1)[-1] in SKIPPED_NAMES:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def prepare_float8(model: nn.Module, precision) -> list[str]:
    """Swap `model`'s eligible Linear layers for torchao Float8Linear when `precision` (a
    suite.runtime.PrecisionPolicy) asks for fp8; returns their names (none otherwise)."""
    if not precision.float8:
        return []
    quiet_torchao()
    # deferred: torchao costs ~1-2 s to import; only train.precision=fp8 needs it
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and float8_eligible(m, n)]
    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=float8_eligible)
    return names
