"""`suite export format=gguf` of the MoE and MLA families in llama.cpp itself: Qwen3-MoE as llama.cpp's
qwen3moe, DeepSeek-V3 as its deepseek2 (MLA's kv_b split per head into k_b / v_b, sigmoid routing
over groups with the balancing bias, shared experts, the first layer dense).

Each model is made by transformers at a small size, its weights perturbed away from their initial
values, saved with a byte-level tokenizer and exported through the CLI's entry point from `hf:<folder>`.
llama-cpp-python (built from source) decodes 16 greedy tokens, which must equal transformers' own
greedy tokens from the original fp32 model.

The perturbation is milder than tests/unit/test_families.py's _randomise (the layers' matrices
N(0, 1/(4 fan_in)), not N(0, 0.04)): with _randomise's weights these models are chaotic, so q8_0's
rounding alone (transformers with the file's dequantized weights) changes the greedy tokens after
five. Every width a q8_0 row runs along is a multiple of 32 (the block), so the matrices are
quantized, not kept F16. llama.cpp also rounds a q8_0 matmul's activations to 8 bits, which moves its
logits by about 0.1 here: near a tie that flips a greedy token. So of 64 seeded prompts the test
decodes the one whose 16 greedy steps transformers decides by the widest margins (>= 0.1, chosen
from transformers alone, among paths of at least 8 different tokens); at f16 llama.cpp's logits are
also within 0.05 of transformers' (measured 5e-3), which any layout mistake exceeds by far (a
missing k_b transpose: 1.4; gate and up swapped: 1.2; the expert groups not written: 1.7).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from suite.data.tokenizer import train_tokenizer
from tests.e2e.test_gguf_source import _gguf

VOCAB = 288  # the byte-level tokenizer's 256 bytes, 2 special tokens and a few merges
TEXT = ["the quick brown fox jumps over the lazy dog; attention lets every token look back"] * 4
MODELS = {
    # experts in every layer (llama.cpp's qwen3moe has no dense ones) with renormalised top-k weights;
    # heads of their own size (32, not 64 / 4), grouped-query attention
    "qwen3moe": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
        )
    ),
    # MLA with a query bottleneck; 8 experts in 4 groups keeping 2, sigmoid scores with the balancing
    # bias, routed_scaling_factor, a shared expert; layer 0 dense (first_k_dense_replace)
    "deepseek2": lambda: DeepseekV3ForCausalLM(
        DeepseekV3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_shared_experts=1,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
        )
    ),
}
CANDIDATES, DISTINCT = 64, 8


def _perturb(model: torch.nn.Module) -> None:
    """Every tensor away from its initial value: the embedding and head N(0, 1/fan_in), the layers'
    matrices N(0, 1/(4 fan_in)), norms 1 +- 0.2, the balancing bias N(0, 0.1^2) (it decides which
    experts run)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            gain = 1.0 if name.endswith(("embed_tokens.weight", "lm_head.weight")) else 0.5
            p.copy_(1.0 + 0.2 * noise if p.dim() == 1 else gain * noise / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def _greedy(hf: torch.nn.Module, prompts: torch.Tensor, steps: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy tokens for each prompt (generate with its KV cache, no end-of-text stop)
    and the smallest top-1 - top-2 logit margin along each path."""
    hf.generation_config.eos_token_id = None  # 16 tokens whatever they are
    out = hf.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=steps,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    top = torch.stack(out.scores, dim=1).topk(2).values
    return out.sequences[:, prompts.shape[1] :], (top[..., 0] - top[..., 1]).min(dim=1).values


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, dict]:
    """Per architecture: the saved folder, the model, and of CANDIDATES seeded prompts the one whose
    16 greedy steps are decided by the widest margins (chosen from transformers alone, among paths of
    at least DISTINCT different tokens, not a token repeated), with its tokens."""
    root = tmp_path_factory.mktemp("gguf-moe")
    out = {}
    for arch, make in MODELS.items():
        hf = make().eval()
        _perturb(hf)
        hf.save_pretrained(root / arch)
        train_tokenizer(TEXT, VOCAB, root / arch)
        prompts = torch.randint(0, VOCAB, (CANDIDATES, 8), generator=torch.Generator().manual_seed(3))
        tokens, margins = _greedy(hf, prompts)
        varied = torch.tensor([len(set(path.tolist())) >= DISTINCT for path in tokens])
        best = int(torch.where(varied, margins, -torch.inf).argmax())
        assert margins[best] >= 0.1, (arch, float(margins[best]))  # a path decided, not a near-tie
        out[arch] = {
            "folder": root / arch,
            "hf": hf,
            "prompt": prompts[best].tolist(),
            "tokens": tokens[best].tolist(),
            "margin": float(margins[best]),
        }
    return out


def _export(folder: Path, out: Path, precision: str) -> tuple[Path, dict]:
    from suite.cli import main

    assert (
        main(["export", f"ckpt=hf:{folder}", "format=gguf", f"export.quantize={precision}", f"out={out}"])
        == 0
    )
    (path,) = out.glob("*.gguf")
    return path, json.loads((out / "export_manifest.json").read_text())


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("precision", ["f16", "q8_0"])
def test_llama_cpp_decodes_transformers_greedy_tokens(sources, tmp_path, arch, precision):
    """16 greedy tokens in llama.cpp equal transformers' from the fp32 model, and at f16 its logits
    on the decoded sequence are within 0.05 of transformers' (measured 0.02). Fails with a missing
    or untransposed k_b, v_b from the wrong rows of kv_b, the experts' gate and up swapped, the
    balancing bias, group count, gating function, routed scale or renormalisation not written, a
    wrong head size or key_length_mla, or a quantized router."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)"
    )
    case = sources[arch]
    path, manifest = _export(case["folder"], tmp_path / "out", precision)
    assert manifest["architecture"] == arch
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    try:
        llm.eval(case["prompt"])
        got = []
        for _ in range(16):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            got.append(token)
            llm.eval([token])
        theirs = np.array(llm.scores[: llm.n_tokens - 1])
    finally:
        llm.close()
    with torch.no_grad():
        logits = case["hf"](torch.tensor([case["prompt"] + got[:-1]])).logits[0].numpy()
    error = float(np.abs(logits - theirs).max())
    print(f"{arch} {precision}: margin {case['margin']:.3f}, max |logits - transformers| {error:.3g}, {got}")
    assert got == case["tokens"], (arch, precision)
    if precision == "f16":  # q8_0: about 0.1, and a routing flip at one position moves it to 0.7
        assert error < 0.05, (arch, error)


def test_deepseek2_file_holds_mla_as_llama_cpp_reads_it(sources, tmp_path):
    """Without llama.cpp: the f16 file's keys and MLA tensors, exactly. k_b is each head's first
    qk_nope_head_dim rows of kv_b, transposed to [kv_lora_rank, nope]; v_b the other v_head_dim rows;
    the balancing bias and the router stay F32. Fails with an untransposed k_b (the square 32 x 32
    shapes here would still load), rows taken across heads, or MLA written as plain heads."""
    import gguf

    case = sources["deepseek2"]
    path, manifest = _export(case["folder"], tmp_path / "out", "f16")
    assert manifest["verification"]["max_abs_logits_error"] is None  # transformers has no deepseek2
    reader = gguf.GGUFReader(path)
    config = case["hf"].config

    def value(key):
        return reader.get_field(f"deepseek2.{key}").contents()

    assert value("attention.head_count_kv") == 1  # MLA runs as one shared latent head
    assert value("attention.key_length") == config.kv_lora_rank + config.qk_rope_head_dim
    assert value("attention.value_length") == config.kv_lora_rank
    assert value("attention.key_length_mla") == config.qk_nope_head_dim + config.qk_rope_head_dim
    assert value("attention.value_length_mla") == config.v_head_dim
    assert value("rope.dimension_count") == config.qk_rope_head_dim
    assert value("leading_dense_block_count") == 1 and value("expert_shared_count") == 1
    assert value("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID
    assert value("expert_weights_scale") == pytest.approx(2.5) and value("expert_weights_norm") is True
    assert value("expert_group_count") == 4 and value("expert_group_used_count") == 2
    stored = {t.name: t for t in reader.tensors}

    def read(name):
        t = stored[name]
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(array)).float().reshape([int(n) for n in reversed(t.shape)])

    layer = case["hf"].model.layers[1]
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    kv_b = layer.self_attn.kv_b_proj.weight.detach().half().float().reshape(heads, nope + v, -1)
    assert torch.equal(read("blk.1.attn_k_b.weight"), kv_b[:, :nope].transpose(1, 2))
    assert torch.equal(read("blk.1.attn_v_b.weight"), kv_b[:, nope:])
    assert "blk.1.attn_kv_b.weight" not in stored
    assert torch.equal(read("blk.1.exp_probs_b.bias"), layer.mlp.gate.e_score_correction_bias)
    assert stored["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    gate, up = layer.mlp.experts.gate_up_proj.detach().half().float().chunk(2, dim=1)
    assert torch.equal(read("blk.1.ffn_gate_exps.weight"), gate) and torch.equal(
        read("blk.1.ffn_up_exps.weight"), up
    )
    assert "blk.0.ffn_gate.weight" in stored and "blk.0.ffn_gate_exps.weight" not in stored  # layer 0 dense


def test_multi_token_prediction_layers_are_not_written():
    """A suite DeepSeek-V3 with an MTP module: the GGUF tensors are the decoder's num_layers blocks."""
    from suite.config.schema import ModelConfig
    from suite.export.gguf import gguf_tensors
    from suite.models import build_model, materialize
    from suite.models.hf_mapping import to_hf_state_dict

    cfg = ModelConfig(
        family="deepseek_v3",
        num_layers=2,
        hidden_size=32,
        num_heads=2,
        vocab_size=64,
        max_seq_len=32,
        ffn_hidden_size=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_experts=4,
        top_k=2,
        moe_layers=[1],
        moe_ffn_hidden_size=16,
        num_shared_experts=1,
        router_score="sigmoid",
        num_mtp_layers=1,
    )
    model = materialize(build_model(cfg), "cpu", seed=0)
    names = [name for name, _ in gguf_tensors(cfg, to_hf_state_dict(cfg, model.state_dict()))]
    assert {name.split(".")[1] for name in names if name.startswith("blk.")} == {"0", "1"}
    assert "blk.1.attn_k_b.weight" in names and "blk.0.attn_q.weight" in names  # no q_lora_rank: one wq


REFUSED = [
    (dict(family="qwen3", num_experts=4, top_k=2, norm_topk_prob=False), "model.norm_topk_prob=false"),
    (
        dict(family="qwen3", num_experts=4, top_k=2, norm_topk_prob=True, moe_layers=[1]),
        "experts in every layer",
    ),
    (
        dict(family="deepseek_v3", kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, num_experts=4, top_k=2),
        "model.num_shared_experts=0",
    ),
    (dict(family="deepseek_v3", kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8), "this model has none"),
]


@pytest.mark.parametrize(("fields", "message"), REFUSED)
def test_what_llama_cpp_cannot_hold_is_refused_in_one_line(fields, message):
    from suite.config.errors import ConfigError
    from suite.config.schema import ModelConfig
    from suite.export.gguf import check_gguf_exportable

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, vocab_size=64, **fields)
    with pytest.raises(ConfigError, match=message) as error:
        check_gguf_exportable(cfg, "ckpt=x")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("arch", "message"),
    [
        (
            "deepseek2",
            "is a 'deepseek2' GGUF, which cannot be imported: transformers' GGUF reader has no deepseek2 "
            "architecture (llama.cpp reads the file); import the Hugging Face folder (hf:<folder>)",
        ),
        ("qwen3moe", "is a 'qwen3moe' GGUF, which cannot be imported: its qwen3moe experts (ffn_*_exps)"),
    ],
)
def test_reading_them_back_is_refused_in_one_line(tmp_path, arch, message):
    """`ckpt=gguf:` reads through transformers' GGUF reader and one-to-one tensor names; these two
    architectures are written for llama.cpp and refused on that read path, naming the way on."""
    from suite.config.errors import ConfigError
    from suite.gguf_file import GGUFFile

    path = _gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(ConfigError) as error:
        assert GGUFFile(path, f"ckpt=gguf:{path}").family is None
    assert message in str(error.value) and "\n" not in str(error.value)
