"""Online RL fine-tuning written as the TRL docs write it, piloted in one call:
`GRPOTrainer(model, reward_funcs=[...], args=GRPOConfig(num_generations=4,
max_completion_length=..., reward_weights=[...]), train_dataset=<"prompt" conversations>,
eval_dataset=..., processing_class=tokenizer)` handed to `workbook.adapters.from_trainer` as the
script builds it. The policy is examples/trl_sft.py's pretrained tiny Llama
(`data_samples/tiny_chat_base`, with its chat template); the prompts are the generation sample's
user turns ("repeat: peba"), each with its expected `answer` as an extra column TRL hands to the
reward functions. Two rewards, plain callables: `capitals` (the share of the completion's words
in capitals) and `brevity` (completions that stop early), weighted 1 and 0.5. Needs
`pip install -e .[llm]` (trl).

    python -m workbook pilot --task examples.trl_grpo:task --smoke

Options: `lora=True` (LoRA adapters on every linear layer: the reference is the base with the
adapters off), `beta=0.04` (a KL penalty against the reference: a frozen copy of the policy
without LoRA). `examples/llama_grpo_campaign.py` sizes an 8 B campaign of the same run.

Planted bugs (each named by 01, before any rental): `wrong_length=True` (a reward function that
returns one reward per prompt, not per completion), `constant_reward=True` (a reward that gives
every completion of a prompt the same value: every group has zero spread, zero advantage and no
gradient - TRL's `frac_reward_zero_std` 1.0), `none_reward=True` (a reward that returns None
for completions it cannot parse: TRL turns them into NaN), `short_completions=True`
(max_completion_length=1: most completions are cut before their end token),
`batch_relative=True` (a reward normalised by the longest completion of the batch it is called
on: a completion's reward depends on the others, so on generation_batch_size and the number of
GPUs), `odd_generations=True` (a generation batch of 4 completions with num_generations=3:
TRL refuses it at GRPOConfig, and the pilot relays its words before any notebook).
"""

from __future__ import annotations

import workbook as wb
from workbook.samples import DATA_DIR

BASE = DATA_DIR / "tiny_chat_base"  # the pretrained policy: config, weights, tokenizer


def prompts(count: int = 60) -> list[dict]:
    """One prompt per instruction of the generation sample, with its answer and conversation."""
    rows = []
    for row in wb.read_jsonl(DATA_DIR / "generation.jsonl"):
        if len(rows) == count:
            break
        rows.append({"conversation": row["conversation"], "answer": row["response"],
                     "prompt": [{"role": "user", "content": row["instruction"]}]})
    return rows


def text(completion) -> str:
    """A completion's text: conversational completions are a list with one assistant message."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def capitals(completions, **kwargs) -> list[float]:
    """The share of the completion's words written in capitals (0 for an empty one): a
    preference the policy can learn, as its completions differ in it within a group."""
    words = [text(c).split() for c in completions]
    return [sum(w.isupper() for w in ws) / len(ws) if ws else 0.0 for ws in words]


def brevity(completions, **kwargs) -> list[float]:
    """1 for a completion of at most four words, falling to 0 at twelve."""
    return [max(0.0, min(1.0, (12 - len(text(c).split())) / 8)) for c in completions]


def make_trainer_factory(count: int = 60, wrong_length: bool = False,
                         constant_reward: bool = False, none_reward: bool = False,
                         short_completions: bool = False, odd_generations: bool = False,
                         batch_relative: bool = False, lora: bool = False, beta: float = 0.0):
    """The script's `make_trainer`: everything below is as the TRL docs write it."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = prompts(count)
    train = Dataset.from_list([r for r in rows if int(r["conversation"][4:]) % 10 < 8])
    evaluation = Dataset.from_list([r for r in rows if int(r["conversation"][4:]) % 10 >= 8])
    rewards = [capitals, brevity]
    if wrong_length:  # planted: one reward per prompt (the completions come in groups)
        rewards[1] = lambda completions, **kw: brevity(completions)[::4]
    if constant_reward:  # planted: a reward of the prompt alone, equal across its group
        rewards = [lambda prompts, **kw: [len(p[0]["content"]) / 10 for p in prompts]]
    if batch_relative:  # planted: each completion's length against the batch's longest
        rewards[1] = lambda completions, **kw: [
            len(text(c).split()) / max(1, *(len(text(x).split()) for x in completions))
            for c in completions]
    if none_reward:  # planted: None where the completion is not one word
        rewards[1] = lambda completions, **kw: [1.0 if len(text(c).split()) == 1 else None
                                                for c in completions]

    def make_trainer():
        return GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(BASE),
            reward_funcs=rewards,
            args=GRPOConfig(output_dir="trl-grpo-out", learning_rate=5e-3,
                            num_generations=3 if odd_generations else 4,
                            max_completion_length=1 if short_completions else 12,
                            per_device_train_batch_size=4, per_device_eval_batch_size=4,
                            reward_weights=[1.0] * len(rewards) if constant_reward
                            else [1.0, 0.5], beta=beta, report_to="none", use_cpu=True,
                            seed=0),
            train_dataset=train, eval_dataset=evaluation,
            processing_class=AutoTokenizer.from_pretrained(BASE),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                   task_type="CAUSAL_LM") if lora else None)
    return make_trainer


def make_task(count: int = 60, **planted) -> wb.Task:
    return wb.adapters.from_trainer(make_trainer_factory(count, **planted), name="trl-grpo",
                                    group_column="conversation")


task = make_task
