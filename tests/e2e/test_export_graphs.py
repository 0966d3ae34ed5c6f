"""`suite export format=torch_export|onnx`: the prefill and decode graphs reproduce the suite model.

For a GPT and a Llama (grouped-query) model, each artifact's logits equal the suite's within 1e-4 (fp32)
for the prefill and for 16 decode steps through the cache, at two batch sizes and two prompt lengths,
and greedy generation from the artifact equals, token for token, `suite generate`'s own decoding
(the static-cache path of suite.infer.generate), which shares no cache code with the graphs."""

from __future__ import annotations

import json

import pytest
import torch

from suite.config.schema import GenerateConfig
from suite.infer.generate import generate_tokens
from suite.infer.runners import SuiteRunner, decode_steps, greedy, load_runner
from suite.model_source import ModelSource
from tests.helpers import TINY_MODEL, run_suite

FAMILIES = {
    "gpt": ["model=gpt-tiny"],
    "llama": ["model=llama-tiny", "model.num_kv_heads=2", "model.ffn_hidden_size=128"],
}
TOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("graphs")
    out = {}
    for family, model in FAMILIES.items():
        run = root / family
        run_suite(
            "pretrain",
            *model,
            *TINY_MODEL,
            f"data.path={tiny_data}",
            f"run.dir={run}",
            "train.max_steps=3",
            "train.eval_every=3",
            "train.eval_batches=1",
            "parallel.micro_batch_size=2",
            "parallel.global_batch_size=2",
            check=True,
            timeout=300,
        )
        out[family] = run
    return out


def _export(run, out, *args):
    proc = run_suite("export", f"ckpt={run}", f"out={out}", *args, "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    """export(family, fmt) -> (folder, manifest): each float export made once for the module's tests."""
    made: dict[tuple[str, str], tuple] = {}

    def export(family: str, fmt: str):
        if (family, fmt) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{fmt}") / fmt
            made[family, fmt] = out, _export(runs[family], out, f"format={fmt}")
        return made[family, fmt]

    return export


def _prompts(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))


@pytest.mark.parametrize("fmt", ["torch_export", "onnx"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_graphs_reproduce_the_suite_model(runs, exported, family, fmt):
    out, manifest = exported(family, fmt)
    assert manifest["format"] == fmt and manifest["verification"]["greedy_tokens_equal"]
    assert manifest["verification"]["decode_max_abs_error"] < TOL
    on_disk = json.loads((out / "export_manifest.json").read_text())
    assert on_disk["verification"] == manifest["verification"]
    assert {f"prefill.{'pt2' if fmt == 'torch_export' else 'onnx'}", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }

    model = ModelSource.parse(str(runs[family])).load_model("cpu")
    suite, artifact = SuiteRunner(model), load_runner(out)[0]
    vocab = model.cfg.vocab_size
    for batch in (1, 3):
        for seq in (5, 17):
            tokens = _prompts(vocab, batch, seq)
            want, got = decode_steps(suite, tokens, 16), decode_steps(artifact, tokens, 16)
            assert len(got) == 17
            for step, (a, b) in enumerate(zip(want, got)):
                err = float((a - b).abs().max())
                assert err < TOL, f"{family} {fmt} batch {batch} prompt {seq}: step {step} error {err:.2e}"
            # the whole prefill, not only its last position
            assert float((suite.prefill(tokens)[0] - artifact.prefill(tokens)[0]).abs().max()) < TOL

    greedy_cfg = GenerateConfig(max_new_tokens=24, temperature=0.0, top_k=None, top_p=None)
    tokens = _prompts(vocab, 3, 9)
    from_artifact = greedy(artifact, tokens, 24)
    assert from_artifact.shape == (3, 24)
    for row, prompt in enumerate(tokens.tolist()):
        assert from_artifact[row].tolist() == generate_tokens(model, prompt, greedy_cfg), f"row {row}"


def test_onnx_int8_and_int4_are_onnxruntime_quantized(runs, exported, tmp_path):
    import onnx

    fp32, _ = exported("llama", "onnx")
    ops = {"int8": "MatMulInteger", "int4": "MatMulNBits"}
    for method, op in ops.items():
        out = tmp_path / method
        manifest = _export(runs["llama"], out, "format=onnx", f"export.quantize={method}")
        assert manifest["precision"] == method
        graph = onnx.load(str(out / "decode.onnx")).graph
        kinds = [node.op_type for node in graph.node]
        # every projection of every block is quantized: 2 layers x (q, k, v, o, gate, up, down)
        assert kinds.count(op) >= 2 * 7, (method, sorted(set(kinds)))
        assert (out / "decode.onnx").stat().st_size < 0.7 * (fp32 / "decode.onnx").stat().st_size
        # close to the float model, not equal: the error is measured and recorded
        error = manifest["verification"]["prefill_max_abs_error"]
        assert 0 < error < 1.0, error


def test_graph_formats_refuse_what_they_cannot_hold(runs, tmp_path):
    cases = [
        (["format=torch_export", "export.quantize=int8"], "export.quantize=int8 with format=torch_export"),
        (["format=onnx", "export.quantize=q4_0"], "export.quantize=q4_0 with format=onnx"),
        (["format=onnx", "export.dtype=bf16"], "export.dtype=bf16 with format=onnx"),
    ]
    for args, expected in cases:
        out = tmp_path / "never"
        proc = run_suite("export", f"ckpt={runs['gpt']}", f"out={out}", *args, timeout=300)
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
        assert not out.exists()
