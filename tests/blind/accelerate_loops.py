"""Hugging Face Accelerate training loops written as accelerate's `examples/` and transformers'
`examples/pytorch/*_no_trainer.py` write them, handed to the workbook with
`workbook.adapters.from_accelerate` (the model and optimizer as the script builds them, its
DataLoader unprepared, its loop body verbatim as `training_step`).

Loops (task option `loop`):
- `"glue"`: accelerate `examples/by_feature/gradient_accumulation.py` (nlp_example.py with
  `Accelerator(gradient_accumulation_steps=...)` and `with accelerator.accumulate(model):`), a
  tiny random BERT-style sequence classifier on in-memory sentence pairs, `tokenizer.pad` in the
  collate_fn, AdamW, `get_linear_schedule_with_warmup`, an eval loop with
  `accelerator.gather_for_metrics`. Planted (`backward`):
  - `"accelerator"`: `accelerator.backward(loss)` - the clean twin;
  - `"loss"`: `loss.backward()` in its place (lucidrains/med-seg-diff-pytorch#6 "I did
    loss.backward() instead of accelerator.backward(loss)"; accelerate divides the loss by the
    accumulation steps only inside `accelerator.backward`, huggingface/transformers#26312), so
    each update's gradient is the SUM of its micro-batches' means: `gradient_accumulation_steps`
    times too large;
  - `"divided"`: `loss = loss / gradient_accumulation_steps` before `accelerator.backward(loss)`
    (huggingface/accelerate#3533 "double divide gradient_accumulation_steps"): divided twice,
    each update's gradient `gradient_accumulation_steps` times too small.
- `"clm"`: transformers `run_clm_no_trainer.py` - `tokenize_function`, then `group_texts` into
  fixed `block_size` blocks (labels = input_ids copy), `default_data_collator`, a tiny random
  `GPT2LMHeadModel`, AdamW with the no-decay groups, `get_scheduler("linear", ...)`, eval loss
  via `accelerator.gather_for_metrics(loss.repeat(batch_size))`. Clean: every block has one
  length, so every batch stacks.

Text: words of the tokenizer in data_samples/tiny_chat_base (a word-level vocabulary), found
relative to this file.
"""

from __future__ import annotations

import random
from itertools import chain
from pathlib import Path

import torch
from torch.utils.data import DataLoader

TOKENIZER = Path(__file__).resolve().parents[2] / "data_samples" / "tiny_chat_base"
GRADIENT_ACCUMULATION_STEPS = 2


def tokenizer_and_words():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.islower())[:120]
    return tokenizer, words


def sentences(words, n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(n)]


# ---- accelerate examples/by_feature/gradient_accumulation.py ---------------------------------

def glue_pairs(words, n, seed):
    """MRPC-like pairs: a paraphrase (the words of sentence1, last two swapped) or another
    sentence."""
    rng = random.Random(seed)
    first, other = sentences(words, n, seed), sentences(words, n, seed + 1)
    rows = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for i, (a, b) in enumerate(zip(first, other, strict=True)):
        label = rng.random() < 0.5
        w = a.split()
        rows["sentence1"].append(a)
        rows["sentence2"].append(" ".join(w[:-2] + w[-1:] + w[-2:-1]) if label else b)
        rows["label"].append(int(label))
        rows["idx"].append(i)
    return rows


def make_glue(backward: str = "accelerator", batch_size: int = 4, n: int = 64):
    from accelerate import Accelerator
    from datasets import Dataset
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        get_linear_schedule_with_warmup,
    )

    tokenizer, words = tokenizer_and_words()
    accelerator = Accelerator(gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS,
                              mixed_precision="no", cpu=True)

    def tokenize_function(examples):
        return tokenizer(examples["sentence1"], examples["sentence2"], truncation=True,
                         max_length=None)

    datasets = {split: Dataset.from_dict(glue_pairs(words, n, seed))
                for split, seed in (("train", 0), ("validation", 100))}
    tokenized = {k: d.map(tokenize_function, batched=True,
                          remove_columns=["idx", "sentence1", "sentence2"])
                 .rename_column("label", "labels") for k, d in datasets.items()}

    def collate_fn(examples):
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    train_dataloader = DataLoader(tokenized["train"], shuffle=True, collate_fn=collate_fn,
                                  batch_size=batch_size)
    eval_dataloader = DataLoader(tokenized["validation"], shuffle=False, collate_fn=collate_fn,
                                 batch_size=batch_size)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=64, num_labels=2,
                        pad_token_id=tokenizer.pad_token_id)

    def make_model():
        torch.manual_seed(42)
        return BertForSequenceClassification(config)

    def make_optimizer(model):
        return torch.optim.AdamW(params=model.parameters(), lr=2e-3)

    def make_scheduler(optimizer):
        return get_linear_schedule_with_warmup(
            optimizer=optimizer, num_warmup_steps=0,
            num_training_steps=len(train_dataloader) * 3 // GRADIENT_ACCUMULATION_STEPS)

    def training_step(accelerator, model, optimizer, lr_scheduler, batch):
        with accelerator.accumulate(model):
            output = model(**batch)
            loss = output.loss
            if backward == "divided":
                loss = loss / GRADIENT_ACCUMULATION_STEPS
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
        return accelerator.gather_for_metrics(outputs.loss.repeat(len(batch["labels"])))

    return dict(make_model=make_model, make_optimizer=make_optimizer,
                train_dataloader=train_dataloader, training_step=training_step,
                accelerator=accelerator, make_scheduler=make_scheduler,
                eval_dataloader=eval_dataloader, eval_step=eval_step,
                name=f"blind-accelerate-glue-{backward}")


# ---- transformers examples/pytorch/language-modeling/run_clm_no_trainer.py -------------------

def make_clm(block_size: int = 16, batch_size: int = 4, n: int = 96):
    from accelerate import Accelerator
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

    tokenizer, words = tokenizer_and_words()
    accelerator = Accelerator(gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS,
                              mixed_precision="no", cpu=True)
    raw = {"train": Dataset.from_dict({"text": sentences(words, n, 0)}),
           "validation": Dataset.from_dict({"text": sentences(words, n // 3, 7)})}

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
                  for k, t in concatenated_examples.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    lm = {k: d.map(tokenize_function, batched=True, remove_columns=["text"])
          .map(group_texts, batched=True) for k, d in raw.items()}
    train_dataloader = DataLoader(lm["train"], shuffle=True, collate_fn=default_data_collator,
                                  batch_size=batch_size)
    eval_dataloader = DataLoader(lm["validation"], collate_fn=default_data_collator,
                                 batch_size=batch_size)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1,
                        n_head=2, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)

    def make_model():
        torch.manual_seed(42)
        model = GPT2LMHeadModel(config)
        embedding_size = model.get_input_embeddings().weight.shape[0]
        if len(tokenizer) > embedding_size:
            model.resize_token_embeddings(len(tokenizer))
        return model

    def make_optimizer(model):
        no_decay = ["bias", "layer_norm.weight"]
        optimizer_grouped_parameters = [
            {"params": [p for n, p in model.named_parameters()
                        if not any(nd in n for nd in no_decay)], "weight_decay": 0.0},
            {"params": [p for n, p in model.named_parameters()
                        if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optimizer_grouped_parameters, lr=5e-3)

    def make_scheduler(optimizer):
        return get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=0,
                             num_training_steps=len(train_dataloader) * 3)

    def training_step(accelerator, model, optimizer, lr_scheduler, batch):
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        return loss

    def eval_step(accelerator, model, batch):
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        return accelerator.gather_for_metrics(loss.repeat(batch_size))

    return dict(make_model=make_model, make_optimizer=make_optimizer,
                train_dataloader=train_dataloader, training_step=training_step,
                accelerator=accelerator, make_scheduler=make_scheduler,
                eval_dataloader=eval_dataloader, eval_step=eval_step,
                name="blind-accelerate-clm")


def pieces(loop: str = "glue", **options) -> dict:
    return make_clm(**options) if loop == "clm" else make_glue(**options)


def task(loop: str = "glue", **options):
    """The workbook task, through the call the workbook is to get (it does not exist yet)."""
    from workbook.contract.adapters import from_accelerate

    p = pieces(loop, **options)
    return from_accelerate(p.pop("make_model"), p.pop("make_optimizer"),
                           p.pop("train_dataloader"), p.pop("training_step"), **p)


def train_with_accelerate(loop: str = "glue", steps: int = 8, **options) -> list[float]:
    """The script's own loop with plain Accelerate (prepare, then the loop body): the losses."""
    p = pieces(loop, **options)
    accelerator = p["accelerator"]
    model = p["make_model"]()
    optimizer = p["make_optimizer"](model)
    scheduler = p["make_scheduler"](optimizer)
    model, optimizer, dataloader, scheduler = accelerator.prepare(
        model, optimizer, p["train_dataloader"], scheduler)
    model.train()
    losses = []
    while len(losses) < steps:
        for batch in dataloader:
            losses.append(float(p["training_step"](accelerator, model, optimizer, scheduler,
                                                     batch)))
            if len(losses) == steps:
                break
    accelerator.free_memory()
    return losses
