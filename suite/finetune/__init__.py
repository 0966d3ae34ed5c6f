"""Finetuning: SFT as a training method composed on the common trainer (suite.finetune.method; chat
data in suite.finetune.data). LoRA adapters live in suite.models.lora (inference merges them too);
SFT rows in suite.data.sft."""
