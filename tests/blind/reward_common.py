"""Shared pieces of the RewardTrainer blind cases, written as the TRL docs write a reward model:
`AutoModelForSequenceClassification(..., num_labels=1)`, `RewardTrainer(model=model,
args=RewardConfig(...), train_dataset=<"chosen"/"rejected" conversations, implicit prompt>,
processing_class=tokenizer, peft_config=LoraConfig(...))`. The model is a tiny random Llama
classifier built in the script from a `LlamaConfig` (`from_config`, one score output), the
tokenizer the repository's tiny chat base's (`data_samples/tiny_chat_base`); each pair is a
generation-sample turn: the user's instruction, its own response (chosen) and the response of the
same kind of turn in the next conversation (rejected).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "data_samples" / "tiny_chat_base"


def pairs(count: int = 48) -> list[dict]:
    """`count` preference pairs in the implicit-prompt form: both conversations hold the user
    turn, only the assistant's answer differs."""
    by_kind = defaultdict(list)
    with (ROOT / "data_samples" / "generation.jsonl").open() as f:
        for line in f:
            row = json.loads(line)
            by_kind[row["instruction"].split(":")[0]].append(row)
            if sum(map(len, by_kind.values())) >= 2 * count:
                break
    out = []
    for rows in by_kind.values():
        for row, other in zip(rows, rows[1:] + rows[:1], strict=True):
            user = {"role": "user", "content": row["instruction"]}
            out.append({"chosen": [user, {"role": "assistant", "content": row["response"]}],
                        "rejected": [user, {"role": "assistant", "content": other["response"]}]})
    return out[:count]


def llama_config(tokenizer, **overrides):
    from transformers import LlamaConfig

    fields = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=256, num_labels=1,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    fields.update(overrides)
    return LlamaConfig(**fields)


def reward_trainer(rows: list[dict], *, peft_config=None, config: dict | None = None,
                   max_length: int = 128, **args):
    """The script's trainer: a fresh tiny Llama classifier and the docs' RewardConfig knobs."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(BASE)
    model = AutoModelForSequenceClassification.from_config(
        llama_config(tokenizer, **(config or {})))
    return RewardTrainer(
        model=model,
        args=RewardConfig(output_dir="reward-out", learning_rate=1e-3, max_length=max_length,
                          per_device_train_batch_size=8, logging_steps=1,
                          report_to="none", use_cpu=True, **args),
        train_dataset=Dataset.from_list(rows[: len(rows) * 3 // 4]),
        eval_dataset=Dataset.from_list(rows[len(rows) * 3 // 4:]),
        processing_class=tokenizer, peft_config=peft_config)
