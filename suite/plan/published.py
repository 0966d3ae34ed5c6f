"""Published training runs the cost model is checked against (tests/unit/test_plan_validation.py,
bench/plan_validation.py, docs/planner.md).

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC '21), Table 2: GPT models with sequence length 2048 and vocabulary 51200 on DGX
A100 nodes (8 GPUs, NVLink/NVSwitch, 8 x 200 Gb/s HDR InfiniBand), mixed precision, activation
recompute; achieved TFLOP/s per GPU counted with their eq. (3) (suite.plan.flops.narayanan_flops).

How each system maps onto suite's layouts (the only per-system settings; nothing is set per row):
- PTD-P (Megatron-LM): tp x pp x dp with 1F1B, micro-batch 1, full recompute. Its scatter/gather
  pipeline sends (1/t of an activation per tp rank) equal suite's sends under sequence parallelism,
  and its tp all-reduces take the time of sp's all-gather + reduce-scatter, so the layout is taken
  with sp on. Gradients all-reduced in fp16 (2 bytes).
- ZeRO-3 (DeepSpeed): parameters, gradients and optimizer state sharded over all GPUs, no model
  parallelism, the global batch split with no accumulation (micro-batch = batch / GPUs), full
  recompute, fp16 gathers and reduce-scatters.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from suite.config.cluster import ClusterConfig
from suite.config.schema import ModelConfig
from suite.plan.layout import Job, Layout


@dataclass(frozen=True)
class PublishedRun:
    system: str
    model: str  # 175B | 530B
    gpus: int
    global_batch: int
    tflops_per_gpu: float  # as published
    layout: Layout


GPT_175B = ModelConfig(
    name="gpt3-175b",
    family="gpt",
    num_layers=96,
    hidden_size=12288,
    num_heads=96,
    vocab_size=51200,
    max_seq_len=2048,
)
GPT_530B = ModelConfig(
    name="gpt-530b",
    family="gpt",
    num_layers=105,
    hidden_size=20480,
    num_heads=128,
    vocab_size=51200,
    max_seq_len=2048,
)
MODELS = {"175B": GPT_175B, "530B": GPT_530B}


def _ptdp(model: str, gpus: int, batch: int, pp: int, tflops: float) -> PublishedRun:
    layout = Layout(dp=gpus // (8 * pp), tp=8, sp=True, pp=pp, micro_batch=1, recompute="full")
    return PublishedRun("PTD-P", model, gpus, batch, tflops, layout)


def _zero3(gpus: int, tflops: float) -> PublishedRun:
    layout = Layout(sharding=gpus, stage=3, micro_batch=1536 // gpus, recompute="full")
    return PublishedRun("ZeRO-3", "175B", gpus, 1536, tflops, layout)


NARAYANAN_2021_TABLE_2 = (
    _ptdp("175B", 384, 1536, 12, 153),
    _ptdp("175B", 768, 1536, 12, 149),
    _ptdp("175B", 1536, 1536, 12, 141),
    _ptdp("530B", 560, 2240, 35, 171),
    _ptdp("530B", 1120, 2240, 35, 167),
    _ptdp("530B", 2240, 2240, 35, 159),
    _zero3(384, 144),
    _zero3(768, 88),
    _zero3(1536, 44),
)


def job_of(run: PublishedRun, cluster: ClusterConfig) -> Job:
    """The run's job on `cluster` (a DGX A100 preset) with as many nodes as the run had GPUs / 8."""
    nodes = run.gpus // cluster.devices_per_node
    return Job(
        model=MODELS[run.model],
        cluster=replace(cluster, nodes=nodes),
        seq_len=2048,
        global_batch=run.global_batch,
        precision="bf16",  # fp16 then: the same peak and bytes
        param_dtype="bf16",  # fp16 weights and gradients, fp32 master copies and Adam moments
        reduce_bytes=2,
    )
