"""The campaign a LoRA fine-tune rents GPUs for: a Llama-3-8B-shaped base (32 layers x 4096,
32 heads over 8 key-value heads, feed-forward 14336, vocabulary 128256) in bf16, frozen, with
LoRA adapters of rank 16 on every linear layer and the head trained beside them - the adapters
the pilot's own fine-tune uses (`examples/trl_sft.py`, whose SFTTrainer and data it keeps as the
pilot twin). Notebooks 03, 05 and 08 size the 8 B model on fake tensors (its base holds weights
only: no gradient, no optimizer state); it is never allocated. Needs `pip install -e .[llm]`;
no download.

    python -m workbook pilot --task examples.llama_lora_campaign:task --smoke

Options: `layers`, `width`, `heads`, `kv_heads`, `ffn`, `vocab` set the base
(`layers=80, width=8192, heads=64, kv_heads=8, ffn=28672` is the 70 B shape), `rank` the
adapters' rank, `four_bit` a QLoRA base: its frozen linear layers stored in NF4 with double
quantisation and dequantised for each matmul (sized from that storage format, predicted - the
4-bit kernels do not run here). `qlora_70b` is the 70 B QLoRA campaign:

    python -m workbook pilot --task examples.llama_lora_campaign:qlora_70b --smoke
"""

from __future__ import annotations

import dataclasses

import workbook as wb
from examples.trl_sft import make_task as sft


def make_task(layers: int = 32, width: int = 4096, heads: int = 32, kv_heads: int = 8,
              ffn: int = 14336, vocab: int = 128256, rank: int = 16,
              four_bit: bool = False) -> wb.Task:
    import torch
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=ffn,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=8192,
                       rope_theta=500000.0)
    adapters = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                          modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    campaign = wb.campaign.ConfigModel(LlamaForCausalLM, base, adapters, dtype=torch.bfloat16,
                                       four_bit=four_bit)
    size = "70b" if layers == 80 else "8b"
    return dataclasses.replace(sft(), name=f"llama-{size}-{'qlora' if four_bit else 'lora'}"
                               "-campaign", campaign_model=campaign)


task = make_task


def qlora_70b() -> wb.Task:
    """The 70 B QLoRA campaign: a Llama-3-70B-shaped base in 4 bits, LoRA adapters of rank 16."""
    return make_task(layers=80, width=8192, heads=64, kv_heads=8, ffn=28672, four_bit=True)
