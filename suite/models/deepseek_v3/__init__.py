"""The deepseek_v3 family: DeepSeek-V3 (and V2's layout). Multi-head latent attention
(suite/models/deepseek_v3/attention.py), RMSNorm, SwiGLU; dense first layers, then MoE layers with
sigmoid routing over groups, a per-expert bias balanced without an auxiliary loss
(model.router_bias_update_rate), routed_scaling_factor and shared experts. HF: DeepseekV3ForCausalLM; GGUF: llama.cpp's deepseek2 (MLA's
kv_b split per head into k_b / v_b; multi-token prediction layers are dropped)."""

from suite.models.deepseek_v3 import convert
from suite.models.deepseek_v3.attention import LatentAttention
from suite.models.family import Family, GGUFMapping, HFMapping, register
from suite.models.llama.convert import default_ffn

FAMILY = register(
    Family(
        name="deepseek_v3",
        summary="DeepSeek-V3: multi-head latent attention, sigmoid-routed fine-grained MoE with shared experts",
        rms_norm=True,
        swiglu=True,
        rope=True,
        linear_bias=False,
        default_ffn=default_ffn,
        attention=LatentAttention,
        rotary_dim=lambda cfg: cfg.qk_rope_head_dim,
        checks=convert.check,
        hf=HFMapping(
            model_types=("deepseek_v3",),
            to_config=convert.hf_config,
            from_config=convert.config_from_hf,
            to_state_dict=convert.to_hf_state_dict,
            from_state_dict=convert.from_hf_state_dict,
            on_disk_names=convert.on_disk_names,
        ),
        gguf=GGUFMapping(
            arch="deepseek2",
            add_hparams=convert.gguf_hparams,
            problem=convert.gguf_problem,
            permute_qk=False,
            kv_heads=lambda cfg: 1,
            tensors=convert.gguf_tensors,
            unreadable=convert.gguf_unreadable,
            import_problem=convert.gguf_import_problem,
        ),
    )
)
