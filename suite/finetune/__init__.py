"""Finetuning: LoRA adapters (suite.finetune.lora); SFT data lives in suite.data.sft."""

from suite.finetune.lora import (
    LoRALinear,
    LoRASpec,
    apply_lora,
    count_trainable,
    init_lora,
    load_lora,
    load_lora_state_dict,
    lora_state_dict,
    merge_lora,
    save_lora,
)

__all__ = [
    "LoRALinear",
    "LoRASpec",
    "apply_lora",
    "count_trainable",
    "init_lora",
    "load_lora",
    "load_lora_state_dict",
    "lora_state_dict",
    "merge_lora",
    "save_lora",
]
