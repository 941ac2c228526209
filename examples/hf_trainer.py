"""A Hugging Face Trainer setup piloted in one call: a word-level tokenizer built in memory (no
download), the generation sample's conversations tokenized with `tokenizer(...)` into in-memory
`datasets.Dataset`s, a tiny `LlamaForCausalLM` from its config,
`DataCollatorForLanguageModeling(tokenizer, mlm=False)` and `TrainingArguments` - handed to
`workbook.adapters.from_hf` as they are. Needs
`pip install -e .[hf]`.

    python -m workbook pilot --task examples.hf_trainer:task --smoke
    python -m workbook pilot --task examples.hf_trainer:classifier --smoke   (a classifier)

Planted bugs: `pad_in_labels=True` (a collator that copies input_ids into labels without masking
the padding: notebook 01 names targets on padding), `lr_typo=True` (learning_rate 1e4 instead
of 1e-2: notebook 02 names the diverging learning rate), `pad_is_eos=True` (the blog posts'
`tokenizer.pad_token = tokenizer.eos_token`: the collator masks every pad id, so the EOS that
ends each response is never a target and the model never learns to stop; 01 names it).
"""

from __future__ import annotations

import workbook as wb
from workbook.samples import DATA_DIR


def tokenizer_from(texts: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for t in texts for w in t.split()} - {"<pad>", "<unk>", "<eos>"})
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                   unk_token="<unk>", eos_token="<eos>")


class CopyCollator:
    """The planted collator: labels are input_ids as padded, pad ids included."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, rows):
        batch = self.tokenizer.pad([{k: r[k] for k in ("input_ids", "attention_mask")}
                                    for r in rows], return_tensors="pt")
        batch["labels"] = batch["input_ids"].clone()
        return batch


def trainer_pieces(conversations: int = 400, pad_in_labels: bool = False,
                   lr_typo: bool = False, template: str | None = None,
                   pad_is_eos: bool = False) -> dict:
    """What `transformers.Trainer(...)` receives: model_init, datasets, collator, tokenizer,
    arguments (benchmarks/frameworks.py hands them to the Trainer itself)."""
    from datasets import Dataset
    from transformers import (
        DataCollatorForLanguageModeling,
        LlamaConfig,
        LlamaForCausalLM,
        TrainingArguments,
    )

    rows = wb.read_jsonl(DATA_DIR / "generation.jsonl")[:conversations]
    texts = [" ".join([r["instruction"], *([template] if template else []), r["response"]])
             for r in rows]
    tokenizer = tokenizer_from(texts)
    if pad_is_eos:
        tokenizer.pad_token = tokenizer.eos_token
    tokenized = [{**tokenizer(t + " <eos>", truncation=True, max_length=48),
                  "conversation": r["conversation"]} for t, r in zip(texts, rows, strict=True)]
    # split by conversation, not by row: rows of one conversation share their words (the
    # pilot's 01 names 53 conversations in both splits when split by row)
    train = [r for r in tokenized if int(r["conversation"][4:]) % 10 < 8]
    evaluation = [r for r in tokenized if int(r["conversation"][4:]) % 10 >= 8]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    args = TrainingArguments(output_dir="hf-trainer-out", learning_rate=1e4 if lr_typo else 1e-2,
                             weight_decay=0.01, per_device_train_batch_size=8, report_to="none",
                             use_cpu=True)
    collator = CopyCollator(tokenizer) if pad_in_labels else \
        CompletionOnlyCollator(tokenizer, template) if template else \
        DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return {"model_init": lambda: LlamaForCausalLM(config),
            "train_dataset": Dataset.from_list(train), "eval_dataset": Dataset.from_list(
                evaluation), "data_collator": collator, "processing_class": tokenizer,
            "args": args}


def make_task(conversations: int = 400, pad_in_labels: bool = False,
              lr_typo: bool = False, pad_is_eos: bool = False) -> wb.Task:
    p = trainer_pieces(conversations, pad_in_labels, lr_typo, pad_is_eos=pad_is_eos)
    return wb.adapters.from_hf(p["model_init"], p["train_dataset"], p["eval_dataset"],
                               p["data_collator"], p["processing_class"], p["args"],
                               name="hf-trainer", group_column="conversation")


task = make_task


def classifier_pieces(examples: int = 600) -> dict:
    """A sequence classifier's Trainer pieces: the classification sample's texts tokenized,
    `LlamaForSequenceClassification` with the sample's label names, `DataCollatorWithPadding`;
    split by author (an author's posts share their words)."""
    import json

    from datasets import Dataset
    from transformers import (
        DataCollatorWithPadding,
        LlamaConfig,
        LlamaForSequenceClassification,
        TrainingArguments,
    )

    rows = wb.read_jsonl(DATA_DIR / "classification.jsonl")[:examples]
    label2id = json.loads((DATA_DIR / "classification_labels.json").read_text())
    tokenizer = tokenizer_from([r["text"] for r in rows])
    tokenized = [{**tokenizer(r["text"], truncation=True, max_length=32),
                  "labels": label2id[r["label"]], "author": r["author"]} for r in rows]
    train = [r for r in tokenized if int(r["author"][6:]) % 10 < 8]
    evaluation = [r for r in tokenized if int(r["author"][6:]) % 10 >= 8]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                         num_labels=len(label2id), label2id=label2id,
                         id2label={i: name for name, i in label2id.items()})
    args = TrainingArguments(output_dir="hf-classifier-out", learning_rate=3e-3,
                             weight_decay=0.01, per_device_train_batch_size=8, report_to="none",
                             use_cpu=True)
    return {"model_init": lambda: LlamaForSequenceClassification(config),
            "train_dataset": Dataset.from_list(train),
            "eval_dataset": Dataset.from_list(evaluation),
            "data_collator": DataCollatorWithPadding(tokenizer), "processing_class": tokenizer,
            "args": args}


def make_classifier(examples: int = 600) -> wb.Task:
    p = classifier_pieces(examples)
    return wb.adapters.from_hf(p["model_init"], p["train_dataset"], p["eval_dataset"],
                               p["data_collator"], p["processing_class"], p["args"],
                               name="hf-classifier", group_column="author")


classifier = make_classifier


ANSWER = "### Answer:"


class CompletionOnlyCollator:
    """Supervised fine-tuning as TRL's completion-only collator does it: the language-modelling
    collator's labels, -100 up to and including the response template (the prompt)."""

    def __init__(self, tokenizer, response_template: str = ANSWER):
        from transformers import DataCollatorForLanguageModeling

        self.lm = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        self.marker = tokenizer(response_template, add_special_tokens=False)["input_ids"]

    def __call__(self, rows):
        batch = self.lm(rows)
        for b, ids in enumerate(batch["input_ids"].tolist()):
            k = len(self.marker)
            ends = [i + k for i in range(len(ids) - k + 1) if ids[i:i + k] == self.marker]
            batch["labels"][b, : ends[0] if ends else len(ids)] = -100
        return batch


def make_sft(conversations: int = 400, prompt_in_labels: bool = False) -> wb.Task:
    """Supervised fine-tuning: "instruction ### Answer: response" rows, the prompt masked by
    CompletionOnlyCollator. The pilot finds the prompt by the same `response_template`, so 01
    checks the masking the collator really does. Planted: `prompt_in_labels` (the plain
    language-modelling collator: the prompt is trained on; 01 names it)."""
    from transformers import DataCollatorForLanguageModeling

    p = trainer_pieces(conversations, template=ANSWER)
    if prompt_in_labels:
        p["data_collator"] = DataCollatorForLanguageModeling(p["processing_class"], mlm=False)
    return wb.adapters.from_hf(p["model_init"], p["train_dataset"], p["eval_dataset"],
                               p["data_collator"], p["processing_class"], p["args"],
                               name="hf-sft", group_column="conversation",
                               response_template=ANSWER)


sft = make_sft
