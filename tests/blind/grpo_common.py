"""Shared pieces of the GRPO blind cases, written as the TRL docs write a GRPO run:
`GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=Dataset.from_dict(
{"prompt": [...]}), processing_class=tokenizer)` with plain Python reward functions
`def reward(completions, **kwargs) -> list[float]`. The policy is the repository's pretrained tiny
chat base (`data_samples/tiny_chat_base`, a 2-layer Llama that answers and ends with `<eot>`),
loaded with `from_pretrained`; the prompts are the instructions of the generation
sample (`repeat: fosadu`, `reverse: peba`, ...), conversational as the TRL docs write them.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "data_samples" / "tiny_chat_base"


def prompts(count: int = 16) -> list[list[dict]]:
    rows = []
    with (ROOT / "data_samples" / "generation.jsonl").open() as f:
        for line in f:
            rows.append([{"role": "user", "content": json.loads(line)["instruction"]}])
            if len(rows) == count:
                break
    return rows


def grpo_trainer(reward_funcs, *, num_generations: int = 4, per_device_train_batch_size: int = 4,
                 max_completion_length: int = 8, count: int = 16, **config):
    """The script's trainer: a fresh tiny Qwen2 policy, the docs' GRPOConfig knobs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(BASE), reward_funcs=reward_funcs,
        args=GRPOConfig(output_dir="grpo-out", learning_rate=1e-3,
                        per_device_train_batch_size=per_device_train_batch_size,
                        num_generations=num_generations,
                        max_completion_length=max_completion_length, logging_steps=1,
                        report_to="none", use_cpu=True, **config),
        train_dataset=Dataset.from_dict({"prompt": prompts(count)}),
        processing_class=AutoTokenizer.from_pretrained(BASE))


def overlap(prompt, completion) -> float:
    """The share of the instruction word's letters that the answer holds (`repeat: fosadu` ->
    'fosadu fosadu' scores 1): a reward that varies between the answers of one prompt."""
    word = prompt[-1]["content"].split()[-1].lower()
    text = completion[0]["content"].lower()
    return sum(ch in text for ch in word) / len(word)


def answer_reward(prompts, completions, **kwargs) -> list[float]:
    """The clean reward of the GRPO cases: one `overlap` per completion."""
    return [overlap(p, c) for p, c in zip(prompts, completions, strict=True)]
