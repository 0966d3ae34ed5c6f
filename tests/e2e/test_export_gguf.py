"""`suite export format=gguf` as a user runs it: one .gguf file that transformers loads (weights and
tokenizer), close to the suite model at each precision, and a manifest that says so.

A tiny GPT, a tiny Llama and a tiny Qwen3 (grouped-query attention: the q/k permutation of llama.cpp is undone by
transformers only when it is right) are pretrained for 20 steps by the CLI, exported in-process
through the same entry point (suite.cli.main) and read back with transformers' GGUF loader.
Tolerances are the issue's (f16 1e-3, q8_0 2e-2, max |logit difference| on 2 x 32 tokens). q4_0
has none in the issue: measured 0.10 (GPT) and 0.15 (Llama) on these models, whose logits spread
over about +-10; 0.3 is twice the worst. A packing mistake (nibble order, a scale per wrong block,
an unpermuted q/k) moves logits by whole units, far above it.

These are the rounding of the format on these models, not of the export: against the suite model
with its weights rounded as the file stores them, every precision agrees to fp32 noise
(test_gguf_computes_what_its_precision_allows). On the recipe-size gpt-tiny / llama-tiny (hidden
256, 60 steps; docs/export.md) the same rounding gives f16 1.5e-3 to 7.5e-3 and q8_0 4e-2 to
1.3e-1 (two sets of 2 x 32 random tokens), above the issue's figures, with the as-stored agreement
still <= 4e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.forked_cli import ForkedCLI
from tests.helpers import TINY_MODEL, run_suite, suite_env

LIMITS = {"f16": 1e-3, "q8_0": 2e-2, "q4_0": 0.3}
TRAIN = ["train.max_steps=20", "train.save_every=20", "train.eval_every=20", "optim.lr=3e-3"]
BATCH = ["parallel.micro_batch_size=8", "parallel.global_batch_size=8"]
FAMILIES = {
    "gpt": [],
    "llama": ["model=llama-tiny", "model.num_kv_heads=2", "model.ffn_hidden_size=128"],
    # llama.cpp's qwen3: q/k norms, heads of their own size (24, not 64 / 4), q/k stored unpermuted
    "qwen3": ["model=qwen3-tiny", "model.num_kv_heads=2", "model.head_dim=24", "model.ffn_hidden_size=128"],
}
ARCH = {"gpt": "gpt2", "llama": "llama", "qwen3": "qwen3"}
TEXT = "The quick brown fox jumps over the lazy dog. Attention lets every token look back."


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for family, model in FAMILIES.items():
        out[family] = root / family
        args = [*model, *TINY_MODEL, f"data.path={tiny_data}", f"run.dir={out[family]}", *TRAIN, *BATCH]
        run_suite("pretrain", *args, check=True)
    return out


def _export(run: Path, out: Path, precision: str) -> Path:
    from suite.cli import main

    assert main(["export", f"ckpt={run}", "format=gguf", f"export.quantize={precision}", f"out={out}"]) == 0
    files = list(out.glob("*.gguf"))
    assert len(files) == 1, files
    return files[0]


def _load(path: Path, kwargs: dict):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs).eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", LIMITS)
def test_gguf_loads_in_transformers_close_to_the_suite_model(runs, tmp_path, family, precision):
    from suite.infer.generate import load_for_inference

    path = _export(runs[family], tmp_path / "out", precision)
    manifest = json.loads((path.parent / "export_manifest.json").read_text())
    assert manifest["format"] == "gguf" and manifest["precision"] == precision
    assert manifest["source"]["step"] == 20 and len(manifest["config_sha256"]) == 64
    assert manifest["files"] == {path.name: path.stat().st_size}
    kwargs = manifest["transformers_load_kwargs"]
    assert kwargs["gguf_file"] == path.name
    hf = _load(path, kwargs)
    ours, _, _ = load_for_inference(runs[family])
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        error = float((hf(ids).logits - ours(ids)).abs().max())
    assert error <= LIMITS[precision], (family, precision, error)
    recorded = manifest["verification"]["max_abs_logits_error"]
    assert 0 < recorded <= LIMITS[precision]
    if precision != "f16":  # the quantized matrices are quantized, norms and biases stay F32
        types = manifest["tensors"]
        assert types["blk.0.ffn_down.weight"].startswith(precision.upper())
        assert types["output_norm.weight"].startswith("F32")


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_metadata_and_tokenizer(runs, tmp_path, family):
    """The keys llama.cpp reads, and the tokenizer transformers rebuilds from them."""
    import gguf
    from transformers import AutoTokenizer

    from suite.model_source import ModelSource

    path = _export(runs[family], tmp_path / "out", "f16")
    source = ModelSource.parse(runs[family])
    cfg, ours = source.model_config(), source.tokenizer()
    reader = gguf.GGUFReader(path)

    def value(key):
        return reader.get_field(key).contents()

    arch = ARCH[family]
    assert value("general.architecture") == arch
    assert value(f"{arch}.context_length") == cfg.max_seq_len
    assert value(f"{arch}.block_count") == cfg.num_layers
    assert value(f"{arch}.embedding_length") == cfg.hidden_size
    assert value(f"{arch}.attention.head_count") == cfg.num_heads
    if family != "gpt":
        assert value(f"{arch}.attention.head_count_kv") == 2
        assert value(f"{arch}.rope.freq_base") == pytest.approx(cfg.rope_theta)
        assert value(f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.norm_eps)
    if family == "qwen3":  # the head size is its own: llama.cpp reads it from key/value_length
        assert value("qwen3.attention.key_length") == value("qwen3.attention.value_length") == 24
    assert value("tokenizer.ggml.model") == "gpt2"
    assert len(value("tokenizer.ggml.tokens")) == cfg.vocab_size  # padded with [PAD<i>]
    assert value("tokenizer.ggml.eos_token_id") == ours.eos_token_id
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert theirs.encode(TEXT) == ours.encode(TEXT)  # digits aside (the manifest's note)
    assert theirs.decode(ours.encode(TEXT)) == TEXT
    assert theirs.eos_token_id == ours.eos_token_id


def test_the_hf_folder_gets_a_manifest_too(runs, tmp_path):
    """format=hf (the plain folder): export_manifest.json with the same fields and its self-check."""
    from suite.cli import main

    out = tmp_path / "hf"
    assert main(["export", f"ckpt={runs['llama']}", f"out={out}", "export.dtype=bf16"]) == 0
    manifest = json.loads((out / "export_manifest.json").read_text())
    assert manifest["format"] == "hf" and manifest["precision"] == "bf16"
    assert manifest["source"]["step"] == 20 and manifest["model"]["num_kv_heads"] == 2
    assert {"model.safetensors", "config.json"} <= set(manifest["files"])
    assert "tokenizer.json" in manifest["tokenizer_files"]
    assert 0 < manifest["verification"]["max_abs_logits_error"] < 0.1  # bf16 weights


def test_cli_prints_the_self_check(runs, tmp_path):
    """... and nothing of torchao's import: in a fresh interpreter (a PYTHON* variable makes run_suite
    start one; its fork server imported torchao already) stderr has no "Failed to load <...>.so" or
    pytree "Enum subclass" warnings, which transformers' import of torchao printed first (issue 39)."""
    out = tmp_path / "cli"
    fresh = suite_env(PYTHONHASHSEED="0")
    proc = run_suite(
        "export", f"ckpt={runs['gpt']}", "format=gguf", f"out={out}", "--json", env=fresh, check=True
    )
    assert "Failed to load" not in proc.stderr and "Enum subclass" not in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr  # the source line: ckpt=...: step 20 (...)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["format"] == "gguf" and result["precision"] == "f16"
    assert Path(result["file"]).is_file() and result["max_abs_logits_error"] <= 1e-3
    proc = run_suite("export", f"ckpt={runs['gpt']}", "format=gguf", f"out={out}", check=True)  # reuses it
    assert "self-check: max |logits - suite|" in proc.stdout and "export_manifest.json" in proc.stdout


@pytest.fixture(scope="module")
def refusal_sources(runs, tmp_path_factory, tiny_data) -> dict[str, Path]:
    """A quantized checkpoint, an HF folder without a tokenizer, a Qwen2 (qkv bias) HF folder, a GPT
    whose MLP is not 4 x hidden."""
    from suite.cli import main
    from tests.unit.test_hf_roundtrip import _hf_folder

    root = tmp_path_factory.mktemp("refusals")
    q = root / "int8"
    assert (
        main(
            ["quantize", f"ckpt={runs['llama']}", "compress=int8", f"run.dir={q}", "compress.eval_batches=1"]
        )
        == 0
    )
    bare = root / "bare"
    assert main(["export", f"ckpt={runs['llama']}", f"out={bare}"]) == 0
    for file in bare.glob("tokenizer*"):
        file.unlink()
    qwen = _hf_folder(root / "qwen2", "qwen2", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None})
    wide = root / "gpt-ffn2x"  # an MLP of 2 x hidden: GPT-2's GGUF reader builds 4 x
    run_suite(
        "pretrain",
        *TINY_MODEL,
        "model.ffn_hidden_size=128",
        f"data.path={tiny_data}",
        f"run.dir={wide}",
        "train.max_steps=1",
        "train.eval_every=1",
        "train.eval_batches=1",
        *BATCH,
        check=True,
    )
    return {"quantized": q, "bare": bare, "qwen2": qwen, "ffn2x": wide}


REFUSALS = [
    (["ckpt={gpt}", "format=gguf", "export.quantize=int8"], "export.quantize=int8 cannot be written as GGUF"),
    (["ckpt={gpt}", "format=hf", "export.quantize=q8_0"], "export.quantize=q8_0 with format=hf"),
    (["ckpt={quantized}", "format=gguf"], "GGUF quantizes from full precision"),
    (["ckpt=hf:{bare}", "format=gguf"], "has no tokenizer files"),
    (["ckpt=hf:{qwen2}", "format=gguf"], "model.qkv_bias=true is GGUF's qwen2"),
    (["ckpt={ffn2x}", "format=gguf"], "model.ffn_hidden_size=128 is not 4 x hidden_size"),
    (["ckpt={gpt}", "format=ggml"], "export.format"),
    (["ckpt={gpt}", "format=gguf", "export.dtype=bf16"], "export.dtype=bf16 with format=gguf"),
    (["ckpt={quantized}", "export.dtype=bf16"], "keeps the checkpoint's own tensors"),
]


def test_refusals_are_one_line_and_write_nothing(runs, refusal_sources, tmp_path):
    places = {"gpt": runs["gpt"], **refusal_sources}
    cli = ForkedCLI(suite_env())
    try:
        for i, (argv, expected) in enumerate(REFUSALS):
            out = tmp_path / f"out{i}"
            args = ["export", *(a.format(**places) for a in argv), f"out={out}"]
            proc = cli.run(args, tmp_path)
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert proc.returncode == 2, (args, proc.stderr)
            assert len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr)
            assert expected in lines[0], (args, lines[0])
            assert not out.exists(), args
    finally:
        cli.close()


def _as_stored(model, precision: str) -> None:
    """Round the suite model's matrices the way the file stores them (F16, or quantized and back
    with gguf's own Q8_0 / Q4_0 code; the output head of a q4_0 file Q8_0, the learned positions
    F32), in place. Rows are the input dimension in both layouts, so the blocks are the same."""
    import gguf

    T = gguf.GGMLQuantizationType
    head = "tok_embeddings.weight" if model.cfg.tie_embeddings else "output.weight"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim < 2 or name == "pos_embeddings.weight":
                continue
            if precision == "f16":
                param.copy_(param.half().float())
                continue
            qtype = T.Q8_0 if precision == "q8_0" or name == head else T.Q4_0
            array = param.detach().numpy()
            param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", LIMITS)
def test_gguf_computes_what_its_precision_allows(runs, tmp_path, family, precision):
    """Against the suite model with its weights rounded as the file stores them, every precision is
    exact to fp32 noise (measured <= 4e-6, here and at recipe size): whatever error remains above is the format's rounding,
    none is the export's (a wrong permutation, transpose or block would show in whole units)."""
    from suite.infer.generate import load_for_inference

    path = _export(runs[family], tmp_path / "out", precision)
    kwargs = json.loads((path.parent / "export_manifest.json").read_text())["transformers_load_kwargs"]
    hf = _load(path, kwargs)
    ours, _, _ = load_for_inference(runs[family])
    _as_stored(ours, precision)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        error = float((hf(ids).logits - ours(ids)).abs().max())
    assert error <= 1e-4, (family, precision, error)


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out: HF's rotate-half q/k rows of each
    head (first halves, then second halves) to llama.cpp's interleaved rotary pairs."""
    head_dim = w.shape[0] // heads
    rows = [
        h * head_dim + j + half * head_dim // 2
        for h in range(heads)
        for j in range(head_dim // 2)
        for half in (0, 1)
    ]
    return w[rows]


@pytest.mark.parametrize("precision", LIMITS)
def test_llama_gguf_stores_each_tensor_as_llama_cpp_would(runs, tmp_path, precision):
    """Every tensor of the Llama file, dequantized with the gguf package, equals the HF export's
    tensor (attn_q / attn_k permuted as llama.cpp's converter does) rounded through the type the
    file names, exactly. The logits checks above see a missing q/k permutation only as far as this
    tiny model's attention matters (0.02 on q8_0 and q4_0, the issue's q8_0 limit); here any row in
    the wrong place fails (issue 39)."""
    import gguf
    from safetensors.torch import load_file

    from suite.cli import main

    path = _export(runs["llama"], tmp_path / "gguf", precision)
    hf_dir = tmp_path / "hf"
    assert main(["export", f"ckpt={runs['llama']}", f"out={hf_dir}", "export.dtype=fp32"]) == 0
    hf_sd = load_file(hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    assert kv_heads == 2 < heads  # grouped-query: q and k are permuted with their own head counts
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    source = {names.get_name(k, try_suffixes=(".weight", ".bias")): (k, v) for k, v in hf_sd.items()}
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    tied = config.get("tie_word_embeddings", False)
    assert set(stored) == {n for n in source if not (tied and n == "output.weight")}
    quantized = 0
    for name, tensor in stored.items():
        hf_name, value = source[name]
        want = value.float()
        if hf_name.endswith("self_attn.q_proj.weight"):
            want = _llama_cpp_permute(want, heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            want = _llama_cpp_permute(want, kv_heads)
        qtype = tensor.tensor_type
        array = want.numpy()
        if qtype == gguf.GGMLQuantizationType.F16:
            array = array.astype(np.float16).astype(np.float32)
        elif qtype != gguf.GGMLQuantizationType.F32:
            array = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)
            quantized += 1
        got = gguf.quants.dequantize(tensor.data, qtype).reshape(array.shape)
        assert np.array_equal(got, array), (name, qtype.name, float(np.abs(got - array).max()))
    matrices = sum(1 for name in stored if source[name][1].ndim == 2)  # every matrix, the embedding too
    assert quantized == (0 if precision == "f16" else matrices) and matrices > 7 * config["num_hidden_layers"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("precision", ["f16", "q8_0"])
def test_llama_cpp_itself_decodes_the_greedy_tokens_transformers_does(runs, tmp_path, family, precision):
    """The file in llama.cpp (llama-cpp-python, built from source): 16 greedy tokens equal to
    transformers' reading of the same file. Fails with a wrong architecture key, head size or q/k
    layout (llama.cpp reads them; transformers' reader may not)."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)"
    )
    path = _export(runs[family], tmp_path / "out", precision)
    kwargs = json.loads((path.parent / "export_manifest.json").read_text())["transformers_load_kwargs"]
    hf = _load(path, kwargs)
    prompt = torch.randint(0, hf.config.vocab_size, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    ids = torch.tensor([prompt])
    expected = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0
    )
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval(prompt)
    got = []
    for _ in range(16):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        got.append(token)
        llm.eval([token])
    assert got == expected[0, 8:].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_source_reads_the_file_as_transformers_does(runs, tmp_path, family):
    """`ckpt=gguf:<file>` (suite.gguf_file) on the suite's own q8_0 export: the architecture, the
    tokenizer, and logits within 1e-4 of transformers' reading of the same file (GPT-2's transposed
    Conv1D weights, Llama's interleaved q/k rows, Qwen3's own head size all undone)."""
    from suite.model_source import ModelSource

    path = _export(runs[family], tmp_path / "out", "q8_0")
    run, imported = ModelSource.parse(runs[family]), ModelSource.parse(f"gguf:{path}")
    ours = imported.model_config()
    assert ours.family == family and imported.is_hf and imported.gguf
    assert ours.num_layers == run.model_config().num_layers and ours.head_dim == run.model_config().head_dim
    kwargs = json.loads((path.parent / "export_manifest.json").read_text())["transformers_load_kwargs"]
    tokens = torch.randint(0, ours.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = imported.load_model()(tokens)
        theirs = _load(path, kwargs)(tokens).logits
    assert (mine - theirs).abs().max().item() < 1e-4
    assert imported.tokenizer().encode(TEXT) == run.tokenizer().encode(TEXT)
