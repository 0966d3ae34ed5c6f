"""The qwen3 family: Qwen3 and Qwen3-MoE. The llama blocks plus an RMSNorm over each head's q and k
before RoPE, a head size independent of the width (model.head_dim), no qkv bias; MoE layers with
fine-grained experts, top-k routing and optionally renormalised weights (model.norm_topk_prob).
HF: Qwen3ForCausalLM / Qwen3MoeForCausalLM; GGUF: qwen3 / qwen3moe."""

from suite.models.family import Family, GGUFMapping, HFMapping, register
from suite.models.qwen3 import convert

FAMILY = register(
    Family(
        name="qwen3",
        summary="Qwen3 / Qwen3-MoE: the llama blocks with per-head q/k RMSNorm and an independent head size",
        rms_norm=True,
        swiglu=True,
        rope=True,
        linear_bias=False,
        qk_norm=True,
        default_ffn=convert.default_ffn,
        compile_auto=True,
        checks=convert.check,
        hf=HFMapping(
            model_types=("qwen3", "qwen3_moe"),
            to_config=convert.hf_config,
            from_config=convert.config_from_hf,
            to_state_dict=convert.to_hf_state_dict,
            from_state_dict=convert.from_hf_state_dict,
            on_disk_names=convert.on_disk_names,
        ),
        gguf=GGUFMapping(
            arch="qwen3",
            arch_for=convert.gguf_arch,
            other_archs=("qwen3moe",),
            add_hparams=convert.gguf_hparams,
            tensors=convert.gguf_tensors,
            import_problem=convert.gguf_import_problem,
            problem=convert.gguf_problem,
            permute_qk=False,
            load_kwargs=convert.gguf_load_kwargs,
            config_kwargs=convert.gguf_config_kwargs,
        ),
    )
)
