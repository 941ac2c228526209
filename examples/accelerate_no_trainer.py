"""A causal-LM training loop written as transformers' `run_clm_no_trainer.py` writes it on
Hugging Face Accelerate, piloted in one call of `workbook.adapters.from_accelerate`: texts
tokenized and grouped into fixed blocks (`group_texts`), `default_data_collator`, a tiny random
GPT-2 built with `from_config`, AdamW with the script's no-decay groups, `get_scheduler("linear")`
and `Accelerator(gradient_accumulation_steps=2)`. The loop body (`training_step`) and the
evaluation body (`eval_step`, `gather_for_metrics`) are the script's, verbatim. The texts are the
generation sample's instructions and responses, tokenized by the workbook's byte tokenizer (no
download). Needs `accelerate` and `transformers`.

    python -m workbook pilot --task examples.accelerate_no_trainer:task --smoke

Planted bug: `backward="loss"` (the body calls `loss.backward()` in place of
`accelerator.backward(loss)`, which alone divides by `gradient_accumulation_steps`: every
update's gradient is that many times too large; 04 names it with the Accelerate call as the
fix); `accumulate=False` (the body outside `with accelerator.accumulate(model):`, so the
optimizer steps after every micro-batch; 04, the first notebook to split an update, stops on
it, naming the missing `accelerator.accumulate`). The clean twin is the default.
"""

from __future__ import annotations

import contextlib
import math
from itertools import chain

import torch

import workbook as wb
from workbook.contract.adapters import from_accelerate
from workbook.samples import DATA_DIR

BLOCK_SIZE = 32  # the script's --block_size
PER_DEVICE_TRAIN_BATCH_SIZE = 8
PER_DEVICE_EVAL_BATCH_SIZE = 8
GRADIENT_ACCUMULATION_STEPS = 2
LEARNING_RATE = 5e-3
WEIGHT_DECAY = 0.0
NUM_TRAIN_EPOCHS = 3
NUM_WARMUP_STEPS = 0
VALIDATION_SHARE = 10  # one text in ten is held out, as --validation_split_percentage


def raw_texts(count: int) -> list[str]:
    """The generation sample's rows as plain texts."""
    rows = wb.read_jsonl(DATA_DIR / "generation.jsonl")
    return [f"{r['instruction']} -> {r['response']}" for r in rows[:count]]


def tokenize_function(examples: dict) -> dict:
    """The script's `tokenize_function`, with the byte tokenizer (an end marker per text)."""
    ids = [wb.tokenizer.encode(t) + [wb.tokenizer.EOS] for t in examples["text"]]
    return {"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]}


def group_texts(examples: dict) -> dict:
    """The script's `group_texts`: every text concatenated, cut into blocks of BLOCK_SIZE (the
    remainder dropped), labels a copy of the input ids."""
    concatenated = {k: list(chain(*examples[k])) for k in examples}
    total_length = len(concatenated[next(iter(examples))])
    total_length = (total_length // BLOCK_SIZE) * BLOCK_SIZE
    result = {k: [t[i: i + BLOCK_SIZE] for i in range(0, total_length, BLOCK_SIZE)]
              for k, t in concatenated.items()}
    result["labels"] = result["input_ids"].copy()
    return result


def lm_datasets(count: int):
    """The train and validation blocks, made with `datasets.map` as the script makes them."""
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()
    texts = raw_texts(count)
    splits = {"train": [t for i, t in enumerate(texts) if i % VALIDATION_SHARE],
              "validation": [t for i, t in enumerate(texts) if not i % VALIDATION_SHARE]}
    return {split: Dataset.from_dict({"text": rows})
            .map(tokenize_function, batched=True, remove_columns=["text"])
            .map(group_texts, batched=True) for split, rows in splits.items()}


def make_task(count: int = 400, backward: str = "accelerator", accumulate: bool = True):
    """The script's pieces and the one call; `backward="loss"` plants `loss.backward()`,
    `accumulate=False` a body outside `accelerator.accumulate(model)`."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, GPT2Config, default_data_collator, get_scheduler

    accelerator = Accelerator(gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS)
    config = GPT2Config(vocab_size=wb.tokenizer.VOCAB_SIZE, n_positions=BLOCK_SIZE, n_embd=32,
                        n_layer=2, n_head=2, bos_token_id=wb.tokenizer.BOS,
                        eos_token_id=wb.tokenizer.EOS)
    data = lm_datasets(count)

    def make_model():
        return AutoModelForCausalLM.from_config(config)

    def make_optimizer(model):
        no_decay = ["bias", "layer_norm.weight"]
        grouped = [
            {"params": [p for n, p in model.named_parameters()
                        if not any(nd in n for nd in no_decay)],
             "weight_decay": WEIGHT_DECAY},
            {"params": [p for n, p in model.named_parameters()
                        if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(grouped, lr=LEARNING_RATE)

    train_dataloader = DataLoader(data["train"], shuffle=True, collate_fn=default_data_collator,
                                  batch_size=PER_DEVICE_TRAIN_BATCH_SIZE)
    eval_dataloader = DataLoader(data["validation"], collate_fn=default_data_collator,
                                 batch_size=PER_DEVICE_EVAL_BATCH_SIZE)
    updates_per_epoch = math.ceil(len(train_dataloader) / accelerator.gradient_accumulation_steps)
    max_train_steps = NUM_TRAIN_EPOCHS * updates_per_epoch

    def make_scheduler(optimizer, num_training_steps=max_train_steps):
        return get_scheduler("linear", optimizer=optimizer,
                             num_warmup_steps=NUM_WARMUP_STEPS * accelerator.num_processes,
                             num_training_steps=num_training_steps * accelerator.num_processes)

    def training_step(accelerator, model, optimizer, lr_scheduler, batch):
        with accelerator.accumulate(model) if accumulate else contextlib.nullcontext():
            outputs = model(**batch)
            loss = outputs.loss
            if backward == "loss":
                loss.backward()
            else:
                accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        return loss

    def eval_step(accelerator, model, batch):
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        return accelerator.gather_for_metrics(loss.repeat(PER_DEVICE_EVAL_BATCH_SIZE))

    return from_accelerate(make_model, make_optimizer, train_dataloader, training_step,
                           name="accelerate-clm" + ("-loss-backward" if backward == "loss"
                                                    else "") + ("" if accumulate else
                                                                "-no-accumulate"),
                           accelerator=accelerator, make_scheduler=make_scheduler,
                           eval_dataloader=eval_dataloader, eval_step=eval_step,
                           decode=wb.tokenizer.decode)


def task(count: int = 400, backward: str = "accelerator", accumulate: bool = True):
    """The task the pilot loads (`--option backward=loss`, `--option accumulate=false` plant
    the bugs)."""
    return make_task(count, backward, accumulate)
