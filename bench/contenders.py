"""The contenders bench/throughput.py times: its shapes, the suite's real step, the transformers peer, and
what each one ran (optimizer, weights, compute dtype, attention), read from the built objects."""

from __future__ import annotations

from dataclasses import dataclass


# ---- shapes -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A suite recipe plus overrides; the transformers model is derived from the composed config."""

    recipe: str
    overrides: tuple[str, ...] = ()
    steps: int = 3  # timed steps per repetition (--steps overrides)


SHAPES: dict[str, Shape] = {
    # Exactly the CPU default recipe: 4x256, 4 heads, vocab 8192, seq 256, micro 8 x 2 accumulation.
    "gpt-tiny": Shape("gpt-tiny", steps=3),
    # GPT-2 small-like: ~110M parameters (tied head), GELU 3072.
    "gpt-12x768": Shape(
        "gpt-tiny",
        (
            "model.name=gpt-12x768",
            "model.num_layers=12",
            "model.hidden_size=768",
            "model.num_heads=12",
            "model.vocab_size=32000",
            "model.max_seq_len=512",
            "data.seq_len=512",
            "parallel.micro_batch_size=4",
            "parallel.global_batch_size=4",
        ),
        steps=2,
    ),
    # Llama-family: ~134M parameters, SwiGLU 2048, untied head, no GQA.
    "llama-12x768": Shape(
        "llama-tiny",
        (
            "model.name=llama-12x768",
            "model.num_layers=12",
            "model.hidden_size=768",
            "model.num_heads=12",
            "model.num_kv_heads=12",
            "model.ffn_hidden_size=2048",
            "model.vocab_size=32000",
            "model.max_seq_len=512",
            "model.tie_embeddings=false",
            "data.seq_len=512",
            "parallel.micro_batch_size=4",
            "parallel.global_batch_size=4",
        ),
        steps=2,
    ),
}
WARMUP = 2


# Suite rows besides the recipe as is, per precision: bf16 parameters with fp32 masters is another
# precision scheme than the peer's (fp32 weights + autocast), so it is labelled and compared apart.
SUITE_EXTRA_ROWS = {"bf16": {"bf16 params": ("train.param_dtype=bf16",)}, "fp32": {}}


def suite_config(shape: str, precision: str, extra: tuple[str, ...] | list[str] = ()):
    """The composed, validated suite config of a shape (the source of truth for both contenders);
    `extra`: further overrides (the suite contender's settings)."""
    from suite.config.compose import compose_config, to_object
    from suite.preflight import validate
    from suite.runtime import resolve_auto

    spec = SHAPES[shape]
    overrides = [
        f"recipe={spec.recipe}",
        *spec.overrides,
        f"train.precision={precision}",
        "train.device=cpu",
        *extra,
    ]
    cfg = to_object(resolve_auto(compose_config(overrides)))
    dims = validate(cfg, needs_data=False)
    return cfg, dims


# ---- the contenders (run inside a worker subprocess) --------------------------------------------
def build_suite_step(cfg, dims):
    """The suite's step exactly as `Trainer` builds and runs it, minus data, logging and checkpoints
    (suite.train.trainer.standalone_step: the trainer's own construction calls and `build_step`)."""
    import torch

    from suite.data.batch import Batch
    from suite.train.schedule import lr_at
    from suite.train.trainer import standalone_step

    runner = standalone_step(cfg, dims, torch.device("cpu"))
    done = [0]

    def step(micro_batches):
        lr = lr_at(done[0], cfg.optim, cfg.sched, cfg.train.max_steps)  # the loop's learning rate
        result = runner([Batch.from_windows(b) for b in micro_batches], lr)  # views: no copy
        done[0] += 1
        return result.loss

    step.optimizer = runner.optimizer  # read by step_setup: what the row ran
    return step, runner.model


def hf_model(cfg):
    """transformers' own class for the shape (the config `suite export` writes: suite.models.hf_mapping),
    with no dropout, SDPA attention and no KV cache."""
    from transformers import AutoModelForCausalLM

    from suite.models.hf_mapping import hf_config

    config = hf_config(cfg.model)
    config.initializer_range = cfg.model.init_std
    config.use_cache = False
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def build_hf_step(cfg, compile_: bool):
    """What a user would write with transformers for speed: fused AdamW, autocast, clip, step."""
    from contextlib import nullcontext

    import torch
    import torch.nn.functional as F

    torch.manual_seed(cfg.train.seed)
    model = hf_model(cfg).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        fused=True,  # the fastest AdamW torch has, on CPU too; what the suite's optimizer picks there
    )
    forward = torch.compile(model) if compile_ else model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else nullcontext
    vocab = cfg.model.vocab_size

    def step(micro_batches):
        total = torch.zeros(())
        for batch in micro_batches:
            with autocast():
                logits = forward(input_ids=batch[:, :-1], use_cache=False).logits
                # transformers' ForCausalLMLoss: logits.float(), mean cross-entropy over the tokens.
                loss = F.cross_entropy(logits.float().view(-1, vocab), batch[:, 1:].reshape(-1))
                loss = loss / len(micro_batches)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    step.optimizer = optimizer
    return step, model


def step_setup(contender: str, cfg, model, step) -> dict:
    """What the timed step ran: optimizer and weights read from the built objects, the compute dtype from
    the precision and the weights (both steps autocast over fp32 weights only), the attention kernel."""
    import torch

    weights = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    weight_dtype = weights.get(next(model.parameters()).dtype, str(next(model.parameters()).dtype))
    optimizer = step.optimizer
    optimizer = getattr(optimizer, "inner", optimizer)  # fp32-master wrapper: the AdamW inside
    kind = (
        "fused"
        if optimizer.defaults.get("fused")
        else "foreach"
        if optimizer.defaults.get("foreach")
        else "for-loop"
    )
    autocast = cfg.train.precision if cfg.train.precision != "fp32" and weight_dtype == "fp32" else None
    if contender == "suite":
        attention = cfg.model.attention  # resolved at compose time (auto -> explicit or sdpa)
        masters = " (fp32 masters)" if weight_dtype != "fp32" else ""
    else:
        attention = model.config._attn_implementation
        masters = ""
    return {
        "optimizer": f"{type(optimizer).__name__} {kind}",
        "weights": weight_dtype + masters,
        "compute": f"{autocast} autocast" if autocast else weight_dtype,
        "attention": attention,
    }
