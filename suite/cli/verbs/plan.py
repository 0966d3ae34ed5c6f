"""`suite plan`: every parallel layout of a recipe on a cluster, ranked by the cost model."""

from __future__ import annotations

from suite.cli.common import _expand, _report
from suite.config.compose import compose_config, to_object
from suite.verb import Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    """The cost model's ranked layouts for the recipe on the cluster group (suite/plan/): composed
    without resolve_auto, whose answers are this machine's, not the cluster's."""
    cfg = to_object(compose_config(_expand(overrides)))
    explain = next((f.split("=", 1)[1] for f in flags if f.startswith("--explain=")), None)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.plan.command import run_plan

    result, text = run_plan(cfg, explain)
    return _report(flags, result, text)


HELP = """usage: suite plan [recipe=NAME|PATH.yaml] [cluster={clusters}] [cluster.nodes=N] [key=value ...]
       [--json] [--explain LAYOUT]

The cost model (suite/plan/, docs/planner.md): every parallel layout of the cluster's world size
(cluster.nodes x cluster.devices_per_node) that the trainer accepts - dp, sharding and its ZeRO stage,
offload, tp with sequence parallelism, pp with its schedule and virtual stages, cp, ep, micro-batch,
recompute - is costed for one step of the recipe (model, data.seq_len, parallel.global_batch_size,
train.precision): memory per device (weights, gradients, optimizer state, activations) and step time
(compute, tp/cp/ep/data-parallel communication, pipeline bubble and sends, optimizer). Layouts that do
not fit are dropped; the rest are ranked by step time, with tokens/s, TFLOP/s per device and MFU, and
the reasons the winner wins. The recipe's own parallel.* keys are ignored (except the global batch).
--explain LAYOUT prints one layout's parts (a name from the table, e.g. dp4-tp8sp-pp12-mb1-full:
dpN, shNz1|z2|z3[off], tpN[sp], ppN[vV][gpipe|zb], cpN, epN, mbN, sel|attn|full).
Nothing is allocated, nothing is launched.

Keys: cluster=OPTION  cluster.nodes=N  cluster.devices_per_node=N  cluster.memory_gib=X
      cluster.compute_efficiency=X  cluster.inter_node_bandwidth_gbs=X  (every cluster.* key)
      data.seq_len=N  parallel.global_batch_size=N  train.precision=bf16|fp32  train.param_dtype=fp32|bf16

Examples:
  suite plan recipe=gpt13b cluster=h100-80g cluster.nodes=4
  suite plan recipe=gpt175b cluster=a100-80g cluster.nodes=16 --json
  suite plan recipe=gpt13b cluster=h100-80g cluster.nodes=4 --explain sh2z1-tp8sp-pp2-mb1-full"""


VERB = register(
    Verb(
        name="plan",
        summary="rank every parallel layout by the cost model: suite plan recipe=gpt13b cluster=h100-80g cluster.nodes=4",
        help=HELP,
        run=run,
        unused=("ckpt", "generate", "export", "prune", "finetune", "distill", "eval", "align"),
        section="tools",
        valued_flags={"--explain": "--explain dp4-tp8sp-pp12-mb1-full"},
    )
)
