"""A reward model written as the TRL and PEFT docs write it, piloted in one call:
`RewardTrainer(model=AutoModelForSequenceClassification.from_pretrained(base, num_labels=1),
args=RewardConfig(max_length=...), train_dataset=<chosen / rejected conversations>,
eval_dataset=..., processing_class=tokenizer, peft_config=LoraConfig(task_type="SEQ_CLS"))`
handed to `workbook.adapters.from_trainer` as the script builds it. The base is
examples/trl_sft.py's pretrained tiny Llama (`data_samples/tiny_chat_base`) with a fresh score
head; the pairs are examples/trl_dpo.py's, with the prompt implicit (the user turn opens both
conversations). With `lora=False` the whole model trains. Needs `pip install -e .[llm]`.

    python -m workbook pilot --task examples.trl_reward:task --smoke

Planted bugs, each with 01's finding: `same_answer=True` (every third pair's rejected answer
is its chosen one: a pair with no preference, its loss ln 2 whatever the head learns),
`truncated=True` (the pairs tokenized by the script with `truncation=True, max_length=16` after
a shared 40-word opening, so chosen and rejected are the same tokens; re-tokenized without
truncation they differ), `long_answer=True` (every fourth rejected answer repeated past
`max_length`: RewardTrainer drops the pair silently; 01 counts them), `pad_with_eos=True` (the
script's collator pads with the end token, `DataCollatorForPreference(pad_token_id=eos)`, while
the model reads the score at the last token that is not `config.pad_token_id`: shorter
sequences are scored on their padding), `head="frozen"` (a LoraConfig without `task_type`: PEFT
freezes the score head, which keeps its random start; `head="saved"`, `modules_to_save=
["score"]`, is a clean twin beside the default `task_type="SEQ_CLS"`), `head_std=20.0`
(the script re-initialises the score head at std 20: its random scores rank the pairs from
the start, the first loss is far above ln 2 and back at it with the head zeroed; the default
start, std 0.02, and even std 5 keep it near ln 2). Clean twin: `no_pad_token=True` (a
tokenizer without a pad token: TRL pads with the end token, which then is
`config.pad_token_id` too, and every score is read on the token before the end).
"""

from __future__ import annotations

import workbook as wb
from examples.trl_dpo import BASE, pairs

OPENING = " ".join(["answer briefly"] * 20)  # 40 words both answers share (`truncated`)


def ranked_pairs(count: int, same_answer: bool = False, long_answer: bool = False) -> list[dict]:
    """examples/trl_dpo.py's pairs with an implicit prompt: each answer a whole conversation."""
    rows = [{"conversation": r["conversation"], "chosen": r["prompt"] + r["chosen"],
             "rejected": r["prompt"] + r["rejected"]} for r in pairs(count)]
    if same_answer:  # planted: every third pair prefers an answer to itself
        for row in rows[::3]:
            row["rejected"] = row["chosen"]
    if long_answer:  # planted: every fourth rejected answer outgrows max_length
        for row in rows[::4]:
            answer = row["rejected"][-1]
            row["rejected"] = row["rejected"][:-1] + [
                {**answer, "content": " ".join([answer["content"]] * 40)}]
    return rows


def tokenized_by_script(rows: list[dict], tokenizer) -> list[dict]:
    """Planted (`truncated`): the script tokenizes the pairs itself, truncating at 16 tokens
    after an opening both answers share; the texts are kept beside the ids."""
    out = []
    for row in rows:
        texts = {a: tokenizer.apply_chat_template(
            row[a][:-1] + [{**row[a][-1], "content": f"{OPENING} {row[a][-1]['content']}"}],
            tokenize=False) for a in ("chosen", "rejected")}
        out.append({"conversation": row["conversation"], **texts,
                    **{f"{a}_ids": tokenizer(t, truncation=True, max_length=16)["input_ids"]
                       for a, t in texts.items()}})
    return out


def make_trainer_factory(count: int = 300, lora: bool = True, same_answer: bool = False,
                         truncated: bool = False, long_answer: bool = False,
                         pad_with_eos: bool = False, head: str = "seq_cls",
                         head_std: float | None = None, no_pad_token: bool = False,
                         max_length: int = 64):
    """The script's `make_trainer`: everything below is as the TRL docs write it."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    tokenizer = AutoTokenizer.from_pretrained(BASE)
    if no_pad_token:  # a tokenizer without one, as many bases ship: TRL pads with the EOS
        tokenizer.pad_token = None
    rows = ranked_pairs(count, same_answer, long_answer)
    if truncated:
        rows = tokenized_by_script(rows, tokenizer)
    train = Dataset.from_list([r for r in rows if int(r["conversation"][4:]) % 10 < 8])
    evaluation = Dataset.from_list([r for r in rows if int(r["conversation"][4:]) % 10 >= 8])
    adapters = {"seq_cls": {"task_type": "SEQ_CLS"}, "frozen": {},
                "saved": {"modules_to_save": ["score"]}}[head]

    def scorer():
        model = AutoModelForSequenceClassification.from_pretrained(BASE, num_labels=1)
        if head_std is not None:  # planted: the head re-initialised by hand
            torch.nn.init.normal_(model.score.weight, std=head_std)
        return model

    def make_trainer():
        return RewardTrainer(
            model=scorer(),
            args=RewardConfig(output_dir="trl-reward-out", max_length=max_length,
                              learning_rate=5e-3, per_device_train_batch_size=8,
                              report_to="none", use_cpu=True),
            train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer,
            data_collator=DataCollatorForPreference(pad_token_id=tokenizer.eos_token_id)
            if pad_with_eos else None,
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj"], **adapters) if lora else None)
    return make_trainer


def make_task(count: int = 300, **planted) -> wb.Task:
    return wb.adapters.from_trainer(make_trainer_factory(count, **planted), name="trl-reward",
                                    group_column="conversation")


task = make_task
