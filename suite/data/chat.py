"""Chat rows -> messages -> rendered, tokenized conversations with their assistant (target) tokens.

    normalize_record(record)            any common shape -> [{"role", "content"}, ...]:
                                          {"messages"|"conversations": [{role, content} | {from, value}]}
                                          {"prompt", "response"|"completion"}  (+ optional "system")
                                          {"instruction", "input"?, "output"}  (+ optional "system")
                                        raises MalformedRow(kind, detail) for anything else
    encode_conversation(tok, msgs, tpl) rendered with the chat template, token ids + a per-token
                                        "is an assistant token" flag
    prompt_ids(tok, msgs, tpl)          the prompt of a conversation, tokenized as training tokenizes it

Loss masking. The conversation is rendered with the chat template, and the assistant spans are
found by rendering incrementally: render(messages[:i], add_generation_prompt=True) is the text
before assistant turn i, render(messages[:i+1]) ends with it; the span between them (trailing
whitespace removed) is the reply *and* its end-of-turn token (the eos token in the shipped
templates). The text is then tokenized segment by segment (prompt text, assistant text, ...), so
a token never straddles a prompt/assistant boundary and the prompt is tokenized exactly as
`prompt_ids` tokenizes it for generation. A template for which the incremental renders are not
prefixes of each other is reported per row (kind `template_error`), never guessed at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from suite import user_files
from suite.config.errors import ConfigError

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
        return user_files.read_text(path, "chat template")
    raise ConfigError(
        f"chat template '{name}' is not known; use auto, tokenizer, {', '.join(CHAT_TEMPLATES)}, "
        "a .jinja file or a Jinja string"
    )


def checkpoint_chat_template(tokenizer: Any, key: str, ckpt: str) -> str:
    """The checkpoint's own chat template, for chatting with it (generate.chat, `suite chat`).

    No fallback: a model that was never taught a chat format would answer a made-up one in noise,
    and a silent default hides that its template was lost on the way (e.g. by an export)."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    if own:
        return own
    raise ConfigError(
        f"{key} but ckpt='{ckpt}' carries no chat template (no chat_template.jinja or tokenizer_config "
        "chat_template, no GGUF tokenizer.chat_template); give a chat model (a finetuned run, an HF folder "
        "or GGUF file with a template), or drop generate.chat for plain continuation"
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


INVALID_JSON = object()  # stands in for a record that did not parse


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
    if isinstance(record, tuple) and record and record[0] is INVALID_JSON:
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


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
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
    for (_, flag), piece_ids in zip(pieces, encode_texts(tokenizer, [t for t, _ in pieces])):
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
    return [i for piece in encode_texts(tokenizer, [t for t, _ in pieces]) for i in piece]
