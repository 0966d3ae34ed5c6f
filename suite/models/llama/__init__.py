"""The llama family: Llama / Mistral / Qwen2 / Mixtral. RMSNorm, RoPE, SwiGLU, grouped-query
attention, optional qkv bias (Qwen2) and Mixtral-style MoE layers. HF: LlamaForCausalLM,
Qwen2ForCausalLM (qkv bias), MixtralForCausalLM (MoE); GGUF: llama."""

from suite.models.family import Family, GGUFMapping, HFMapping, register
from suite.models.llama import convert

FAMILY = register(
    Family(
        name="llama",
        summary="Llama / Mistral / Qwen2 / Mixtral: RMSNorm, RoPE, SwiGLU, GQA, optional qkv bias and MoE",
        rms_norm=True,
        swiglu=True,
        rope=True,
        linear_bias=False,
        default_ffn=convert.default_ffn,
        compile_auto=True,
        hf=HFMapping(
            model_types=("llama", "mistral", "qwen2", "mixtral"),
            to_config=convert.hf_config,
            from_config=convert.config_from_hf,
            to_state_dict=convert.to_hf_state_dict,
            from_state_dict=convert.from_hf_state_dict,
            on_disk_names=convert.on_disk_names,
        ),
        gguf=GGUFMapping(arch="llama", add_hparams=convert.gguf_hparams, problem=convert.gguf_problem),
    )
)
