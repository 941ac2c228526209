"""The campaign a GRPO run rents GPUs for: examples/trl_grpo.py's GRPOTrainer (its prompts,
reward functions and GRPOConfig, kept as the pilot twin) on a Llama-3-8B-shaped policy (32
layers x 4096, 32 heads over 8 key-value heads, feed-forward 14336, vocabulary 128256) in
bf16. `lora=True`: LoRA adapters of rank 16 on every linear layer of a frozen base, the
reference the base with the adapters off; `lora=False`: the whole policy trained, the
reference a frozen bf16 copy beside it (weights only). With `beta` > 0 the reference's forward
is in every step. Notebooks 03, 05 and 08 size the 8 B step on fake tensors - every completion
`max_completion_length` long, the generation's KV cache at its end, the reference's forward,
the loss's graph; it is never allocated. Needs `pip install -e .[llm]`; no download.

    python -m workbook pilot --task examples.llama_grpo_campaign:task --smoke
    python -m workbook pilot --task examples.llama_grpo_campaign:task --option lora=false
"""

from __future__ import annotations

import dataclasses

import workbook as wb
from examples.trl_grpo import make_task as grpo


def make_task(lora: bool = True, beta: float = 0.04, layers: int = 32, width: int = 4096,
              heads: int = 32, kv_heads: int = 8, ffn: int = 14336, vocab: int = 128256,
              rank: int = 16) -> wb.Task:
    import torch
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=ffn,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=8192,
                       rope_theta=500000.0)
    adapters = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                          task_type="CAUSAL_LM") if lora else None
    policy = wb.campaign.ConfigModel(LlamaForCausalLM, base, adapters, dtype=torch.bfloat16)
    frozen = wb.campaign.ConfigModel(LlamaForCausalLM, base, dtype=torch.bfloat16)
    task = grpo(lora=lora, beta=beta)

    def build(layers: int):
        reference = None if lora or not beta else frozen.with_layers(layers)()
        return task.framework.policy_around(policy.with_layers(layers)(), reference)
    return dataclasses.replace(task, name=f"llama-8b-grpo-{'lora' if lora else 'full'}",
                               campaign_model=wb.campaign.Deep(build, layers=layers))


task = make_task
