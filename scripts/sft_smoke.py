"""Can a tiny suite Transformer learn the built-in SFT task on this CPU? Prints held-out exact match.

A standalone loop (not the Trainer) over the real pieces: the embedded-corpus tokenizer,
suite.data.tasks, the SFT loader (packing, masked labels), suite.models.lora and
suite.infer.evaluate. Optionally pretrains briefly on the embedded corpus first.

    python scripts/sft_smoke.py --task reverse-6 --method full --steps 300
    python scripts/sft_smoke.py --task reverse-6 --method lora --rank 8 --pretrain-steps 300

The pretrained weights are cached (keyed by the pretraining settings) so several finetuning runs
share one pretraining.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from suite.config.schema import DataConfig, ModelConfig  # noqa: E402
from suite.data import TokenBatches, ensure_prepared, load_tokenizer  # noqa: E402
from suite.data.sft import SFTBatches, SFTDataset, SFTOptions  # noqa: E402
from suite.data.tasks import DEFAULT_TASK, get_task, write_task  # noqa: E402
from suite.infer.evaluate import evaluate_task  # noqa: E402
from suite.models import build_model, materialize  # noqa: E402
from suite.models.lora import apply_lora, count_trainable  # noqa: E402
from suite.train.loss import cross_entropy  # noqa: E402


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def model_config(args) -> ModelConfig:
    return ModelConfig(
        name="gpt-tiny",
        family=args.family,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        vocab_size=8192,
        max_seq_len=args.seq_len,
    )


def pretrained_state(args, cfg: ModelConfig, data_dir: Path) -> dict[str, torch.Tensor] | None:
    """Weights after `--pretrain-steps` of causal-LM training on the embedded corpus (cached)."""
    if args.pretrain_steps <= 0:
        return None
    key = json.dumps(
        [cfg.__dict__, args.pretrain_steps, args.pretrain_lr, args.seed, 16], sort_keys=True, default=str
    )
    cache = (
        Path(tempfile.gettempdir()) / f"sft-smoke-pretrain-{hashlib.sha256(key.encode()).hexdigest()[:10]}.pt"
    )
    if cache.is_file():
        print(f"pretrained weights from {cache}")
        return torch.load(cache, weights_only=True)
    model = materialize(build_model(cfg), "cpu", args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = TokenBatches(data_dir, "train", cfg.max_seq_len, 16, 16, seed=args.seed)
    start = time.time()
    for step in range(args.pretrain_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.pretrain_steps, args.pretrain_lr, 30)
        (batch,) = batches.next_step()
        loss = cross_entropy(model(batch.tokens), batch.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.pretrain_steps - 1:
            print(f"pretrain step {step:4d} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, cache)
    return state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default=DEFAULT_TASK)
    p.add_argument("--method", choices=["full", "lora"], default="full")
    p.add_argument("--family", default="gpt")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--template", default="plain")
    p.add_argument("--num-train", type=int, default=20000)
    p.add_argument("--num-eval", type=int, default=200)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16, help="rows (of seq-len tokens) per step")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 full, 3e-3 lora")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=None, help="default: 2 x rank")
    p.add_argument("--pretrain-steps", type=int, default=0)
    p.add_argument("--pretrain-lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument(
        "--time-limit", type=float, default=600.0, help="seconds of finetuning before a final eval"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lr = args.lr or (1e-3 if args.method == "full" else 3e-3)

    data_dir = ensure_prepared(DataConfig(), progress=False)
    tokenizer = load_tokenizer(data_dir)
    cfg = model_config(args)
    work = Path(tempfile.mkdtemp(prefix="sft-smoke-"))
    files = write_task(args.task, work, args.num_train, args.num_eval, seed=args.seed)
    t0 = time.time()
    dataset = SFTDataset.build(
        files["train"], tokenizer, SFTOptions(seq_len=args.seq_len, template=args.template)
    )
    print(f"SFT data ({time.time() - t0:.1f}s): {dataset.report.summary()}")
    batches = SFTBatches(dataset, args.batch, args.batch, seed=args.seed)

    state = pretrained_state(args, cfg, data_dir)
    model = materialize(build_model(cfg), "cpu", args.seed)
    if state is not None:
        model.load_state_dict(state)
    if args.method == "lora":
        apply_lora(model, rank=args.rank, alpha=args.alpha or 2.0 * args.rank, seed=args.seed)
    counts = count_trainable(model)
    print(
        f"{args.method}: {counts.trainable:,} of {counts.total:,} parameters trainable ({counts.ratio:.2%})"
    )

    def evaluate(limit=None):
        return evaluate_task(
            model,
            tokenizer,
            args.task,
            files["eval"],
            max_new_tokens=args_max_new(args.task),
            limit=limit,
            template=args.template,
        )

    before = evaluate(limit=50)
    print(f"before finetuning: accuracy {before['accuracy']:.1%} on 50")
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0 if args.method == "lora" else 0.1
    )
    model.train()
    start, cpu_start = time.time(), time.process_time()
    step = 0
    while step < args.steps and time.time() - start < args.time_limit:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, lr, args.warmup)
        (batch,) = batches.next_step()
        loss = cross_entropy(model(batch.tokens, **batch.model_kwargs()), batch.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            print(
                f"step {step:4d} loss {loss.item():.4f} lr {lr_at(step, args.steps, lr, args.warmup):.2e} "
                f"epoch {batches.epoch} ({time.time() - start:.0f}s, cpu {time.process_time() - cpu_start:.0f}s)",
                flush=True,
            )
        if step % args.eval_every == 0 and step < args.steps:
            r = evaluate(limit=100)
            print(
                f"  eval@{step}: accuracy {r['accuracy']:.1%} on 100 ({time.time() - start:.0f}s)", flush=True
            )
    train_s, cpu_s = time.time() - start, time.process_time() - cpu_start
    final = evaluate()
    print(
        json.dumps(
            {
                "task": args.task,
                "method": args.method,
                "pretrain_steps": args.pretrain_steps,
                "steps": step,
                "lr": lr,
                "train_seconds": round(train_s, 1),
                "train_cpu_seconds": round(cpu_s, 1),
                "threads": torch.get_num_threads(),
                "accuracy": final["accuracy"],
                "correct": final["correct"],
                "total": final["total"],
                "trainable_ratio": round(counts.ratio, 4),
                "rank": args.rank if args.method == "lora" else None,
                "examples": final["examples"][:3],
            }
        )
    )


def args_max_new(task: str) -> int:
    return get_task(task).max_answer_chars + 2  # digits are single tokens, plus eos and slack


if __name__ == "__main__":
    main()
