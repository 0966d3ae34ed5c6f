"""Shared test helpers: run the real CLI in a subprocess, read what a run wrote, compare weights."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.vocab_size=512",
    "model.max_seq_len=64",
    "data.seq_len=32",
    "train.precision=fp32",  # the gpt-tiny recipe trains in bf16; layout comparisons need fp32
    "log.wandb=false",
    "log.progress=false",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def suite_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def run_suite(
    *args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """`suite <args>` as a user types it (python -m suite, so no PATH assumptions)."""
    proc = subprocess.run(
        [sys.executable, "-m", "suite", *args],
        cwd=cwd or REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or suite_env(),
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"suite {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model weights as plain full tensors, whatever layout wrote them
    (under the unfused names when the run fused its projections, so layouts compare)."""
    from suite.config.compose import load_saved_config
    from suite.models import build_model, materialize
    from suite.models.transformer import unfuse_state_dict
    from suite.train.checkpoint import load_model_weights, resolve_checkpoint

    folder = resolve_checkpoint(run_dir)
    cfg = load_saved_config(folder / "config.yaml")
    model = materialize(build_model(cfg.model), "cpu", seed=0)
    load_model_weights(folder, model)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return unfuse_state_dict(cfg.model, weights) if cfg.model.fused_projections else weights


def initial_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights a run started from (its seeded initialisation, the same in every layout), under
    the unfused names, so that `final_weights(run) - initial_weights(run)` is the run's update."""
    from suite.config.compose import load_saved_config
    from suite.models import build_model, materialize
    from suite.models.transformer import unfuse_state_dict

    cfg = load_saved_config(Path(run_dir) / "config.yaml")
    model = materialize(build_model(cfg.model), "cpu", seed=cfg.train.seed)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return unfuse_state_dict(cfg.model, weights) if cfg.model.fused_projections else weights


def assert_close_updates(ref_run: Path, got_run: Path, tol: float = 1e-4) -> None:
    """Per tensor, the weight updates (final minus initial) of two runs that started from the same
    weights: ||got_update - ref_update|| / ||ref_update|| <= tol. Comparing whole weights would
    mostly compare the shared initial values."""
    start = initial_weights(ref_run)
    ref, got = final_weights(ref_run), final_weights(got_run)
    assert ref.keys() == got.keys() == start.keys()
    for name in ref:
        ref_update = ref[name].float() - start[name].float()
        diff = (got[name].float() - ref[name].float()).norm() / ref_update.norm().clamp_min(1e-12)
        assert ref_update.norm() > 0, f"{name} did not move: the comparison would prove nothing"
        assert diff <= tol, (name, float(diff))


def worker_pids(parent: int, attempt: int | None = None) -> dict[int, int]:
    """{global rank: pid} of the live `suite.worker` processes whose parent is `parent` (the
    launching `suite` process), found from outside through /proc; with `attempt`, only those of
    that restart attempt (TORCHELASTIC_RESTART_COUNT, 0 for the first group)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(
                item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item
            )
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid != parent or b"suite.worker" not in cmdline or b"RANK" not in environ:
            continue
        if attempt is not None and int(environ.get(b"TORCHELASTIC_RESTART_COUNT", b"0")) != attempt:
            continue
        found[int(environ[b"RANK"])] = int(entry.name)
    return found


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (no longer in /proc, or a zombie its parent has not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def assert_close_losses(ref: dict[int, float], got: dict[int, float], rtol: float = 1e-4) -> None:
    assert ref.keys() == got.keys(), (sorted(ref), sorted(got))
    for step in ref:
        assert abs(ref[step] - got[step]) <= rtol * abs(ref[step]), (step, ref[step], got[step])


def assert_close_weights(
    ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tol: float = 1e-4
) -> None:
    """Per tensor: ||ref - got|| / ||ref|| <= tol."""
    assert ref.keys() == got.keys()
    for name in ref:
        diff = (ref[name].float() - got[name].float()).norm() / ref[name].float().norm().clamp_min(1e-12)
        assert diff <= tol, (name, float(diff))


def export_and_compare(run: Path, out: Path, **overrides: str) -> float:
    """`suite export` a run's checkpoint (in this process) to `out`; the largest |logit difference|
    between transformers on the exported folder and the suite model loaded from the checkpoint."""
    from transformers import AutoModelForCausalLM

    from suite.cli import main
    from suite.infer.generate import load_for_inference

    assert main(["export", f"ckpt={run}", f"out={out}", *(f"{k}={v}" for k, v in overrides.items())]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ours, _, _ = load_for_inference(run)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float((hf(ids).logits - ours(ids)).abs().max())
