"""GRPO's parts on tiny tensors: group advantages and the clipped objective against plain loops, the
sampler's recorded log-probabilities against the trainer's forward, and the rewards' refusals."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from suite.align import rollout
from suite.align.grpo import clipped_objective, group_advantages
from suite.align.rewards import Rewards
from suite.align.rollout import head_logits, rollout_generator, sample_group, token_logprobs
from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig, ModelConfig
from suite.data.batch import IGNORE_INDEX
from suite.infer.generate import sample_with_logprobs
from suite.models import build_model, materialize
from tests.grpo_aids import hot_sampler


def test_group_advantages_match_a_plain_loop():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 0.0, 2.0, 7.0]])
    got = group_advantages(rewards)
    for row, values in enumerate(rewards.tolist()):
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))  # unbiased, as TRL
        for col, v in enumerate(values):
            assert got[row, col].item() == pytest.approx((v - mean) / (std + 1e-4), abs=1e-6)
    assert torch.all(got[1] == 0)  # equal rewards: no signal


def test_clipped_objective_matches_a_plain_loop_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    b, s, eps, beta = 3, 5, 0.2, 0.05
    logp = (-torch.rand(b, s, generator=gen) * 3).requires_grad_(True)
    old = logp.detach() + (torch.rand(b, s, generator=gen) - 0.5)  # ratios both inside and outside the clip
    ref = logp.detach() + (torch.rand(b, s, generator=gen) - 0.5)
    adv = torch.tensor([1.5, -0.7, 0.0])
    mask = torch.rand(b, s, generator=gen) > 0.3
    got = clipped_objective(logp, old, adv, mask.float(), eps, ref, beta)
    got.sum().backward()
    want_grad = torch.zeros(b, s)
    for i in range(b):
        for j in range(s):
            if not mask[i, j]:
                assert got[i, j].item() == 0.0
                continue
            lp = logp[i, j].item()
            ratio = math.exp(lp - old[i, j].item())
            a = adv[i].item()
            clipped = min(max(ratio, 1 - eps), 1 + eps)
            surrogate = min(ratio * a, clipped * a)
            d = ref[i, j].item() - lp
            want = -surrogate + beta * (math.exp(d) - d - 1)
            assert got[i, j].item() == pytest.approx(want, abs=1e-6)
            # d/dlp: the unclipped branch carries ratio * a, the clipped one nothing; k3: 1 - exp(d)
            unclipped_active = ratio * a <= clipped * a
            grad = -(ratio * a if unclipped_active else 0.0) + beta * (1 - math.exp(d))
            want_grad[i, j] = grad
    assert torch.allclose(logp.grad, want_grad, atol=1e-6)


def test_sampling_logprobs_are_the_distribution_sampled_from():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    plain_cfg = GenerateConfig(temperature=1.0, top_k=None, top_p=1.0)
    token, sampled, plain = sample_with_logprobs(logits, plain_cfg, torch.Generator().manual_seed(1))
    assert torch.equal(sampled, plain)
    assert torch.equal(plain, logits.log_softmax(-1).gather(-1, token))
    hot = GenerateConfig(temperature=0.5, top_k=None, top_p=0.9)
    token, sampled, plain = sample_with_logprobs(logits, hot, torch.Generator().manual_seed(1))
    kept = torch.softmax(logits / 0.5, -1)  # sampled tokens lie inside the nucleus: renormalised there
    assert torch.all(sampled >= kept.gather(-1, token).log() - 1e-6)
    assert torch.equal(plain, logits.log_softmax(-1).gather(-1, token))


@pytest.fixture(scope="module")
def tiny_model():
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, max_seq_len=64)
    model = materialize(build_model(cfg, "meta"), torch.device("cpu"), 0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # peaked distributions: eos and long completions both occur
    return model


def _group(model, kv: bool = False):
    sampling = GenerateConfig(temperature=0.9, top_k=None, top_p=0.95)
    prompt = list(range(3, 14))
    return sample_group(
        model, prompt, 4, 7, sampling, rollout_generator(0, 5, torch.device("cpu")), 7, 0, kv=kv
    )


def test_exact_sampler_logprobs_equal_the_trainers_forward(tiny_model):
    group = _group(tiny_model)
    assert group.tokens.shape == group.labels.shape == (4, 11 + 7)
    assert group.mask.any() and not group.mask[:, :10].any()  # completions only, after the prompt
    tiny_model.train()
    mine = token_logprobs(head_logits(tiny_model, group.tokens), group.labels)
    assert float((mine - group.logprobs).abs().max()) == 0.0  # bitwise: the same kernels on the same shapes
    again = _group(tiny_model)  # the generator is a function of (seed, prompt number)
    assert torch.equal(again.tokens, group.tokens) and torch.equal(again.labels, group.labels)
    kv = _group(tiny_model, kv=True)  # the KV cache: other shapes, close but not bitwise
    kv_mine = token_logprobs(head_logits(tiny_model, kv.tokens), kv.labels)
    assert float((kv_mine - kv.logprobs).abs().max()) < 1e-3
    for row, ids in enumerate(group.completions):  # eos ends a completion; what follows is not a target
        targets = group.labels[row][group.labels[row] != IGNORE_INDEX].tolist()
        assert targets[: len(ids)] == ids and len(targets) - len(ids) in (0, 1)


def test_a_temperature_applied_only_at_sampling_shows_in_the_recorded_logprobs(tiny_model, monkeypatch):
    monkeypatch.setattr(rollout, "sample_with_logprobs", hot_sampler)
    group = _group(tiny_model)
    mine = token_logprobs(head_logits(tiny_model, group.tokens), group.labels)
    assert float((mine - group.logprobs).abs().max()) > 1e-2


def test_rewards_exact_format_and_a_named_callable(tmp_path, monkeypatch):
    exact = Rewards("exact", "addition-3")
    assert exact("What is 1 + 2?", " 859 ", "859") == 1.0 and exact("q", "858", "859") == 0.0
    both = Rewards("exact,format", "addition-3")
    assert both("q", "859", "859") == 2.0 and both("q", "85x", "859") == 0.0 and both("q", "12", "859") == 1.0
    (tmp_path / "my_rewards.py").write_text(
        "def length(p, c, a):\n    return len(c)\n"
        "def boom(p, c, a):\n    raise ValueError('no')\n"
        "def text(p, c, a):\n    return 'high'\n"
        "def nan(p, c, a):\n    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert Rewards("my_rewards:length", "addition-3")("q", "abc", "1") == 3.0
    for spec, said in (("my_rewards:boom", "raised ValueError: no"), ("my_rewards:text", "returned 'high' (str)"),
                       ("my_rewards:nan", "returned nan")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            Rewards(spec, "addition-3")("q", "12", "12")
        assert said in str(err.value) and "\n" not in str(err.value)
    for spec, said in (("exakt", "is not a reward"), ("no_such_module_x:f", "importing no_such_module_x failed"),
                       ("my_rewards:missing", "has no function 'missing'")):  # fmt: skip
        with pytest.raises(ConfigError, match=said):
            Rewards(spec, "addition-3")
    assert "no_such_module_x" not in sys.modules


def test_a_grpo_run_is_identified_by_its_task_group_and_reward():
    """A resume that switched the task, the group size or the reward would continue another run: the
    align verb's identity (suite.train.run_folder refuses a resume whose identity differs) names them.
    Fails if grpo registers no identity or the verb drops it."""
    from suite.cli.verbs.align import identity_keys
    from suite.config.compose import compose_config, to_object

    def keys(*overrides: str) -> dict:
        return identity_keys(to_object(compose_config(["align.method=grpo", *overrides])))

    base = keys("finetune.data.task=addition-2")
    assert base["align.method"] == "grpo" and base["finetune.data.task"] == "addition-2"
    for change in ("finetune.data.task=addition-3", "align.grpo.group_size=4", "align.grpo.reward=format"):
        assert keys("finetune.data.task=addition-2", change) != base, change
    assert "align.grpo.group_size" not in identity_keys(to_object(compose_config(["align.method=dpo"])))


def test_layouts_and_models_grpo_cannot_run_are_refused_before_any_process_starts():
    """The parent's layout check (suite.align.checks.check_align_layout -> the method's own): prompts
    that do not split over the data ranks, dropout (the sampler runs without it, the update with it),
    and DPO's held-out pairs fewer than the ranks. Fails if a check is left to the ranks or dropped."""
    from types import SimpleNamespace

    from suite.align.checks import check_align_layout
    from suite.config.compose import compose_config, to_object

    def dims(dp: int):
        return SimpleNamespace(data_parallel_size=dp, tp=1, pp=1, cp=1, ep=1)

    def refusal(overrides: list[str], dp: int) -> str:
        with pytest.raises(ConfigError) as caught:
            check_align_layout(to_object(compose_config(overrides)), dims(dp))
        return str(caught.value)

    grpo = ["align.method=grpo", "align.grpo.prompts_per_step=3"]
    assert "align.grpo.prompts_per_step=2" in refusal(grpo, 2)
    check_align_layout(to_object(compose_config(grpo)), dims(1))
    assert "model.dropout=0" in refusal(["align.method=grpo", "model.dropout=0.1"], 1)
    lora = ["align.method=grpo", "align.lora=true", "finetune.lora.dropout=0.05"]
    assert "finetune.lora.dropout=0" in refusal(lora, 1)
    assert "align.num_eval=4" in refusal(["align.method=dpo", "align.num_eval=2"], 4)
