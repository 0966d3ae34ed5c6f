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
    from suite.checks import validate
    from suite.config.compose import compose_config, to_object
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
    """The suite's step exactly as `Trainer` builds and runs it, minus data, logging and checkpoints.

    A bare Trainer gets the attributes `Trainer.__init__` gives it (same calls, same order), so the
    step timed is `Trainer.train_step` itself; keep this in step with `Trainer.__init__`.
    """
    from collections import deque

    import torch

    from suite.models import build_model, materialize
    from suite.parallel.env import DistEnv
    from suite.parallel.parallelize import parallelize
    from suite.runtime import resolve_precision
    from suite.train.host_memory import apply_host_memory_setting
    from suite.train.optim import build_optimizer
    from suite.train.trainer import Trainer, autocast_factory

    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.dims = cfg, dims
    trainer.device = torch.device("cpu")
    trainer.host_memory_kept = apply_host_memory_setting(cfg.train.keep_host_memory, trainer.device)
    trainer.precision = resolve_precision(cfg.train, trainer.device)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, "meta")
    trainer.parallel = parallelize(model, cfg, dims, trainer.device, trainer.precision)
    trainer.model = trainer.parallel.model
    trainer.parallel.loss_chunk_tokens = cfg.train.loss_chunk_tokens
    if trainer.parallel.materialized is False:
        materialize(trainer.model, trainer.device, cfg.train.seed)
    if hasattr(trainer.parallel, "build_optimizer"):  # the trainer asks the parallel model (layouts wrap it)
        trainer.optimizer = trainer.parallel.build_optimizer(cfg.optim)
    else:
        trainer.optimizer = build_optimizer(
            trainer.model, cfg.optim, trainer.device, trainer.precision.param_dtype
        )
    trainer.scaler = torch.amp.GradScaler(trainer.device.type, enabled=trainer.precision.grad_scaler)
    trainer.autocast = autocast_factory(trainer.device, trainer.precision)
    trainer.step = 0
    trainer.env = DistEnv.from_environ()
    trainer.bad_steps = trainer.bad_in_a_row = 0  # bookkeeping the loop keeps (non-finite steps)
    trainer.batch_number, trainer.spiked = 0, False  # loss-spike bookkeeping (train.spike_factor=0: off)
    trainer.loss_window = deque(maxlen=cfg.train.spike_window)

    def step(micro_batches):
        out = trainer.train_step(micro_batches)  # (loss, grad_norm, ...): the loop's own call
        trainer.step += 1
        return out[0]

    step.optimizer = trainer.optimizer  # read by step_setup: what the row ran
    return step, trainer.model


def hf_model(cfg):
    """transformers' own class for the shape, with the same sizes, no dropout, SDPA attention."""
    m = cfg.model
    if m.family == "gpt":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=m.vocab_size,
            n_positions=m.max_seq_len,
            n_embd=m.hidden_size,
            n_layer=m.num_layers,
            n_head=m.num_heads,
            n_inner=m.ffn_hidden_size,
            activation_function="gelu_new",
            resid_pdrop=m.dropout,
            embd_pdrop=m.dropout,
            attn_pdrop=m.dropout,
            layer_norm_epsilon=m.norm_eps,
            initializer_range=m.init_std,
            tie_word_embeddings=m.tie_embeddings,
            use_cache=False,
        )
        config._attn_implementation = "sdpa"
        return GPT2LMHeadModel(config)
    from transformers import LlamaConfig, LlamaForCausalLM

    from suite.models.transformer import ffn_size

    config = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=ffn_size(m),
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads or m.num_heads,
        max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        attention_bias=m.qkv_bias,
        mlp_bias=False,
        attention_dropout=m.dropout,
        initializer_range=m.init_std,
        tie_word_embeddings=m.tie_embeddings,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


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
