"""LoRA for the suite Transformer: low-rank adapters on chosen linear layers, base weights frozen.

    y = x W^T + b + (dropout(x) A^T) B^T * alpha / rank        A: [rank, in], B: [out, rank]

`apply_lora` swaps each targeted nn.Linear for a LoRALinear that keeps the base parameters under
their own names (`layers.0.attention.wq.weight`, `.bias`) and adds `wq.lora_a.weight` and
`wq.lora_b.weight`, so base checkpoints load into an adapted model unchanged. B starts at zero:
the adapted model computes exactly what the base model does until B moves.

Lifecycle (composes with meta-device building and parallelize):

    model = build_model(cfg.model)                  # meta device
    apply_lora(model, rank=8, alpha=16)             # adapters on meta too; base frozen
    ... parallelize / materialize / load base weights (these overwrite every parameter) ...
    init_lora(model, seed)                          # A seeded per name, B = 0 (after any init)

A's values depend only on (seed, parameter name), like Transformer.init_weights, so every layout
starts identical; init_lora handles DTensor parameters by writing each rank's piece of the full
value. Tensor parallelism: for a column-parallel base (wq/wk/wv/w1/w3), shard lora_b like the
weight (Shard(0)) and replicate lora_a; for a row-parallel base (wo/w2), shard lora_a on its input
dim (Shard(1)) and replicate lora_b — the LoRA term is then a partial sum exactly like the base
output and the existing all-reduce covers both.

Mixture-of-Experts layers: the routed experts' stacked weights (suite.models.moe.GroupedExperts,
w1/w3 [E, ffn, h], w2 [E, h, ffn]) get per-expert factors `experts.lora_a.w1` [E, rank, in] and
`experts.lora_b.w1` [E, out, rank], computed low-rank inside the grouped / padded / loop expert
compute and sharded with the experts under expert parallelism (dim 0). The targets w1/w2/w3 name
those weights wherever they are (dense MLPs, shared experts, routed experts, as PEFT's names do on
Mixtral); `experts` names the routed experts' weights alone. The router stays frozen.

Saving: `lora_state_dict` (adapters only, plain names) and `save_lora`/`load_lora` (safetensors +
lora.json with rank/alpha/targets). `merge_lora` folds B A * alpha/rank into the base weights and
puts plain nn.Linear modules back, so the state-dict keys are those of a plain model (for export).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from suite.config.errors import ConfigError
from suite.config.schema import LORA_TARGETS, LoRAConfig
from suite.models.moe import GroupedExperts

DEFAULT_TARGETS = LORA_TARGETS
# fused projections (model.fused_projections): one layer stands for several unfused names
FUSED_TARGETS = {"wqkv": ("wq", "wk", "wv"), "w13": ("w1", "w3")}
BLOCK_LINEARS = frozenset((*DEFAULT_TARGETS, *FUSED_TARGETS))
EXPERT_WEIGHTS = ("w1", "w2", "w3")  # GroupedExperts' stacked weights
EXPERTS_TARGET = "experts"  # every stacked expert weight, and nothing else
ADAPTER_FILE = "lora.safetensors"
ADAPTER_CONFIG = "lora.json"
# Name segments that wrappers (activation checkpointing, torch.compile, FSDP1) insert.
_WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.|$)")


def canonical(name: str) -> str:
    return _WRAPPERS.sub("", name).lstrip(".")


@dataclass(frozen=True)
class LoRASpec:
    rank: int = LoRAConfig.rank
    alpha: float = LoRAConfig.alpha
    dropout: float = LoRAConfig.dropout
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update. Parameter names: weight, bias,
    lora_a.weight, lora_b.weight (so the base weight keeps its checkpoint name)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.weight = base.weight
        self.bias = base.bias
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Linear(self.in_features, rank, bias=False, **factory)
        self.lora_b = nn.Linear(rank, self.out_features, bias=False, **factory)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = nn.functional.linear(x, self.weight, self.bias)
        if getattr(self, "lora_off", False):  # adapters_disabled: the base model alone
            return base
        return base + self.lora_b(self.lora_a(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """B A * alpha/rank, in fp32, shaped like `weight`."""
        return (self.lora_b.weight.float() @ self.lora_a.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha}"


class ParamCount(NamedTuple):
    trainable: int
    total: int

    @property
    def ratio(self) -> float:
        return self.trainable / max(1, self.total)


def _check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    tied = bool(getattr(getattr(model, "cfg", None), "tie_embeddings", False))
    # a family's own block linears too (MLA's wq_a, wq_b, wkv_a, wkv_b: suite/models/deepseek_v3)
    own = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in f".{name}"
    }
    allowed = set(BLOCK_LINEARS) | own | {EXPERTS_TARGET} | ({"output"} if not tied else set())
    unknown = [t for t in targets if t not in allowed]
    if unknown:
        why = (
            " (output is tied to the embedding: merging would change both)"
            if "output" in unknown and tied
            else ""
        )
        raise ConfigError(
            f"finetune.lora.target_modules has {unknown}{why}; choose from {', '.join(sorted(allowed))}"
        )


def _resolve_fused_targets(model: nn.Module, targets: tuple[str, ...]) -> set[str]:
    """Module names to adapt: a fused layer (wqkv, w13) is adapted when any name it replaces
    (wq/wk/wv, w1/w3) is a target and the model has no unfused layer of that name."""
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = set(targets)
    for fused, parts in FUSED_TARGETS.items():
        if fused in present and any(t in parts and t not in present for t in targets):
            chosen.add(fused)
    return chosen


def apply_lora(
    model: nn.Module,
    rank: int = LoRAConfig.rank,
    alpha: float = LoRAConfig.alpha,
    dropout: float = 0.0,
    target_modules: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
    seed: int = 0,
) -> nn.Module:
    """Wrap every nn.Linear whose last name segment is in `target_modules`; freeze everything else.

    On a model with fused projections, targeting any of wq/wk/wv adapts `wqkv` (all three) and
    any of w1/w3 (SwiGLU) adapts `w13`: one adapter over the fused output, as PEFT does for GPT-2's
    c_attn. Under tensor parallelism its lora_b is split like the fused weight (whole head groups).

    Works on a meta-device model (the adapters stay on meta until materialised; call init_lora
    afterwards). On a materialised model the adapters are initialised at once with `seed`.
    Returns the model (modified in place); `model.lora_spec` records the settings.
    """
    targets = tuple(target_modules)
    if rank < 1:
        raise ConfigError(f"finetune.lora.rank={rank} must be >= 1; e.g. 8")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"finetune.lora.dropout={dropout} must be in [0, 1)")
    if not targets:
        raise ConfigError("finetune.lora.target_modules is empty; e.g. [wq, wk, wv, wo, w1, w2, w3]")
    _check_targets(model, targets)
    if any(_adapted(m) for m in model.modules()):
        raise ValueError("apply_lora: the model already has LoRA adapters (merge_lora first)")
    chosen = _resolve_fused_targets(model, targets)
    swaps = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in chosen
    ]
    expert_names = (
        EXPERT_WEIGHTS if EXPERTS_TARGET in targets else tuple(w for w in EXPERT_WEIGHTS if w in chosen)
    )
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)] if expert_names else []
    if not swaps and not experts:
        raise ConfigError(f"finetune.lora.target_modules={list(targets)} match no linear layer of the model")
    for param in model.parameters():
        param.requires_grad_(False)
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module, rank, alpha, dropout))
    for module in experts:
        _add_expert_adapters(module, expert_names, rank, alpha, dropout)
    model.lora_spec = LoRASpec(rank, float(alpha), float(dropout), targets)
    if not any(p.is_meta for p in lora_parameters(model).values()):
        init_lora(model, seed)
    return model


def _adapted(module: nn.Module) -> bool:
    return isinstance(module, LoRALinear) or getattr(module, "lora_a", None) is not None


def _add_expert_adapters(
    experts: nn.Module, names: tuple[str, ...], rank: int, alpha: float, dropout: float
) -> None:
    """Per-expert factors for the stacked weights `names` of a GroupedExperts (w3 only where it has one)."""
    lora_a, lora_b = nn.ParameterDict(), nn.ParameterDict()
    for name in names:
        weight = getattr(experts, name, None)
        if weight is None:  # gpt-family experts have no w3
            continue
        num, out_features, in_features = weight.shape
        factory = {"device": weight.device, "dtype": weight.dtype}
        lora_a[name] = nn.Parameter(torch.empty(num, rank, in_features, **factory))
        lora_b[name] = nn.Parameter(torch.empty(num, out_features, rank, **factory))
    experts.lora_a, experts.lora_b = lora_a, lora_b
    experts.lora_scaling = alpha / rank
    experts.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()


@torch.no_grad()
def _merge_experts(experts: nn.Module) -> None:
    """Fold W[e] += B[e] A[e] * scaling into every adapted stacked weight and drop the factors."""
    for name, a in experts.lora_a.items():
        weight = getattr(experts, name)
        delta = torch.bmm(experts.lora_b[name].float(), a.float()) * experts.lora_scaling
        weight.copy_((weight.float() + delta).to(weight.dtype))
    del experts.lora_a, experts.lora_b, experts.lora_scaling, experts.lora_dropout


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, `model` computes what its base computes: every adapter (LoRALinear, the routed experts'
    factors) is skipped. A preference method's reference model is the policy with its adapters off,
    so no second copy of the base weights exists."""
    switched = [m for m in model.modules() if _adapted(m)]
    for module in switched:
        module.lora_off = True
    try:
        yield
    finally:
        for module in switched:
            module.lora_off = False


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """LoRALinear modules by canonical name."""
    return {canonical(n): m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter parameters by canonical name ('...wq.lora_a.weight')."""
    return {canonical(n): p for n, p in model.named_parameters() if ".lora_a." in n or ".lora_b." in n}


def lora_init_value(name: str, shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    """The full initial value of adapter parameter `name`: B zeros; A uniform(+-1/sqrt(in)) (as PEFT's
    kaiming_uniform(a=sqrt(5))), drawn from a generator seeded by (seed, name). Stacked expert
    factors ([E, rank, in]) draw every expert's A at once from that generator."""
    if ".lora_b." in name:
        return torch.zeros(shape)
    gen = torch.Generator(device="cpu").manual_seed(seed + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[-1])
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """(Re)initialise every adapter: A from (seed, name), B = 0. Call after materialising/loading."""
    for name, param in lora_parameters(model).items():
        if param.is_meta:
            raise RuntimeError(f"init_lora: {name} is still on the meta device; materialise the model first")
        full = lora_init_value(name, tuple(param.shape), seed)
        if isinstance(param, DTensor):
            local = distribute_tensor(
                full, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local.to(param.dtype))
        else:
            param.copy_(full.to(param.dtype))


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only (detached, full tensors on CPU), by canonical name."""
    out = {}
    for name, param in lora_parameters(model).items():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = value.detach().cpu().clone()
    return out


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy adapter tensors into an adapted model. strict: every adapter present, nothing extra."""
    params = lora_parameters(model)
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if strict and (missing or unexpected):
        raise ConfigError(
            f"LoRA adapters do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "apply_lora with the rank and target_modules the adapters were trained with"
        )
    for name in set(params) & set(state):
        param, value = params[name], state[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ConfigError(
                f"LoRA adapter {name} has shape {tuple(value.shape)}, the model {tuple(param.shape)}"
            )
        if isinstance(param, DTensor):
            value = distribute_tensor(
                value, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(value.to(param.dtype))
        else:
            param.copy_(value.to(param.dtype))


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and restore plain nn.Linear modules (in place).

    Afterwards the state-dict keys are exactly a plain model's and every parameter is trainable
    again. Single-process (plain tensors); gather a parallel model first.
    """
    for module in list(model.modules()):
        if getattr(module, "lora_a", None) is not None and not isinstance(module, LoRALinear):
            _merge_experts(module)
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        weight = module.weight
        weight.copy_((weight.float() + module.delta_weight()).to(weight.dtype))
        plain = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        plain.weight = weight
        plain.bias = module.bias
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
    for param in model.parameters():
        param.requires_grad_(True)
    if hasattr(model, "lora_spec"):
        del model.lora_spec
    return model


def count_trainable(model: nn.Module) -> ParamCount:
    """(trainable, total) parameter counts; shared (tied) tensors counted once."""
    seen: set[int] = set()
    trainable = total = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return ParamCount(trainable, total)


def save_lora(model: nn.Module, out_dir: str | Path) -> Path:
    """Write lora.safetensors (adapters) and lora.json (rank, alpha, dropout, targets) into out_dir."""
    spec = getattr(model, "lora_spec", None)
    if spec is None:
        raise ValueError("save_lora: the model has no LoRA adapters (apply_lora first)")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in lora_state_dict(model).items()}, str(out / ADAPTER_FILE))
    meta = {**asdict(spec), "target_modules": list(spec.target_modules)}
    (out / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return out


def read_lora_spec(folder: str | Path) -> LoRASpec:
    path = Path(folder).expanduser() / ADAPTER_CONFIG
    if not path.is_file():
        raise ConfigError(f"'{folder}' holds no {ADAPTER_CONFIG}; give a folder written by save_lora")
    meta = json.loads(path.read_text(encoding="utf-8"))
    return LoRASpec(
        int(meta["rank"]),
        float(meta["alpha"]),
        float(meta.get("dropout", 0.0)),
        tuple(meta["target_modules"]),
    )


def load_lora(model: nn.Module, folder: str | Path) -> nn.Module:
    """Apply the adapters saved in `folder` to a (materialised) base model and load their values."""
    spec = read_lora_spec(folder)
    if getattr(model, "lora_spec", None) is None:
        apply_lora(model, spec.rank, spec.alpha, spec.dropout, spec.target_modules)
    load_lora_state_dict(model, load_file(str(Path(folder).expanduser() / ADAPTER_FILE)))
    return model
