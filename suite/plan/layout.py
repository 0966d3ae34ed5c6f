"""What is planned: a Job (model, sequence, global batch, precision, cluster) and a Layout (the
parallel degrees, schedule, micro-batch and recompute) with a short name that `--explain` parses back.

Validity reuses the trainer's own checks (suite.parallel.dims, suite.parallel.pipeline), so the
planner never proposes a layout `suite pretrain` would refuse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from suite.config.cluster import ClusterConfig
from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig, ParallelConfig, SuiteConfig
from suite.models.moe import expert_ffn_size
from suite.models.transformer import ffn_size
from suite.parallel.dims import ParallelDims, check_pipeline
from suite.runtime import auto_attention, auto_precision
from suite.train.muon import check_muon_dims

RECOMPUTE_NAMES = {"none": "", "core_attn": "sel", "full_attn": "attn", "full": "full"}
SCHEDULE_NAMES = {"1f1b": "", "gpipe": "gpipe", "interleaved_1f1b": "", "zero_bubble": "zb"}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class MuonJob:
    """optim=muon's keys the planner prices (Job.muon; suite.plan.muon_cost)."""

    exclude: tuple[str, ...]
    ns_steps: int
    ns_dtype: str  # fp32 | bf16


@dataclass(frozen=True)
class Job:
    """Everything about one training step that is not the layout."""

    model: ModelConfig
    cluster: ClusterConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16"  # compute dtype: fp32 | bf16 | fp16
    param_dtype: str = "fp32"  # what parameters (and gradients) are held in: fp32 | bf16
    reduce_bytes: int = 4  # bytes per gradient element in data-parallel reductions (suite: fp32)
    loss_chunk_tokens: int = 1024  # head + cross-entropy in chunks of this many tokens (0: all at once)
    fused_adamw: bool | None = None  # optim.fused (None: as the trainer decides per device and layout)
    muon: MuonJob | None = None  # optim=muon (None: AdamW on every parameter)

    @property
    def world(self) -> int:
        return self.cluster.nodes * self.cluster.devices_per_node

    @property
    def compute_bytes(self) -> int:
        return BYTES[self.precision]

    @property
    def param_bytes(self) -> int:
        return BYTES[self.param_dtype]

    @classmethod
    def from_config(cls, cfg: SuiteConfig) -> Job:
        """The job a composed recipe describes on its cluster group (which gives the world size, and
        settles the recipe's `auto` precision and attention for its device type, not this machine's)."""
        device = cfg.cluster.device_type
        precision = cfg.train.precision
        if precision == "auto":  # every GPU preset computes bf16 natively; a CPU: as the trainer decides
            precision = "bf16" if device == "cuda" else auto_precision("cpu")
        model = cfg.model
        if model.attention == "auto":
            model = replace(model, attention=auto_attention(device, precision, cfg.data.seq_len))
        return cls(
            model=model,
            cluster=cfg.cluster,
            seq_len=cfg.data.seq_len,
            global_batch=cfg.parallel.global_batch_size,
            precision=precision,
            param_dtype=cfg.train.param_dtype,
            reduce_bytes=4,  # suite.runtime.resolve_precision: reduce_dtype is always fp32
            loss_chunk_tokens=cfg.train.loss_chunk_tokens,
            fused_adamw=cfg.optim.fused,
            muon=_muon_job(cfg, "bf16" if device == "cuda" else auto_precision("cpu")),
        )


def _muon_job(cfg: SuiteConfig, native: str) -> MuonJob | None:
    """`native`: the auto precision of the cluster's device, which settles muon_ns_dtype=auto."""
    o = cfg.optim
    ns_dtype = ("bf16" if native == "bf16" else "fp32") if o.muon_ns_dtype == "auto" else o.muon_ns_dtype
    return MuonJob(tuple(o.muon_exclude), o.muon_ns_steps, ns_dtype) if o.name == "muon" else None


@dataclass(frozen=True)
class Layout:
    """One way to run the job: degrees multiply to the world size (ep borrows data ranks)."""

    dp: int = 1
    sharding: int = 1
    stage: int = 3  # ZeRO stage of `sharding` (1: optimizer state, 2: + gradients, 3: + parameters)
    offload: bool = False
    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: str = "1f1b"
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    recompute: str = "none"  # none | core_attn (selective) | full_attn | full

    @property
    def world(self) -> int:
        return self.dp * self.sharding * self.tp * self.pp * self.cp

    @property
    def data_ranks(self) -> int:
        return self.dp * self.sharding

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches each data-parallel rank runs per step."""
        return global_batch // (self.micro_batch * self.data_ranks)

    @property
    def name(self) -> str:
        """A short, parseable name: e.g. `dp4-tp8sp-pp12-mb1-full`, `sh64z3-tp2sp-mb2-sel`."""
        parts = []
        if self.dp > 1:
            parts.append(f"dp{self.dp}")
        if self.sharding > 1:
            parts.append(f"sh{self.sharding}z{self.stage}" + ("off" if self.offload else ""))
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("sp" if self.sp else ""))
        if self.pp > 1:
            vpp = f"v{self.vpp}" if self.vpp > 1 else ""
            parts.append(f"pp{self.pp}{vpp}{SCHEDULE_NAMES[self.schedule]}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"mb{self.micro_batch}")
        if self.recompute != "none":
            parts.append(RECOMPUTE_NAMES[self.recompute])
        return "-".join(parts)

    def parallel_config(self, global_batch: int) -> ParallelConfig:
        """The recipe keys (parallel.*) that run this layout."""
        return ParallelConfig(
            dp=self.dp,
            sharding=self.sharding,
            sharding_stage=self.stage,
            offload=self.offload,
            tp=self.tp,
            sp=self.sp,
            pp=self.pp,
            pp_schedule=self.schedule,
            vpp=self.vpp,
            cp=self.cp,
            ep=self.ep,
            micro_batch_size=self.micro_batch,
            global_batch_size=global_batch,
        )

    def overrides(self, global_batch: int) -> str:
        """The command-line overrides for `suite pretrain` that select this layout: every parallel key
        (a recipe's own values, e.g. sharding_stage, would otherwise stay) and the recompute group."""
        pc = self.parallel_config(global_batch)
        keys = (
            "dp", "sharding", "sharding_stage", "offload", "tp", "sp", "pp", "pp_schedule", "vpp", "cp", "ep",
            "micro_batch_size",
        )  # fmt: skip
        out = [f"parallel.{key}={str(getattr(pc, key)).lower()}" for key in keys]
        return " ".join([*out, f"recompute={self.recompute}"])


_TOKEN = re.compile(
    r"^(?:dp(?P<dp>\d+)|sh(?P<sh>\d+)z(?P<z>[123])(?P<off>off)?|tp(?P<tp>\d+)(?P<sp>sp)?"
    r"|pp(?P<pp>\d+)(?:v(?P<v>\d+))?(?P<sched>gpipe|zb)?|cp(?P<cp>\d+)|ep(?P<ep>\d+)|mb(?P<mb>\d+)"
    r"|(?P<rc>sel|attn|full))$"
)


def parse_layout(text: str) -> Layout:
    """The inverse of Layout.name (tokens in any order); a ConfigError names the token it cannot read."""
    fields: dict = {}
    for token in text.strip().split("-"):
        match = _TOKEN.match(token)
        if not match:
            raise ConfigError(
                f"--explain {text}: cannot read '{token}'; a layout is tokens joined by '-' like "
                "dp4-sh8z3off-tp8sp-pp12v2-cp2-ep8-mb1-full (see the names `suite plan` prints)"
            )
        g = {k: v for k, v in match.groupdict().items() if v is not None}
        if "dp" in g:
            fields["dp"] = int(g["dp"])
        if "sh" in g:
            fields.update(sharding=int(g["sh"]), stage=int(g["z"]), offload="off" in g)
        if "tp" in g:
            fields.update(tp=int(g["tp"]), sp="sp" in g)
        if "pp" in g:
            vpp = int(g.get("v", 1))
            sched = g.get("sched")
            schedule = {"gpipe": "gpipe", "zb": "zero_bubble"}.get(sched or "", "1f1b")
            if vpp > 1 and schedule == "1f1b":
                schedule = "interleaved_1f1b"
            fields.update(pp=int(g["pp"]), vpp=vpp, schedule=schedule)
        for key, name in (("cp", "cp"), ("ep", "ep"), ("mb", "micro_batch")):
            if key in g:
                fields[name] = int(g[key])
        if "rc" in g:
            fields["recompute"] = {v: k for k, v in RECOMPUTE_NAMES.items() if v}[g["rc"]]
    return Layout(**fields)


def check_layout(job: Job, layout: Layout) -> None:
    """ConfigError (one line) when the trainer would refuse `layout` for `job`: the degrees against
    the model and batch (ParallelDims.validate), the pipeline schedule (check_pipeline), the sequence
    splits of sp and cp, the MoE / expert-parallel rules, and the layouts optim=muon refuses."""
    if layout.world != job.world:
        raise ConfigError(
            f"layout {layout.name} uses {layout.world} devices but the cluster has {job.world} "
            f"(cluster.nodes={job.cluster.nodes} x cluster.devices_per_node={job.cluster.devices_per_node})"
        )
    pcfg = layout.parallel_config(job.global_batch)
    dims = ParallelDims(
        dp=layout.dp,
        sharding=layout.sharding,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        ep=layout.ep,
        world_size=layout.world,
    )
    dims.validate(pcfg, job.model)
    if job.muon is not None:
        check_muon_dims(dims, layout.offload)
    _check_model_splits(job, layout)
    check_pipeline(pcfg, dims, False)


def _check_model_splits(job: Job, layout: Layout) -> None:
    """The parts of ParallelDims.validate_run that depend on the model and sequence only."""
    m, tp, cp = job.model, layout.tp, layout.cp
    if tp > 1 and (m.vocab_size % tp or ffn_size(m) % tp):
        raise ConfigError(f"tp={tp} does not divide model.vocab_size or the MLP width")
    if tp > 1 and m.num_experts > 0 and expert_ffn_size(m) % tp:
        raise ConfigError(f"tp={tp} does not divide the expert MLP width")
    if layout.sp and job.seq_len % (tp * cp):
        raise ConfigError(f"sp with tp={tp} does not divide data.seq_len={job.seq_len}")
    dropping = m.num_experts > 0 and m.capacity_factor is not None
    if cp > 1 and (job.seq_len % (2 * cp) or dropping):
        raise ConfigError(f"cp={cp} needs seq_len % 2cp == 0 and no MoE capacity dropping")
    if layout.offload and (layout.sharding == 1 or layout.stage == 1):
        raise ConfigError("offload needs sharding > 1 at stage 2 or 3")
    # ep with ZeRO-1 keeps the expert state whole (suite.train.zero1), as rank_numel counts it; with
    # offload the experts' own FSDP group shards them over edp on the host (host bytes here count them
    # whole: an over-estimate of what leaves the device, which nothing is checked against)
    if layout.ep > 1 and (m.num_experts == 0 or m.num_experts % layout.ep or layout.data_ranks % layout.ep):
        raise ConfigError(f"ep={layout.ep} must divide model.num_experts and the data ranks")


def with_(layout: Layout, **changes) -> Layout:
    """A copy of `layout` with some fields changed (dataclasses.replace, named for call sites)."""
    return replace(layout, **changes)
