"""`suite chat`: a console conversation with a finetuned model, in its chat template."""

from __future__ import annotations

from suite.cli.common import _compose, _device, _say
from suite.config.errors import ConfigError
from suite.verb import Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    """An interactive conversation on the console: each line is a user turn, rendered with the
    model's chat template together with the history; the reply streams. /exit or end of input stops."""
    _, cfg = _compose(overrides)
    if not cfg.ckpt:
        raise ConfigError("ckpt is missing; pass ckpt=<a finetuned run, hf:<folder> or export folder>")
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.infer.checks import check_generate
    from suite.infer.engines import load_engine
    from suite.infer.generate import generate_texts

    check_generate(cfg)
    engine, tokenizer, described = load_engine(
        cfg.ckpt, _device(cfg.train.device), compile=cfg.generate.compile, dtype=cfg.generate.dtype
    )
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.data.chat import checkpoint_chat_template, prompt_ids

    template = checkpoint_chat_template(tokenizer, "suite chat", str(cfg.ckpt))
    _say(f"{described}\nchat: type a message; /exit or Ctrl-D ends")
    history: list[dict[str, str]] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = prompt_ids(tokenizer, history, template)
        if len(ids) >= engine.max_seq_len - 1:  # the oldest turns go first
            history = history[-1:]
            ids = prompt_ids(tokenizer, history, template)
        reply = generate_texts(
            engine, tokenizer, [ids], cfg.generate, on_text=lambda t: print(t, end="", flush=True)
        )[0]
        print()
        history.append({"role": "assistant", "content": reply})


HELP = """usage: suite chat ckpt=<finetuned run|hf:folder|gguf:file|export folder> [generate.KEY=VALUE ...]

An interactive conversation on the console: each line you type is a user turn, rendered with the
checkpoint's own chat template (refused when it has none: a pretrained-only run, an export that lost it)
together with the conversation so far; the reply streams. /exit or end of input (Ctrl-D) ends. The oldest turns are
dropped when the conversation outgrows the model's context. Keys: those of `suite generate`.

Examples:
  suite chat ckpt=runs/sft-tiny generate.temperature=0"""


VERB = register(
    Verb(
        name="chat",
        summary="talk to a finetuned model on the console: suite chat ckpt=runs/sft-tiny",
        help=HELP,
        run=run,
        unused=("export", "prune", "distill", "optim", "sched", "recompute", "cluster", "align"),
        section="use",
    )
)
