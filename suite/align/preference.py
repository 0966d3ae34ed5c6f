"""Preference tuning: DPO (with a frozen reference) and SimPO (reference-free), registered as
align.method=dpo and align.method=simpo.

    data      `PairData`: align.data's pairs (suite.align.pairs) rendered with the base's tokenizer and
              chat template; a step's global batch is parallel.global_batch_size pairs, each pair's
              two conversations in one micro-batch; held out: the last align.num_eval pairs, whose
              chosen responses give val_loss (their cross-entropy per token)
    weights   model.init_from (suite.finetune.method.BaseWeights); align.lora=true adds finetune.lora.*
              adapters (suite.finetune.method.LoRA) and trains only them
    reference dpo: the base's log-probabilities (suite.align.reference): a frozen copy placed like the
              policy, or under align.lora the policy with its adapters off (no second copy)
    loss      `PreferenceLoss`, a suite.train.step.MethodLoss: per pair, from the summed log-probabilities
              of the response tokens (pc, pr: policy, chosen and rejected; rc, rr: reference)
                dpo    z = beta * ((pc - rc) - (pr - rr))
                       loss = -(1 - ls) logsigmoid(z) - ls logsigmoid(-z) - rpo_alpha pc / |c|
                       (ls: align.label_smoothing, TRL's "sigmoid" loss, conservative DPO when ls > 0;
                       rpo_alpha: align.rpo_alpha, the chosen response's NLL per token: RPO, TRL's
                       rpo_alpha, which keeps the chosen likelihood from falling; 0: plain DPO)
                       rewards: beta (pc - rc), beta (pr - rr)
                simpo  z = simpo_beta * (pc / |c| - pr / |r|) - simpo_gamma   (length-normalised; no reference)
                       loss = -(1 - ls) logsigmoid(z) - ls logsigmoid(-z)
                       rewards: simpo_beta pc / |c|, simpo_beta pr / |r|
              averaged over the global batch's pairs (the step weighs a PairBatch by its pairs)
    logged    rewards/chosen, rewards/rejected, rewards/margin (their mean difference) and
              rewards/accuracy (the share of pairs whose chosen reward is higher), over the logging window;
              at each evaluation val_rewards/accuracy and val_rewards/margin of the held-out pairs
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from suite.align import register
from suite.align.logps import target_logps
from suite.align.pairs import TASK_PREFIX, PairDataset, build_pairs, read_pairs
from suite.align.reference import Reference, load_reference
from suite.align.sampled_pairs import policy_sampler, sampled_task_pairs
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.data.batch import IGNORE_INDEX, Batch
from suite.data.chat import use_chat_template
from suite.data.sampler import GlobalBatches
from suite.data.tasks import get_task
from suite.finetune.method import BaseWeights, LoRA, base_source
from suite.infer.generate import load_for_inference
from suite.model_source import ModelSource
from suite.models.moe import moe_aux_loss
from suite.train.components import Component, Data, Method, Trainer
from suite.train.loss import HeadInput

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


# ---- the objectives ------------------------------------------------------------------------------
def sigmoid_loss(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - ls) log sigmoid(z) - ls log sigmoid(-z), per pair."""
    return -F.logsigmoid(z) * (1.0 - label_smoothing) - F.logsigmoid(-z) * label_smoothing


@dataclass(frozen=True)
class DPO:
    """Direct preference optimisation against a frozen reference (Rafailov et al. 2023); with
    rpo_alpha > 0 plus the chosen response's negative log-likelihood per token (RPO): DPO alone can
    lower the chosen likelihood along with the rejected one (measured: docs/benchmarks.md)."""

    beta: float
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    needs_reference = True

    def __call__(self, policy: torch.Tensor, lengths: torch.Tensor, reference: torch.Tensor | None):
        """(per-pair losses [b], chosen rewards [b], rejected rewards [b]) from [b, 2] summed log-probs."""
        rewards = self.beta * (policy - reference)
        z = rewards[:, 0] - rewards[:, 1]
        losses = sigmoid_loss(z, self.label_smoothing)
        if self.rpo_alpha:
            losses = losses - self.rpo_alpha * policy[:, 0] / lengths[:, 0].clamp(min=1)
        return losses, rewards[:, 0].detach(), rewards[:, 1].detach()


@dataclass(frozen=True)
class SimPO:
    """Simple preference optimisation: length-normalised log-probabilities, a margin, no reference
    (Meng et al. 2024)."""

    beta: float
    gamma: float
    label_smoothing: float = 0.0
    needs_reference = False

    def __call__(self, policy: torch.Tensor, lengths: torch.Tensor, reference: torch.Tensor | None):
        rewards = self.beta * policy / lengths.clamp(min=1)
        z = rewards[:, 0] - rewards[:, 1] - self.gamma
        return sigmoid_loss(z, self.label_smoothing), rewards[:, 0].detach(), rewards[:, 1].detach()


Objective = DPO | SimPO


# ---- the loss in the step ------------------------------------------------------------------------
class PreferenceLoss:
    """The policy's preference loss on a micro-batch of pairs (rows 2i chosen, 2i + 1 rejected); the
    reference (if the objective has one) runs on the micro-batch's tokens first."""

    def __init__(self, objective: Objective, reference: Reference | None, moe: bool, device: torch.device):
        self.objective = objective
        self.reference = reference
        self.moe = moe
        self.model: torch.nn.Module | None = None  # the policy (for its MoE aux losses)
        # pairs, summed chosen rewards, summed rejected rewards, pairs ranked right; since the last log
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    @contextmanager
    def micro_batch(self, tokens: torch.Tensor, kwargs: dict) -> Iterator[Any]:
        reference = None
        if self.reference is not None:
            reference = self.reference.token_logps(tokens, kwargs)
        yield partial(self._loss, reference)

    def sequence_logps(
        self, output: HeadInput, targets: torch.Tensor, reference: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[pairs, 2] summed response log-probabilities of the policy, response lengths, and the
        reference's (None without one)."""
        if not isinstance(output, HeadInput):
            raise RuntimeError("the preference loss gets the head's input (pipeline schedules are refused)")
        keep = targets != IGNORE_INDEX
        policy = target_logps(output.hidden, output.weight, targets).sum(-1).view(-1, 2)
        lengths = keep.sum(-1).view(-1, 2)
        ref = None if reference is None else torch.where(keep, reference, 0.0).sum(-1).view(-1, 2)
        return policy, lengths, ref

    def _loss(self, reference, output, targets, weight, aux_weight: float = 0.0) -> torch.Tensor:
        policy, lengths, ref = self.sequence_logps(output, targets, reference)
        losses, chosen, rejected = self.objective(policy, lengths, ref)
        with torch.no_grad():
            self.sums += torch.stack(
                [
                    torch.tensor(float(len(losses)), device=chosen.device),
                    chosen.sum(),
                    rejected.sum(),
                    (chosen > rejected).sum(),
                ]
            ).to(self.sums)
        loss = losses.sum() * weight
        if self.moe and aux_weight and self.model is not None:
            aux = moe_aux_loss(self.model)
            if aux is not None:
                loss = loss + aux.to(loss.device) * aux_weight
        return loss

    def window_metrics(self, data_sum) -> dict:
        """The logging window's reward metrics over every data-parallel rank's pairs; resets the window."""
        sums = data_sum(self.sums.clone())  # (data_sum returns its argument when there is one rank)
        self.sums.zero_()
        pairs, chosen, rejected, right = (float(v) for v in sums.tolist())
        if not pairs:
            return {}
        return dict(
            zip(METRICS, (chosen / pairs, rejected / pairs, (chosen - rejected) / pairs, right / pairs))
        )


class Preference(Component):
    """The objective's loss in every training step (with the reference it needs) and its metrics."""

    def __init__(self, objective: Objective, data: PairData | None = None):
        self.objective = objective
        self.data = data  # its held-out pairs give val_rewards/* at each evaluation
        self.loss: PreferenceLoss | None = None

    def step_loss(self, trainer: Trainer) -> PreferenceLoss:
        reference = load_reference(trainer) if self.objective.needs_reference else None
        moe = bool(trainer.cfg.model.num_experts)
        self.loss = PreferenceLoss(self.objective, reference, moe, trainer.placement.input_device())
        self.loss.model = trainer.model
        return self.loss

    def log_metrics(self, trainer: Trainer, window_steps: int) -> dict:
        return self.loss.window_metrics(trainer.placement.data_sum) if self.loss is not None else {}

    @torch.no_grad()
    def eval_metrics(self, trainer: Trainer) -> dict:
        """The held-out pairs' rewards: val_rewards/accuracy and val_rewards/margin over the same pairs
        as val_loss (train.eval_batches x micro_batch_size of them, in every layout)."""
        loss, data = self.loss, self.data
        if loss is None or data is None or data.held_out_pairs is None:
            return {}
        rows = trainer.cfg.train.eval_batches * trainer.cfg.parallel.micro_batch_size
        device = trainer.placement.input_device()
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        model = trainer.model
        model.eval()
        for batch in data.held_out_pairs.eval_rows(rows):
            tokens, labels = batch.tokens.to(device), batch.labels.to(device)
            with trainer.autocast():
                reference = None if loss.reference is None else loss.reference.token_logps(tokens, {})
                head = partial(_scored, loss, labels, reference)
                policy, lengths, ref = model(tokens, head=head)
            _, chosen, rejected = loss.objective(policy, lengths, ref)
            sums += torch.stack(
                [
                    torch.tensor(float(len(chosen)), device=device),
                    chosen.sum(),
                    rejected.sum(),
                    (chosen > rejected).sum(),
                ]
            ).to(sums)
        pairs, chosen, rejected, right = (float(v) for v in trainer.placement.data_sum(sums).tolist())
        if not pairs:
            return {}
        return {"val_rewards/accuracy": right / pairs, "val_rewards/margin": (chosen - rejected) / pairs}


def _scored(loss: PreferenceLoss, labels: torch.Tensor, reference, hidden, weight):
    """A forward's head: the pairs' summed response log-probabilities (PreferenceLoss.sequence_logps)."""
    return loss.sequence_logps(HeadInput(hidden, weight, 0), labels, reference)


# ---- the data ------------------------------------------------------------------------------------
class ChosenRows:
    """The held-out pairs' chosen conversations alone (plain Batches): val_loss is their cross-entropy
    per response token, comparable with the SFT run's."""

    def __init__(self, pairs: PairDataset):
        self.pairs = pairs
        self.seq_len = pairs.seq_len

    def __len__(self) -> int:
        return len(self.pairs)

    def batch(self, indices: np.ndarray) -> Batch:
        rows = 2 * np.asarray(indices, dtype=np.int64)
        get = lambda a: torch.from_numpy(a[rows].astype(np.int64))  # noqa: E731
        return Batch(get(self.pairs.tokens), get(self.pairs.labels))

    def too_small(self, global_batch_size: int, split: str) -> str:
        return self.pairs.too_small(global_batch_size, split)

    def resume_mismatch(self, saved_samples: int) -> str | None:
        return None


class PairData(Data):
    """align.data's pairs, rendered with model.init_from's tokenizer and chat template."""

    rows_per_sample = 2  # a sample of the global batch is a pair: its chosen and rejected rows

    def __init__(self, source: ModelSource):
        self.source = source
        self.held_out_pairs: GlobalBatches | None = None

    def prepare(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.tokenizer = self.source.tokenizer()
        if self.tokenizer.eos_token is None:
            raise ConfigError("the base tokenizer has no eos token; chat turns need one to end")
        self.chat_template = use_chat_template(self.tokenizer, cfg.finetune.data.template)
        a = cfg.align
        if a.data.startswith(TASK_PREFIX) and a.pair_samples > 0:
            pairs = self.sampled_pairs(trainer)
        else:
            pairs = read_pairs(
                a.data,
                self.tokenizer,
                self.chat_template,
                cfg.data.seq_len,
                a.num_pairs,
                cfg.finetune.data.task_seed,
                cfg.finetune.data.num_eval,  # task:<name>: never the SFT run's held-out questions
            )
        held = cfg.align.num_eval
        if len(pairs) <= held:
            raise ConfigError(
                f"align.data={cfg.align.data} holds {len(pairs)} pairs, no more than the align.num_eval={held} "
                f"held out; align.num_eval={max(1, len(pairs) // 10)} or add pairs"
            )
        self.train_pairs, self.eval_pairs = pairs.split(held)
        trainer.log(
            f"preference pairs: {len(self.train_pairs):,} to train on, {len(self.eval_pairs):,} held out "
            f"(rows of {cfg.data.seq_len} tokens)"
        )

    def sampled_pairs(self, trainer: Trainer) -> PairDataset:
        """task:<name> pairs whose rejected answers model.init_from samples (suite.align.sampled_pairs)."""
        cfg, a = trainer.cfg, trainer.cfg.align
        task = a.data[len(TASK_PREFIX) :]
        model, _, _ = load_for_inference(self.source, str(trainer.device))
        sample = policy_sampler(
            model, self.tokenizer, self.chat_template, task, a.pair_samples, a.pair_temperature,
            cfg.train.seed,
        )  # fmt: skip
        rows, fallbacks = sampled_task_pairs(
            task, a.num_pairs, cfg.finetune.data.task_seed, cfg.finetune.data.num_eval, sample
        )
        del model
        trainer.log(
            f"preference pairs of {task}: {len(rows) - fallbacks:,} rejected answers sampled from "
            f"model.init_from ({a.pair_samples} per question, temperature {a.pair_temperature}); "
            f"{fallbacks:,} questions had no wrong sample and pair the answer with its digits swapped"
        )
        where = ((f"{a.data} pair {i}", row) for i, row in enumerate(rows, 1))
        return build_pairs(where, self.tokenizer, self.chat_template, cfg.data.seq_len)

    def loaders(self, trainer: Trainer) -> tuple[Any, Any]:
        cfg, dims = trainer.cfg, trainer.dims
        p, dp, dp_rank = cfg.parallel, dims.data_parallel_size, trainer.placement.dp_rank
        train = GlobalBatches(
            self.train_pairs, p.micro_batch_size, p.global_batch_size, dp_rank, dp, cfg.train.seed
        )
        held = ChosenRows(self.eval_pairs)
        eval_global = min(p.micro_batch_size * dp, len(held))
        eval_global -= eval_global % dp
        if eval_global < dp:
            raise ConfigError(
                f"align.num_eval={cfg.align.num_eval} holds out fewer pairs than the {dp} data-parallel "
                f"ranks; align.num_eval={dp}"
            )
        held_out = GlobalBatches(
            held, min(p.micro_batch_size, eval_global // dp), eval_global, dp_rank, dp, cfg.train.seed,
            split="held-out",
        )  # fmt: skip
        # the same pairs whole, for their rewards (suite.align.preference.Preference.eval_metrics)
        self.held_out_pairs = GlobalBatches(
            self.eval_pairs, held_out.micro_batch_size, eval_global, dp_rank, dp, cfg.train.seed,
            split="held-out",
        )  # fmt: skip
        return train, held_out

    def write_run_files(self, trainer: Trainer) -> None:
        self.tokenizer.save_pretrained(trainer.run_dir)  # with the chat template trained with

    def vocab(self) -> dict:
        return self.tokenizer.get_vocab()


def _compose(cfg: SuiteConfig, objective: Objective) -> Method:
    source = base_source(cfg)
    lora = [LoRA()] if cfg.align.lora else []
    data = PairData(source)
    return Method("align", data, [BaseWeights(source), *lora, Preference(objective, data)])


def check_preference(cfg: SuiteConfig) -> None:
    """What dpo and simpo need besides the align section's common checks."""
    a = cfg.align
    if not a.data:
        raise ConfigError(
            f"align.data is missing; align.method={a.method} learns from preference pairs: "
            "align.data=data/pairs.jsonl (rows of prompt, chosen, rejected)"
        )
    if a.data.startswith(TASK_PREFIX):
        get_task(a.data[len(TASK_PREFIX) :])  # a one-line error for an unknown name
        if a.num_pairs <= a.num_eval:
            raise ConfigError(
                f"align.num_pairs={a.num_pairs} leaves nothing to train on after align.num_eval={a.num_eval} "
                f"held out; align.num_pairs={max(2000, 2 * a.num_eval)}"
            )
    elif not Path(a.data).expanduser().exists():
        raise ConfigError(
            f"align.data={a.data} does not exist; give a .jsonl/.json/.parquet file of pairs, a folder of "
            "them, or a folder `datasets` saved (save_to_disk)"
        )
    if a.pair_samples < 0 or (a.pair_samples and not a.data.startswith(TASK_PREFIX)):
        raise ConfigError(
            f"align.pair_samples={a.pair_samples} with align.data={a.data}: it is 0 (pairs as given) or, "
            "with align.data=task:<name>, the answers sampled per question (e.g. 4)"
        )
    if not a.pair_temperature > 0:
        raise ConfigError(f"align.pair_temperature={a.pair_temperature} must be > 0; e.g. 1.0")
    if not 0.0 <= a.label_smoothing < 0.5:
        raise ConfigError(f"align.label_smoothing={a.label_smoothing} must be in [0, 0.5); e.g. 0.1")
    for key, value in (("beta", a.beta), ("simpo_beta", a.simpo_beta)):
        if not value > 0:
            raise ConfigError(
                f"align.{key}={value} must be > 0; e.g. align.{key}={0.1 if key == 'beta' else 2.0}"
            )
    if a.rpo_alpha < 0 or (a.rpo_alpha and a.method != "dpo"):
        raise ConfigError(
            f"align.rpo_alpha={a.rpo_alpha} with align.method={a.method}: it is >= 0 and weighs the chosen "
            "responses' NLL in DPO's loss (align.method=dpo align.rpo_alpha=1.0), or 0"
        )
    if a.simpo_gamma < 0:
        raise ConfigError(f"align.simpo_gamma={a.simpo_gamma} must be >= 0 (the target margin); e.g. 1.0")
    if a.num_eval < 1:
        raise ConfigError(f"align.num_eval={a.num_eval} must be >= 1 (pairs held out for val_loss); e.g. 16")


def check_preference_layout(cfg: SuiteConfig, dims) -> None:
    """Every data-parallel rank scores at least one held-out pair (checked before any process starts)."""
    dp = dims.data_parallel_size if dims is not None else 1
    if cfg.align.num_eval < dp:
        raise ConfigError(
            f"align.num_eval={cfg.align.num_eval} holds out fewer pairs than the {dp} data-parallel "
            f"ranks; align.num_eval={dp}"
        )


@register("dpo", check=check_preference, layout_check=check_preference_layout)
def compose_dpo(cfg: SuiteConfig) -> Method:
    """align.method=dpo: the pairs, the base's weights (+ LoRA), DPO against the reference."""
    return _compose(cfg, DPO(cfg.align.beta, cfg.align.label_smoothing, cfg.align.rpo_alpha))


@register("simpo", check=check_preference, layout_check=check_preference_layout)
def compose_simpo(cfg: SuiteConfig) -> Method:
    """align.method=simpo: the pairs, the base's weights (+ LoRA), SimPO (no reference)."""
    return _compose(cfg, SimPO(cfg.align.simpo_beta, cfg.align.simpo_gamma, cfg.align.label_smoothing))
