"""The gpt family: GPT-2 / Megatron GPT. Pre-LN with LayerNorm, learned positions, a tanh-GELU MLP,
biases on every projection, tied embeddings by default. HF class: GPT2LMHeadModel; GGUF: gpt2."""

from suite.models.family import Family, GGUFMapping, HFMapping, register
from suite.models.gpt import convert

FAMILY = register(
    Family(
        name="gpt",
        summary="GPT-2 / Megatron GPT: LayerNorm, learned positions, GELU MLP, biases",
        rms_norm=False,
        swiglu=False,
        rope=False,
        linear_bias=True,
        default_ffn=lambda cfg: 4 * cfg.hidden_size,
        hf=HFMapping(
            model_types=("gpt2",),
            to_config=convert.hf_config,
            from_config=convert.config_from_hf,
            to_state_dict=convert.to_hf_state_dict,
            from_state_dict=convert.from_hf_state_dict,
            export_problem=convert.hf_export_problem,
            quantized_problem=(
                "GPT-2's transformers class computes with Conv1D layers, which transformers' TorchAoConfig "
                "does not quantize (nn.Linear only)"
            ),
        ),
        gguf=GGUFMapping(
            arch="gpt2",
            add_hparams=convert.gguf_hparams,
            problem=convert.gguf_problem,
            transposed=convert.GPT2_TRANSPOSED,
            permute_qk=False,
            load_kwargs=convert.gguf_load_kwargs,
            config_kwargs=convert.gguf_config_kwargs,
        ),
    )
)
