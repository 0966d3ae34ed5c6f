"""Preference pairs: rows of (prompt, chosen, rejected) -> token rows of both conversations, side by side.

Rows (TRL's shapes), from align.data: a .jsonl/.jsonl.gz/.json/.parquet file, a folder of them, or a
`datasets` save_to_disk folder (read by suite.data.sft.iter_sft_rows):

    {"prompt": "...", "chosen": "...", "rejected": "..."}                 strings (+ optional "system")
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}  chat messages: the prompt's
                                                                          turns end with the user's, the
                                                                          responses are assistant turns
    {"chosen": [messages], "rejected": [messages]}                        implicit prompt: two whole
                                                                          conversations; the prompt is the
                                                                          turns they share

Each side is rendered with the base's chat template (suite.data.chat) as prompt + response; the
targets are the response's tokens only (the prompt's, including earlier assistant turns, are not).
A pair's two conversations are rows 2i (chosen) and 2i + 1 (rejected) of one `PairBatch`, so they are
always on the same rank and in the same micro-batch; rows are right-padded to data.seq_len, one
conversation each (no packing). A row holds the whole conversation (its last token too, whose target
is ignored), so the next input token of every target position is its target: the reference scores
each position's next input token (suite.align.reference).

Bad rows are refused in one line naming the file, the row and the field: a missing field, an empty
response, chosen equal to rejected, a conversation longer than data.seq_len.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from suite import user_files
from suite.config.errors import ConfigError
from suite.data.batch import IGNORE_INDEX, Batch
from suite.data.chat import MalformedRow, encode_conversation, normalize_record, prompt_ids
from suite.data.sft import SFT_SUFFIXES, iter_sft_rows
from suite.data.tasks import generate_task

FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class PairBatch(Batch):
    """A micro-batch of preference pairs: rows 2i (chosen) and 2i + 1 (rejected) are pair i. Its weight
    in the step's loss is its number of pairs: the preference loss is a mean over the global batch's pairs."""

    @property
    def num_targets(self) -> int:
        return int(self.tokens.shape[0]) // 2


class PairDataset:
    """Token rows of pairs ([2 * pairs, seq_len] int32, interleaved chosen/rejected), a SampleSource
    of pairs (suite.data.sampler)."""

    def __init__(self, tokens: np.ndarray, labels: np.ndarray, seq_len: int, what: str = "train"):
        self.tokens, self.labels = tokens, labels
        self.seq_len = seq_len
        self.what = what

    def __len__(self) -> int:
        return int(self.tokens.shape[0]) // 2

    def rows(self, pairs: np.ndarray) -> np.ndarray:
        """The row numbers of `pairs`, chosen then rejected for each."""
        pairs = np.asarray(pairs, dtype=np.int64)
        return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)

    def batch(self, indices: np.ndarray) -> PairBatch:
        rows = self.rows(indices)
        get = lambda a: torch.from_numpy(a[rows].astype(np.int64))  # noqa: E731
        return PairBatch(get(self.tokens), get(self.labels))

    def split(self, held_out: int) -> tuple[PairDataset, PairDataset]:
        """(the first pairs, the last `held_out` pairs)."""
        cut = 2 * (len(self) - held_out)
        first = PairDataset(self.tokens[:cut], self.labels[:cut], self.seq_len, "train")
        last = PairDataset(self.tokens[cut:], self.labels[cut:], self.seq_len, "held-out")
        return first, last

    def too_small(self, global_batch_size: int, split: str) -> str:
        return (
            f"align.data's {split} split holds {len(self):,} pairs, fewer than one global batch "
            f"(parallel.global_batch_size={global_batch_size}); "
            f"parallel.global_batch_size={max(1, len(self))} or add pairs"
        )

    def resume_mismatch(self, saved_samples: int) -> str | None:
        if saved_samples == len(self):
            return None
        return (
            f"align.data now holds {len(self):,} training pairs but the checkpoint was trained on "
            f"{saved_samples:,}; resume with the same data and align.num_eval, or start a new run"
        )


def pair_messages(record: Any, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt messages, chosen response messages, rejected response messages) of one row."""
    if not isinstance(record, dict):
        raise ConfigError(
            f"{where}: the row is a {type(record).__name__}, not an object with {', '.join(FIELDS)}"
        )
    # without a prompt, chosen and rejected are whole conversations (lists): strings need the prompt
    explicit = record.get("prompt") is not None or not isinstance(record.get("chosen"), list)
    for field in FIELDS if explicit else FIELDS[1:]:
        if record.get(field) is None:
            raise ConfigError(
                f"{where}: field '{field}' is missing; a pair needs prompt, chosen and rejected "
                "(or chosen and rejected conversations that share their prompt turns)"
            )
    chosen, rejected = record["chosen"], record["rejected"]
    if not explicit:  # implicit prompt: the turns both conversations share
        turns = [_turns(record, f, where) for f in ("chosen", "rejected")]
        shared = 0
        while shared < min(map(len, turns)) and turns[0][shared] == turns[1][shared]:
            shared += 1
        while shared and turns[0][shared - 1]["role"] == "assistant":
            shared -= 1  # the responses start after the last shared user turn
        return turns[0][:shared], turns[0][shared:], turns[1][shared:]
    prompt = record["prompt"]
    if isinstance(prompt, str):
        system = record.get("system")
        head = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
        if not prompt.strip():
            raise ConfigError(f"{where}: field 'prompt' is empty")
        prompt_turns = [*head, {"role": "user", "content": prompt}]
    else:
        prompt_turns = _turns(record, "prompt", where)
    return prompt_turns, _response(chosen, "chosen", where), _response(rejected, "rejected", where)


def _turns(record: dict, field: str, where: str) -> list[dict]:
    value = record[field]
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ConfigError(f"{where}: field '{field}' is not a list of chat messages ({{role, content}})")
    return [{"role": m.get("role"), "content": m.get("content")} for m in value]


def _response(value: Any, field: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return [{"role": m.get("role"), "content": m.get("content")} for m in value]
    raise ConfigError(f"{where}: field '{field}' is a {type(value).__name__}; give a string or chat messages")


def encode_pair(
    tokenizer: Any, template: str, record: Any, where: str, seq_len: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(ids, shifted labels) of chosen, of rejected]; targets on the response tokens only."""
    prompt, chosen, rejected = pair_messages(record, where)
    if chosen == rejected:
        raise ConfigError(
            f"{where}: 'chosen' and 'rejected' are the same; a pair needs two different responses"
        )
    out = []
    prompt_part = prompt_ids(tokenizer, prompt, template) if prompt else []
    for field, response in (("chosen", chosen), ("rejected", rejected)):
        if not response or any(
            m["role"] == "assistant" and not str(m.get("content") or "").strip() for m in response
        ):
            raise ConfigError(f"{where}: field '{field}' is an empty response")
        try:
            messages = normalize_record({"messages": prompt + response})
            ids, flags = encode_conversation(tokenizer, messages, template)
        except MalformedRow as err:
            raise ConfigError(f"{where}: field '{field}': {err.detail}") from None
        if ids[: len(prompt_part)] != prompt_part:
            raise ConfigError(
                f"{where}: field '{field}': the chat template renders the prompt differently before a "
                "response; use a template that renders incrementally (finetune.data.template=chatml)"
            )
        if len(ids) > seq_len:
            raise ConfigError(
                f"{where}: field '{field}' makes a conversation of {len(ids)} tokens, more than "
                f"data.seq_len={seq_len}; data.seq_len={len(ids)} (within model.max_seq_len), or drop the row"
            )
        target = np.asarray(flags[1:], dtype=bool)
        target[: max(0, len(prompt_part) - 1)] = False  # the prompt's assistant turns are not scored
        arr = np.asarray(ids, dtype=np.int64)
        out.append((arr, np.where(target, arr[1:], IGNORE_INDEX)))
    return out


def build_pairs(rows: Iterable[tuple[str, Any]], tokenizer: Any, template: str, seq_len: int) -> PairDataset:
    """Every row's two conversations, right-padded to seq_len (pad: the pad token, else eos)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    samples = [s for where, record in rows for s in encode_pair(tokenizer, template, record, where, seq_len)]
    tokens = np.full((len(samples), seq_len), pad_id, dtype=np.int32)
    labels = np.full((len(samples), seq_len), IGNORE_INDEX, dtype=np.int32)
    for r, (ids, labs) in enumerate(samples):
        tokens[r, : len(ids)] = ids  # the last token too: the reference scores each position's next input
        labels[r, : len(ids) - 1] = labs
    return PairDataset(tokens, labels, seq_len)


TASK_PREFIX = "task:"


def read_pairs(
    path: str,
    tokenizer: Any,
    template: str,
    seq_len: int,
    num_pairs: int = 0,
    seed: int = 0,
    held_out: int = 0,
) -> PairDataset:
    """align.data's pairs (a path: a file, a folder of files, or a save_to_disk folder; or
    task:<name>, `num_pairs` pairs of a built-in task's training questions: `task_pairs`)."""
    if path.startswith(TASK_PREFIX):
        rows = task_pairs(path[len(TASK_PREFIX) :], num_pairs, seed, held_out)
        return build_pairs(
            ((f"{path} pair {i}", row) for i, row in enumerate(rows, 1)), tokenizer, template, seq_len
        )
    local = Path(path).expanduser()
    if not local.exists():
        raise ConfigError(
            f"align.data={path} does not exist; give a {'/'.join(SFT_SUFFIXES)} file of pairs, a folder of "
            "them, or a folder `datasets` saved (save_to_disk)"
        )
    plain_folder = local.is_dir() and not user_files.is_saved_dataset(local)
    if plain_folder and not any(p.name.endswith(SFT_SUFFIXES) for p in local.iterdir()):
        raise ConfigError(f"align.data={path} holds no {'/'.join(SFT_SUFFIXES)} files and no saved dataset")
    pairs = build_pairs(iter_sft_rows(str(local)), tokenizer, template, seq_len)
    if not len(pairs):
        raise ConfigError(
            f"align.data={path} holds no pairs; fill it with rows of prompt, chosen and rejected"
        )
    return pairs


def corrupt(answer: str) -> str:
    """A wrong answer of the same length: the answer's last two characters swapped, or its last one
    replaced where swapping changes nothing."""
    if len(answer) >= 2 and answer[-1] != answer[-2]:
        return answer[:-2] + answer[-1] + answer[-2]
    last = answer[-1:] or "0"
    return answer[:-1] + ("1" if last != "1" else "2")


def task_pairs(name: str, num: int, seed: int = 0, held_out: int = 0) -> list[dict[str, str]]:
    """`num` pairs {prompt, chosen, rejected} of a built-in task (suite.data.tasks): its right answer
    against a corrupted one; for tests, examples and a first look at the method. The questions are
    the task's training questions for `held_out` held-out ones (finetune.data.num_eval, task_seed
    `seed`), so `suite eval` of the result measures questions it never saw."""
    rows, _ = generate_task(name, num, held_out, seed)
    return [
        {"prompt": m[0]["content"], "chosen": m[1]["content"], "rejected": corrupt(m[1]["content"])}
        for m in rows
    ]
