"""A Hugging Face text classifier set up as the Transformers docs' "Text classification"
tutorial writes it, handed to `workbook.adapters.from_hf` as it stands - no hub download: a
tiny `BertForSequenceClassification` built from its config through
`AutoModelForSequenceClassification.from_config`, a word-level tokenizer built in memory
(`examples.hf_trainer.tokenizer_from`), the classification sample's posts in
`datasets.Dataset.from_dict` with a `text` and a `label` column, `dataset.map(preprocess_function,
batched=True)`, `DataCollatorWithPadding` (or a custom collator reading `f["label"]`), a numpy
`compute_metrics` over an `EvalPrediction`, `TrainingArguments` with `lr_scheduler_type="cosine"`
and a 10% warm-up, and a `TrainerCallback` that writes a record at every checkpoint. The eval
set is padded to a multiple of `per_device_eval_batch_size` with rows whose label is -100.

    python -m workbook pilot --task examples.hf_docs:task --smoke

Clean by default. Planted bugs, each one the pilot names:
  `metrics_count_padding=True` - compute_metrics does not leave out the rows with label -100,
      which Trainer.evaluate hands it: the reported accuracy counts the padding as wrong;
  `collator_drops_mask=True` - the custom collator pads input_ids but returns no
      attention_mask: the model attends to the padding (01: padding changes outputs);
  `save_only_model=True` - checkpoints without optimizer and schedule (07: resume);
  `callback_raises=True` - the callback's on_save reads kwargs["tokenizer"], which the Trainer
      of transformers 5 passes as processing_class (named at the first checkpoint);
  `max_length=3` - preprocess_function truncates every post to its first 3 tokens ([CLS],
      two words, [SEP]): distinct posts become identical inputs, some in both splits (01 names
      the truncation, not only the duplicates). The default, 32, cuts posts too and makes no
      duplicate: nothing to name.
Clean twin: `callback_eval=True` - the callback calls model.eval() in on_step_end and
on_evaluate, which the Trainer undoes (training_step calls model.train() before every update).
"""

from __future__ import annotations

import json
import os

import numpy as np

import workbook as wb
from workbook.samples import DATA_DIR

EVAL_BATCH = 16


def accuracy_and_f1(predictions: np.ndarray, labels: np.ndarray, classes: int) -> dict:
    """What `evaluate.load("accuracy")` and `evaluate.load("f1")` (average="macro") compute,
    in numpy."""
    accuracy = float((predictions == labels).mean()) if len(labels) else 0.0
    f1 = []
    for c in range(classes):
        tp = int(((predictions == c) & (labels == c)).sum())
        fp = int(((predictions == c) & (labels != c)).sum())
        fn = int(((predictions != c) & (labels == c)).sum())
        f1.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return {"accuracy": accuracy, "f1": float(np.mean(f1))}


def metrics_for(classes: int, count_padding: bool = False, f1: bool = False):
    def compute_metrics(eval_pred):
        predictions, labels = eval_pred
        predictions = np.argmax(predictions, axis=1)
        if not count_padding:  # the padding rows carry label -100: they are no examples
            mask = labels != -100
            predictions, labels = predictions[mask], labels[mask]
        got = {**accuracy_and_f1(predictions, labels, classes), "n_examples": len(labels)}
        return got if f1 else {k: got[k] for k in ("accuracy", "n_examples")}
    return compute_metrics


class PadCollator:
    """A custom collator as the docs write one: pad the token ids, take the labels from
    `f["label"]`. `drop_mask=True` is the planted bug: no attention_mask in the batch."""

    def __init__(self, tokenizer, drop_mask: bool = False):
        self.tokenizer, self.drop_mask = tokenizer, drop_mask

    def __call__(self, features):
        import torch

        batch = self.tokenizer.pad([{"input_ids": f["input_ids"],
                                     "attention_mask": f["attention_mask"]} for f in features],
                                   return_tensors="pt")
        if self.drop_mask:
            del batch["attention_mask"]
        batch["labels"] = torch.tensor([f["label"] for f in features])
        return dict(batch)


def save_record_callback(raises: bool = False, evaluates: bool = False):
    from transformers import TrainerCallback

    class SaveRecordCallback(TrainerCallback):
        """Writes the step and learning rate beside every checkpoint, as a user's own record
        of the run (`events` keeps what was called, for tests)."""

        def __init__(self):
            self.events = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.events.append(("on_train_begin", state.global_step))

        def on_step_end(self, args, state, control, **kwargs):
            self.events.append(("on_step_end", state.global_step))
            if evaluates:  # harmless: the Trainer's training_step calls model.train()
                kwargs["model"].eval()

        def on_evaluate(self, args, state, control, **kwargs):
            if evaluates:
                kwargs["model"].eval()

        def on_save(self, args, state, control, **kwargs):
            self.events.append(("on_save", state.global_step))
            tokenizer = kwargs["tokenizer"] if raises else kwargs["processing_class"]
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "record.json"), "w") as f:
                json.dump({"global_step": state.global_step, "vocab": len(tokenizer),
                           "lr": kwargs["lr_scheduler"].get_last_lr()[0]}, f)

    return SaveRecordCallback()


def trainer_pieces(examples: int = 600, collator: str = "padding",
                   metrics_count_padding: bool = False, collator_drops_mask: bool = False,
                   save_only_model: bool = False, callback_raises: bool = False,
                   f1: bool = False, arch: str = "bert", max_length: int = 32,
                   callback_eval: bool = False) -> dict:
    """What `transformers.Trainer(...)` receives, the docs' way."""
    from datasets import Dataset
    from transformers import (
        AutoModelForSequenceClassification,
        BertConfig,
        DataCollatorWithPadding,
        LlamaConfig,
        TrainingArguments,
    )

    from examples.hf_trainer import tokenizer_from

    rows = wb.read_jsonl(DATA_DIR / "classification.jsonl")[:examples]
    label2id = json.loads((DATA_DIR / "classification_labels.json").read_text())
    id2label = {i: name for name, i in label2id.items()}
    tokenizer = tokenizer_from([r["text"] for r in rows])

    def preprocess_function(examples):
        return tokenizer(examples["text"], truncation=True, max_length=max_length)

    # split by author: an author's posts share their words
    train = [r for r in rows if int(r["author"][6:]) % 10 < 8]
    evaluation = [r for r in rows if int(r["author"][6:]) % 10 >= 8]
    short = -len(evaluation) % EVAL_BATCH  # padded to a multiple of the eval batch
    columns = {"train": train, "eval": evaluation}
    datasets = {}
    for split, part in columns.items():
        pad = short if split == "eval" else 0
        datasets[split] = Dataset.from_dict({
            "text": [r["text"] for r in part] + [tokenizer.pad_token] * pad,
            "label": [label2id[r["label"]] for r in part] + [-100] * pad,
            "author": [r["author"] for r in part] + ["padding"] * pad,
        }).map(preprocess_function, batched=True)

    sizes = {"vocab_size": len(tokenizer), "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 64,
             "pad_token_id": tokenizer.pad_token_id, "num_labels": len(label2id),
             "id2label": id2label, "label2id": label2id}
    config = BertConfig(**sizes) if arch == "bert" else LlamaConfig(**sizes,
                                                                    num_key_value_heads=2)
    warmup = ({"warmup_ratio": 0.1} if "warmup_ratio" in TrainingArguments.__dataclass_fields__
              else {"warmup_steps": 0.1})  # transformers 5 reads a float below 1 as a ratio
    training_args = TrainingArguments(
        output_dir="my_awesome_model", learning_rate=3e-3, per_device_train_batch_size=16,
        per_device_eval_batch_size=EVAL_BATCH, num_train_epochs=2, weight_decay=0.01,
        lr_scheduler_type="cosine", eval_strategy="epoch", save_strategy="epoch",
        save_only_model=save_only_model, report_to="none", use_cpu=True, **warmup)
    data_collator = PadCollator(tokenizer, drop_mask=collator_drops_mask) \
        if collator == "custom" or collator_drops_mask else DataCollatorWithPadding(tokenizer)
    return {"model_init": lambda: AutoModelForSequenceClassification.from_config(config),
            "args": training_args, "train_dataset": datasets["train"],
            "eval_dataset": datasets["eval"], "processing_class": tokenizer,
            "data_collator": data_collator,
            "compute_metrics": metrics_for(len(label2id), metrics_count_padding, f1),
            "callbacks": [save_record_callback(callback_raises, callback_eval)]}


def make_task(examples: int = 600, collator: str = "padding",
              metrics_count_padding: bool = False, collator_drops_mask: bool = False,
              save_only_model: bool = False, callback_raises: bool = False,
              f1: bool = False, arch: str = "bert", max_length: int = 32,
              callback_eval: bool = False) -> wb.Task:
    """`arch="llama"`: the same pieces on a tiny LlamaForSequenceClassification."""
    p = trainer_pieces(examples, collator, metrics_count_padding, collator_drops_mask,
                       save_only_model, callback_raises, f1, arch, max_length, callback_eval)
    return wb.adapters.from_hf(p["model_init"], p["train_dataset"], p["eval_dataset"],
                               p["data_collator"], p["processing_class"], p["args"],
                               name="hf-docs", group_column="author",
                               compute_metrics=p["compute_metrics"], callbacks=p["callbacks"])


task = make_task
