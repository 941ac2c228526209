"""A text classifier fine-tuned the way transformers' `run_glue_no_trainer.py` trains one:
`AdamW` over two parameter groups (no weight decay on biases and LayerNorm weights) and
`get_scheduler("linear", optimizer, num_warmup_steps=..., num_training_steps=...)`, stepped
after every `optimizer.step()`.

Source: huggingface/transformers#34754 ("warmup LR schedulers start from LR=0": evaluated at
step 0 the linear warm-up's factor is 0, so the first optimizer step changes no weight);
the same question for BERT's own schedule is google-research/bert#1293.

Planted: `num_warmup_steps=10` (the script's `--num_warmup_steps`): the first update runs at
learning rate 0, so nothing moves. Clean twin: `num_warmup_steps=0`.

    task(num_warmup_steps=10)  -> the planted bug
    task(num_warmup_steps=0)   -> the clean twin
"""

from __future__ import annotations

import random

import torch

import workbook as wb

LABELS = ["negative", "positive"]
WORDS = ["good", "great", "fine", "nice", "bad", "awful", "poor", "sad",
         "the", "a", "movie", "film", "plot", "was", "is", "very", "not", "really"]
VOCAB = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"] + WORDS


def sentences(n: int = 120, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = i % 2
        mood = rng.choice(WORDS[:4] if label else WORDS[4:8])
        filler = [rng.choice(WORDS[8:]) for _ in range(rng.randint(2, 6))]
        words = filler[: len(filler) // 2] + [mood] + filler[len(filler) // 2:]
        rows.append({"idx": i, "sentence": " ".join(words), "label": LABELS[label],
                     "review": f"review-{i}"})
    return rows


def tokenize(sentence: str) -> list[int]:
    ids = {w: i for i, w in enumerate(VOCAB)}
    return [1] + [ids.get(w, 3) for w in sentence.split()] + [2]


def encode(example: dict) -> dict[str, torch.Tensor]:
    ids = tokenize(example["sentence"])
    return {"input_ids": torch.tensor(ids),
            "attention_mask": torch.ones(len(ids), dtype=torch.long),
            "labels": torch.tensor(LABELS.index(example["label"]))}


def collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """DataCollatorWithPadding, written out: right padding with [PAD] = 0."""
    longest = max(len(f["input_ids"]) for f in features)
    batch = {"input_ids": torch.zeros(len(features), longest, dtype=torch.long),
             "attention_mask": torch.zeros(len(features), longest, dtype=torch.long)}
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        batch["input_ids"][row, :n] = f["input_ids"]
        batch["attention_mask"][row, :n] = 1
    batch["labels"] = torch.stack([f["labels"] for f in features])
    return batch


def build_model():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=32, num_labels=len(LABELS))
    return BertForSequenceClassification(config)


def task(num_warmup_steps: int = 10, max_train_steps: int = 200,
         weight_decay: float = 0.01) -> wb.Task:
    def build_optimizer(model, lr):
        # run_glue_no_trainer.py: "Split weights in two groups, one with weight decay and the
        # other not."
        no_decay = ["bias", "LayerNorm.weight"]
        optimizer_grouped_parameters = [
            {"params": [p for n, p in model.named_parameters()
                        if not any(nd in n for nd in no_decay)],
             "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters()
                        if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optimizer_grouped_parameters, lr=lr)

    def build_scheduler(optimizer):
        from transformers import get_scheduler

        return get_scheduler(name="linear", optimizer=optimizer,
                             num_warmup_steps=num_warmup_steps,
                             num_training_steps=max_train_steps)

    return wb.Task(
        name="glue-no-trainer", kind="classification", load_examples=sentences,
        encode=encode, collate=collate, build_model=build_model,
        decode=lambda ids: ", ".join(LABELS[int(i)] for i in ids),
        decode_input=lambda ids: " ".join(VOCAB[int(i)] for i in ids),
        id_key="idx", group_key="review", label_names=LABELS, label_field="label",
        model_inputs=("input_ids", "attention_mask"), build_optimizer=build_optimizer,
        build_scheduler=build_scheduler, lr=2e-3,
        options={"num_warmup_steps": num_warmup_steps})
