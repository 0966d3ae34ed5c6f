"""align.method=grpo: Group Relative Policy Optimization (DeepSeekMath, arXiv 2402.03300) with
verifiable rewards, composed on the common trainer.

    prompts     finetune.data's built-in task questions (its training split; the held-out split stays
                held out and scores val_accuracy, as after SFT: suite.finetune.method.TaskAccuracy)
    rollouts    every `updates_per_batch` steps the loader samples G = group_size completions of each of
                the step's prompts with the current weights (suite.align.rollout: batched, every token's
                log-probabilities recorded); under data parallelism each rank samples its own share of
                the prompts, with a generator seeded by (train.seed, prompt number): the same completions
                in any layout and after a resume
    rewards     suite.align.rewards (align.grpo.reward), then advantages normalised within each group:
                A = (r - mean(r)) / (std(r) + 1e-4), std unbiased (TRL's GRPOTrainer)
    the check   before the first update on a rollout batch the trainer recomputes the log-probabilities
                of the sampled tokens with its own forward and compares them with the sampler's: max and
                mean absolute difference are logged (logprob_diff_max / _mean); above
                align.grpo.max_abs_logprob_diff the run stops in one line
    the loss    per completion token -min(rho A, clip(rho, 1 - eps, 1 + eps) A) + kl_coef k3, with
                rho = exp(logp - logp_sampler) and k3 = exp(ref - logp) - (ref - logp) - 1; averaged over
                every completion token of the global batch (token-level mean: DAPO's, TRL's
                loss_type="dapo"), which is the common step's own weighting of target tokens
                (suite.train.step.TrainStep.loss_weight), so any data-parallel split gives the same loss

Each group is one micro-batch of the common step (suite.train.step: a `MethodLoss`), so the step's
data-parallel synchronisation, clipping and the optimizer skip are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from suite.align import register
from suite.align.reference import Reference, load_reference
from suite.align.rewards import Rewards
from suite.align.rollout import Group, head_logits, rollout_generator, sample_group, token_logprobs
from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig, GRPOConfig, SuiteConfig
from suite.data.batch import IGNORE_INDEX, Batch
from suite.data.chat import prompt_ids
from suite.data.tasks import generate_task, get_task
from suite.finetune.method import BaseWeights, LoRA, SFTData, TaskAccuracy, base_source
from suite.train.components import Component, Method, Trainer
from suite.train.loss import HeadInput
from suite.train.step import LossFn

KEY = "align.grpo"
ADV_EPS = 1e-4


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[P, G] rewards -> advantages normalised within each group (row): (r - mean) / (std + 1e-4)."""
    rewards = rewards.double()
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True) if rewards.shape[-1] > 1 else torch.zeros_like(mean)
    return ((rewards - mean) / (std + ADV_EPS)).float()


def clipped_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token loss [b, s] (0 where `mask` is false): the negated clipped surrogate
    -min(rho A, clip(rho) A) plus kl_coef times the k3 estimate of KL(policy || reference).
    advantages: [b] (one per completion)."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(-1).to(ratio.dtype)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
    if kl_coef and ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        loss = loss + kl_coef * (torch.exp(delta) - delta - 1.0)
    return loss * mask


class GRPOLoss:
    """The step's training loss (suite.train.step.MethodLoss) on the current rollout batch: the
    micro-batches arrive in the order the loader handed them out, each one group."""

    def __init__(self, grpo: GRPOConfig, reference: Reference | None = None):
        self.grpo = grpo
        self.reference = reference  # the frozen base (kl_coef > 0: suite.align.reference)
        self.pending: list[Group] = []

    @contextmanager
    def micro_batch(self, tokens: torch.Tensor, kwargs: dict) -> Iterator[LossFn]:
        group = self.pending.pop(0)
        if not torch.equal(group.tokens.to(tokens.device), tokens):
            raise RuntimeError("GRPO: a micro-batch is not the rollout group the loader handed out next")
        ref = None
        if self.grpo.kl_coef and self.reference is not None:  # labels are the next tokens where scored
            ref = self.reference.token_logps(tokens, kwargs) * (
                group.labels.to(tokens.device) != IGNORE_INDEX
            )
        yield partial(self._loss, group, ref)

    def _loss(self, group: Group, ref, output, targets, weight, aux_weight=0.0) -> torch.Tensor:
        if not isinstance(output, HeadInput):
            raise RuntimeError(
                "GRPO runs on the accumulation step only (pp is refused by suite.align.checks)"
            )
        logits = F.linear(output.hidden, output.weight)  # as suite.align.rollout.head_logits
        logprobs = token_logprobs(logits, targets)
        device = logprobs.device
        per_token = clipped_objective(
            logprobs,
            group.logprobs.to(device),
            group.advantages.to(device),
            (targets != IGNORE_INDEX).float(),
            self.grpo.clip_eps,
            ref,
            self.grpo.kl_coef,
        )
        return per_token.sum() * weight


class Prompt:
    """One training question: its rendered prompt ids, its text and the task's answer."""

    def __init__(self, ids: list[int], text: str, answer: str):
        self.ids, self.text, self.answer = ids, text, answer


class RolloutBatches:
    """The training loader: a new rollout batch every `updates_per_batch` steps, else the current one
    again. State: the steps taken and the current batch's groups (a resume between updates continues
    on the same rollouts)."""

    steps_per_epoch = 1 << 40  # the trainer numbers batches epoch x steps_per_epoch + position
    epoch = 0

    def __init__(self, trainer: Trainer, data: GRPOData, loss: GRPOLoss):
        cfg = trainer.cfg
        self.trainer, self.data, self.loss = trainer, data, loss
        self.grpo: GRPOConfig = cfg.align.grpo
        self.seed = cfg.train.seed
        self.dp = trainer.dims.data_parallel_size
        self.dp_rank = trainer.placement.dp_rank
        self.position = 0  # optimizer steps taken
        self.groups: list[Group] = []
        self.fresh = False  # the groups were sampled for this step (the log-probability check runs)
        # the current rollout batch's logged figures (reward, logprob_diff_*, completion_tokens), reduced
        # over the ranks when it was sampled; checkpointed with its groups, so a step resumed between two
        # updates of one batch logs them too (its check does not run again)
        self.stats: dict[str, float] = {}
        self.error: str | None = None  # a reward's failure, raised on every rank by the component
        g = self.grpo
        self.sampling = GenerateConfig(temperature=g.temperature, top_k=None, top_p=g.top_p)
        self.max_new_tokens = g.max_new_tokens or get_task(data.task).max_answer_chars + 2
        self.order = np.random.default_rng([self.seed, 0x6790]).permutation(len(data.prompts))

    def _prompt_numbers(self, rollout: int) -> list[int]:
        per_rank = self.grpo.prompts_per_step // self.dp
        first = rollout * self.grpo.prompts_per_step + self.dp_rank * per_rank
        return list(range(first, first + per_rank))

    def _sample(self, rollout: int) -> list[Group]:
        tok = self.data.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        device = self.trainer.placement.input_device()
        groups = []
        for number in self._prompt_numbers(rollout):
            prompt = self.data.prompts[int(self.order[number % len(self.order)])]
            with self.trainer.autocast():  # the step's precision: the trainer's arithmetic
                group = self._group(prompt, number, device, pad)
            texts = [tok.decode(ids, skip_special_tokens=False) for ids in group.completions]
            try:
                group.rewards = torch.tensor(
                    [self.data.rewards(prompt.text, t, prompt.answer) for t in texts]
                )
            except ConfigError as exc:
                self.error = str(exc)
                group.rewards = torch.zeros(self.grpo.group_size)
            group.advantages = group_advantages(group.rewards[None])[0]
            groups.append(group)
        return groups

    def _group(self, prompt: Prompt, number: int, device: torch.device, pad: int) -> Group:
        return sample_group(
            self.trainer.model,
            prompt.ids,
            self.grpo.group_size,
            self.max_new_tokens,
            self.sampling,
            rollout_generator(self.seed, number, device),
            self.data.tokenizer.eos_token_id,
            pad,
            prompt_number=number,
            kv=self.grpo.sampler == "kv",
        )

    def next_step(self) -> list[Batch]:
        if self.position % self.grpo.updates_per_batch == 0 or not self.groups:
            self.groups = self._sample(self.position // self.grpo.updates_per_batch)
            self.fresh = True
        else:
            self.fresh = False
        self.position += 1
        self.loss.pending = list(self.groups)
        return [group.batch() for group in self.groups]

    def tokens_by_source(self) -> None:
        """The trainer's loader interface (suite.data.sampler.GlobalBatches): rollouts mix no sources."""
        return None

    def state_dict(self) -> dict[str, Any]:
        fields = ("tokens", "labels", "logprobs", "sample_logprobs", "rewards", "advantages")
        groups = [
            {"prompt_number": g.prompt_number, "prompt_len": g.prompt_len, "completions": g.completions}
            | {f: getattr(g, f).cpu() for f in fields}
            for g in self.groups
        ]
        # every data-parallel rank's groups (a checkpoint keeps rank 0's state file; saving is
        # collective): a resume between two updates of one rollout batch trains each rank on its own
        every: list[Any] = [groups]
        if self.trainer.placement.data_group is not None:
            every = [None] * self.dp
            dist.all_gather_object(every, groups, group=self.trainer.placement.data_group)
        return {"position": self.position, "groups_by_rank": every, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.groups = []
        self.stats = {k: float(v) for k, v in state.get("stats", {}).items()}
        by_rank = state["groups_by_rank"]
        if len(by_rank) != self.dp:
            return  # another number of ranks: the current rollout batch is sampled anew
        for saved in by_rank[self.dp_rank]:
            group = Group(
                saved["prompt_number"], saved["prompt_len"], saved["tokens"], saved["labels"],
                saved["logprobs"], saved["sample_logprobs"], saved["completions"], saved["rewards"],
            )  # fmt: skip
            group.advantages = saved["advantages"]
            self.groups.append(group)


class GRPOData(SFTData):
    """finetune.data's task: its training questions as prompts (with their answers), its held-out rows
    for val_loss and val_accuracy as in finetuning."""

    def prepare(self, trainer: Trainer) -> None:
        super().prepare(trainer)
        cfg = trainer.cfg
        d = cfg.finetune.data
        self.task = d.task
        self.rewards = Rewards(cfg.align.grpo.reward, d.task)
        train, _ = generate_task(d.task, d.num_train, d.num_eval, d.task_seed)
        self.prompts = [
            Prompt(
                prompt_ids(self.tokenizer, rows[:-1], self.chat_template),
                rows[-2]["content"],
                rows[-1]["content"],
            )
            for rows in train
        ]

    def loaders(self, trainer: Trainer) -> tuple[Any, Any]:
        _, held_out = super().loaders(trainer)
        loss = next(c for c in trainer.method.components if isinstance(c, GRPO)).loss
        return RolloutBatches(trainer, self, loss), held_out


class GRPO(Component):
    """The loss, the log-probability check before updating, and the rollout metrics."""

    def __init__(self, grpo: GRPOConfig):
        self.loss = GRPOLoss(grpo)

    def step_loss(self, trainer: Trainer) -> GRPOLoss:
        if self.loss.grpo.kl_coef:
            self.loss.reference = load_reference(trainer)
        return self.loss

    def before_step(self, trainer: Trainer) -> None:
        loader: RolloutBatches = trainer.loader
        if not loader.fresh:
            return
        worst, total, count = logprob_gap(trainer, loader.groups)
        rewards = torch.cat([g.rewards for g in loader.groups]).double()
        lengths = [len(c) for g in loader.groups for c in g.completions]
        values = torch.tensor(
            [worst, total, count, float(rewards.sum()), rewards.numel(), float(sum(lengths)),
             1.0 if loader.error else 0.0],
            dtype=torch.float64,
        )  # fmt: skip
        group = trainer.placement.data_group
        if group is not None:  # on the device the backend reduces on (nccl: the GPU)
            device = trainer.placement.input_device()
            worst_t = values[[0, 6]].to(device)
            sums = values[[1, 2, 3, 4, 5]].to(device)
            dist.all_reduce(worst_t, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(sums, group=group)
            values = torch.stack([worst_t[0], *sums, worst_t[1]]).cpu()
        if values[6] > 0:
            raise ConfigError(loader.error or f"{KEY}.reward failed on another rank (its line above)")
        bound = trainer.cfg.align.grpo.max_abs_logprob_diff
        stats = loader.stats = {
            "reward": float(values[3] / max(values[4], 1.0)),
            "logprob_diff_max": float(values[0]),
            "logprob_diff_mean": float(values[1] / max(values[2], 1.0)),
            "completion_tokens": float(values[5] / max(values[4], 1.0)),
        }
        if not values[0] <= bound:
            raise ConfigError(
                f"{KEY}.max_abs_logprob_diff={bound:g}: the trainer's log-probabilities of the sampled tokens "
                f"differ from the sampler's by up to {float(values[0]):.3g} (mean {stats['logprob_diff_mean']:.3g}) "
                f"at step {trainer.step + 1}; the update would be biased. Use {KEY}.sampler=exact in fp32, or "
                f"raise the bound knowingly: {KEY}.max_abs_logprob_diff={_looser(float(values[0]))}"
            )

    def log_metrics(self, trainer: Trainer, window_steps: int) -> dict:
        return dict(getattr(trainer.loader, "stats", {}))


def _looser(value: float) -> str:
    return f"{10 ** math.ceil(math.log10(value)):g}" if value > 0 and math.isfinite(value) else "1"


@torch.no_grad()
def logprob_gap(trainer: Trainer, groups: list[Group]) -> tuple[float, float, float]:
    """(max, sum, count) of |trainer log-prob - sampler log-prob| over this rank's sampled tokens: the
    trainer's forward of each group in its training shapes, under the step's autocast."""
    worst, total, count = 0.0, 0.0, 0.0
    device = trainer.placement.input_device()
    for group in groups:
        with trainer.autocast():
            logits = head_logits(trainer.model, group.tokens.to(device))
        mine = token_logprobs(logits, group.labels.to(device))
        gap = (mine - group.logprobs.to(device)).abs()[group.mask.to(device)]
        if gap.numel():
            worst = max(worst, float(gap.max()))
            total += float(gap.double().sum())
            count += gap.numel()
    return worst, total, count


def check(cfg: SuiteConfig) -> None:
    """The keys GRPO reads, in one line each (run in the parent before anything starts)."""
    g: GRPOConfig = cfg.align.grpo
    if g.group_size < 2:
        raise ConfigError(
            f"{KEY}.group_size={g.group_size}: advantages are normalised within each prompt's group, which "
            f"needs at least 2 completions; {KEY}.group_size=8"
        )
    if not g.temperature > 0:
        raise ConfigError(
            f"{KEY}.temperature={g.temperature}: sampling needs a temperature > 0; {KEY}.temperature=1.0"
        )
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"{KEY}.top_p={g.top_p} must be in (0, 1]; {KEY}.top_p=1.0")
    if (
        g.prompts_per_step < 1
        or g.updates_per_batch < 1
        or not g.clip_eps > 0
        or g.kl_coef < 0
        or not g.max_abs_logprob_diff >= 0
    ):
        raise ConfigError(
            f"{KEY}: prompts_per_step={g.prompts_per_step} and updates_per_batch={g.updates_per_batch} must be >= 1, clip_eps={g.clip_eps} > 0, "
            f"kl_coef={g.kl_coef} >= 0 and max_abs_logprob_diff={g.max_abs_logprob_diff} >= 0"
        )
    if g.sampler not in ("exact", "kv"):
        raise ConfigError(f"{KEY}.sampler={g.sampler!r} is not a sampler; use exact or kv")
    if g.max_new_tokens is not None and g.max_new_tokens < 1:
        raise ConfigError(f"{KEY}.max_new_tokens={g.max_new_tokens} must be >= 1 (or unset: the task's)")
    if not cfg.finetune.data.task:
        raise ConfigError(
            "align.method=grpo samples finetune.data.task's questions and scores them against its answers; "
            "finetune.data.task=addition-3"
        )
    get_task(cfg.finetune.data.task)  # tp, pp, cp, ep: suite.align.checks.check_align (every method)
    Rewards(g.reward, cfg.finetune.data.task)  # names parsed, a module:function imported now


def check_layout(cfg: SuiteConfig, dims) -> None:
    """What GRPO needs of the base model and the layout, once both are known (before any process)."""
    g: GRPOConfig = cfg.align.grpo
    dp = dims.data_parallel_size if dims is not None else 1
    if g.prompts_per_step % dp:
        raise ConfigError(
            f"{KEY}.prompts_per_step={g.prompts_per_step} is not a multiple of the {dp} data-parallel "
            f"ranks (each samples its own share); {KEY}.prompts_per_step={dp * max(1, g.prompts_per_step // dp)}"
        )
    # the sampler runs without dropout and the update with it: the first ratio would not be 1 and the
    # log-probability check would stop the run (TRL turns dropout off for the same reason)
    lora_dropout = cfg.finetune.lora.dropout if cfg.align.lora else 0.0
    for key, value in (("model.dropout", cfg.model.dropout), ("finetune.lora.dropout", lora_dropout)):
        if value > 0:
            raise ConfigError(
                f"{key}={value}: align.method=grpo compares the sampler's log-probabilities with the "
                f"update's, which dropout makes differ; {key}=0"
            )


def run_identity(cfg: SuiteConfig) -> dict:
    """What defines a GRPO run's rollouts: the task its prompts come from, the group and the reward."""
    g = cfg.align.grpo
    return {
        "finetune.data.task": cfg.finetune.data.task,
        "align.grpo.group_size": g.group_size,
        "align.grpo.prompts_per_step": g.prompts_per_step,
        "align.grpo.reward": g.reward,
    }


@register("grpo", check=check, identity=run_identity, layout_check=check_layout)
def compose(cfg: SuiteConfig) -> Method:
    """GRPO from model.init_from's weights (+ LoRA under align.lora) on finetune.data's task."""
    source = base_source(cfg)
    data = GRPOData(source)
    lora = [LoRA()] if cfg.align.lora else []
    return Method("align", data, [BaseWeights(source), *lora, GRPO(cfg.align.grpo), TaskAccuracy(data)])
