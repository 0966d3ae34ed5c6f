"""`suite quantize` (torchao post-training quantization, CPU methods), as a user runs it.

A tiny GPT is pretrained for a few steps by the CLI; int8 is quantized by the CLI in a subprocess,
w8a8, int4, smoothquant and gptq in-process through the same entry point (suite.cli.main) to save the
interpreter start. Each output folder is read back the way `suite generate` reads it, and compared
with the full-precision model. Tolerances are relative L2 errors of the logits on held-out windows,
measured on this model (int8 0.07%, w8a8 0.14%, smoothquant 0.14%, int4 1.05%) with headroom.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.helpers import TINY_MODEL, run_suite

REPORT_KEYS = {"params", "file_bytes", "block_bytes", "loss", "perplexity", "decode_tokens_per_s"}
# relative L2 error of the logits, and the torchao type each method leaves on the Linear weights
METHODS = {
    "int8": (0.005, "Int8Tensor"),
    "w8a8": (0.01, "Int8Tensor"),
    "smoothquant": (0.01, "Int8Tensor"),
    "int4": (0.05, "IntxUnpackedToInt8Tensor"),
    "gptq": (0.05, "IntxUnpackedToInt8Tensor"),
}
FAST_REPORT = ["compress.eval_batches=2", "compress.decode_tokens=8", "compress.calib_samples=8"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny_data) -> Path:
    run_dir = tmp_path_factory.mktemp("quantize") / "base"
    run_suite(
        "pretrain",
        *TINY_MODEL,
        f"data.path={tiny_data}",
        f"run.dir={run_dir}",
        "train.max_steps=20",
        "train.save_every=20",
        "train.eval_every=20",
        "train.log_every=10",
        "parallel.micro_batch_size=8",
        "parallel.global_batch_size=8",
        "optim.lr=3e-3",
        check=True,
    )
    return run_dir


@pytest.fixture(scope="module")
def quantized(base_run) -> dict[str, Path]:
    """method -> output run folder; int8 through the CLI in a subprocess (its --json line checked)."""
    from suite.cli import main

    outs = {}
    for method in METHODS:
        out = base_run.parent / f"base-{method}"
        args = ["quantize", f"ckpt={base_run}", f"compress={method}", f"run.dir={out}", *FAST_REPORT]
        if method == "int8":
            proc = run_suite(*args, "--json", check=True)
            assert "[1/5]" in proc.stderr and "[5/5]" in proc.stderr  # progress, on stderr
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            assert result["report"] == str(out / "report.json")
        else:
            assert main(args) == 0
        outs[method] = out
    return outs


def _held_out_tokens(base_run: Path) -> torch.Tensor:
    from suite.compress.quantize import held_out_and_calibration
    from suite.model_source import ModelSource
    from tests.helpers import run_config

    cfg = run_config(base_run)
    evals, _, _ = held_out_and_calibration(cfg, ModelSource.parse(base_run).tokenizer(), cfg, base_run)
    return evals[0].tokens


@pytest.mark.parametrize("method", list(METHODS))
def test_quantized_logits_close_and_weights_are_torchao_tensors(base_run, quantized, method):
    from suite.infer.generate import load_for_inference
    from suite.model_source import ModelSource
    from suite.models.int4_cpu import PackedInt4Linear
    from suite.models.quantized import is_quantized_tensor

    tolerance, type_name = METHODS[method]
    tokens = _held_out_tokens(base_run)
    reference = ModelSource.parse(base_run).load_model()
    runtime, _, folder = load_for_inference(str(quantized[method]))  # as `suite generate` reads it
    with torch.no_grad():
        ref, got = reference(tokens), runtime(tokens)
    error = float((got - ref).norm() / ref.norm())
    assert error < tolerance, f"{method}: relative logit error {error:.4f} >= {tolerance}"
    # on CPU int4 runs in the packed kernel's layout (suite.models.int4_cpu); the stored tensors:
    packed = {n for n, m in runtime.named_modules() if isinstance(m, PackedInt4Linear)}
    model, _, _ = load_for_inference(str(quantized[method]), packed=False)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    info = json.loads((folder / "quantized.json").read_text())
    assert info["method"] == method and info["skipped"] == ["output"]
    assert sorted(info["quantized"]) == sorted(n for n in linears if n != "output")
    for name in info["quantized"]:
        weight = linears[name].weight
        assert type(weight.data).__name__ == type_name and is_quantized_tensor(weight), name
    assert packed == (set(info["quantized"]) if type_name == "IntxUnpackedToInt8Tensor" else set())
    assert not is_quantized_tensor(linears["output"].weight)  # skipped (tied to the embedding)
    assert model.output.weight is model.tok_embeddings.weight


def test_bytes_shrink_and_report_fields(quantized):
    reports = {m: json.loads((out / "report.json").read_text()) for m, out in quantized.items()}
    for method, report in reports.items():
        before, after = report["before"], report["after"]
        assert set(before) >= REPORT_KEYS and set(after) >= REPORT_KEYS, method
        assert report["all_quantized"] and report["reload_max_abs_diff"] == 0.0, method
        assert report["packed_for_cpu"] == (report["quantized_layers"] if method in ("int4", "gptq") else 0)
        assert after["params"] == before["params"]
        assert after["file_bytes"] < before["file_bytes"]
        assert after["perplexity"] < before["perplexity"] * 1.05, method
        assert after["decode_tokens_per_s"] > 0
        # the checkpoint file is the one measured
        folder = Path(report["checkpoint"])
        assert (folder / "model.safetensors").stat().st_size == after["file_bytes"]
    fp32_block = reports["int8"]["before"]["block_bytes"]
    int8_block = reports["int8"]["after"]["block_bytes"]
    int4_block = reports["int4"]["after"]["block_bytes"]
    assert fp32_block / int8_block >= 3.5, (fp32_block, int8_block)
    # int4 blocks vs bf16 (half the fp32 source's bytes): the weights' 3.56x, less the norm and bias
    # vectors stored at 2 bytes; at this width (64) they weigh most: 3.41x (gpt-tiny, width 256: 3.52x)
    assert fp32_block / 2 / int4_block >= 3.4 and int4_block < int8_block, (fp32_block, int4_block)
    # gptq's grid is int4's plus an integer zero point per group (compress.symmetric=false), stored as
    # one int8 each: the blocks' bytes are int4's and those zero points, nothing else
    with safe_open(str(Path(reports["gptq"]["checkpoint"]) / "model.safetensors"), "pt") as f:
        names = f.keys()  # a safetensors handle is not iterable
        zeros = [k for k in names if k.startswith("layers.") and k.endswith("_zero_point")]
        zero_bytes = sum(math.prod(f.get_slice(k).get_shape()) for k in zeros)  # int8: a byte each
    assert zeros and reports["gptq"]["after"]["block_bytes"] == int4_block + zero_bytes
    assert abs(reports["int8"]["after"]["perplexity"] / reports["int8"]["before"]["perplexity"] - 1) < 0.01


def test_gptq_tracks_the_model_closer_than_round_to_nearest(base_run, quantized):
    """Same int4 grid and tensor type; GPTQ's error compensation gives logits nearer the source's."""
    from suite.infer.generate import load_for_inference
    from suite.model_source import ModelSource

    tokens = _held_out_tokens(base_run)
    with torch.no_grad():
        ref = ModelSource.parse(base_run).load_model()(tokens)
        errors = {
            m: float((load_for_inference(str(quantized[m]))[0](tokens) - ref).norm())
            for m in ("int4", "gptq")
        }
    assert errors["gptq"] < errors["int4"], errors


def test_output_folder_loads_in_generate_and_eval(quantized):
    out = quantized["int4"]
    proc = run_suite(
        "generate", f"ckpt={out}", "prompt=The quick", "generate.max_new_tokens=6", "--json", check=True
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1])["text"]
    proc = run_suite(
        "eval", f"ckpt={quantized['int8']}", "task=reverse-3", "eval.num_samples=2", "--json", check=True
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1])["total"] == 2
    saved = (out / "config.yaml").read_text()
    assert "method: int4" in saved and f"dir: {out}" in saved


def _refused(capsys, *argv: str) -> str:
    from suite.cli import main

    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


def test_refusals_are_one_line(base_run, quantized, capsys, tmp_path):
    err = _refused(
        capsys, "quantize", f"ckpt={quantized['int8']}", "compress=int4", f"run.dir={tmp_path / 'a'}"
    )
    assert "already quantized (int8)" in err and f"ckpt={base_run}" in err
    err = _refused(capsys, "quantize", f"ckpt={base_run}", "compress=qat-int4", f"run.dir={tmp_path / 'b'}")
    assert "suite finetune compress=qat-int4" in err and "compress=int4" in err
    err = _refused(capsys, "quantize", f"ckpt={base_run}", "compress=gptq", "compress.gptq_damp=0")
    assert "compress.gptq_damp=0" in err and "0.01" in err
    err = _refused(capsys, "quantize", f"ckpt={base_run}", "compress.method=int9")
    assert "int8, w8a8, int4" in err
    if not torch.cuda.is_available():
        err = _refused(capsys, "quantize", f"ckpt={base_run}", "compress=int4-tinygemm")
        assert "needs CUDA" in err and "compress=int4" in err
        err = _refused(capsys, "quantize", f"ckpt={base_run}", "compress=int8", "train.device=cuda")
        assert "no CUDA device" in err
    err = _refused(capsys, "quantize", f"ckpt={base_run}", "compress=int4", "compress.group_size=48")
    assert "compress.group_size=48" in err and "compress.group_size=64" in err
    err = _refused(capsys, "quantize", f"ckpt={base_run}", "compress=int8", f"run.dir={base_run}")
    assert "is the run being quantized" in err
    err = _refused(capsys, "export", f"ckpt={quantized['int8']}", f"out={tmp_path / 'hf'}")
    # GPT-2 cannot hold torchao weights in transformers (Conv1D); llama: tests/e2e/test_export_quantized_hf.py
    assert "computes with Conv1D layers" in err
    err = _refused(capsys, "export", f"ckpt={quantized['int8']}", "format=gguf", f"out={tmp_path / 'gguf'}")
    assert "GGUF quantizes from full precision" in err
    err = _refused(capsys, "pretrain", "compress=int8", f"run.dir={tmp_path / 'c'}")
    assert "suite quantize" in err
    err = _refused(capsys, "distill", f"distill.teacher={quantized['int8']}", f"run.dir={tmp_path / 'd'}")
    assert "already quantized" in err
    err = _refused(
        capsys,
        "finetune",
        f"model.init_from={quantized['int8']}",
        "data.seq_len=64",
        f"run.dir={tmp_path / 'e'}",
    )
    assert "is quantized" in err and "finetune.method=lora" in err  # full finetuning; LoRA runs (test_qlora)
    err = _refused(
        capsys, "finetune", f"model.init_from={quantized['w8a8']}", "finetune.method=lora", "data.seq_len=64",
        f"run.dir={tmp_path / 'f'}",
    )  # fmt: skip
    assert "w8a8" in err and "no gradient" in err and "compress=int8" in err


def test_quantize_has_help(capsys):
    from suite.cli import main

    assert main(["quantize", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: suite quantize") and "int4-tinygemm" in text


def test_finetuned_run_reports_task_accuracy_and_evals(base_run, capsys):
    """A run finetuned on a built-in task: perplexity on its held-out rows, exact match before and
    after, and `suite eval` on the quantized folder finds the task in its config."""
    from suite.cli import main

    sft = base_run.parent / "sft"
    run_suite(
        "finetune",
        f"model.init_from={base_run}",
        f"run.dir={sft}",
        "log.wandb=false",
        "log.progress=false",
        "data.seq_len=64",
        "finetune.data.task=reverse-3",
        "finetune.data.num_train=48",
        "finetune.data.num_eval=8",
        "finetune.eval_samples=2",
        "train.max_steps=2",
        "train.eval_every=2",
        "train.save_every=2",
        "parallel.micro_batch_size=2",
        "parallel.global_batch_size=4",
        "train.precision=fp32",
        check=True,
    )
    out = base_run.parent / "sft-int8"
    assert main(["quantize", f"ckpt={sft}", "compress=int8", f"run.dir={out}", *FAST_REPORT]) == 0
    report = json.loads((out / "report.json").read_text())
    for side in ("before", "after"):
        assert report[side]["task_questions"] == 8 and 0.0 <= report[side]["task_accuracy"] <= 1.0
        assert report[side]["perplexity"] is not None
    capsys.readouterr()
    assert main(["eval", f"ckpt={out}", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["task"] == "reverse-3" and result["total"] == 8


def test_hf_folder_calibrates_on_data_in_its_own_tokenizer(base_run, quantized, tiny_data, capsys):
    """An hf: source has no recipe: data.path (in its tokenizer) gives SmoothQuant/GPTQ their
    calibration and every report its perplexity. The export holds the run's weights and the same
    windows are read, so GPTQ from it measures what GPTQ from the run does; pruning starts from it too."""
    from suite.cli import main

    hf = base_run.parent / "base-hf"
    assert main(["export", f"ckpt={base_run}", f"out={hf}"]) == 0
    same = [f"data.path={tiny_data}", "data.seq_len=32", "parallel.micro_batch_size=8", *FAST_REPORT]
    out = base_run.parent / "hf-gptq"
    assert main(["quantize", f"ckpt=hf:{hf}", "compress=gptq", f"run.dir={out}", *same]) == 0
    report = json.loads((out / "report.json").read_text())
    from_run = json.loads((quantized["gptq"] / "report.json").read_text())
    assert report["all_quantized"]
    for side in ("before", "after"):
        assert report[side]["perplexity"] == pytest.approx(from_run[side]["perplexity"], rel=1e-4)
    capsys.readouterr()
    assert main(["generate", f"ckpt={out}", "prompt=The quick", "generate.max_new_tokens=4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]
    pruned = base_run.parent / "hf-pruned"
    assert main(["prune", f"ckpt=hf:{hf}", f"run.dir={pruned}", "prune.ffn=0.25", *same]) == 0
    assert json.loads((pruned / "report.json").read_text())["after"]["perplexity"] is not None
