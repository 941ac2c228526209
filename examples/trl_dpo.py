"""Preference tuning written as the TRL and PEFT docs write it, piloted in one call:
`DPOTrainer(model, args=DPOConfig(beta=..., max_length=...), train_dataset=<prompt / chosen /
rejected conversations>, eval_dataset=..., processing_class=tokenizer,
peft_config=LoraConfig(...))` handed to `workbook.adapters.from_trainer` as the script builds
it. The base is examples/trl_sft.py's pretrained tiny Llama (`data_samples/tiny_chat_base`); the
pairs are the generation sample's turns: the prompt a user turn, the chosen answer its own
response, the rejected one the response of another conversation's turn of the same kind. With
LoRA the reference is the base itself (the adapters switched off), as DPOTrainer does; with
`lora=False` it is a frozen copy of the base beside the trained one. Needs `pip install -e
.[llm]` (trl, peft).

    python -m workbook pilot --task examples.trl_dpo:task --smoke

Planted bugs: `same_answer=True` (the rejected answer is the chosen one: a pair with no
preference, whose DPO loss stays ln 2 whatever the model does; 01 names the pairs),
`long_prompt=True` (a prompt that fills `max_length` with the answers cut away: TRL drops such
pairs; 01 counts them), `shared_opening=True` (both answers open with the same 80 words, so at
max_length=64 truncation leaves every pair's chosen and rejected sequences identical; 01 names
them).
"""

from __future__ import annotations

from collections import defaultdict

import workbook as wb
from workbook.samples import DATA_DIR

BASE = DATA_DIR / "tiny_chat_base"


def pairs(count: int = 300) -> list[dict]:
    """One preference pair per turn of `count` conversations: the user's instruction, its own
    response (chosen) and the response to the same turn of the next conversation (rejected)."""
    turns = defaultdict(list)
    for row in wb.read_jsonl(DATA_DIR / "generation.jsonl"):
        if len(turns) == count and row["conversation"] not in turns:
            break
        turns[row["conversation"]].append(row)
    names = list(turns)
    out = []
    for i, name in enumerate(names):
        other = turns[names[(i + 1) % len(names)]]
        for j, t in enumerate(turns[name]):
            wrong = other[j % len(other)]["response"]
            if wrong == t["response"]:
                continue
            out.append({"conversation": name,
                        "prompt": [{"role": "user", "content": t["instruction"]}],
                        "chosen": [{"role": "assistant", "content": t["response"]}],
                        "rejected": [{"role": "assistant", "content": wrong}]})
    return out


def make_trainer_factory(count: int = 300, lora: bool = True, same_answer: bool = False,
                         long_prompt: bool = False, shared_opening: bool = False,
                         max_length: int = 64):
    """The script's `make_trainer`: everything below is as the TRL docs write it."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    rows = pairs(count)
    if same_answer:  # planted: every third pair prefers an answer to itself
        for row in rows[::3]:
            row["rejected"] = row["chosen"]
    if long_prompt:  # planted: every fourth prompt fills the context
        for row in rows[::4]:
            row["prompt"][0]["content"] = " ".join([row["prompt"][0]["content"]] * 40)
    if shared_opening:  # planted: both answers open alike for longer than max_length
        for row in rows:
            for answer in ("chosen", "rejected"):
                row[answer][0]["content"] = " ".join(["answer briefly"] * 40 + [
                    row[answer][0]["content"]])
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    train = Dataset.from_list([r for r in rows if int(r["conversation"][4:]) % 10 < 8])
    evaluation = Dataset.from_list([r for r in rows if int(r["conversation"][4:]) % 10 >= 8])

    def make_trainer():
        return DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(BASE),
            args=DPOConfig(output_dir="trl-dpo-out", beta=0.1, max_length=max_length,
                           learning_rate=5e-3, per_device_train_batch_size=8,
                           report_to="none", use_cpu=True),
            train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer,
            # the head trains whole beside the adapters, as in examples/trl_sft.py
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                   modules_to_save=["lm_head"], task_type="CAUSAL_LM")
            if lora else None)
    return make_trainer


def make_task(count: int = 300, **planted) -> wb.Task:
    return wb.adapters.from_trainer(make_trainer_factory(count, **planted), name="trl-dpo-lora",
                                    group_column="conversation")


task = make_task
