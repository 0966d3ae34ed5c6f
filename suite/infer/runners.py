"""One interface over every way to run the prefill/decode graphs (suite.infer.graphs): the suite model
itself, a torch.export `.pt2` pair, an ONNX pair in onnxruntime. `suite generate`, the exports'
self-verification and bench/generate.py drive them through `greedy` / `decode_steps`, so an artifact
is checked by the same loop that uses it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from suite.config.errors import ConfigError
from suite.infer.graphs import graph_modules, prepare_for_export
from suite.models.transformer import Transformer

MANIFEST = "export_manifest.json"  # written by suite.export.manifest
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # logits, keys, values


class GraphRunner(Protocol):
    max_seq_len: int

    def prefill(self, tokens: torch.Tensor) -> Outputs: ...

    def decode(self, tokens: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> Outputs: ...


class ModuleRunner:
    """A prefill and a decode module run as PyTorch (no autograd)."""

    def __init__(self, prefill: torch.nn.Module, decode: torch.nn.Module, max_seq_len: int):
        self._prefill, self._decode, self.max_seq_len = prefill, decode, max_seq_len

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> Outputs:
        return self._prefill(tokens)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> Outputs:
        return self._decode(tokens, keys, values)


def SuiteRunner(model: Transformer) -> ModuleRunner:  # noqa: N802 (reads as the runner it builds)
    """The suite model through the same graph modules that were exported (eager PyTorch)."""
    prepare_for_export(model)
    graphs = graph_modules(model)
    return ModuleRunner(graphs["prefill"], graphs["decode"], model.cfg.max_seq_len)


def ProgramRunner(folder: Path, max_seq_len: int) -> ModuleRunner:  # noqa: N802
    """prefill.pt2 and decode.pt2 (torch.export programs), run as PyTorch modules."""
    load = lambda name: torch.export.load(str(folder / f"{name}.pt2")).module()  # noqa: E731
    return ModuleRunner(load("prefill"), load("decode"), max_seq_len)


class OnnxRunner:
    """prefill.onnx and decode.onnx in onnxruntime (CPU), tensors in and out as torch tensors."""

    def __init__(self, folder: Path, max_seq_len: int, threads: int | None = None):
        # deferred: onnxruntime is optional (the deploy extra); only running an ONNX export needs it
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3  # warnings about unused initializers are noise here
        self._prefill = ort.InferenceSession(
            str(folder / "prefill.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self._decode = ort.InferenceSession(
            str(folder / "decode.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self.max_seq_len = max_seq_len

    @staticmethod
    def _run(session, **inputs: torch.Tensor) -> Outputs:
        out = session.run(None, {k: v.cpu().numpy() for k, v in inputs.items()})
        return tuple(torch.from_numpy(o) for o in out)

    def prefill(self, tokens: torch.Tensor) -> Outputs:
        return self._run(self._prefill, tokens=tokens)

    def decode(self, tokens: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> Outputs:
        return self._run(self._decode, tokens=tokens, past_keys=keys, past_values=values)


def is_graph_export(folder: Path) -> bool:
    """A folder written by `suite export format=torch_export|onnx`."""
    manifest = Path(folder) / MANIFEST
    if not manifest.is_file():
        return False
    return json.loads(manifest.read_text()).get("format") in ("torch_export", "onnx")


def load_runner(folder: Path, threads: int | None = None) -> tuple[GraphRunner, dict]:
    """The runner of an exported folder and its manifest."""
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    limit = int(manifest["model"]["max_seq_len"])
    if manifest["format"] == "torch_export":
        return ProgramRunner(Path(folder), limit), manifest
    try:
        return OnnxRunner(Path(folder), limit, threads), manifest
    except ImportError:
        raise ConfigError(
            f"'{folder}' is an ONNX export and onnxruntime is not installed: pip install 'suite[deploy]'"
        ) from None


def decode_steps(runner: GraphRunner, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Greedy: the prefill's last logits, then those of each of `steps` decode steps (rows in step)."""
    logits, keys, values = runner.prefill(tokens)
    seen = [logits[:, -1]]
    for _ in range(steps):
        token = seen[-1].argmax(-1, keepdim=True)
        logits, keys, values = runner.decode(token, keys, values)
        seen.append(logits[:, -1])
    return seen


def graph_steps(
    runner: GraphRunner,
    tokens: torch.Tensor,
    max_new_tokens: int,
    pick: Callable[[torch.Tensor], torch.Tensor],
) -> Iterator[torch.Tensor]:
    """Each step's next tokens [b] for equal-length prompts [b, s] (pick(logits [b, V]) -> [b, 1]);
    the caller stops early (eos, stop sequences). The graphs take no padding mask: callers group
    prompts by length."""
    budget = min(max_new_tokens, runner.max_seq_len - tokens.shape[1])
    logits, keys, values = runner.prefill(tokens)
    for step in range(budget):
        token = pick(logits[:, -1].float())
        yield token[:, 0]
        if step + 1 < budget:
            logits, keys, values = runner.decode(token, keys, values)


def greedy(runner: GraphRunner, tokens: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy continuation [b, n] of equal-length prompts [b, s]."""
    steps = list(graph_steps(runner, tokens, max_new_tokens, lambda logits: logits.argmax(-1, keepdim=True)))
    return torch.stack(steps, dim=1) if steps else tokens.new_zeros(tokens.shape[0], 0)
