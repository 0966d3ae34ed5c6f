"""optim=muon on one process: the update against torch.optim.Muon, and which parameters it takes."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from suite.config.errors import ConfigError
from suite.config.schema import OptimConfig, SuiteConfig
from suite.parallel.dims import ParallelDims
from suite.train.muon import MuonWithAdamW, check_muon_layout
from suite.train.optim import build_optimizer


def _pair(shape: tuple[int, int], seed: int = 0) -> tuple[nn.Parameter, nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    return nn.Parameter(w.clone()), nn.Parameter(w.clone())


def test_muon_update_matches_torch_muon_on_a_single_tensor():
    """Three steps on a tall and a wide matrix equal torch.optim.Muon's within 1e-6. Fails if the
    momentum (lerp), Nesterov blend, Newton-Schulz (orientation, bf16, coefficients), decoupled weight
    decay or the shape-adjusted lr differ from torch's."""
    for shape in ((48, 16), (16, 40)):
        ours, ref = _pair(shape)
        opt = MuonWithAdamW(
            [{"params": [ours], "weight_decay": 0.1, "muon": True}],
            lr=0.02,
            momentum=0.9,
            nesterov=True,
            ns_steps=5,
            adjust_lr="match_rms_adamw",
        )
        torch_opt = torch.optim.Muon(
            [ref], lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw"
        )
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            grad = torch.randn(shape, generator=gen)
            ours.grad, ref.grad = grad.clone(), grad.clone()
            opt.step()
            torch_opt.step()
            torch.testing.assert_close(ours.data, ref.data, atol=1e-6, rtol=0)
        torch.testing.assert_close(
            opt.state[ours]["momentum_buffer"], torch_opt.state[ref]["momentum_buffer"], atol=1e-6, rtol=0
        )
        assert opt.orthogonalised == 3


class _Tiny(nn.Module):
    """The suite's parameter names: embeddings and head outside `layers.`, a block inside."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 8)
        self.layers = nn.ModuleDict({"0": nn.ModuleDict({"wq": nn.Linear(8, 8), "router": nn.Linear(8, 4)})})
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 32, bias=False)


def test_muon_takes_only_the_hidden_matrices_and_adamw_the_rest():
    """Fails if the embeddings, output head, norms, biases or the router went to Muon (or a hidden
    matrix to AdamW), and if AdamW's half stopped being a plain AdamW step."""
    model = _Tiny()
    cfg = OptimConfig(name="muon", lr=1e-3, fused=False)
    opt = build_optimizer(model, cfg, torch.device("cpu"), torch.float32)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g.get("muon") for p in g["params"]}
    assert muon == {"layers.0.wq.weight"}
    ref_model = _Tiny()
    ref_model.load_state_dict(model.state_dict())
    rest = [(n, p) for n, p in ref_model.named_parameters() if n != "layers.0.wq.weight"]
    ref = torch.optim.AdamW(
        [
            {"params": [p for _, p in rest if p.ndim == 2], "weight_decay": 0.1},
            {"params": [p for _, p in rest if p.ndim == 1], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
        foreach=True,
    )
    for m in (model, ref_model):
        hidden = m.layers["0"]["wq"](m.tok_embeddings.weight[:4])
        (m.output(m.norm(hidden)).sum() + m.layers["0"]["router"](hidden).sum()).backward()
    opt.step()
    ref.step()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        if name != "layers.0.wq.weight":
            torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"tp": 2, "sharding": 2, "world_size": 4}, "parallel.tp=2 and parallel.sharding=2"),
        ({"tp": 2, "ep": 2, "dp": 2, "world_size": 4}, "parallel.tp=2 and parallel.ep=2"),
        ({"pp": 2}, "parallel.pp=2"),
        ({"offload": True}, "parallel.offload=true"),
    ],
)
def test_muon_refuses_the_layouts_not_built(overrides, key):
    """Fails if optim=muon were let through under tp with sharding (strided shards: not built), tp with
    ep, pp or offload (not built or tested) instead of a ConfigError naming key and value, or if ep
    (with dp or sharding) were refused."""
    cfg = SuiteConfig()
    cfg.optim.name = "muon"
    cfg.parallel.offload = overrides.pop("offload", False)
    dims = ParallelDims(
        **{"dp": 1, "sharding": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "world_size": 2, **overrides}
    )
    with pytest.raises(ConfigError, match=re.escape(key)):
        check_muon_layout(cfg, dims)
    check_muon_layout(SuiteConfig(), dims)  # adamw: every layout
    cfg.parallel.offload = False
    check_muon_layout(cfg, ParallelDims(dp=1, sharding=2, tp=1, pp=1, cp=1, ep=1, world_size=2))
    check_muon_layout(cfg, ParallelDims(dp=2, sharding=1, tp=2, pp=1, cp=1, ep=1, world_size=4))
    check_muon_layout(cfg, ParallelDims(dp=2, sharding=1, tp=1, pp=1, cp=1, ep=2, world_size=2))


def test_stacked_expert_weights_are_orthogonalised_one_expert_at_a_time():
    """A [E, out, in] expert stack steps like E separate torch.optim.Muon matrices. Fails if the stack
    were orthogonalised as one flattened matrix, or the lr adjusted by the stack's first two dims."""
    gen = torch.Generator().manual_seed(2)
    stack = nn.Parameter(torch.randn(3, 24, 8, generator=gen))
    refs = [nn.Parameter(m.detach().clone()) for m in stack.unbind(0)]
    opt = MuonWithAdamW(
        [{"params": [stack], "weight_decay": 0.1, "muon": True}],
        lr=0.02,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        adjust_lr="match_rms_adamw",
    )
    torch_opt = torch.optim.Muon(refs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(2):
        grad = torch.randn(stack.shape, generator=gen)
        stack.grad = grad.clone()
        for ref, g in zip(refs, grad.unbind(0)):
            ref.grad = g.clone()
        opt.step()
        torch_opt.step()
    torch.testing.assert_close(stack.data, torch.stack([r.data for r in refs]), atol=1e-6, rtol=0)


def test_muon_runs_on_fp32_masters_of_bf16_parameters():
    """train.param_dtype=bf16: the Muon group reaches the optimizer over the fp32 masters and its state
    is fp32. Fails if the master-weight wrapper dropped the `muon` flag (the matrices would get AdamW)."""
    model = _Tiny()
    cfg = OptimConfig(name="muon", lr=1e-3, fused=False)
    opt = build_optimizer(model, cfg, torch.device("cpu"), torch.bfloat16)
    hidden = model.layers["0"]["wq"](model.tok_embeddings.weight[:4])
    (model.output(model.norm(hidden)).sum() + model.layers["0"]["router"](hidden).sum()).backward()
    opt.step()
    inner = opt.inner
    muon = [p for g in inner.param_groups if g.get("muon") for p in g["params"]]
    assert len(muon) == 1 and inner.state[muon[0]]["momentum_buffer"].dtype == torch.float32
    assert isinstance(inner, MuonWithAdamW) and inner.orthogonalised == 1
    assert model.layers["0"]["wq"].weight.dtype == torch.bfloat16
