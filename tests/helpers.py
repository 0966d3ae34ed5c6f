"""Shared test helpers: run the real CLI in a subprocess, read what a run wrote, compare weights."""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from suite.launch.fork_server import SERVER_NAME
from tests.forked_cli import ForkedCLI

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
    # report.md + five matplotlib PNGs cost ~2 s per run; tests/e2e/test_report.py turns them on
    "log.report=false",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def suite_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"})
    env["SUITE_TEST_COMPONENTS"] = str(REPO / "tests" / "fault_injection.py")  # the tests' fault injection
    env.update(extra)
    return env


# Variables a process reads when it imports torch or starts the interpreter: a call that changes one
# of these gets a fresh interpreter, since a forked child keeps its server's.
_IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "TORCH", "CUDA", "PYTHON", "LD_", "MALLOC")
_SERVER: ForkedCLI | None = None


def _forked_cli() -> ForkedCLI:
    """This test process' fork server (tests/forked_cli.py), started on first use."""
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = ForkedCLI(suite_env())
        atexit.register(_SERVER.close)
    return _SERVER


def _cuda_machine() -> bool:
    import torch

    return torch.cuda.is_available()  # asks the driver; does not initialise CUDA in this process


def _forkable(env: dict[str, str], server: dict[str, str]) -> dict[str, str] | None:
    """What `env` sets beyond the server's environment, or None when a forked child cannot honour it."""
    if set(server) - set(env):
        return None
    extra = {k: v for k, v in env.items() if server.get(k) != v}
    return None if any(k.startswith(_IMPORT_TIME_ENV) for k in extra) else extra


def run_suite(
    *args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """`suite <args>` as a user types it: the CLI's `main` (what `python -m suite` runs) in a child
    forked from a server that imported torch and the suite once, which saves every call the ~4 s of
    a fresh interpreter; `python -m suite` itself when `env` changes what the interpreter reads at start."""
    env = env or suite_env()
    # a machine with a CUDA GPU: a fresh interpreter every call (CUDA cannot run in a forked child of a
    # server whose imports, torchao's among them, already initialised it)
    extra = None if _cuda_machine() else _forkable(env, _forked_cli().env)
    if extra is None:
        proc = subprocess.run(
            [sys.executable, "-m", "suite", *args],
            cwd=cwd or REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    else:
        with tempfile.TemporaryDirectory(prefix="suite-call-") as out:
            proc = _forked_cli().run(
                list(args), cwd=Path(cwd or REPO), env=extra, timeout=timeout, out=Path(out)
            )
        if proc.returncode == 124:
            raise subprocess.TimeoutExpired(["suite", *args], timeout, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"suite {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_loopback_nodes(args: list[str], log_dir: Path, nodes: int = 2, timeout: float = 400) -> str:
    """`suite <args> launch.nnodes=N launch.node_rank=r` for every r at once on 127.0.0.1 (free port),
    as on N machines; asserts every node exits 0 and returns their logs."""
    import signal

    base = [*args, f"launch.nnodes={nodes}", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"]
    logs = [Path(log_dir) / f"node{r}.log" for r in range(nodes)]
    procs = []
    for rank, log in enumerate(logs):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "suite", *base, f"launch.node_rank={rank}"],
                cwd=REPO,
                env=suite_env(),
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    try:
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = "\n".join(log.read_text() for log in logs)
    assert codes == [0] * nodes, text
    return text


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def run_config(run_dir: Path):
    """The resolved config a run (or checkpoint folder) was trained with."""
    from suite.config.compose import load_saved_config
    from suite.train.checkpoint import resolve_checkpoint

    return load_saved_config(resolve_checkpoint(run_dir) / "config.yaml")


def _model_like_run(cfg):
    """The plain model a run trains (with its LoRA adapters, for a LoRA finetuning run), on meta."""
    from suite.models import build_model
    from suite.models.lora import apply_lora

    model = build_model(cfg.model, "meta")
    if _is_lora(cfg):
        lo = cfg.finetune.lora
        apply_lora(model, lo.rank, lo.alpha, lo.dropout, tuple(lo.target_modules), cfg.train.seed)
    return model


def _is_lora(cfg) -> bool:
    return bool(cfg.model.init_from) and cfg.finetune.method == "lora"


def _plain_names(cfg, model) -> dict[str, torch.Tensor]:
    from suite.models.transformer import unfuse_state_dict

    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return unfuse_state_dict(cfg.model, weights) if cfg.model.fused_projections else weights


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model weights (a checkpoint folder: that one's) as plain full tensors,
    whatever layout wrote them (under the unfused names when the run fused its projections, so
    layouts compare; LoRA adapters included)."""
    from suite.models import materialize
    from suite.train.checkpoint import load_model_weights, resolve_checkpoint

    cfg = run_config(run_dir)
    model = materialize(_model_like_run(cfg), "cpu", seed=0)
    load_model_weights(resolve_checkpoint(run_dir), model)
    return _plain_names(cfg, model)


def initial_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights a run started from, rebuilt the way the trainer builds them: the seeded init
    (every layout starts from these values), the base model's weights for finetuning, fresh LoRA
    adapters (names as `final_weights` gives them). tests/e2e/test_checks.py checks it against a
    run that cannot move its weights."""
    from suite.model_source import ModelSource
    from suite.models import materialize
    from suite.models.lora import init_lora

    cfg = run_config(run_dir)
    model = materialize(_model_like_run(cfg), "cpu", cfg.train.seed)
    if cfg.model.init_from:
        ModelSource.parse(cfg.model.init_from, "model.init_from").load_weights(
            model, cfg.model.fused_projections
        )
    if _is_lora(cfg):
        init_lora(model, cfg.train.seed)
    return _plain_names(cfg, model)


def val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}


def held_out_rows(run_dir: Path) -> int:
    cfg = run_config(run_dir)
    return cfg.train.eval_batches * cfg.parallel.micro_batch_size


def grad_norms(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in read_metrics(run_dir) if "grad_norm" in r}


def step_gradients(run_dir: Path, step: int = 1) -> dict[str, torch.Tensor]:
    """The gradients `train.save_grads_step=<step>` wrote, merged over the ranks' files (pipeline
    stages hold different parameters; where ranks share a name their gradients must agree)."""
    from safetensors.torch import load_file

    from suite.models.transformer import unfuse_state_dict

    files = sorted((Path(run_dir) / "grads" / f"step_{step}").glob("rank*.safetensors"))
    assert files, f"{run_dir} has no gradients of step {step} (train.save_grads_step={step})"
    merged: dict[str, torch.Tensor] = {}
    for path in files:
        for name, grad in load_file(str(path)).items():
            if name in merged:
                same = (merged[name] - grad).norm() <= 1e-6 * merged[name].norm().clamp_min(1e-12)
                assert same, f"{path.name}: the gradient of {name} differs from another rank's"
            merged[name] = grad
    cfg = run_config(run_dir)
    return unfuse_state_dict(cfg.model, merged) if cfg.model.fused_projections else merged


# The attention key bias gets no gradient in exact arithmetic (softmax ignores a shift that is the
# same for every key of a query); in floating point it gets rounding noise, which AdamW turns into
# ~1e-7 updates whose sign depends on summation order. Compared in absolute terms instead.
NOISE_ONLY = ("attention.wk.bias",)


def assert_equivalent(
    ref_dir: Path,
    run_dir: Path,
    *,
    loss_rtol: float = 1e-4,
    norm_rtol: float = 1e-4,
    grad_rtol: float = 1e-4,
    update_rtol: float = 1e-4,
    noise_atol: float = 1e-5,
    grad_step: int | None = 1,
    min_update: float = 1e-3,
    from_step: int = 0,
    to_step: int | None = None,
) -> None:
    """A layout trained like the reference run, checked at every level a scale or sharding bug shows:

    - the loss and the gradient norm of every logged step (a gradient off by a constant factor moves
      the norm by that factor, while AdamW and clipping hide it from losses and weights);
    - the held-out loss of every evaluation (the same rows in every layout: suite.train.trainer.evaluate);
    - every parameter's gradient of step `grad_step` (train.save_grads_step), relative per tensor;
    - every parameter's update (final minus initial weights), relative to the reference's update,
      after checking that the reference moved each parameter by at least `min_update` of its norm
      (a tolerance on whole weights would mostly measure the shared initial values).
    `from_step`: a run resumed from that step's checkpoint logs only the later steps; `to_step`:
    compare the steps up to that one and the weights of that step's checkpoints (a shorter run).
    """
    last = to_step if to_step is not None else 1 << 30

    def later(values: dict[int, float]) -> dict[int, float]:
        return {step: v for step, v in values.items() if from_step < step <= last}

    def weights_of(run: Path) -> dict[str, torch.Tensor]:
        return final_weights(run if to_step is None else Path(run) / "checkpoints" / f"step_{to_step}")

    assert_close_losses(later(train_losses(ref_dir)), later(train_losses(run_dir)), rtol=loss_rtol)
    # evaluations both runs logged (a shorter run evaluates at its own end); step 0's is the initial model's.
    # The held-out rows are train.eval_batches x micro_batch_size (suite.train.trainer.evaluate): a layout
    # run with another micro-batch size evaluates other rows, and only its training is compared
    if held_out_rows(ref_dir) == held_out_rows(run_dir):
        ref_vals, vals = val_losses(ref_dir), val_losses(run_dir)
        common = sorted(s for s in ref_vals.keys() & vals.keys() if from_step <= s <= last)
        assert common, ("no val_loss logged at the same step", sorted(ref_vals), sorted(vals))
        for step in common:
            value = ref_vals[step]
            assert abs(vals[step] - value) <= loss_rtol * abs(value), ("val_loss", step, value, vals[step])
    ref_norms, norms = later(grad_norms(ref_dir)), later(grad_norms(run_dir))
    assert ref_norms.keys() == norms.keys() and ref_norms, (sorted(ref_norms), sorted(norms))
    for step, value in ref_norms.items():
        if math.isinf(value):  # an overflowing fp16 step, skipped (tests/distributed/test_fp16.py)
            continue
        assert abs(norms[step] - value) <= norm_rtol * abs(value), ("grad_norm", step, value, norms[step])
    if grad_step is not None:
        ref_grads, grads = step_gradients(ref_dir, grad_step), step_gradients(run_dir, grad_step)
        assert ref_grads.keys() == grads.keys(), sorted(ref_grads.keys() ^ grads.keys())
        for name, ref in ref_grads.items():
            if name.endswith(NOISE_ONLY):
                assert float((ref - grads[name]).abs().max()) <= noise_atol, ("grad", name)
                continue
            diff = (ref - grads[name]).norm() / ref.norm().clamp_min(1e-12)
            assert diff <= grad_rtol, ("grad", name, float(diff))
    start, ref_final, final = initial_weights(ref_dir), weights_of(ref_dir), weights_of(run_dir)
    assert start.keys() == ref_final.keys() == final.keys(), sorted(start.keys() ^ final.keys())
    for name, init in start.items():
        ref_update = (ref_final[name] - init).float()
        if name.endswith(NOISE_ONLY):
            assert float((ref_final[name] - final[name]).abs().max()) <= noise_atol, ("weight", name)
            continue
        if float(ref_update.abs().max()) == 0.0:  # frozen (a LoRA base weight): frozen here too
            assert torch.equal(final[name], ref_final[name]), ("frozen weight changed", name)
            continue
        if float(init.abs().max()) > 0:  # zero-initialised biases have no scale to compare with
            moved = ref_update.norm() / init.float().norm()
            assert moved >= min_update, ("reference update / weight", name, float(moved))
        diff = (final[name] - ref_final[name]).float().norm() / ref_update.norm()
        assert diff <= update_rtol, ("update", name, float(diff))


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def override_value(overrides: list[str], key: str, default: str) -> str:
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return values[-1] if values else default


BLOCK_MATRIX = re.compile(r"^layers\.\*\.(attention|feed_forward)\.(shared_experts\.)?w\w+\.weight$")
# MLA's low-rank down-projections (suite/models/deepseek_v3/attention.py): whole on every tp rank
LOW_RANK = re.compile(r"^layers\.\*\.attention\.(wq_a|wkv_a)\.weight$")
# multi-token prediction modules (suite/models/mtp.py): their block's head-split matrices, and the
# per-token projection whole on every tp rank
MTP_BLOCK_MATRIX = re.compile(
    r"^mtp\.\w+\.block\.(attention\.(wq|wq_b|wkv_b|wo)|feed_forward\.w\d+)\.weight$"
)
MTP_PROJECTION = re.compile(r"^mtp\.\w+\.projection\.weight$")


def assert_layout(run_dir: Path, nproc: int, overrides: list[str]) -> dict:
    """The layout the overrides ask for is the one that ran (summary.json `layout`, read off each
    rank's model by suite.parallel.describe): world size, degrees, data-parallel kind, and on every
    rank the placements and wrappers those degrees imply. Returns the layout."""
    layout = summary(run_dir)["layout"]
    degrees = {
        axis: int(override_value(overrides, f"parallel.{axis}", "1"))
        for axis in ("pp", "dp", "sharding", "cp", "tp", "ep")
    }
    assert layout["world_size"] == nproc, layout["world_size"]
    assert layout["degrees"] == {k: v for k, v in degrees.items() if v > 1 and k != "ep"}, layout["degrees"]
    stage = int(override_value(overrides, "parallel.sharding_stage", "3"))
    if degrees["dp"] * degrees["sharding"] * degrees["cp"] == 1:
        kind = "none"
    elif degrees["sharding"] == 1:
        kind = "replicate"
    else:
        kind = "zero1" if stage == 1 else ("hsdp" if degrees["dp"] > 1 else "fsdp")
    assert layout["data_parallel"] == kind, (layout["data_parallel"], kind)
    assert layout["precision"] == override_value(overrides, "train.precision", "fp32")
    recompute = override_value(
        overrides, "recompute.granularity", override_value(overrides, "recompute", "none")
    )
    offload = override_value(overrides, "parallel.offload", "false") == "true"
    for view in layout["ranks"]:
        params, modules = view["params"], view["modules"]
        for name, placement in params.items():
            if degrees["tp"] > 1 and (LOW_RANK.match(name) or MTP_PROJECTION.match(name)):
                assert "tp:Replicate()" in placement, (name, placement)
            elif degrees["tp"] > 1 and (
                BLOCK_MATRIX.match(name) or MTP_BLOCK_MATRIX.match(name) or name == "output.weight"
            ):
                assert "tp:Shard(dim=" in placement, (name, placement)
            expert = ".experts." in name  # expert parallel: on their own (edp, ep) mesh, not FSDP's
            if degrees["tp"] > 1 and expert:  # expert-tensor-parallel: each expert split on its ffn dim
                assert f"tp:Shard(dim={2 if name.endswith('w2') else 1})" in placement, (name, placement)
            if degrees["tp"] > 1 and name.endswith(".router.weight"):  # routing replicated on tp ranks
                assert "tp:Replicate()" in placement, (name, placement)
            if kind in ("fsdp", "hsdp") and not (expert and degrees["ep"] > 1):
                # over the sharding axis, or with cp over the flattened (sharding, cp) mesh
                assert re.search(r"(sharding\w*|data_cp):(_Strided)?Shard\(dim=0", placement), (
                    name,
                    placement,
                )
            if kind in ("replicate", "zero1"):
                assert "Replicate()" in placement, (name, placement)
            if kind == "none" and degrees["tp"] == 1 and degrees["ep"] == 1:
                assert placement == "local", (name, placement)
        if kind in ("replicate", "zero1"):
            assert "replicate" in modules, modules
        if kind in ("fsdp", "hsdp"):
            assert "fsdp" in modules and "replicate" not in modules, modules
        if degrees["cp"] > 1:
            mtp = int(override_value(overrides, "model.num_mtp_layers", "0"))  # and each MTP block
            assert len(modules.get("context_parallel", [])) == len(view["layers"]) + mtp, modules
        if degrees["tp"] > 1 and any(".experts." in n for n in params):
            assert modules.get("expert_tensor_parallel"), modules
        if degrees["ep"] > 1:
            assert modules.get("expert_parallel"), modules
            experts = [p for n, p in params.items() if ".experts." in n]
            assert experts and all("ep:Shard(dim=0)" in p for p in experts), experts
            if offload:  # their own FSDP group over edp (suite.parallel.expert_parallel.shard_experts)
                assert all(re.search(r"edp:(_Strided)?Shard\(dim=0", p) for p in experts), experts
                held = [n for n in modules["expert_parallel"] if n in modules.get("fsdp_offload", [])]
                assert held == modules["expert_parallel"], modules
        if offload:  # FSDP2 CPUOffloadPolicy on every wrapped group
            assert modules.get("fsdp_offload") == modules["fsdp"], modules
        if recompute != "none":
            assert any(k == f"recompute:{recompute}" for k in modules), modules
    if degrees["pp"] > 1:  # each stage's layers, held by every rank of that stage; together all layers
        stages = [tuple(v["layers"]) for v in layout["ranks"]]
        assert len(set(stages)) >= degrees["pp"], stages
        flat = sorted({layer for st in stages for layer in st})
        assert sum(len(set(st)) for st in set(stages)) == len(flat), stages
    return layout


def assert_close_updates(ref_run: Path, got_run: Path, tol: float = 1e-4) -> None:
    """Per tensor, the weight updates (final minus initial) of two runs that started from the same
    weights: ||got_update - ref_update|| / ||ref_update|| <= tol. Comparing whole weights would
    mostly compare the shared initial values."""
    start = initial_weights(ref_run)
    ref, got = final_weights(ref_run), final_weights(got_run)
    assert ref.keys() == got.keys() == start.keys()
    for name in ref:
        if name.endswith(NOISE_ONLY):  # no true gradient: rounding noise, compared in absolute terms
            assert float((ref[name] - got[name]).abs().max()) <= 1e-5, name
            continue
        ref_update = ref[name].float() - start[name].float()
        diff = (got[name].float() - ref[name].float()).norm() / ref_update.norm().clamp_min(1e-12)
        assert ref_update.norm() > 0, f"{name} did not move: the comparison would prove nothing"
        assert diff <= tol, (name, float(diff))


def worker_pids(parent: int, attempt: int | None = None) -> dict[int, int]:
    """{global rank: pid} of the live `suite.cli.worker` processes whose parent is `parent` (the
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
        if ppid != parent or b"suite.cli.worker" not in cmdline or b"RANK" not in environ:
            continue
        if attempt is not None and int(environ.get(b"TORCHELASTIC_RESTART_COUNT", b"0")) != attempt:
            continue
        found[int(environ[b"RANK"])] = int(entry.name)
    return found


def child_processes(parent: int) -> dict[int, bytes]:
    """{pid: cmdline} of the live processes whose parent is `parent`, found through /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found[int(entry.name)] = cmdline
    return found


def fork_servers(parent: int) -> list[int]:
    """The worker servers (suite/launch/fork_server.py) among `parent`'s children: a fresh
    `python -m suite.launch.fork_server <socket>`, or one forked in place from the launcher, which
    keeps the launcher's command line and is named SERVER_NAME."""
    found = []
    for pid, cmd in child_processes(parent).items():
        try:
            name = Path(f"/proc/{pid}/comm").read_bytes().strip()
        except OSError:
            continue
        if name == SERVER_NAME or (b"suite.launch.fork_server" in cmd and b"--client" not in cmd):
            found.append(pid)
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


def merged(*groups: list[str]) -> list[str]:
    """Overrides with each key once, the last value winning (a shared list plus a test's changes)."""
    out: dict[str, str] = {}
    for group in groups:
        for item in group:
            out[item.split("=", 1)[0]] = item
    return list(out.values())
