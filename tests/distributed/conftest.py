"""Shared runs for the distributed tests: each layout is trained once per session, on demand.

Every run is the real CLI (`suite pretrain ... launch.nproc_per_node=N`), 10 steps of a tiny model
on the tiny corpus, global batch 16, checkpoints at steps 5 and 10, so that equivalence, memory
and resume tests can share runs instead of training the same layout twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import TINY_MODEL, run_suite

STEPS = 10
GLOBAL_BATCH = 16
COMMON = [
    "train.log_every=1",
    "train.save_every=5",
    "train.eval_every=10",
    "train.eval_batches=2",
    f"parallel.global_batch_size={GLOBAL_BATCH}",
    "parallel.micro_batch_size=4",
    # large steps from the first one (no long warm-up), so every parameter's update is measurable
    # and a wrong gradient shows in the next loss (tests/helpers.py: assert_equivalent)
    "optim.lr=3e-3",
    "sched.warmup_steps=1",
    "train.save_grads_step=1",  # first-step gradients, compared tensor by tensor
]
# A Llama-family tiny model: RoPE, RMSNorm, SwiGLU, grouped-query attention (4 heads, 2 KV heads).
LLAMA = ["recipe=llama-tiny", "model.num_kv_heads=2", "model.ffn_hidden_size=128"]

# name -> (processes, overrides). Micro-batch 4 everywhere: 4 micro-batches per step in one
# process, 2 per rank with 2 data-parallel ranks, 1 with 4.
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "dp2": (2, ["parallel.dp=2"]),
    # every rank a fresh interpreter, as before the fork server (suite/launch/fork_server.py, the CPU default)
    "dp2-spawn": (2, ["parallel.dp=2", "launch.worker_start=spawn"]),
    "sharding2-stage1": (2, ["parallel.sharding=2", "parallel.sharding_stage=1"]),
    "sharding2-stage2": (2, ["parallel.sharding=2", "parallel.sharding_stage=2"]),
    "sharding2-stage3": (2, ["parallel.sharding=2", "parallel.sharding_stage=3"]),
    # explicit FSDP2 prefetching changes when parameters are gathered, never what is computed
    "sharding2-stage3-prefetch": (
        2,
        [
            "parallel.sharding=2",
            "parallel.sharding_stage=3",
            "parallel.fsdp_forward_prefetch=1",
            "parallel.fsdp_backward_prefetch=2",
        ],
    ),
    "sharding2-offload": (2, ["parallel.sharding=2", "parallel.sharding_stage=3", "parallel.offload=true"]),
    # the chunked loss (128 tokens per micro-batch in chunks of 24) reads FSDP's root-held head weight
    "sharding2-stage3-chunked-loss": (
        2,
        ["parallel.sharding=2", "parallel.sharding_stage=3", "train.loss_chunk_tokens=24"],
    ),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "dp2-tp2": (4, ["parallel.dp=2", "parallel.tp=2"]),
    "sharding2-tp2": (4, ["parallel.sharding=2", "parallel.tp=2", "parallel.sp=true"]),
    "sharding4-stage3": (4, ["parallel.sharding=4", "parallel.sharding_stage=3"]),
    # micro-batch 2: two micro-batches per rank, so HSDP's once-per-step all-reduce across dp is exercised
    "hsdp": (
        4,
        ["parallel.dp=2", "parallel.sharding=2", "parallel.sharding_stage=3", "parallel.micro_batch_size=2"],
    ),
    # train.param_dtype=bf16: the optimizer's fp32 masters (one process) vs FSDP2's MixedPrecisionPolicy
    "single-bf16-params": (1, ["train.precision=bf16", "train.param_dtype=bf16"]),
    "sharding2-bf16-params": (2, ["parallel.sharding=2", "train.precision=bf16", "train.param_dtype=bf16"]),
    # no data parallelism: the fp32 masters live in the optimizer, as DTensor shards (tp) or per stage (pp)
    "tp2-bf16-params": (2, ["parallel.tp=2", "train.precision=bf16", "train.param_dtype=bf16"]),
    "pp2-bf16-params": (2, ["parallel.pp=2", "train.precision=bf16", "train.param_dtype=bf16"]),
    "llama-single": (1, LLAMA),
    "llama-tp2": (2, [*LLAMA, "parallel.tp=2"]),
    "llama-tp2-sp": (2, [*LLAMA, "parallel.tp=2", "parallel.sp=true"]),
    # fused wqkv / w13 (GQA: 2 kv heads, one whole group per rank) against the unfused reference
    "llama-tp2-fused": (2, [*LLAMA, "parallel.tp=2", "model.fused_projections=true"]),
    # compiled blocks (train.compile=true): under tp the first block's input must not be a view of
    # the embedding's DTensor; under cp the blocks compile around the eager cp attention
    "llama-tp2-compile": (2, [*LLAMA, "parallel.tp=2", "train.compile=true"]),
    "llama-cp2-compile": (2, [*LLAMA, "parallel.cp=2", "train.compile=true"]),
    # every pipeline stage runs context-parallel attention: micro-batches carry each rank's chunks
    "llama-cp2-pp2": (4, [*LLAMA, "parallel.cp=2", "parallel.pp=2"]),
}


def pretrain(
    run_dir: Path, data: Path, nproc: int, *overrides: str, steps: int = STEPS, timeout: float = 420
) -> Path:
    """One real `suite pretrain` on `nproc` local processes; fails the test with its output on error."""
    run_suite(
        "pretrain",
        *TINY_MODEL,
        f"data.path={data}",
        f"run.dir={run_dir}",
        *COMMON,
        f"train.max_steps={steps}",
        *overrides,
        f"launch.nproc_per_node={nproc}",
        timeout=timeout,
        check=True,
    )
    return run_dir


@pytest.fixture(scope="session")
def layout_run(tiny_data, tmp_path_factory):
    """layout_run(name) -> run dir of that layout's 10-step run (trained on first request)."""
    root = tmp_path_factory.mktemp("layouts")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            nproc, overrides = LAYOUTS[name]
            done[name] = pretrain(root / name, tiny_data, nproc, *overrides)
        return done[name]

    return get


def reference_name(name: str) -> str:
    return "llama-single" if name.startswith("llama") else "single"
