"""suite.train.loss_scale in one process: what it unscales and checks, and how it skips.
(Its all-reduce over ranks: tests/distributed/test_fp16.py.)"""

from __future__ import annotations

import torch
from torch import nn

from suite.train.loss_scale import LossScaler
from suite.train.optim import WrappedOptimizer

CPU = torch.device("cpu")


class SlicedSGD(WrappedOptimizer):
    """Like ZeRO-1: the inner optimizer's parameters get their gradients only inside the step."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.copies = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        self.inner = torch.optim.SGD(self.copies, lr=1.0)
        self.steps = 0

    def _update(self) -> None:
        self.steps += 1
        for p, copy in zip(self.model.parameters(), self.copies):
            copy.grad = p.grad
        self.inner.step()


def test_wrapped_optimizer_gradients_are_the_models():
    model = nn.Linear(2, 2)
    opt = SlicedSGD(model)
    scaler = LossScaler(CPU, enabled=True)
    assert scaler.get_scale() == 2.0**16  # exists before any scale(): stages without the loss need it
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    assert torch.allclose(model.weight.grad, torch.ones(2, 2))  # unscaled in place (d sum / dW = x)
    scaler.step(opt)
    scaler.update()
    assert opt.steps == 1 and scaler.get_scale() == 2.0**16


def test_an_inf_skips_the_step_and_halves_the_scale():
    model = nn.Linear(2, 2)
    opt = SlicedSGD(model)
    scaler = LossScaler(CPU, enabled=True)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    model.bias.grad[0] = float("inf")
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert opt.steps == 0 and scaler.get_scale() == 2.0**15


def test_plain_optimizer_matches_torch_grad_scaler():
    results = []
    for make in (lambda: LossScaler(CPU, enabled=True), lambda: torch.amp.GradScaler("cpu")):
        torch.manual_seed(0)
        model = nn.Linear(3, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # the found_inf path
        scaler = make()
        for step in range(3):
            scaler.scale(model(torch.randn(2, 3)).pow(2).sum()).backward()
            if step == 1:
                model.weight.grad[0, 0] = float("nan")
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        results.append((model.weight.detach().clone(), scaler.get_scale()))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1] == 2.0**15
