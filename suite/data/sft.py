"""Supervised finetuning (SFT) data: chat rows -> masked, packed token rows -> data-parallel batches.

Pipeline, one function per step:

    iter_sft_rows(sources)              local .jsonl/.json/.parquet files (glob/folder) or a `datasets` name;
                                        yields (location, record), e.g. ("data/train.jsonl line 17", {...})
    normalize_record(record)            any common shape -> [{"role", "content"}, ...]:
                                          {"messages"|"conversations": [{role, content} | {from, value}]}
                                          {"prompt", "response"|"completion"}  (+ optional "system")
                                          {"instruction", "input"?, "output"}  (+ optional "system")
                                        raises MalformedRow(kind, detail) for anything else
    encode_conversation(tok, msgs, tpl) rendered with the chat template, token ids + a per-token
                                        "is an assistant token" flag
    SFTDataset.build(...)               truncation, malformed-row policy, packing, padding; a report
    SFTBatches(dataset, ...)            the resumable, data-parallel-sliced step iterator
    SFTBatch / sft_loss                 what a training step consumes

Loss masking. The conversation is rendered with the chat template, and the assistant spans are
found by rendering incrementally: render(messages[:i], add_generation_prompt=True) is the text
before assistant turn i, render(messages[:i+1]) ends with it; the span between them (trailing
whitespace removed) is the reply *and* its end-of-turn token (the eos token in the shipped
templates). The text is then tokenized segment by segment (prompt text, assistant text, ...), so
a token never straddles a prompt/assistant boundary and the prompt is tokenized exactly as
`prompt_ids` tokenizes it for generation. Only assistant tokens are targets: labels are -100 on
system/user/template tokens and padding. A template for which the incremental renders are not
prefixes of each other is reported per row (kind `template_error`), never guessed at.

Shifting. A sample of n tokens x_0..x_{n-1} becomes n-1 positions: tokens x_0..x_{n-2} and
labels[t] = x_{t+1} when x_{t+1} is an assistant token, else -100 (labels are already shifted).

Packing. Samples are greedily packed into rows of `seq_len` in a seeded order; positions restart at
0 for every sample and `doc_ids` numbers the samples of a row (padding: -1), so
`attention_mask_from_doc_ids` gives the block-diagonal causal mask under which a packed sample
sees exactly what it would see alone. Without packing, one sample per row, right-padded; the
plain causal mask is then enough and `doc_ids` is None.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from suite.config.errors import ConfigError
from suite.config.schema import DataConfig, SFTDataConfig
from suite.data.sources import json_lines, match_local

_SFT_DEFAULTS = SFTDataConfig()  # recipe keys finetune.data.*: the one source of these defaults
_DATA_DEFAULTS = DataConfig()

IGNORE_INDEX = -100
SFT_SUFFIXES = (".jsonl", ".json", ".parquet")
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
}
ENCODE_CHUNK = 1024

# ---- chat templates --------------------------------------------------------------------------------
# Both shipped templates end every turn with the tokenizer's eos token (so generation stops there)
# and mark the assistant reply with {% generation %}, so transformers' `return_assistant_tokens_mask`
# agrees with the spans computed here. Newlines are written as string literals: transformers
# renders with trim_blocks, which would eat a bare newline after a tag.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + eos_token -}}{% endgeneration %}"
    "{%- else -%}"
    "{{- message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
PLAIN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] + '\\n\\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- 'User: ' + message['content'] + '\\n' -}}"
    "{%- else -%}{{- 'Assistant: ' -}}"
    "{% generation %}{{- message['content'] + eos_token -}}{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
)
CHAT_TEMPLATES = {"chatml": CHATML_TEMPLATE, "plain": PLAIN_TEMPLATE}
DEFAULT_TEMPLATE = "chatml"


def resolve_chat_template(tokenizer: Any, template: str | None = "auto") -> str:
    """The Jinja chat template to use.

    template: "auto" (or None): the tokenizer's own `chat_template` when it has one, else the
    shipped default (`chatml`); "tokenizer": the tokenizer's own, an error when it has none;
    a shipped name (`chatml`, `plain`); a path to a .jinja file; or a literal Jinja string.
    """
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    name = "auto" if template is None else str(template)
    if name in ("auto", "tokenizer"):
        if own:
            return own
        if name == "tokenizer":
            raise ConfigError(
                "template=tokenizer but the tokenizer has no chat_template; "
                f"use one of {', '.join(CHAT_TEMPLATES)} or a .jinja file"
            )
        return CHAT_TEMPLATES[DEFAULT_TEMPLATE]
    if name in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[name]
    if "{{" in name or "{%" in name:
        return name
    path = Path(name).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ConfigError(
        f"chat template '{name}' is not known; use auto, tokenizer, {', '.join(CHAT_TEMPLATES)}, "
        "a .jinja file or a Jinja string"
    )


def use_chat_template(tokenizer: Any, template: str | None = "auto") -> str:
    """Resolve `template` and store it on the tokenizer, so `save_pretrained` exports it."""
    text = resolve_chat_template(tokenizer, template)
    tokenizer.chat_template = text
    return text


def render_chat(
    tokenizer: Any, messages: list[dict[str, str]], template: str, add_generation_prompt: bool
) -> str:
    """Render `messages` with the Jinja `template` (eos/bos token variables from the tokenizer)."""
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


# ---- malformed rows ------------------------------------------------------------------------------
class MalformedRow(ValueError):
    """A row that cannot become a training sample. `kind` is a stable short category for reports:

    invalid_json, missing_fields, bad_role, bad_content, empty_prompt, empty_response,
    too_long, template_error.
    """

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class SFTDataError(ConfigError):
    """on_error=fail met a malformed row; the message names its location (file and line)."""


_INVALID_JSON = object()  # stands in for a record that did not parse


# ---- reading rows --------------------------------------------------------------------------------
def _source_spec(source: Any) -> tuple[str, str, str | None]:
    """(path, split, name) of a source given as a string/Path or an object/dict with those fields."""
    if isinstance(source, (str, Path)):
        return str(source), "train", None
    get = source.get if isinstance(source, dict) else lambda k, d=None: getattr(source, k, d)
    return str(get("path")), str(get("split", "train") or "train"), get("name", None)


def _local_sft_files(pattern: str) -> list[Path] | None:
    """Files a local path/glob/folder names, or None when `pattern` looks like a `datasets` name."""
    files = match_local(pattern, SFT_SUFFIXES)
    if files is None:
        return None
    bad = [p for p in files if p.suffix not in SFT_SUFFIXES]
    if not files or bad:
        found = f"matches '{bad[0]}', which is not" if bad else "matches no"
        raise ConfigError(
            f"SFT source '{pattern}' {found} {'/'.join(SFT_SUFFIXES)} files; give a file, folder or glob of "
            "chat rows, or a `datasets` name"
        )
    return files


def iter_sft_rows(sources: Any) -> Iterator[tuple[str, Any]]:
    """(location, record) for every row of every source, in a fixed order.

    `sources`: one source or a list; a source is a path/glob/folder string, a `datasets` name, or an
    object/dict with `path` (+ `split`, `name` for `datasets`). Locations are 1-based:
    "file.jsonl line 17", "file.parquet row 3", "org/set[train] row 9". A JSONL line that is not
    valid JSON yields a record that normalize_record reports as `invalid_json`.
    """
    if isinstance(sources, (str, Path)) or not isinstance(sources, Sequence):
        sources = [sources]
    for source in sources:
        path, split, name = _source_spec(source)
        files = _local_sft_files(path)
        if files is None:
            yield from _iter_datasets(path, split, name)
            continue
        for file in files:
            if file.suffix == ".jsonl":
                yield from _iter_jsonl(file)
            elif file.suffix == ".json":
                yield from _iter_json(file)
            else:
                yield from _iter_parquet(file)


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    for lineno, record in json_lines(path):
        if isinstance(record, json.JSONDecodeError):
            record = (_INVALID_JSON, record.msg)
        yield f"{path} line {lineno}", record


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"SFT source '{path}' is not valid JSON ({err.msg} at line {err.lineno})") from err
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise ConfigError(
            f"SFT source '{path}' must hold a JSON list of rows (or use .jsonl, one row a line)"
        )
    for i, record in enumerate(data, 1):
        yield f"{path} item {i}", record


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    for i, record in enumerate(pq.read_table(path).to_pylist(), 1):
        yield f"{path} row {i}", record


def _iter_datasets(path: str, split: str, name: str | None) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(path, name, split=split)
    except Exception as err:  # network, unknown name, bad split: one user-facing line
        reason = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(
            f"SFT source '{path}' is neither a local file nor a loadable `datasets` dataset ({reason}); "
            "check the name, split and config name, or give a local .jsonl/.parquet path"
        ) from err
    for i, record in enumerate(ds, 1):
        yield f"{path}[{split}] row {i}", record


# ---- normalising rows ----------------------------------------------------------------------------
def _text(value: Any, what: str, kind_if_empty: str) -> str:
    if not isinstance(value, str):
        raise MalformedRow("bad_content", f"{what} is {type(value).__name__}, not a string")
    if not value.strip():
        raise MalformedRow(kind_if_empty, f"{what} is empty")
    return value


def _optional_system(record: dict) -> list[dict[str, str]]:
    system = record.get("system")
    if system is None or (isinstance(system, str) and not system.strip()):
        return []
    return [{"role": "system", "content": _text(system, "'system'", "bad_content")}]


def normalize_record(record: Any, system_prompt: str | None = None) -> list[dict[str, str]]:
    """One row in any supported shape -> a checked list of {"role", "content"} messages.

    Rules: roles are system/user/assistant (aliases human, gpt, bot, model); at most one system
    message, first; then user and assistant strictly alternate, starting with user and ending with
    assistant; every user/assistant content is a non-empty string. `system_prompt` is added when
    the row has no system message. Raises MalformedRow otherwise.
    """
    if isinstance(record, tuple) and record and record[0] is _INVALID_JSON:
        raise MalformedRow("invalid_json", f"not valid JSON ({record[1]})")
    if not isinstance(record, dict):
        raise MalformedRow("missing_fields", f"row is a {type(record).__name__}, not an object")
    turns_key = next((k for k in ("messages", "conversations") if record.get(k) is not None), None)
    if turns_key is not None:
        messages = _normalize_turns(record[turns_key], turns_key)
    elif record.get("prompt") is not None or "response" in record or "completion" in record:
        reply_key = next((k for k in ("response", "completion") if record.get(k) is not None), None)
        if record.get("prompt") is None or reply_key is None:
            have = "response" if reply_key else "prompt"
            need = "prompt" if reply_key else "response (or completion)"
            raise MalformedRow("missing_fields", f"has '{have}' but no '{need}'")
        messages = _optional_system(record) + [
            {"role": "user", "content": _text(record["prompt"], "'prompt'", "empty_prompt")},
            {"role": "assistant", "content": _text(record[reply_key], f"'{reply_key}'", "empty_response")},
        ]
    elif record.get("instruction") is not None or "output" in record:
        if record.get("instruction") is None or record.get("output") is None:
            missing = "instruction" if record.get("instruction") is None else "output"
            raise MalformedRow("missing_fields", f"has no '{missing}'")
        prompt = _text(record["instruction"], "'instruction'", "empty_prompt")
        extra = record.get("input")
        if extra is not None:
            if not isinstance(extra, str):
                raise MalformedRow("bad_content", f"'input' is {type(extra).__name__}, not a string")
            if extra.strip():
                prompt = f"{prompt}\n\n{extra}"
        messages = _optional_system(record) + [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": _text(record["output"], "'output'", "empty_response")},
        ]
    else:
        fields = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise MalformedRow(
            "missing_fields",
            f"has none of the chat shapes messages | prompt+response | instruction(+input)+output (fields: {fields})",
        )
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _normalize_turns(turns: Any, key: str) -> list[dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise MalformedRow("missing_fields", f"'{key}' is not a non-empty list of messages")
    out: list[dict[str, str]] = []
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, dict):
            raise MalformedRow("missing_fields", f"message {i} is a {type(turn).__name__}, not an object")
        role_key, content_key = (
            ("role", "content") if "role" in turn or "content" in turn else ("from", "value")
        )
        if turn.get(role_key) is None or content_key not in turn:
            raise MalformedRow("missing_fields", f"message {i} lacks '{role_key}' or '{content_key}'")
        raw = turn[role_key]
        role = ROLE_ALIASES.get(str(raw).lower()) if isinstance(raw, str) else None
        if role is None:
            raise MalformedRow(
                "bad_role", f"message {i} has unknown role {raw!r}; use one of {', '.join(ROLES)}"
            )
        content = turn[content_key]
        if role == "system":
            if i != 1:
                raise MalformedRow("bad_role", f"message {i} is a system message; only the first may be")
            if not isinstance(content, str):
                raise MalformedRow(
                    "bad_content", f"message {i} content is {type(content).__name__}, not a string"
                )
            if content.strip():
                out.append({"role": "system", "content": content})
            continue
        expected = "user" if not out or out[-1]["role"] != "user" else "assistant"
        if role != expected:
            raise MalformedRow(
                "bad_role",
                f"message {i} has role '{role}' where '{expected}' is expected; "
                "after an optional system message, user and assistant must alternate, starting with user",
            )
        kind = "empty_response" if role == "assistant" else "empty_prompt"
        out.append({"role": role, "content": _text(content, f"message {i} content", kind)})
    if not out or out[-1]["role"] != "assistant":
        last = out[-1]["role"] if out else "nothing"
        raise MalformedRow("bad_role", f"the conversation ends with {last}, not an assistant reply")
    return out


# ---- rendering + tokenizing ----------------------------------------------------------------------
def conversation_segments(
    tokenizer: Any, messages: list[dict[str, str]], template: str, add_generation_prompt: bool = False
) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_assistant) pieces, in order.

    Assistant pieces are each assistant reply with its end-of-turn token(s) (trailing whitespace
    excluded). With add_generation_prompt the text after the last message (the generation prompt)
    is the final piece; otherwise text after the final reply is dropped (it is never a target).
    """
    try:
        full = render_chat(tokenizer, messages, template, add_generation_prompt)
        pieces: list[tuple[str, bool]] = []
        pos = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = render_chat(tokenizer, messages[:i], template, True)
            upto = render_chat(tokenizer, messages[: i + 1], template, False)
            if not (upto.startswith(before) and full.startswith(upto) and len(before) >= pos):
                raise MalformedRow(
                    "template_error",
                    f"the chat template does not render incrementally at message {i + 1} (rendering the "
                    "first messages is not a prefix of rendering one more), so assistant tokens cannot be "
                    "located; use template=chatml or a template without history-dependent rewriting",
                )
            reply = upto[len(before) :].rstrip()
            if not reply:
                raise MalformedRow("template_error", f"the chat template renders message {i + 1} as nothing")
            pieces.append((full[pos : len(before)], False))
            pieces.append((reply, True))
            pos = len(before) + len(reply)
    except MalformedRow:
        raise
    except Exception as err:  # jinja raise_exception(...) and friends
        reason = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise MalformedRow("template_error", f"the chat template rejected the row ({reason})") from err
    if add_generation_prompt:
        pieces.append((full[pos:], False))
    return [(text, flag) for text, flag in pieces if text]


def _encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added (templates write their own)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def encode_conversation(
    tokenizer: Any, messages: list[dict[str, str]], template: str
) -> tuple[list[int], list[bool]]:
    """(token ids, is-assistant flag per token) of one normalised conversation."""
    pieces = conversation_segments(tokenizer, messages, template)
    ids: list[int] = []
    flags: list[bool] = []
    for (_, flag), piece_ids in zip(pieces, _encode_texts(tokenizer, [t for t, _ in pieces])):
        ids.extend(piece_ids)
        flags.extend([flag] * len(piece_ids))
    return ids, flags


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]], template: str) -> list[int]:
    """Token ids of the generation prompt for the reply to `messages`.

    A trailing assistant message (the reference answer) is dropped. The ids are exactly the ones
    the same conversation has before that reply in training.
    """
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    pieces = conversation_segments(tokenizer, messages, template, add_generation_prompt=True)
    return [i for piece in _encode_texts(tokenizer, [t for t, _ in pieces]) for i in piece]


# ---- the dataset -----------------------------------------------------------------------------------
@dataclass
class SFTOptions:
    """How rows become training rows (defaults: finetune.data.* and data.seq_len in the schema).

    seq_len: tokens per row (the model sees seq_len positions; a sample may hold seq_len + 1 tokens).
    template: see resolve_chat_template ("auto": the tokenizer's own, else chatml).
    packing: several samples per row (block-diagonal mask, positions restart per sample).
    truncation: "truncate" drops tokens from the left (system/earlier turns/prompt start) until the
        sample fits, as long as the final assistant reply stays whole; "skip" treats every
        over-long sample as malformed (kind too_long). Samples whose final reply alone does not fit
        are too_long either way.
    on_error: "skip" counts malformed rows and goes on; "fail" raises SFTDataError at the first,
        naming its file and line.
    system_prompt: added to rows that have no system message.
    shuffle_seed: the order in which samples are packed into rows.
    key: the config key prefix named in error messages.
    """

    seq_len: int = _DATA_DEFAULTS.seq_len
    template: str = _SFT_DEFAULTS.template
    packing: bool = _SFT_DEFAULTS.packing
    truncation: str = _SFT_DEFAULTS.truncation
    on_error: str = _SFT_DEFAULTS.on_error
    system_prompt: str | None = _SFT_DEFAULTS.system_prompt
    shuffle_seed: int = 0
    key: str = "finetune.data"

    def check(self) -> None:
        if self.seq_len < 2:
            raise ConfigError(f"{self.key}.seq_len={self.seq_len} must be >= 2; e.g. 256")
        if self.truncation not in ("truncate", "skip"):
            raise ConfigError(f"{self.key}.truncation={self.truncation!r}; use truncate or skip")
        if self.on_error not in ("skip", "fail"):
            raise ConfigError(f"{self.key}.on_error={self.on_error!r}; use skip or fail")


@dataclass
class SFTReport:
    """What happened to the rows: counts and the first location of each kind of problem."""

    rows: int = 0
    samples: int = 0
    malformed: Counter = field(default_factory=Counter)
    first_error: dict[str, str] = field(default_factory=dict)
    truncated: int = 0
    sample_tokens: int = 0  # positions used by samples (tokens - 1 each)
    target_tokens: int = 0
    num_rows: int = 0  # training rows after packing/padding
    seq_len: int = 0

    @property
    def num_malformed(self) -> int:
        return sum(self.malformed.values())

    @property
    def fill(self) -> float:
        """Fraction of row positions that hold sample tokens (the rest is padding)."""
        return self.sample_tokens / max(1, self.num_rows * self.seq_len)

    def summary(self) -> str:
        text = (
            f"{self.rows:,} rows -> {self.samples:,} samples in {self.num_rows:,} rows of {self.seq_len} "
            f"({self.fill:.0%} filled, {self.target_tokens:,} target tokens)"
        )
        if self.truncated:
            text += f"; {self.truncated:,} truncated from the left"
        if self.malformed:
            parts = [
                f"{kind} {n:,} (first: {self.first_error[kind]})"
                for kind, n in sorted(self.malformed.items())
            ]
            text += f"; {self.num_malformed:,} malformed rows skipped: " + "; ".join(parts)
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "samples": self.samples,
            "malformed": dict(self.malformed),
            "first_error": dict(self.first_error),
            "truncated": self.truncated,
            "sample_tokens": self.sample_tokens,
            "target_tokens": self.target_tokens,
            "num_rows": self.num_rows,
            "seq_len": self.seq_len,
            "fill": round(self.fill, 4),
        }


@dataclass
class SFTBatch:
    """One micro-batch. Every tensor is [b, s] int64.

    tokens: model inputs; labels: the target for tokens[t] (already shifted), -100 where nothing is
    learned (system/user/template tokens, padding, the last position of a sample); positions:
    restart at 0 per sample; doc_ids: sample number within the row (-1 = padding) when packed,
    else None (one right-padded sample per row: the plain causal mask suffices).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SFTBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return SFTBatch(move(self.tokens), move(self.labels), move(self.positions), move(self.doc_ids))

    @property
    def mask(self) -> torch.Tensor | None:
        """The boolean attention mask [b, 1, s, s] (None: plain causal)."""
        return None if self.doc_ids is None else attention_mask_from_doc_ids(self.doc_ids)

    def model_kwargs(self) -> dict[str, torch.Tensor | None]:
        """Keyword arguments for Transformer.forward besides the tokens: positions and mask."""
        return {"positions": self.positions, "mask": self.mask}

    @property
    def num_targets(self) -> int:
        """Label tokens in this micro-batch (to weight a sum-of-losses across micro-batches)."""
        return int((self.labels != IGNORE_INDEX).sum())


def attention_mask_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean mask [b, 1, s, s]: query t attends key u iff u <= t and both are in the same document.

    Padding (doc id -1) attends only to padding, so no row of the mask is empty (no NaN) and no real
    token ever sees padding.
    """
    s = doc_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & causal)[:, None]


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in fp32 over the positions whose label is not -100 ("mean" or "sum")."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )


def _fit(
    ids: list[int], flags: list[bool], seq_len: int, truncation: str
) -> tuple[list[int], list[bool], bool]:
    """Truncate from the left to seq_len + 1 tokens; raises MalformedRow(too_long) when impossible."""
    if len(ids) <= seq_len + 1:
        return ids, flags, False
    last_start = len(flags)  # first token of the final assistant reply
    while last_start > 0 and flags[last_start - 1]:
        last_start -= 1
    reply = len(ids) - last_start
    if truncation == "skip" or reply + 1 > seq_len + 1:
        why = (
            f"the final assistant reply alone is {reply} tokens"
            if reply + 1 > seq_len + 1
            else f"{len(ids) - 1} tokens"
        )
        raise MalformedRow("too_long", f"{why}, more than seq_len={seq_len} allows")
    cut = len(ids) - (seq_len + 1)
    return ids[cut:], flags[cut:], True


class SFTDataset:
    """Packed/padded training rows ([num_rows, seq_len] int32 arrays) and the report that made them."""

    def __init__(
        self,
        tokens: np.ndarray,
        labels: np.ndarray,
        positions: np.ndarray,
        doc_ids: np.ndarray | None,
        report: SFTReport,
        template: str,
    ) -> None:
        self.tokens, self.labels, self.positions, self.doc_ids = tokens, labels, positions, doc_ids
        self.report = report
        self.template = template
        self.seq_len = int(tokens.shape[1])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def batch(self, rows: np.ndarray | Sequence[int]) -> SFTBatch:
        rows = np.asarray(rows, dtype=np.int64)
        get = lambda a: torch.from_numpy(a[rows].astype(np.int64))  # noqa: E731
        return SFTBatch(
            get(self.tokens),
            get(self.labels),
            get(self.positions),
            None if self.doc_ids is None else get(self.doc_ids),
        )

    @classmethod
    def build(cls, sources: Any, tokenizer: Any, options: SFTOptions | None = None) -> SFTDataset:
        """Read, normalise, render, tokenize, check, truncate, pack and pad every row of `sources`."""
        return cls.from_rows(iter_sft_rows(sources), tokenizer, options)

    @classmethod
    def from_rows(
        cls, rows: Iterable[tuple[str, Any]], tokenizer: Any, options: SFTOptions | None = None
    ) -> SFTDataset:
        """Like build, from (location, record) pairs (e.g. generated in memory)."""
        opts = options or SFTOptions()
        opts.check()
        if tokenizer.eos_token is None:
            raise ConfigError("the tokenizer has no eos token; SFT needs one to end each assistant turn")
        template = resolve_chat_template(tokenizer, opts.template)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        report = SFTReport(seq_len=opts.seq_len)
        samples: list[tuple[np.ndarray, np.ndarray]] = []
        pending: list[tuple[str, list[tuple[str, bool]]]] = []

        def bad(location: str, err: MalformedRow) -> None:
            if opts.on_error == "fail":
                raise SFTDataError(
                    f"{location}: {err.detail} [{err.kind}]; fix or remove the row, or set "
                    f"{opts.key}.on_error=skip to skip malformed rows"
                )
            report.malformed[err.kind] += 1
            report.first_error.setdefault(err.kind, f"{location}: {err.detail}")

        def flush() -> None:
            texts = [text for _, pieces in pending for text, _ in pieces]
            encoded = iter(_encode_texts(tokenizer, texts)) if texts else iter(())
            for location, pieces in pending:
                ids: list[int] = []
                flags: list[bool] = []
                for _, flag in pieces:
                    piece = next(encoded)
                    ids.extend(piece)
                    flags.extend([flag] * len(piece))
                try:
                    ids, flags, cut = _fit(ids, flags, opts.seq_len, opts.truncation)
                except MalformedRow as err:
                    bad(location, err)
                    continue
                arr = np.asarray(ids, dtype=np.int64)
                target = np.asarray(flags[1:], dtype=bool)
                if not target.any():
                    bad(location, MalformedRow("empty_response", "no assistant tokens remain"))
                    continue
                report.truncated += int(cut)
                samples.append((arr, np.where(target, arr[1:], IGNORE_INDEX)))
            pending.clear()

        for location, record in rows:
            report.rows += 1
            try:
                messages = normalize_record(record, opts.system_prompt)
                pending.append((location, conversation_segments(tokenizer, messages, template)))
            except MalformedRow as err:
                flush()  # keep failures in row order
                bad(location, err)
            if len(pending) >= ENCODE_CHUNK:
                flush()
        flush()
        if not samples:
            first = next(iter(report.first_error.values()), "the sources hold no rows")
            raise ConfigError(
                f"no usable SFT samples in {report.rows:,} rows ({dict(report.malformed) or 'empty'}); first "
                f"problem: {first}"
            )
        report.samples = len(samples)
        report.sample_tokens = sum(len(ids) - 1 for ids, _ in samples)
        report.target_tokens = int(sum((lab != IGNORE_INDEX).sum() for _, lab in samples))
        arrays = pack_samples(samples, opts.seq_len, pad_id, opts.packing, opts.shuffle_seed)
        report.num_rows = int(arrays[0].shape[0])
        return cls(*arrays, report=report, template=template)


def pack_samples(
    samples: Sequence[tuple[np.ndarray, np.ndarray]],
    seq_len: int,
    pad_id: int,
    packing: bool = True,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(tokens, labels, positions, doc_ids) int32 arrays [rows, seq_len] from (ids, shifted labels) samples.

    A sample of n ids occupies n-1 positions (inputs ids[:-1], labels already aligned). With packing,
    samples are taken in a seeded order and a new row starts when the next one does not fit.
    Padding: pad_id tokens, -100 labels, position 0, doc id -1.
    """
    order = np.random.default_rng(seed).permutation(len(samples)) if packing else np.arange(len(samples))
    rows: list[list[int]] = []
    used = seq_len
    for i in order:
        n = len(samples[i][0]) - 1
        if not packing or used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(int(i))
        used += n
    shape = (len(rows), seq_len)
    tokens = np.full(shape, pad_id, dtype=np.int32)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int32)
    positions = np.zeros(shape, dtype=np.int32)
    doc_ids = np.full(shape, -1, dtype=np.int32)
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            ids, labs = samples[i]
            n = len(ids) - 1
            tokens[r, at : at + n] = ids[:-1]
            labels[r, at : at + n] = labs
            positions[r, at : at + n] = np.arange(n)
            doc_ids[r, at : at + n] = d
            at += n
        if not packing:
            positions[r, at:] = np.arange(at, seq_len)  # the causal mask already hides these pads
    return tokens, labels, positions, doc_ids if packing else None


def load_sft_dataset(sources: Any, tokenizer: Any, options: SFTOptions | None = None) -> SFTDataset:
    """SFTDataset.build, under the name the rest of the suite uses."""
    return SFTDataset.build(sources, tokenizer, options)


# ---- the step iterator ---------------------------------------------------------------------------
class SFTBatches:
    """Step-at-a-time SFT micro-batches for one data-parallel rank, resumable via state_dict().

    Like suite.data.loader.TokenBatches: each optimizer step takes the next `global_batch_size`
    rows of the epoch's seeded permutation (seed + epoch); rank r takes the r-th contiguous slice
    and cuts it into micro-batches in order. So the rows of a step do not depend on dp or the
    micro-batch size. The partial global batch at the end of an epoch is dropped.
    """

    def __init__(
        self,
        dataset: SFTDataset,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        split: str = "train",
    ) -> None:
        from suite.data.loader import _check_shapes

        _check_shapes(dataset.seq_len, micro_batch_size, global_batch_size, dp_rank, dp_size)
        if len(dataset) < global_batch_size:
            raise ConfigError(
                f"the SFT {split} split packs into {len(dataset):,} rows of {dataset.seq_len} tokens, fewer than "
                f"one global batch (parallel.global_batch_size={global_batch_size}); lower the global batch "
                "size or seq_len, or add rows"
            )
        self.dataset = dataset
        self.split = split
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = global_batch_size // dp_size
        self.seed = seed
        self.steps_per_epoch = len(dataset) // global_batch_size
        self.epoch = 0
        self.position = 0  # optimizer steps already taken in this epoch
        self._order_epoch = -1
        self._order = np.zeros(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = np.random.default_rng(self.seed + epoch).permutation(len(self.dataset))
            self._order_epoch = epoch
        return self._order

    def _rank_micro_batches(self, step_rows: np.ndarray) -> list[SFTBatch]:
        mine = step_rows[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]
        return [
            self.dataset.batch(mine[i : i + self.micro_batch_size])
            for i in range(0, len(mine), self.micro_batch_size)
        ]

    def next_step(self) -> list[SFTBatch]:
        """The micro-batches this rank processes for the next optimizer step."""
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
        g = self.global_batch_size
        step = self._permutation(self.epoch)[self.position * g : (self.position + 1) * g]
        self.position += 1
        return self._rank_micro_batches(step)

    def eval_batches(self, num_batches: int | None = None) -> list[SFTBatch]:
        """This rank's part of the first `num_batches` global batches in row order (None: all of them)."""
        g = self.global_batch_size
        count = self.steps_per_epoch if num_batches is None else min(num_batches, self.steps_per_epoch)
        out: list[SFTBatch] = []
        for step in range(count):
            out.extend(self._rank_micro_batches(np.arange(step * g, (step + 1) * g, dtype=np.int64)))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` left off; refuses a dataset that packs differently."""
        if int(state.get("num_rows", len(self.dataset))) != len(self.dataset):
            raise ConfigError(
                f"the SFT data now packs into {len(self.dataset):,} rows but the checkpoint was trained on "
                f"{state['num_rows']:,}; resume with the same data, seq_len and packing, or start a new run"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.dataset.seq_len
