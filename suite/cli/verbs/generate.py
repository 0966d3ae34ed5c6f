"""`suite generate`: text sampled from a checkpoint, an HF folder or an export (one prompt or a file)."""

from __future__ import annotations

from suite.cli.common import _compose, _device, _report, _say
from suite.config.errors import ConfigError
from suite.verb import Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.infer.checks import check_generate, take_prompt

    overrides, prompt = take_prompt(overrides)  # verbatim: never through the override grammar
    _, cfg = _compose(overrides)
    if not cfg.ckpt:
        raise ConfigError(
            "ckpt is missing; pass ckpt=<run.dir, checkpoint, hf:<folder>, or a suite export folder>, "
            "e.g. ckpt=runs/gpt-tiny"
        )
    if prompt is not None:
        cfg.generate.prompt = prompt
    check_generate(cfg)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.infer.engines import load_engine
    from suite.infer.generate import check_prompts, encode_prompt, generate_texts, read_prompts

    g = cfg.generate
    texts = read_prompts(g.prompts_file) if g.prompts_file else [g.prompt]
    engine, tokenizer, described = load_engine(
        cfg.ckpt, _device(cfg.train.device), compile=g.compile, dtype=g.dtype
    )
    prompts = [encode_prompt(tokenizer, text, g.chat, str(cfg.ckpt)) for text in texts]
    if not all(prompts):
        raise ConfigError('generate.prompt is empty; pass prompt="some text"')
    check_prompts(prompts, g.max_new_tokens, engine.max_seq_len)
    _say(described)
    stream = g.stream and len(texts) == 1 and "--json" not in flags
    if stream:
        print(texts[0] if not g.chat else "", end="", flush=True)
    outputs = generate_texts(
        engine, tokenizer, prompts, g, on_text=(lambda t: print(t, end="", flush=True)) if stream else None
    )
    if stream:
        print()
        return 0
    results = [{"prompt": p, "text": t} for p, t in zip(texts, outputs)]
    if len(results) == 1:
        shown = results[0]["text"] if g.chat else texts[0] + outputs[0]
        return _report(flags, results[0], shown)
    shown = "\n".join(f"### {r['prompt']}\n{r['text']}" for r in results)
    return _report(flags, {"results": results}, shown)


HELP = """usage: suite generate ckpt=<run.dir|checkpoint dir|hf:folder|export folder> prompt="..." [generate.KEY=VALUE ...] [--json]

Samples text with a KV cache, streaming it to the console. ckpt= is a suite run or checkpoint, an HF
folder (hf:DIR), a `suite quantize` checkpoint, or a `suite export format=torch_export|onnx` folder
(its .pt2 programs or onnxruntime). `prompt=` (or generate.prompt=) is taken exactly as typed: no
override grammar, no ${...} interpolation; prompt_file=PATH reads one prompt from a file, prompt_file=-
from stdin. generate.prompts_file=PATH decodes a batch: one prompt per line, or JSONL {"prompt": ...},
generate.batch_size at a time (left-padded into one static-cache batch; an export folder batches prompts
of equal length). generate.stop='["\n\n"]' ends a continuation where a stop sequence appears;
generate.chat=true renders the prompt as a user turn with the checkpoint's own chat template (a run's
chat_template.jinja, an HF folder's, a GGUF file's tokenizer.chat_template; refused when it has none;
`suite chat` is the interactive form). A prompt longer than the model's context is refused; generation stops at the context
length (said).
Keys: generate.max_new_tokens  generate.temperature (0 = greedy)  generate.top_k  generate.top_p
      generate.seed  generate.prompts_file  generate.batch_size  generate.stop  generate.chat
      generate.stream  generate.compile (torch.compile the decode step)
      generate.dtype (fp32 | bf16 | fp16: the suite model's decode precision)

Examples:
  suite generate ckpt=runs/gpt-tiny prompt="The module"
  suite generate ckpt=runs/gpt-tiny prompt="It's a test (1, 2)" generate.temperature=0 --json
  suite generate ckpt=runs/gpt-tiny prompt_file=data/prompt.txt generate.max_new_tokens=20
  suite generate ckpt=runs/gpt-tiny generate.prompts_file=data/prompts.txt generate.temperature=0 --json"""


VERB = register(
    Verb(
        name="generate",
        summary='sample text from a trained model or an export: suite generate ckpt=<run.dir> prompt="..."',
        help=HELP,
        run=run,
        unused=("export", "prune", "distill", "optim", "sched", "recompute", "cluster", "align"),
        section="use",
        stage_output="result",
    )
)
