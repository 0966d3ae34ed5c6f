"""Hidden-state matching (suite.distill.hidden): no loss for a student equal to its teacher, gradients
reach the student and the projection, ignored tokens count for nothing, blocks are paired evenly, and
the hooks capture block outputs without changing the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from suite.data.batch import IGNORE_INDEX
from suite.distill.hidden import HIDDEN_LOSSES, PROJECTIONS, BlockOutputs, hidden_loss, layer_pairs


def test_blocks_pair_evenly_last_to_last():
    assert layer_pairs(2, 4) == [(0, 1), (1, 3)]
    assert layer_pairs(4, 4) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert layer_pairs(3, 12) == [(0, 3), (1, 7), (2, 11)]
    assert layer_pairs(4, 2) == [(0, 0), (1, 0), (2, 0), (3, 1)]  # a deeper student: never block -1


@pytest.mark.parametrize("kind", HIDDEN_LOSSES)
def test_a_student_equal_to_its_teacher_has_no_hidden_loss(kind):
    gen = torch.Generator().manual_seed(0)
    blocks = {0: torch.randn(2, 5, 8, generator=gen), 1: torch.randn(2, 5, 8, generator=gen)}
    targets = torch.randint(0, 10, (2, 5), generator=gen)
    identity = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))
    for proj in identity:
        nn.init.eye_(proj.weight)
    pairs = [(0, 0), (1, 1)]
    for projections in (None, identity):
        loss = hidden_loss(blocks, blocks, pairs, projections, targets, kind)
        assert abs(float(loss.detach())) < 1e-5, (kind, float(loss.detach()))


@pytest.mark.parametrize("kind", HIDDEN_LOSSES)
def test_gradients_reach_the_student_and_the_projection_not_the_teacher(kind):
    gen = torch.Generator().manual_seed(1)
    student = {0: torch.randn(2, 6, 8, generator=gen, requires_grad=True)}
    teacher = {1: torch.randn(2, 6, 12, generator=gen, requires_grad=True)}  # wider
    projections = nn.ModuleList([nn.Linear(8, 12, bias=False)])
    targets = torch.randint(0, 10, (2, 6), generator=gen)
    targets[0, :4] = IGNORE_INDEX  # a prompt: no loss there
    loss = hidden_loss(student, teacher, [(0, 1)], projections, targets, kind)
    loss.backward()
    assert float(loss) > 0
    assert student[0].grad is not None and projections[0].weight.grad is not None
    assert projections[0].weight.grad.abs().sum() > 0
    assert (student[0].grad[0, :4] == 0).all() and student[0].grad[0, 4:].abs().sum() > 0
    assert teacher[1].grad is None  # the teacher is frozen


def test_ignored_tokens_count_for_nothing_and_pairs_average():
    gen = torch.Generator().manual_seed(2)
    s = {0: torch.randn(1, 4, 6, generator=gen), 1: torch.randn(1, 4, 6, generator=gen)}
    t = {0: torch.randn(1, 4, 6, generator=gen), 1: torch.randn(1, 4, 6, generator=gen)}
    targets = torch.tensor([[IGNORE_INDEX, 3, IGNORE_INDEX, 1]])
    got = hidden_loss(s, t, [(0, 0), (1, 1)], None, targets, "mse")
    want = sum(((s[i][0, [1, 3]] - t[i][0, [1, 3]]) ** 2).mean(-1).sum() for i in (0, 1)) / 2
    torch.testing.assert_close(got, want)


def test_hooks_capture_block_outputs_and_leave_the_model_as_it_was():
    from suite.config.schema import ModelConfig
    from suite.distill.hidden import attach_projections
    from suite.models import build_model, materialize

    cfg = ModelConfig(num_layers=2, hidden_size=16, num_heads=2, vocab_size=32, max_seq_len=16)
    model = materialize(build_model(cfg), "cpu", seed=0)
    tokens = torch.randint(0, 32, (1, 5))
    plain = model(tokens)
    with BlockOutputs(model, [1]) as kept:
        again = model(tokens)
    assert list(kept.outputs) == [1] and kept.outputs[1].shape == (1, 5, 16)
    torch.testing.assert_close(plain, again)
    model(tokens)
    assert kept.outputs[1].shape == (1, 5, 16) and not model.layers["1"]._forward_hooks  # hooks gone
    attach_projections(model, 16, 16)
    assert not hasattr(model, PROJECTIONS)  # equal widths: nothing to learn
    attach_projections(model, 16, 24)
    assert [tuple(p.weight.shape) for p in getattr(model, PROJECTIONS)] == [(24, 16), (24, 16)]


def test_the_linear_hidden_schedule_decays_to_zero_at_the_last_step():
    from suite.distill.hidden import hidden_weight_at

    assert [hidden_weight_at(2.0, "linear", s, 5) for s in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    assert [hidden_weight_at(2.0, "constant", s, 5) for s in range(5)] == [2.0] * 5
    with pytest.raises(ValueError, match="hidden_schedule='cosine'"):
        hidden_weight_at(1.0, "cosine", 0, 5)
