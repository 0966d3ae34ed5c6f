"""`suite eval harness=<task,...>`: lm-evaluation-harness tasks on any model source.

`SuiteLM` is an lm_eval model (registered as "suite" once this module is imported) over what `suite.infer.generate.load_for_inference` reads: a suite run or
checkpoint, an hf:<folder>, a `suite quantize` output. Its tokenization and scoring follow lm_eval's
own `hf` model (HFLM) so the two give the same per-sample log-likelihoods on the same weights:
context and continuation encoded together then split (TemplateLM._encode_pair), the tokenizer's
default special tokens, an empty context replaced by the bos (else eos) token, inputs cut on the
left to the model's context, rolling windows from lm_eval.utils.

lm_eval is optional (`pip install 'suite[harness]'`): only this module imports it, and only the
harness path imports this module (`require_lm_eval` says how to install it when it is missing).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig
from suite.eval_tasks import TASKS_DIR, shipped_tasks
from suite.infer.generate import generate_tokens, load_for_inference

MISSING = "eval.harness needs lm-evaluation-harness: pip install 'suite[harness]' (or lm-eval==0.4.13)"


def require_lm_eval() -> None:
    """One line (ConfigError, exit 2) when lm_eval cannot be imported."""
    try:
        import lm_eval  # noqa: F401  # deferred: probes the optional lm-eval (one line when it is missing)
    except ImportError:
        raise ConfigError(MISSING) from None


require_lm_eval()

import lm_eval  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402


@register_model("suite")
class SuiteLM(TemplateLM):
    """lm_eval's view of a suite model source: loglikelihood, loglikelihood_rolling, generate_until."""

    def __init__(self, ckpt: Any, device: str = "auto", batch_size: int | str = 8, **_: Any) -> None:
        super().__init__()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model, self.tokenizer, self.folder = load_for_inference(ckpt, device)
        self.model.eval()
        self._device = torch.device(device)
        self.batch_size = int(batch_size)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is replaced by: bos, else eos (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return int(self.model.cfg.max_seq_len)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's own default special tokens unless told otherwise; none added before a
        string that already starts with the prefix token's text."""
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        prefix = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and prefix and string.startswith(prefix):
            extra = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **extra)

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether greedy decoding gives the continuation;
        batches right-padded (causal attention: padding after a row never changes its logits)."""
        out: list[tuple[float, bool]] = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start : start + self.batch_size]
            inputs, lengths = [], []
            for _, context, continuation in chunk:
                if not continuation:
                    raise ValueError("lm_eval asked for the likelihood of an empty continuation")
                ids = (context + continuation)[-(self.max_length + 1) :][:-1]
                inputs.append(ids)
                lengths.append(len(ids))
            width = max(lengths)
            batch = torch.zeros(len(inputs), width, dtype=torch.long)
            for row, ids in enumerate(inputs):
                batch[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logp = F.log_softmax(self.model(batch.to(self._device)).float(), dim=-1)
            for row, (key, _, continuation) in enumerate(chunk):
                n = len(continuation)
                scores = logp[row, lengths[row] - n : lengths[row]]
                target = torch.tensor(continuation, dtype=torch.long, device=scores.device)
                greedy = bool((scores.argmax(-1) == target).all())
                answer = (float(scores.gather(-1, target[:, None]).sum()), greedy)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                out.append(answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts in disjoint windows of the model's context (as HFLM)."""
        results = []
        for (string,) in [req.args for req in requests]:
            windows = [
                (None, *lm_utils.make_disjoint_window(w))
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            results.append(total)
        return results

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with gen_kwargs temperature > 0) continuations with the KV cache,
        cut at the first stop string (`until`, default the eos token's text)."""
        out = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tokenizer.decode(self.eot_token_id)
            if eos_text and eos_text not in until:
                until.append(eos_text)
            max_new = int(kwargs.get("max_gen_toks", 256))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            cfg = GenerateConfig(max_new_tokens=max_new, temperature=temperature, top_k=None, top_p=None)
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new) :]
            text = self.tokenizer.decode(generate_tokens(self.model, ids, cfg, self.eot_token_id))
            for stop in until:
                if stop:
                    text = text.split(stop, 1)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def task_manager():
    """lm_eval's TaskManager over its own tasks plus the ones suite ships (suite/eval_tasks)."""
    # deferred: lm_eval.tasks costs ~2 s (it indexes its task folders); only naming or running tasks needs it
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


def task_names(harness: str, manager: Any) -> list[str]:
    """harness=<a,b> as a list of task names; an unknown one is one line naming the shipped tasks."""
    names = [n.strip() for n in str(harness).split(",") if n.strip()]
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            raise ConfigError(
                f"harness task '{name}' is unknown; shipped with suite: {', '.join(shipped_tasks())} "
                "(lm-evaluation-harness's own task names, e.g. hellaswag, work too where their data can be "
                "downloaded)"
            )
    return names


def evaluate_lm(lm: Any, names: list[str], limit: int | None, manager: Any, **kwargs: Any) -> dict:
    """lm_eval.simple_evaluate on an lm_eval model instance, lm_eval's logging kept to errors."""
    quiet = logging.getLogger("lm_eval")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return lm_eval.simple_evaluate(model=lm, tasks=names, limit=limit, task_manager=manager, **kwargs)
    finally:
        quiet.setLevel(level)


def run_harness(source: Any, eval_cfg: Any, device: str = "auto") -> dict[str, Any]:
    """`suite eval harness=...`: the tasks checked first (before the model loads), then scored.
    Returns {"tasks": {task: {metric: value}}, "limit", "ckpt"}."""
    manager = task_manager()
    names = task_names(eval_cfg.harness, manager)
    lm = SuiteLM(source, device=device, batch_size=eval_cfg.batch_size)
    raw = evaluate_lm(lm, names, eval_cfg.limit, manager)
    return {"tasks": scores(raw), "limit": eval_cfg.limit, "ckpt": str(lm.folder)}


def scores(raw: dict) -> dict[str, dict[str, float]]:
    """lm_eval's results as {task: {metric: value}} ("acc,none" -> "acc"; stderr kept, alias dropped)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in raw["results"].items():
        row = {}
        for key, value in metrics.items():
            if key == "alias" or not isinstance(value, (int, float)):
                continue
            if key == "sample_len":  # how many samples were scored, not a metric
                row["samples"] = int(value)
                continue
            name, _, filt = key.partition(",")
            row[name if filt in ("none", "") else f"{name},{filt}"] = float(value)
        out[task] = row
    return out


def harness_text(result: dict[str, Any]) -> str:
    """One table: task, metric, value, stderr."""
    lines = [f"{'task':<20} {'metric':<12} {'value':>8} {'stderr':>8}"]
    for task, metrics in result["tasks"].items():
        for name, value in metrics.items():
            if name == "samples" or name.endswith("_stderr") or "_stderr," in name:
                continue
            err = metrics.get(f"{name}_stderr")
            err_text = f"{err:8.4f}" if isinstance(err, float) and err == err else f"{'-':>8}"
            lines.append(
                f"{task:<20} {name:<12} {value:8.4f} {err_text}  ({metrics.get('samples', '?')} samples)"
            )
    limit = f", at most {result['limit']} samples per task" if result["limit"] else ""
    lines.append(f"ckpt {result['ckpt']}{limit}")
    return "\n".join(lines)
