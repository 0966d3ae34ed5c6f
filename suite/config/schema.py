"""Structured configs: the single source of every default in the suite.

Each dataclass is one Hydra config group (or the root). YAML recipes only override these
fields; a key that is not declared here is rejected at compose time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from suite.config.cluster import ClusterConfig


@dataclass
class ModelConfig:
    """Architecture only. `family` names a registered model family (suite.models.family)."""

    name: str = "gpt-tiny"
    family: str = "gpt"  # a registered family (suite/models/<family>/): gpt | llama | qwen3
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: Optional[int] = None  # None: same as num_heads (no grouped-query attention)
    # width of one attention head; None: hidden_size // num_heads (a pruned model's heads keep their
    # size while hidden_size or num_heads shrink: suite prune)
    head_dim: Optional[int] = None
    ffn_hidden_size: Optional[int] = None  # None: 4*hidden (gpt) or Llama's 8/3*hidden rounded to 256
    vocab_size: int = 8192
    max_seq_len: int = 1024  # learned-position table size (gpt); RoPE cache length (llama)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None  # e.g. {rope_type: llama3, factor: 8.0, ...}
    qkv_bias: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    # one matmul for q/k/v (attention.wqkv) and for the SwiGLU gate/up (feed_forward.w13); see
    # suite/models/transformer.py and docs/performance.md (off: it did not pay on the CPU measured)
    fused_projections: bool = False
    # softmax(QK^T)V: sdpa (F.scaled_dot_product_attention: flash kernels, no score matrix) | explicit
    # (the score matrix in the compute dtype: 2x faster than the CPU flash kernel in bf16) | auto (explicit
    # for bf16/fp16 on CPU up to EXPLICIT_ATTENTION_MAX_SEQ tokens, else sdpa; resolved at compose time)
    attention: str = "auto"
    # packed documents (data.doc_mask, SFT packing): varlen (one causal SDPA per document, memory linear
    # in the sequence) | dense (a [seq, seq] boolean mask, quadratic); suite/models/document_attention.py
    document_attention: str = "varlen"
    init_std: float = 0.02
    init_from: Optional[str] = None  # hf:<folder> or a suite run/checkpoint folder
    # Mixture of Experts (suite/models/moe.py); num_experts=0: every layer is dense
    num_experts: int = 0
    top_k: int = 2  # experts per token (softmax over the top-k router logits)
    # true: the top-k weights renormalised to sum to 1 (Mixtral, Qwen3-MoE's norm_topk_prob=true);
    # false: each expert weighted by its probability in the softmax over all experts
    norm_topk_prob: bool = True
    # the router's scores: softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3: each expert scored on its own)
    router_score: str = "softmax"
    # grouped top-k (DeepSeek-V3's n_group / topk_group): experts in router_groups groups, tokens choose
    # among the router_topk_groups groups with the best two-expert sums; 1 / 1: plain top-k
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this (DeepSeek-V3: 2.5)
    # auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing
    # experts only, moved by this much after every step toward the mean load (0: no bias; V3: 0.001)
    router_bias_update_rate: float = 0.0
    # Multi-head latent attention (the deepseek_v3 family; suite/models/deepseek_v3/attention.py):
    # q through a rank-q_lora_rank bottleneck (None: one projection), k/v from a rank-kv_lora_rank latent
    # (what the decode cache holds) plus one RoPE key of qk_rope_head_dim shared by the heads
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # multi-token prediction (DeepSeek-V3's num_nextn_predict_layers; suite/models/mtp.py): modules that
    # predict the token k + 1 ahead from the model's last hidden state and the next tokens' embeddings,
    # their mean cross-entropy times mtp_loss_coef added to the training loss; dropped on export
    num_mtp_layers: int = 0
    mtp_loss_coef: float = 0.3
    moe_every: int = 1  # every n-th layer is MoE (layers n-1, 2n-1, ...)
    moe_layers: Optional[list[int]] = None  # explicit MoE layer ids; overrides moe_every
    num_shared_experts: int = 0  # experts every token also goes through (one MLP of that many widths)
    moe_ffn_hidden_size: Optional[int] = None  # width of one expert; None: the dense MLP width
    capacity_factor: Optional[float] = None  # None: dropless; else tokens beyond cf*T*k/E per expert drop
    # the experts' matmuls: grouped (one torch._grouped_mm per weight for all experts; padded where it
    # does not run) | padded (tokens in an [experts, max tokens, hidden] buffer, torch.bmm) | loop (one
    # matmul chain per expert, the reference); suite/models/moe.py
    moe_impl: str = "grouped"
    aux_loss_coef: float = 0.01  # load-balancing loss weight (Switch/Mixtral)
    z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE); 0: off


@dataclass
class ParallelConfig:
    """Parallel degrees and batch sizes. Degrees may be the string 'auto' (what is left of the world)."""

    dp: Any = 1
    sharding: Any = 1
    sharding_stage: int = 3
    offload: bool = False
    tp: Any = 1
    sp: bool = False
    pp: Any = 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    vpp: int = 1
    cp: Any = 1
    ep: Any = 1
    # expert all-to-all: flat (straight to each expert's rank) | hierarchical (each token once per
    # node, then inside the node: suite/parallel/hierarchical_dispatch.py) | auto (hierarchical
    # when the ep groups span nodes)
    ep_dispatch: str = "auto"
    micro_batch_size: int = 8
    global_batch_size: int = 16
    # true (`parallel=auto`): `suite pretrain` asks the planner (suite/plan/auto.py) for the fastest
    # layout that fits the world it launches (launch.nnodes x launch.nproc_per_node on the cluster
    # group) and trains with its degrees, micro_batch_size and recompute; global_batch_size stays
    auto: bool = False
    # FSDP2 (sharding_stage 2-3): blocks whose all-gather each block starts ahead in forward / in
    # backward (docs/performance.md); 0 / 1 are FSDP2's implicit defaults
    fsdp_forward_prefetch: int = 0
    fsdp_backward_prefetch: int = 1


@dataclass
class RecomputeConfig:
    granularity: str = "none"  # none | full | full_attn | core_attn
    num_layers: Optional[int] = None  # None: every layer (after skip_layers)
    skip_layers: int = 0


@dataclass
class CompressConfig:
    """`suite quantize ckpt=<run> compress=<option>`: post-training quantization (torchao).

    method: none | a registered method (suite.models.compression; `suite quantize --help` lists them);
    on `suite pretrain` / `suite finetune`: a method's training option, qat-int4 | qat-int8
    (quantization-aware training, converted to int4 / int8 at the end). See docs/compression.md.

    The keys users type, flat: each method reads its own through its config dataclass (`options`:
    group_size for int4 and gptq, symmetric, clip_search and clip_weighted for gptq, act_order for gptq
    and gptq-int8, smoothquant_alpha, gptq_damp, calib_samples for calibrated methods;
    learn_scales and scale_lr for the training half); skip and the report's keys apply to all.
    """

    method: str = "none"
    group_size: int = 32  # int4: weights per quantization group along the input dimension
    # module-name patterns (fnmatch, on names like layers.0.attention.wq) left in full precision;
    # the embedding is never a Linear, the output head is usually tied to it
    skip: list[str] = field(default_factory=lambda: ["tok_embeddings", "pos_embeddings", "output"])
    # the token embedding (and the output head tied to it) after any method: int8, one scale per row
    # (a 4-byte-per-weight table that dominates a small model's file); none: kept in full precision
    embedding: str = "none"
    # qat-*: the fake quantizer's scales are trained with the weights (learned step size, LSQ; torchao's
    # range learning) and the conversion stores them; false: each step recomputes them from the weights
    learn_scales: bool = True
    # learned scales' learning rate as a multiple of optim.lr: int4's; int8's, whose steps are ~17x finer
    # (max / 127.5 against max / 7.5), get 7.5 / 127.5 of it, the same change relative to the scale
    scale_lr: float = 1.0
    calib_samples: int = 32  # smoothquant, gptq: sequences of the recipe's data calibration sees
    smoothquant_alpha: float = 0.5  # smoothquant: migration strength (0: none, 1: all onto the weights)
    gptq_damp: float = 0.01  # gptq: fraction of the mean Hessian diagonal added to it (numerical damping)
    # gptq: int4 groups with an integer zero point, scale = (max - min) / 15 (torchao's ASYMMETRIC mapping;
    # fits off-centre groups, measured better on SmolLM2 in docs/benchmarks.md); true: scale = max|w| / 7.5,
    # zero point 0 (int4, qat-int4 and gptq-int8 are always symmetric)
    symmetric: bool = False
    # gptq (asymmetric): each group's range shrunk by the factor in 1.0..0.8 (steps of 0.025) whose
    # rounding error on its weights is least (measured better on SmolLM2 in docs/benchmarks.md)
    clip_search: bool = True
    # gptq (clip_search): each weight's error in the search weighted by its input's mean square on the
    # calibration data (diag H, as AWQ's and GPTQModel's MSE searches weigh it); measured on SmolLM2
    # (docs/benchmarks.md): no better with act_order, so off
    clip_weighted: bool = False
    # gptq, gptq-int8: columns rounded in order of decreasing diag H (GPTQ's act-order / desc_act), the
    # groups' scales and zero points taken from the weight before compensation (static groups), so the
    # stored layout is unchanged; SmolLM2 int4 (docs/benchmarks.md): +12.7% -> +6.6% perplexity over fp32
    act_order: bool = True
    # gptq: this many Linear layers, those with the largest relative int4 output error on the calibration
    # data, are quantized on the int8 grid instead (mixed precision; named in the quantize output)
    int8_layers: int = 0
    eval_batches: int = 8  # report: held-out batches for the perplexity before and after
    decode_tokens: int = (
        16  # report: greedy tokens generated to time decoding (tokens/s; 3 timed calls a model)
    )
    # report: held-out questions answered greedily (exact match) when the run was finetuned on a built-in task; 0: none
    task_samples: int = 50


@dataclass
class DataSourceConfig:
    """One text source, blended by weight: local .txt/.jsonl/.jsonl.gz/.parquet files (a file, folder
    or glob), a `datasets` save_to_disk folder, or a `datasets` name."""

    path: str = MISSING
    weight: float = 1.0
    text_field: str = "text"
    split: str = "train"
    name: Optional[str] = None  # datasets config name
    min_chars: int = 0  # documents shorter than this many characters are dropped (counted as filtered)


@dataclass
class DataConfig:
    path: Optional[str] = None  # prepared data folder; None: the embedded corpus, built on first use
    sources: list[DataSourceConfig] = field(default_factory=list)
    seq_len: int = 256
    vocab_size: int = 8192  # tokenizer size when `suite prepare` trains one
    val_fraction: float = 0.02
    tokenizer: Optional[str] = None  # an existing tokenizer.json/folder to reuse instead of training
    cache_dir: Optional[str] = None  # where the embedded corpus is built; None: ~/.cache/suite
    max_corpus_mb: float = 8.0  # size cap of the embedded corpus text
    doc_mask: bool = False  # pretraining: attention stays inside documents, positions restart after EOS
    # gather the next step's batch in a background thread (pinned memory on CUDA); None: on when
    # training on an accelerator, off on the CPU (the thread would compete with compute for cores)
    prefetch: Optional[bool] = None
    # suite prepare: tokenization worker processes (None: the cores available); the shards are the same
    # whatever the number. skip_bad_files: a source file that cannot be read is skipped and counted
    # instead of stopping. part_mb: text per resumable part: a killed prepare, run again, redoes at
    # most one part per worker. tokenizer_sample_mb: the reservoir sample a trained tokenizer learns from.
    workers: Optional[int] = None
    skip_bad_files: bool = False
    part_mb: float = 64.0
    tokenizer_sample_mb: float = 64.0


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (Muon on the hidden matrices, AdamW on the rest: suite/train/muon.py)
    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    fused: Optional[bool] = None  # None: fused where the device supports it
    # optim=muon: the hidden matrices' momentum, Nesterov, Newton-Schulz iterations, and the lr scaling
    # by shape (match_rms_adamw: 0.2*sqrt(max(rows, cols)), so optim.lr/weight_decay carry over from AdamW;
    # original: sqrt(max(1, rows/cols)); none)
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"
    # the Newton-Schulz iteration's dtype: bf16 (torch.optim.Muon's, fast on GPUs) or fp32 (no rounding
    # flips: layouts then match one process within 1e-4, where bf16 agrees only to ~1e-2 of the update);
    # auto: bf16 where the device computes bf16 natively, else fp32 (on an AVX2 CPU a 256 x 1024
    # orthogonalisation took 6.6x longer in emulated bf16 than in fp32: docs/benchmarks.md, time to loss)
    muon_ns_dtype: str = "auto"
    # name parts of 2-D (3-D: experts) weights under `layers.` that stay on AdamW: the MoE router and
    # LoRA adapters (low-rank factors, whose orthogonalisation is not what Muon was tuned for)
    muon_exclude: list[str] = field(default_factory=lambda: ["router", "lora_"])


@dataclass
class SchedConfig:
    name: str = "cosine"  # cosine | linear | constant | wsd
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    # wsd (warmup-stable-decay): the decay takes the last decay_fraction of train.max_steps, shaped
    # linear | cosine | 1-sqrt, down to min_lr_ratio * optim.lr; the lr is constant before it
    decay_fraction: float = 0.2
    decay_shape: str = "linear"
    # the step count the schedule decays over (null: train.max_steps); larger than train.max_steps, a run
    # stops part-way down a longer schedule, as a checkpoint inside that longer run would
    total_steps: Optional[int] = None


@dataclass
class LogConfig:
    progress: bool = True
    wandb: bool = True
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "suite"
    tensorboard: bool = False  # scalars under <run.dir>/tensorboard/ (log=tensorboard)
    report: bool = True  # report.md + plots/*.png in the run folder when training ends (suite.report)


@dataclass
class LaunchConfig:
    nproc_per_node: Any = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = "127.0.0.1:29500"
    max_restarts: int = 0
    backend: str = "auto"  # auto | nccl | gloo
    # how each rank's process starts: spawn (a fresh interpreter that imports torch and the suite,
    # ~4 s of CPU per rank), fork (forked from one process per job that imported them once:
    # suite/launch/fork_server.py), auto (fork for CPU workers, spawn for GPU ones, not yet measured there)
    worker_start: str = "auto"


@dataclass
class TrainConfig:
    max_steps: int = 300
    save_every: int = 100
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 1234
    # fp32 | bf16 | fp16 | fp8 (CUDA 8.9+: torchao float8 Linear matmuls, bf16 elsewhere) | auto (bf16
    # where the device has native bf16, else fp32)
    precision: str = "fp32"
    # bf16: model params/grads in bf16, AdamW on fp32 master copies with fp32 state (docs/performance.md)
    param_dtype: str = "fp32"  # fp32 | bf16 (needs precision=bf16)
    resume: bool = True
    # start clean in a run.dir that holds a run: move that run aside to <run.dir>.old-<N> first
    overwrite: bool = False
    peak_flops: Optional[float] = (
        None  # per device; None: tabled for known GPUs (unknown GPU: no MFU), measured on CPU
    )
    compile: Any = (
        "auto"  # torch.compile each block: auto (where it pays, docs/performance.md) | true | false
    )
    device: str = "auto"  # auto | cpu | cuda
    num_threads: Optional[int] = None
    # keep freed host memory in the process (glibc malloc: no per-step page faults): auto (on for CPU
    # training) | true | false (suite.train.host_memory, docs/performance.md)
    keep_host_memory: Any = "auto"
    # performance (docs/performance.md)
    profile: bool = False  # torch profiler trace + top-operator table into <run.dir>/profile/
    profile_wait: int = 1  # steps skipped before profiling (the first step pays one-off costs)
    profile_warmup: int = 1  # steps traced but discarded (profiler start-up)
    profile_steps: int = 2  # steps recorded
    # peak live tensor bytes per rank over the last step (slow: that step only), what `suite plan`
    # predicts: summary.json tensor_peak_gb_per_rank (suite.train.tensor_memory)
    tensor_memory: bool = False
    loss_chunk_tokens: int = (
        1024  # head + cross-entropy over chunks of this many tokens (not all logits at once); 0: off
    )
    # reliability (docs/reliability.md)
    keep_last: int = 3  # checkpoints kept (newest first); 0 keeps all
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this, forever; 0: off
    max_bad_steps: int = 3  # non-finite loss/grad-norm steps in a row before the run stops
    collective_timeout_s: float = 600.0  # process-group timeout: a hung collective fails after this
    async_save: bool = False  # write checkpoints in a background thread while training goes on
    spike_factor: float = 0.0  # loss-spike rollback: a loss above factor x the running mean; 0: off
    spike_window: int = 20  # good steps in that running mean
    # layout checks: write this step's gradients (full tensors, before clipping) to
    # <run.dir>/grads/step_<N>/ (suite.train.grad_dump); 0: off
    save_grads_step: int = 0
    # fault-injection aids for tests; inert at their defaults
    inject_nan_steps: list[int] = field(default_factory=list)  # steps whose loss is made NaN
    fault_kill_rank: Optional[int] = None  # this rank SIGKILLs itself at fault_kill_step (first attempt only)
    fault_kill_step: Optional[int] = None
    inject_spike_batches: list[int] = field(default_factory=list)  # batches (1-based) whose loss is x100


@dataclass
class GenerateConfig:
    prompt: str = "The "
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: Optional[int] = 50
    top_p: Optional[float] = 0.95
    seed: int = 0
    prompts_file: Optional[str] = (
        None  # a batch of prompts: a text file (one per line) or JSONL ({"prompt": ...})
    )
    batch_size: int = 8  # prompts decoded together (prompts_file)
    stop: list[str] = field(default_factory=list)  # stop sequences: generation ends where one appears
    chat: bool = False  # render the prompt as a user turn with the model's chat template
    stream: bool = True  # print tokens as they are decoded (one prompt, console)
    compile: bool = False  # torch.compile the decode step (static shapes: compiled once per batch size)
    # the suite model's decode precision: fp32 | bf16 | fp16 (weights, activations and KV cache; half
    # the bytes read per token, logits within docs/benchmarks.md's stated tolerance of fp32's)
    dtype: str = "fp32"


@dataclass
class GRPOConfig:
    """align.method=grpo: reinforcement learning with verifiable rewards (docs/grpo.md). The prompts are
    finetune.data's built-in task questions (the held-out ones stay held out); each optimizer step is
    one update, and a new rollout batch is sampled every `updates_per_batch` steps."""

    group_size: int = 8  # G: completions sampled per prompt (>= 2: advantages are normalised per group)
    prompts_per_step: int = 8  # prompts of one rollout batch, over all data-parallel ranks
    temperature: float = 1.0  # sampling temperature (> 0)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability
    max_new_tokens: Optional[int] = None  # completion budget; None: the task's answer length + 2
    reward: str = "exact"  # reward names summed, comma-separated: exact | format | module:function
    kl_coef: float = 0.0  # weight of the k3 KL estimate to the frozen reference (0: no reference)
    clip_eps: float = 0.2  # the ratio is clipped to [1 - clip_eps, 1 + clip_eps]
    updates_per_batch: int = 1  # optimizer steps on each rollout batch
    # the sampler's log-probabilities vs the trainer's for the same tokens, checked before the first
    # update of every rollout batch: a larger max absolute difference stops the run
    max_abs_logprob_diff: float = 1e-4
    sampler: str = "exact"  # exact: the trainer's shapes every token (bitwise in fp32) | kv: KV cache


@dataclass
class ExportConfig:
    # hf: a save_pretrained folder (safetensors + config + tokenizer); torch_export: prefill and decode .pt2
    # programs with an explicit KV cache; onnx: the same two graphs for onnxruntime; gguf: llama.cpp's file
    format: str = "hf"
    quantize: Optional[str] = None  # onnx: int8 | int4 (onnxruntime); gguf: f16 | q8_0 | q4_0 (None: f16)
    out: Optional[str] = None  # None: <run.dir>/export-<format>
    dtype: str = "fp32"  # fp32 | bf16 | fp16
    merge_lora: bool = False  # a LoRA run: fold the adapters into the weights (needed for format=hf)
    max_shard_mb: float = 2048.0  # safetensors files of at most this size (+ an index when several)


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # every linear layer of a block


@dataclass
class LoRAConfig:
    """Low-rank adapters (finetune.method=lora): y = x W^T + (x A^T) B^T * alpha / rank."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # + output when untied; + experts on a MoE model (the routed experts alone; w1/w2/w3 include them)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))


@dataclass
class SFTSourceConfig:
    """Chat rows: a local .jsonl/.jsonl.gz/.json/.parquet file, folder or glob, a `datasets`
    save_to_disk folder, or a `datasets` name."""

    path: str = MISSING
    split: str = "train"
    name: Optional[str] = None  # datasets config name


@dataclass
class SFTDataConfig:
    """What finetuning learns from: a built-in task, or chat rows (see docs/finetuning.md).

    The row-shaping defaults here are the ones suite.data.sft.SFTOptions uses.
    """

    task: Optional[str] = None  # a built-in task (reverse-N, sort-N, addition-N); generated, no network
    task_seed: int = 0  # the task's question generator (the held-out split depends on it and num_eval only)
    num_train: int = 20000  # task questions to train on
    num_eval: int = 200  # task questions held out
    sources: list[SFTSourceConfig] = field(default_factory=list)  # chat rows (instead of a task)
    eval_sources: list[SFTSourceConfig] = field(default_factory=list)  # held-out rows; []: eval_fraction
    eval_fraction: float = 0.02  # of `sources`' samples held out when eval_sources is empty
    template: str = "auto"  # chat template: auto (the tokenizer's own, else chatml) | chatml | plain | file
    packing: bool = True  # several samples per row, no attention across samples
    truncation: str = "truncate"  # truncate (from the left, the last reply kept whole) | skip
    on_error: str = "skip"  # malformed rows: skip (counted, reported) | fail (first one's line number)
    system_prompt: Optional[str] = None  # added to rows without a system message


@dataclass
class FinetuneConfig:
    """`suite finetune`: supervised finetuning of model.init_from's weights (docs/finetuning.md)."""

    method: str = "full"  # full | lora
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    epochs: Optional[float] = None  # set: train.max_steps = epochs x steps per epoch
    eval_samples: int = 100  # held-out task questions answered (greedy) at each eval; 0: loss only
    max_new_tokens: Optional[int] = None  # answer budget in task evaluation; None: the task's + 2


@dataclass
class EvalConfig:
    """`suite eval ckpt=<run>`: held-out exact match by greedy generation (metric=accuracy), sliding-window
    perplexity (metric=perplexity), or lm-evaluation-harness tasks (harness=<task,...>)."""

    metric: str = "accuracy"  # accuracy (a built-in task) | perplexity
    task: Optional[str] = None  # None: the task the checkpoint was finetuned on
    num_samples: Optional[int] = None  # None: the run's finetune.data.num_eval
    max_new_tokens: Optional[int] = None  # None: the task's answer length + 2
    data: Optional[str] = (
        None  # perplexity text: None = the recipe's validation shards; a .txt/.jsonl file; hf:<dataset>
    )
    seq_len: Optional[int] = None  # perplexity window (None: model.max_seq_len)
    stride: Optional[int] = None  # perplexity window step (None: seq_len, no overlap)
    max_tokens: Optional[int] = None  # perplexity: score at most this many tokens (None: all)
    harness: Optional[str] = None  # lm-evaluation-harness task names, comma-separated
    limit: Optional[int] = None  # harness: samples per task (None: all)
    batch_size: int = 8


@dataclass
class AlignConfig:
    """`suite align`: preference tuning (DPO, SimPO) or reinforcement learning with rewards (GRPO) of
    model.init_from's weights (docs/align.md). The methods are registered in suite/align/."""

    method: str = "dpo"  # a registered method: dpo | simpo | grpo
    # preference pairs (dpo, simpo): a .jsonl/.jsonl.gz/.json/.parquet file, a folder of them, or a
    # `datasets` save_to_disk folder; rows {prompt, chosen, rejected} as strings or chat messages;
    # task:<name>: align.num_pairs questions of a built-in task, right answer vs a corrupted one
    data: Optional[str] = None
    num_pairs: int = 2000  # align.data=task:<name>: pairs drawn (align.num_eval of them held out)
    # align.data=task:<name>: 0: rejected = the right answer with two digits swapped; N > 0: the most
    # frequent wrong one of N answers model.init_from samples per question (the swapped one where none
    # is wrong), at align.pair_temperature (suite.align.sampled_pairs)
    pair_samples: int = 0
    pair_temperature: float = 1.0
    num_eval: int = 16  # pairs held out (the last ones of the data) for val_loss
    lora: bool = False  # adapters with finetune.lora.*'s shapes; the reference is the base, adapters off
    beta: float = 0.1  # dpo: strength of the implicit KL to the reference (TRL's default)
    label_smoothing: float = (
        0.0  # dpo: the chance a pair's labels are flipped (conservative DPO), in [0, 0.5)
    )
    # dpo: weight of the chosen response's negative log-likelihood per token added to each pair's loss
    # (RPO, TRL's rpo_alpha): keeps the chosen likelihood from falling with the rejected one; 0: plain DPO
    rpo_alpha: float = 0.0
    simpo_beta: float = 2.0  # simpo: scale of the length-normalised log-probabilities (the paper's default)
    simpo_gamma: float = 1.0  # simpo: the target reward margin
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # align.method=grpo (docs/grpo.md)


@dataclass
class PruneConfig:
    """`suite prune ckpt=<run> prune.ffn=<fraction> prune.heads=<fraction> prune.hidden=<fraction>
    prune.layers=<count>`: structured pruning by activation importance on calibration data
    (docs/compression.md); calibration, held-out and report sizes are compress.calib_samples /
    eval_batches / task_samples / decode_tokens."""

    ffn: float = 0.0  # fraction of every MLP's channels to remove
    layers: int = 0  # blocks to remove (the least important: 1 - cos(input, output))
    heads: float = 0.0  # fraction of every layer's attention (query) heads to remove (GQA: per KV group)
    hidden: float = 0.0  # fraction of the hidden (embedding) channels to remove


@dataclass
class DistillConfig:
    """`suite distill teacher=<run|checkpoint|hf:dir>`: train the recipe's model (the student) on the
    recipe's data against a frozen teacher's distribution (docs/compression.md)."""

    teacher: Optional[str] = None  # the teacher model: a suite run/checkpoint folder or hf:<folder>
    data: str = "pretrain"  # pretrain: the recipe's data (data.*) | sft: finetune.data's chat rows
    loss: str = "forward_kl"  # forward_kl | reverse_kl | jsd: the divergence to the teacher
    temperature: float = 1.0  # both distributions softened by it; the divergence is scaled by T^2
    ce_weight: float = 0.5  # weight of the hard-label cross-entropy; the divergence gets 1 - ce_weight
    chunk_tokens: int = 1024  # tokens whose logits exist at once (both models' full vocabulary)
    # hidden-state matching (0: off): every student block's output against an evenly spaced teacher
    # block's, at the target tokens, through a learned projection when the widths differ
    hidden_weight: float = 0.0
    hidden_loss: str = "cosine"  # cosine: 1 - cos(student, teacher) | mse: mean squared error per element
    # constant: hidden_weight at every step | linear: from hidden_weight at step 1 down to 0 at the last
    # step (the teacher's blocks guide the start, the labels and logits have the end)
    hidden_schedule: str = "constant"


@dataclass
class RunConfig:
    dir: str = "runs/${model.name}"
    name: Optional[str] = None


@dataclass
class SuiteConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    log: LogConfig = field(default_factory=LogConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    align: AlignConfig = field(default_factory=AlignConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    ckpt: Optional[str] = None  # model to read: a run folder, a checkpoint folder, or hf:<folder>
    recipe_name: str = "default"


GROUPS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "recompute": RecomputeConfig,
    "compress": CompressConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "sched": SchedConfig,
    "log": LogConfig,
    "launch": LaunchConfig,
    "cluster": ClusterConfig,
}
