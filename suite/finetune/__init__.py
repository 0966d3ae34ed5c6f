"""Finetuning: SFT on the pretraining trainer (suite.finetune.trainer). LoRA adapters live in
suite.models.lora (inference merges them too); SFT data in suite.data.sft."""
