"""LoRA over a `suite quantize` checkpoint (QLoRA): `suite finetune model.init_from=<quantized>
finetune.method=lora`, as a user runs it.

A seeded tiny GPT (an HF folder) is quantized to int4 by the CLI, then finetuned with LoRA over its
frozen int4 weights. The run's model, read back the way `suite eval` / `suite generate` read it, must
hold the source's int4 weights unchanged with the trained adapters beside them, and compute what the
dequantized weights plus the merged adapters compute; a run resumed from its step-2 checkpoint
continues exactly; what it cannot do is one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.e2e.test_finetune import TINY_FT, tiny_base
from tests.helpers import run_suite, train_losses

STEPS = 4
QLORA = [
    *[o for o in TINY_FT if not o.startswith("train.max_steps") and not o.startswith("train.save_every")],
    "finetune.method=lora",
    f"train.max_steps={STEPS}",
    "train.save_every=2",
]


@pytest.fixture(scope="module")
def int4(tmp_path_factory, tiny_data) -> Path:
    root = tmp_path_factory.mktemp("qlora")
    base = tiny_base(root / "base-hf", tiny_data)
    out = root / "int4"
    run_suite(
        "quantize", f"ckpt=hf:{base}", "compress=int4", f"run.dir={out}", "compress.group_size=32",
        "compress.eval_batches=1", "compress.decode_tokens=4", "compress.task_samples=0", "log.progress=false",
        check=True,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def qlora_run(int4, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("qlora-run") / "run"
    proc = run_suite("finetune", f"model.init_from={int4}", f"run.dir={run}", *QLORA, check=True)
    assert "is quantized" not in proc.stderr
    return run


def test_lora_over_int4_keeps_the_int_weights_and_trains_the_adapters(int4, qlora_run):
    from suite.model_source import ModelSource
    from suite.models.lora import LoRALinear, merge_lora
    from suite.models.quantized import is_quantized_tensor, load_quantized_model

    losses = train_losses(qlora_run)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(
        torch.isfinite(torch.tensor(v)) for v in losses.values()
    )
    source = ModelSource.parse(str(int4))
    quantized = load_quantized_model(source.folder, source.model_config())
    model = ModelSource.parse(str(qlora_run)).load_model()
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted, "no LoRA layers in the finetuned model"
    for name, module in adapted.items():
        assert is_quantized_tensor(module.weight), name  # still int4, not dequantized
        want = quantized.get_submodule(name).weight
        assert torch.equal(module.weight.dequantize(), want.dequantize()), name
    assert any(m.lora_b.weight.abs().max() > 0 for m in adapted.values())  # B starts at 0: it trained
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, before = model(tokens), quantized(tokens)
        assert (got - before).abs().max() > 1e-5  # the adapters change the output
        for module in adapted.values():  # the float reference: dequantized weights + merged adapters
            module.weight = torch.nn.Parameter(module.weight.dequantize().float())  # replaces the buffer
        reference = merge_lora(model)(tokens)
    assert (got - reference).abs().max() < 1e-4


def test_a_resumed_qlora_run_continues_exactly(int4, qlora_run, tmp_path):
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(qlora_run / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    run_suite("finetune", f"model.init_from={int4}", f"run.dir={resumed}", *QLORA, check=True)
    want = {s: v for s, v in train_losses(qlora_run).items() if s > 2}
    assert train_losses(resumed) == want, (train_losses(resumed), want)


def _refused(*args: str) -> str:
    proc = run_suite(*args)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


def test_what_lora_over_a_quantized_model_cannot_do_is_one_line(int4, qlora_run, tmp_path):
    base = [f"model.init_from={int4}", *QLORA]
    err = _refused("finetune", *base, "finetune.method=full", f"run.dir={tmp_path / 'a'}")
    assert "finetune.method=lora" in err and str(int4) in err
    err = _refused("finetune", *base, "parallel.dp=2", "launch.nproc_per_node=2", f"run.dir={tmp_path / 'b'}")
    assert "one process" in err
    err = _refused("export", f"ckpt={qlora_run}", f"out={tmp_path / 'hf'}")
    assert "QLoRA" in err and "exporting" in err
    err = _refused("finetune", f"model.init_from={qlora_run}", *QLORA, f"run.dir={tmp_path / 'c'}")
    assert "QLoRA" in err
