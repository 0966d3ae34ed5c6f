"""What `suite --help` and `suite <verb> --help` print: the verbs, their keys and examples (the
examples are run as written by tests/e2e/test_docs_commands.py)."""

from __future__ import annotations

from suite.config.compose import known_options

USAGE = """usage: suite <verb> [key=value ...] [group=option ...] [--json]

verbs:
  pretrain   train a language model from scratch (default: gpt-tiny on the embedded corpus)
  finetune   supervised finetuning (full or LoRA) of a suite or HF checkpoint: suite finetune model.init_from=runs/gpt-tiny
  distill    train a smaller student against a frozen teacher: suite distill recipe=distill-gpt-tiny
  prune      remove MLP channels and layers by activation importance: suite prune ckpt=runs/gpt-tiny prune.ffn=0.25
  eval       task accuracy, perplexity (metric=perplexity), lm-eval tasks (harness=suite_tiny_mc)
  prepare    build a tokenizer and packed token shards from text
  generate   sample text from a trained model or an export: suite generate ckpt=<run.dir> prompt="..."
  chat       talk to a finetuned model on the console: suite chat ckpt=runs/sft-tiny
  export     write a Hugging Face folder, torch.export/ONNX graphs or GGUF: suite export ckpt=<run.dir> format=onnx
  quantize   post-training quantization with a before/after report: suite quantize ckpt=<run.dir> compress=int8
  config     show / list / cp recipes: suite config show recipe=gpt13b
  plan       rank every parallel layout by the cost model: suite plan recipe=gpt13b cluster=h100-80g cluster.nodes=4
  report     report.md + plots of a run, or one figure comparing runs: suite report runs/a runs/b out=reports/a-vs-b
  run        a whole lifecycle as one resumable job with a report: suite run pipeline=embedded

Run `suite <verb> --help` for the keys a verb reads. Every default lives in the recipes;
`suite config list` shows them, `suite config show` prints a resolved config.

Every folder a verb writes holds one thing and records what made it: the same command continues
it, another one is refused (exit 2, the folder untouched); --overwrite (train.overwrite=true)
moves the old content aside to <folder>.old-<N> first."""

VERB_HELP = {
    "pretrain": """usage: suite pretrain [recipe=NAME|PATH.yaml] [group=option ...] [key=value ...]

Causal-LM pretraining. With no arguments: gpt-tiny on the embedded corpus (built on first use),
on this machine, writing to run.dir (runs/<model.name>). Re-running the same command resumes from
the newest good checkpoint (train.resume=true). A run folder holds one run: a config that its
checkpoints do not fit (another model, tokenizer) is refused; train.overwrite=true starts clean
after moving the old run aside to <run.dir>.old-<N>.

Common keys:
  recipe={recipes}|./my.yaml
  run.dir=DIR  train.max_steps=N  train.save_every=N  train.log_every=N  train.eval_every=N
  train.seed=N  train.precision=fp32|bf16|fp16|auto  train.resume=true|false  train.overwrite=true
  train.compile=auto|true|false  parallel.micro_batch_size=N  parallel.global_batch_size=N
  parallel.dp/sharding/tp/pp=N  data.path=DIR  data.seq_len=N  model.num_layers=N  model.hidden_size=N
  model.num_heads=N  model.vocab_size=N  optim.lr=X  launch.nproc_per_node=N  log.wandb=false

Writes: <run.dir>/config.yaml, metrics.jsonl, checkpoints/step_<N>/, tokenizer.json, summary.json,
report.md + plots/*.png (suite report --help) (+ plan.json with parallel=auto; tensorboard/ with
log=tensorboard, the same scalars as metrics.jsonl, instead of wandb's offline run in wandb/)

--dry-run [--rank N|worst]: build one rank of the job as written (any world size: launch.nnodes x
launch.nproc_per_node) on the meta device under torch's fake process group, place it with the real
parallelize, and print the parameters, gradient and optimizer-state bytes that rank holds beside
the cost model's count (suite plan); nothing is allocated, no data is read. Default: the worst rank.
e.g. suite pretrain recipe=gpt175b parallel.tp=8 parallel.pp=16 parallel.sharding=8 launch.nnodes=128 --dry-run

--print-launch: print the command each of the launch.nnodes nodes runs (its launch.node_rank, the
launch.rdzv_endpoint on node 0) and run nothing; scripts/slurm/suite.sbatch runs them under srun
(also for finetune and distill). e.g. suite pretrain launch.nnodes=4 launch.rdzv_endpoint=gpu01:29500 --print-launch

parallel=auto (or parallel.auto=true): the planner (suite plan) searches the layouts of the world
this run launches (launch.nnodes x launch.nproc_per_node) on the cluster group's devices (cluster=cpu
here), keeps the recipe's global batch, and trains with the fastest that fits and that the trainer
accepts: every parallel degree, micro_batch_size and recompute. One line names it and why;
<run.dir>/plan.json holds the table, config.yaml the layout that ran. With --dry-run it plans for the
cluster group as it is (e.g. cluster=h100-80g) and builds that layout's worst rank.

Before anything is allocated, a recipe whose planned memory (its own layout, this launch) clearly
exceeds this machine's (each GPU's, or the available RAM shared by this node's CPU processes) stops
with one line: the smallest cluster of the cluster group it needs and the `suite plan` line for the
table (e.g. suite pretrain recipe=gpt175b on a laptop: exit 2, in seconds).

Examples:
  suite pretrain
  suite pretrain parallel=auto launch.nproc_per_node=2
  suite pretrain recipe=llama-tiny train.max_steps=200 run.dir=runs/llama-200
  suite pretrain recipe=moe-tiny train.precision=fp32""",
    "distill": """usage: suite distill distill.teacher=<run.dir|checkpoint|hf:folder> [recipe=NAME|PATH.yaml] [key=value ...]

Knowledge distillation: the recipe's model (the student; from scratch, or model.init_from=<run>)
trains on the recipe's pretraining data (or chat rows: distill.data=sft) against the frozen teacher's next-token distribution,
mixed with the hard-label loss. Default recipe: distill-gpt-tiny (a half-size gpt-tiny student of
runs/gpt-tiny). The teacher is placed like the student (dp, sharding, tp) and must share its tokenizer.
Layouts: dp, sharding and tp (+sp), MoE students too (pp, cp and ep are not supported yet for distillation).

Common keys:
  distill.teacher=runs/gpt-tiny|hf:DIR  distill.loss=forward_kl|reverse_kl|jsd  distill.temperature=X
  distill.ce_weight=X (hard-label share, 0..1)  distill.chunk_tokens=N  distill.data=pretrain|sft
  distill.hidden_weight=X (hidden-state matching; 0: off)  distill.hidden_loss=cosine|mse
  distill.hidden_schedule=constant|linear (linear: decays to 0 at the last step)
  (sft: finetune.data.task=... or finetune.data.sources=..., as for suite finetune)  model.num_layers=N
  model.hidden_size=N  run.dir=DIR  train.max_steps=N  parallel.dp/sharding/tp=N  launch.nproc_per_node=N

Writes: <run.dir>/config.yaml, metrics.jsonl (loss: the mixed loss; val_loss: the student's
cross-entropy), checkpoints/step_<N>/, tokenizer.json, summary.json

Examples:
  suite distill
  suite distill distill.loss=jsd distill.temperature=2 run.dir=runs/distill-jsd""",
    "finetune": """usage: suite finetune [recipe=sft-tiny|PATH.yaml] model.init_from=<run.dir|checkpoint|hf:folder> [key=value ...]

Supervised finetuning with the pretraining trainer (same parallel layouts, recompute, logging,
checkpoints, resume). Default recipe: sft-tiny (gpt-tiny from runs/gpt-tiny on the built-in
reverse-6 task). The base checkpoint gives the architecture and the tokenizer.

Common keys:
  finetune.method=full|lora  finetune.lora.rank=N  finetune.lora.alpha=X  finetune.lora.dropout=X
  'finetune.lora.target_modules=[wq,wk,wv,wo,w1,w2,w3]'  finetune.epochs=X (sets train.max_steps)
  finetune.data.task=reverse-6|sort-6|addition-3  finetune.data.num_train=N  finetune.data.num_eval=N
  finetune.data.task=null 'finetune.data.sources=[{path: data/chat.jsonl}]' (the recipe sets a task)
  'finetune.data.eval_sources=[{path: ...}]'
  finetune.data.template=auto|chatml|plain|FILE.jinja  finetune.data.packing=true|false
  finetune.data.truncation=truncate|skip  finetune.data.on_error=skip|fail  finetune.eval_samples=N
  run.dir=DIR  train.max_steps=N  train.eval_every=N  optim.lr=X  data.seq_len=N  launch.nproc_per_node=N

Writes: <run.dir>/config.yaml, metrics.jsonl (val_loss, val_accuracy), checkpoints/step_<N>/ (+ lora/),
tokenizer files with the chat template, task/ (a built-in task's train/eval rows), lora/ (LoRA runs)

Examples:
  suite finetune model.init_from=runs/gpt-tiny
  suite finetune recipe=sft-tiny-lora model.init_from=runs/gpt-tiny
  suite finetune model.init_from=runs/gpt-tiny finetune.data.task=null 'finetune.data.sources=[{path: data/chat.jsonl}]' run.dir=runs/sft-chat""",
    "eval": """usage: suite eval ckpt=<run.dir|checkpoint dir|hf:folder|quantized dir> [task=NAME | metric=perplexity | harness=TASK,...] [--json]

Three evaluations of any model source:
  (default)          greedy exact-match accuracy on a built-in task's held-out questions (the ones finetuning
                     held out: same finetune.data.task_seed, the first eval.num_samples); `task=` (eval.task),
                     default the task the checkpoint was finetuned on
  metric=perplexity  sliding-window perplexity (the windows of Hugging Face's perplexity guide): windows of
                     eval.seq_len tokens (default model.max_seq_len) every eval.stride tokens (default seq_len),
                     each scoring the tokens the previous one did not; eval.data = unset (the run's validation
                     shards; for hf: give data.path) | FILE.txt | FILE.jsonl ("text" per line, documents joined
                     with eos) | hf:<dataset>[:<config>][:<split>]; eval.max_tokens caps the tokens scored;
                     eval.batch_size windows per forward; launch.nproc_per_node=N parallel.tp=N: tensor parallel
  harness=TASK,...   lm-evaluation-harness tasks through the `suite` lm_eval model (pip install 'suite[harness]'):
                     the shipped offline task suite_tiny_mc, or lm_eval's own task names; eval.limit samples per
                     task, eval.batch_size

Examples:
  suite eval ckpt=runs/sft-tiny
  suite eval ckpt=runs/sft-tiny task=reverse-6 eval.num_samples=50 --json
  suite eval ckpt=runs/gpt-tiny metric=perplexity eval.seq_len=128 eval.stride=64 eval.max_tokens=4000
  suite eval ckpt=runs/gpt-tiny harness=suite_tiny_mc eval.limit=10 --json""",
    "prepare": """usage: suite prepare [data=OPTION] [data.path=OUT] ['data.sources=[{path: GLOB_OR_DATASET, weight: W}]']

Trains a byte-level BPE tokenizer (data.vocab_size) and writes packed, memory-mapped token shards
(train/val split by data.val_fraction) into data.path. Sources are local .txt/.jsonl/.parquet globs
or `datasets` names, blended by weight. With no sources: the embedded corpus (no network).

Keys: data.path  data.sources  data.vocab_size  data.val_fraction  data.tokenizer  data.cache_dir
A prepared folder trains with data.path=<it>, model.vocab_size at least its vocabulary and
data.seq_len at most the model's max_seq_len (gpt-tiny: 256).

Examples:
  suite prepare
  suite prepare 'data.sources=[{path: "corpus/*.jsonl"}]' data.path=data/prepared data.vocab_size=8192
  suite pretrain data.path=data/prepared run.dir=runs/prepared-8k""",
    "generate": """usage: suite generate ckpt=<run.dir|checkpoint dir|hf:folder|export folder> prompt="..." [generate.KEY=VALUE ...] [--json]

Samples text with a KV cache, streaming it to the console. ckpt= is a suite run or checkpoint, an HF
folder (hf:DIR), a `suite quantize` checkpoint, or a `suite export format=torch_export|onnx` folder
(its .pt2 programs or onnxruntime). `prompt=` (or generate.prompt=) is taken exactly as typed: no
override grammar, no ${...} interpolation; prompt_file=PATH reads one prompt from a file, prompt_file=-
from stdin. generate.prompts_file=PATH decodes a batch: one prompt per line, or JSONL {"prompt": ...},
generate.batch_size at a time (left-padded into one static-cache batch; an export folder batches prompts
of equal length). generate.stop='["\\n\\n"]' ends a continuation where a stop sequence appears;
generate.chat=true renders the prompt as a user turn with the model's chat template (`suite chat` is the
interactive form). A prompt longer than the model's context is refused; generation stops at the context
length (said).
Keys: generate.max_new_tokens  generate.temperature (0 = greedy)  generate.top_k  generate.top_p
      generate.seed  generate.prompts_file  generate.batch_size  generate.stop  generate.chat
      generate.stream  generate.compile (torch.compile the decode step)

Examples:
  suite generate ckpt=runs/gpt-tiny prompt="The module"
  suite generate ckpt=runs/gpt-tiny prompt="It's a test (1, 2)" generate.temperature=0 --json
  suite generate ckpt=runs/gpt-tiny prompt_file=data/prompt.txt generate.max_new_tokens=20
  suite generate ckpt=runs/gpt-tiny generate.prompts_file=data/prompts.txt generate.temperature=0 --json""",
    "chat": """usage: suite chat ckpt=<finetuned run|hf:folder|export folder> [generate.KEY=VALUE ...]

An interactive conversation on the console: each line you type is a user turn, rendered with the
model's chat template (the tokenizer's own, else the one finetuning used by default) together with the
conversation so far; the reply streams. /exit or end of input (Ctrl-D) ends. The oldest turns are
dropped when the conversation outgrows the model's context. Keys: those of `suite generate`.

Examples:
  suite chat ckpt=runs/sft-tiny generate.temperature=0""",
    "export": """usage: suite export ckpt=<run.dir|checkpoint dir|hf:folder> [format=hf|torch_export|onnx|gguf] [out=DIR]
       [export.dtype=fp32|bf16|fp16] [export.quantize=int8|int4 (onnx)|f16|q8_0|q4_0 (gguf)] [merge_lora=true]
       [export.max_shard_mb=2048]

format=hf (default) writes a Hugging Face folder (safetensors, config.json, generation_config.json,
tokenizer files) that transformers.AutoModelForCausalLM / AutoTokenizer.from_pretrained load with no
custom code: gpt models as GPT-2, llama-family models as Llama (Qwen2 when they use qkv bias).
format=torch_export writes prefill.pt2 and decode.pt2 (torch.export programs); format=onnx the same two
graphs as prefill.onnx / decode.onnx for onnxruntime, fp32, or with export.quantize=int8 (onnxruntime
dynamic quantization) or int4 (block-wise MatMulNBits, blocks of 32). Both graphs carry the KV cache
explicitly ([layers, batch, kv heads, length, head_dim]; dynamic batch, prompt and past lengths):
prefill(tokens) -> logits, keys, values; decode(tokens [b, 1], past_keys, past_values) -> the same.
`suite generate ckpt=<that folder>` runs them.
`format=` and `out=` are short for export.format and export.out (default <run.dir>/export-<format>).
A LoRA finetuning run needs merge_lora=true (export.merge_lora): the adapters are folded into the
weights. A run finetuned with a chat template exports it (chat_template.jinja).
format=hf reads the checkpoint (any parallel layout wrote it) one tensor at a time, never the whole model;
export.max_shard_mb=N splits the weights into safetensors files of at most N MB (+ an index).
`out=` must be a new or empty folder, or an earlier export (it is never mixed into other files).
Special-token ids are the source's (an hf: folder's config.json); one outside the vocabulary is left
out with a note. The written folder is checked: transformers loads it.
format=gguf writes one llama.cpp file (gpt2 / llama architecture, byte-level BPE tokenizer) at
export.quantize=f16 (default), q8_0 or q4_0; norms and biases stay F32.
A `suite quantize` checkpoint (llama family) exports as an HF folder that transformers loads
quantized (TorchAoConfig in config.json, the checkpoint's own torchao tensors).
Every export writes export_manifest.json (format, precision, files, tokenizer, source checkpoint and
step, config hash) and prints its self-check: the largest |logits - suite| of the artifact as a user
runs it (transformers, torch.export, onnxruntime), also recorded there. See docs/export.md.

Examples:
  suite export ckpt=runs/gpt-tiny
  suite export ckpt=runs/gpt-tiny out=exports/gpt-tiny-bf16 export.dtype=bf16 export.max_shard_mb=1
  suite export ckpt=runs/gpt-tiny format=onnx export.quantize=int8 out=exports/gpt-tiny-onnx-int8
  suite generate ckpt=exports/gpt-tiny-onnx-int8 prompt="The module" generate.temperature=0
  suite export ckpt=runs/gpt-tiny format=gguf export.quantize=q8_0 out=exports/gpt-tiny-gguf""",
    "prune": """usage: suite prune ckpt=<run.dir|checkpoint dir> [prune.ffn=FRACTION] [prune.heads=FRACTION]
       [prune.hidden=FRACTION] [prune.layers=COUNT] [run.dir=OUT] [--json]

Structured pruning into a smaller dense model of the same family (Minitron-style importance from
activations on compress.calib_samples sequences of the run's data): prune.ffn removes that fraction of
every MLP's channels (least mean |activation| at the down projection's input), prune.heads that
fraction of every layer's attention heads (scored at the output projection's input; with grouped KV
heads each group keeps the same number of its query heads, or whole groups go), prune.hidden that fraction of the
embedding channels everywhere (scored at the norms' outputs), prune.layers the blocks that change their
input least (1 - cosine similarity of a block's input and output). Heal the result with
`suite distill distill.teacher=<ckpt> model.init_from=<run.dir>` or `suite finetune`.

Writes: <run.dir>/ (default <ckpt run>-pruned): config.yaml, checkpoints/step_0/, the tokenizer,
report.json (parameters, bytes, held-out perplexity, task exact match for a finetuned run, before and
after). Every verb reads it (generate, eval, export, finetune, distill); a GPT with pruned heads does
not export (GPT-2's HF config has no head size of its own). See docs/compression.md.

Examples:
  suite prune ckpt=runs/gpt-tiny prune.ffn=0.25
  suite prune ckpt=runs/gpt-tiny prune.ffn=0.5 prune.layers=1 run.dir=runs/gpt-tiny-half
  suite prune ckpt=runs/gpt-tiny prune.heads=0.5 prune.hidden=0.25 run.dir=runs/gpt-tiny-narrow""",
    "quantize": """usage: suite quantize ckpt=<run.dir|checkpoint dir|hf:folder> compress=int8|w8a8|int4|smoothquant|gptq [run.dir=OUT]
       [compress.group_size=32] ['compress.skip=[tok_embeddings, pos_embeddings, output]'] [--json]

Post-training quantization of the Linear layers with torchao, measured before and after on the
recipe's held-out data. compress= picks a recipes/compress option (compress.method):
  int8           int8 weights, float activations                                  CPU, CUDA
  w8a8           int8 weights + int8 activations quantized per token at run time  CPU, CUDA
  int4           int4 weights, one bf16 scale per compress.group_size weights      CPU, CUDA
  int4-tinygemm  int4 with torchao's tinygemm kernels                              CUDA only
  smoothquant    w8a8 after SmoothQuant calibration on compress.calib_samples sequences  CPU, CUDA
  gptq           int4's grid, GPTQ error compensation on compress.calib_samples sequences  CPU, CUDA
  gptq-int8      int8's grid, GPTQ error compensation                               CPU, CUDA
Keys: compress.group_size  compress.skip (module-name patterns kept in full precision)
      compress.calib_samples  compress.smoothquant_alpha  compress.gptq_damp
      compress.eval_batches  compress.decode_tokens
      compress.task_samples (held-out questions scored when the run was finetuned on a built-in task)
      run.dir (default <ckpt run>-<method>)  train.device=auto|cpu|cuda

Writes: <run.dir>/checkpoints/step_<N>/ (model.safetensors with torchao's quantized tensors,
quantized.json), config.yaml (with compress), the tokenizer, report.json (parameters, bytes on disk,
held-out perplexity, task exact match for a finetuned run, decode tokens/s, before and after).
`suite generate` and `suite eval` take the folder as ckpt=, `suite finetune finetune.method=lora` as
model.init_from= (LoRA over the int weights: int8, int4, gptq). See docs/compression.md.

Examples:
  suite quantize ckpt=runs/gpt-tiny compress=int8
  suite quantize ckpt=runs/gpt-tiny compress=int4 compress.group_size=64 run.dir=runs/gpt-tiny-int4-g64
  suite quantize ckpt=runs/gpt-tiny compress=gptq run.dir=runs/gpt-tiny-gptq
  suite finetune recipe=sft-tiny-lora model.init_from=runs/gpt-tiny-gptq run.dir=runs/qlora""",
    "plan": """usage: suite plan [recipe=NAME|PATH.yaml] [cluster={clusters}] [cluster.nodes=N] [key=value ...]
       [--json] [--explain LAYOUT]

The cost model (suite/plan/, docs/planner.md): every parallel layout of the cluster's world size
(cluster.nodes x cluster.devices_per_node) that the trainer accepts - dp, sharding and its ZeRO stage,
offload, tp with sequence parallelism, pp with its schedule and virtual stages, cp, ep, micro-batch,
recompute - is costed for one step of the recipe (model, data.seq_len, parallel.global_batch_size,
train.precision): memory per device (weights, gradients, optimizer state, activations) and step time
(compute, tp/cp/ep/data-parallel communication, pipeline bubble and sends, optimizer). Layouts that do
not fit are dropped; the rest are ranked by step time, with tokens/s, TFLOP/s per device and MFU, and
the reasons the winner wins. The recipe's own parallel.* keys are ignored (except the global batch).
--explain LAYOUT prints one layout's parts (a name from the table, e.g. dp4-tp8sp-pp12-mb1-full:
dpN, shNz1|z2|z3[off], tpN[sp], ppN[vV][gpipe|zb], cpN, epN, mbN, sel|attn|full).
Nothing is allocated, nothing is launched.

Keys: cluster=OPTION  cluster.nodes=N  cluster.devices_per_node=N  cluster.memory_gib=X
      cluster.compute_efficiency=X  cluster.inter_node_bandwidth_gbs=X  (every cluster.* key)
      data.seq_len=N  parallel.global_batch_size=N  train.precision=bf16|fp32  train.param_dtype=fp32|bf16

Examples:
  suite plan recipe=gpt13b cluster=h100-80g cluster.nodes=4
  suite plan recipe=gpt175b cluster=a100-80g cluster.nodes=16 --json
  suite plan recipe=gpt13b cluster=h100-80g cluster.nodes=4 --explain sh2z1-tp8sp-pp2-mb1-full""",
    "report": """usage: suite report <run.dir> [<run.dir> ...] [out=DIR] [--json]

Reads each run folder's metrics.jsonl (and config.yaml) and draws PNG plots with matplotlib.
Every training run (pretrain, finetune, distill) writes its report when it ends (log.report=true);
`suite report` draws it again, e.g. for a run that was stopped or resumed.

One run: <run.dir>/report.md (final and best losses, median tokens/s and MFU, peak memory, the
settings that shaped the run) and <run.dir>/plots/: loss.png (loss and val_loss), lr.png,
tokens_per_s.png, mfu.png (where a peak FLOP/s applies), memory.png. out=DIR writes them to DIR.

Several runs: one figure, loss_comparison.png (training loss and validation loss, a line per run,
by step), and a report.md with a table comparing the runs, in out=DIR (default
reports/compare-<timestamp>/). A folder that is not a training run, or has no metrics yet, is
refused in one line before anything is written.

Examples:
  suite report runs/gpt-tiny
  suite pretrain recipe=llama-tiny
  suite report runs/gpt-tiny runs/llama-tiny out=reports/gpt-vs-llama""",
    "run": """usage: suite run pipeline=<name|PATH.yaml> [run.dir=DIR] [<stage>.<key>=<value> ...] [--from STAGE | --only STAGE]

Runs a pipeline recipe (recipes/pipeline/<name>.yaml; shipped: {pipelines}): its stages in order, each
as `suite <verb> <its args>` in a subprocess, into one folder (run.dir, default runs/pipeline-<name>)
with one subfolder per stage. A stage reads an earlier one's output as ${stage:NAME} in its args.
Rerunning the same command skips every stage that finished (its outputs verified: checkpoint manifest,
file sha256) and goes on where it stopped: a killed training stage resumes from its last checkpoint.
--from STAGE reruns that stage and every later one; --only STAGE reruns that stage alone.
<stage>.<key>=<value> adds an override to that stage (it wins over the recipe's), e.g.
pretrain.train.max_steps=100. A failing quality gate (gates: in the recipe) stops the pipeline with
one line naming the gate and the figures, exit 3; a failing stage stops it with that stage's exit code.

Writes: <run.dir>/<stage>/ (each stage's run folder, export or result.json), logs/<stage>.log,
logs/<stage>.done.json (a finished stage's marker), pipeline.json (every stage's command, result
and figures), report.md and report.png (accuracy, perplexity, size, decode tokens/s per stage).
See docs/pipeline.md.

Examples:
  suite run pipeline=embedded
  suite run pipeline=embedded --only eval-int8
  suite run pipeline=embedded --from int8""",
    "config": """usage: suite config show [overrides...] [--json]   print the resolved config
       suite config list                         list recipes and every config-group option
       suite config cp recipe=NAME DEST.yaml     copy a shipped recipe for editing, then:
                                                 suite pretrain recipe=DEST.yaml

Examples:
  suite config list
  suite config show recipe=llama-tiny
  suite config cp recipe=gpt-tiny ./mytiny.yaml
  suite pretrain recipe=./mytiny.yaml train.max_steps=20""",
}


def verb_help(verb: str) -> str:
    """A verb's --help (the recipe list is the one `suite config list` shows, never a stale copy)."""
    text = VERB_HELP[verb].replace("{recipes}", "|".join(known_options("recipe")))
    text = text.replace("{pipelines}", ", ".join(known_options("pipeline")))
    return text.replace("{clusters}", "|".join(known_options("cluster")))
