"""`from_hf`: the pieces of a Hugging Face `Trainer` - model factory, tokenized train and eval
datasets, data collator, tokenizer and `TrainingArguments` - as a Task. The collator is the
user's own: it makes every batch and, one row at a time, every example's labels, so the pilot
checks the masking it really does (a collator that leaves pad ids in the labels shows in 01)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import WorkbookError, reason
from ..task import IGNORE_INDEX, Task, adamw

SPLITS = ("train", "validation", "test")
INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")
PROMPT = "prompt_mask"  # True on a row's prompt tokens (labels aligned with input_ids)


def _kind(model: nn.Module) -> tuple[str, int]:
    """(kind, label_shift) read from the model class: a causal LM (labels aligned with
    input_ids, shifted inside the model) or a sequence classifier."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "generation", 1
    if name.endswith("ForSequenceClassification"):
        return "classification", 0
    raise WorkbookError(f"from_hf maps causal LMs and sequence classifiers, not {name}",
                        "write a workbook.Task for it (README 'Bring your own task'); "
                        "seq2seq and token classification are not mapped yet")


def _rows(dataset: Any, split: str) -> Any:
    if dataset is None:
        return []
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise WorkbookError(f"the {split} dataset is a {type(dataset).__name__}, not a "
                            "map-style dataset (a datasets.Dataset or a list of dicts)",
                            "pass a datasets.Dataset (not an IterableDataset) or a list")
    if len(dataset) and not isinstance(dataset[0], dict):
        raise WorkbookError(f"rows of the {split} dataset are {type(dataset[0]).__name__}, not "
                            "dicts of token ids", "tokenize it first (dataset.map(tokenize))")
    if len(dataset) and "input_ids" not in dataset[0]:
        raise WorkbookError(f"rows of the {split} dataset have no input_ids (columns "
                            f"{sorted(dataset[0])})", "tokenize it first (dataset.map(tokenize))")
    return dataset


def _prompts(tokenizer: Any, response_template: str | None,
             first: dict) -> Callable[[dict], int] | None:
    """How many leading tokens of a row are its prompt: up to and including the first
    `response_template`, or the chat template's rendering of every message but the last with
    the generation prompt; 0 where it is not found (a completion-only collator then masks the
    whole row, which 01 names as an example without targets)."""
    if response_template is not None:
        marker = tokenizer(response_template, add_special_tokens=False)["input_ids"]
        if not marker:
            raise WorkbookError(f"the response template {response_template!r} tokenizes to "
                                "nothing", "give the text that starts every answer")

        def after_marker(row: dict) -> int:
            ids = list(row["input_ids"])
            for i in range(len(ids) - len(marker) + 1):
                if ids[i:i + len(marker)] == marker:
                    return i + len(marker)
            return 0
        return after_marker
    if "messages" in first and getattr(tokenizer, "chat_template", None):
        def chat_prompt(row: dict) -> int:
            rendered = tokenizer.apply_chat_template(
                row["messages"][:-1], add_generation_prompt=True, tokenize=True)
            prefix = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
            ids = list(row["input_ids"])
            return len(prefix) if ids[:len(prefix)] == prefix else 0
        return chat_prompt
    return None


def from_hf(model_factory: Callable[[], nn.Module], train_dataset: Any, eval_dataset: Any,
            data_collator: Callable, tokenizer: Any, args: Any = None, *, name: str,
            test_dataset: Any = None, group_column: str | None = None,
            label_column: str = "labels", response_template: str | None = None,
            **task_fields: Any) -> Task:
    """A Task over tokenized rows (dicts with input_ids; a `datasets.Dataset` or a list), the
    user's `data_collator` and `tokenizer` (decoding, padding side), `args` (a
    `TrainingArguments` or any object with `learning_rate`, `weight_decay`, `adam_beta1/2`,
    `adam_epsilon`) for the learning rate and AdamW. A causal LM keeps the Hugging Face
    convention (labels aligned with input_ids, `label_shift=1`; its loss is the model's own,
    summed over the targets of the whole update as `num_items_in_batch` does); a sequence
    classifier reads `label_column` and the model config's `id2label`. `group_column` names
    the unit of leakage (default: each row its own group). The prompt of a causal LM's row is
    found by `response_template` (the text that starts the answer, as a completion-only
    collator finds it) or, for rows with a `messages` column, by the tokenizer's chat template
    (every message but the last, with the generation prompt): 01 then checks the collator
    keeps it out of the loss (`prompt_in_loss=True` says it should be in). Other Task fields
    pass through."""
    try:
        with torch.device("meta"):
            probe = model_factory()
    except Exception as exc:
        raise WorkbookError(f"the model factory failed on the meta device: {reason(exc)}",
                            "pass a factory that builds the model from its config "
                            "(no download inside it)") from exc
    kind, shift = _kind(probe)
    data = {split: _rows(d, split) for split, d in zip(SPLITS, (train_dataset, eval_dataset,
                                                               test_dataset), strict=True)}
    if not len(data["train"]) or not len(data["validation"]):
        raise WorkbookError("from_hf needs a train and an eval dataset with rows",
                            "pass both (the pilot evaluates on the eval dataset)")
    id2label = getattr(probe.config, "id2label", None) or {}
    label_names = [str(id2label.get(i, i)) for i in range(probe.config.num_labels)] \
        if kind == "classification" else None

    own_labels = label_column in data["train"][0]  # else the collator makes them
    prompt_of = _prompts(tokenizer, response_template, data["train"][0]) \
        if kind == "generation" else None

    def tensors(row: dict) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(v) for k, v in row.items()
                if k in INPUTS or k == label_column}

    def collated(rows: list[dict]) -> dict[str, torch.Tensor]:
        # the rows as the dataset holds them: labels made by encode (from the collator) stay out
        given = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in r.items()
                  if (k != "labels" or own_labels) and k != PROMPT} for r in rows]
        try:
            out = dict(data_collator(given))
        except Exception as exc:
            raise WorkbookError(f"the data collator raised {type(exc).__name__}: {reason(exc)}",
                                "fix the collator, or pass the one your Trainer uses") from exc
        if label_column != "labels" and label_column in out:
            out["labels"] = out.pop(label_column)
        copies = [i for i, r in enumerate(rows) if "labels" in r and
                  bool((torch.as_tensor(r["labels"]) == IGNORE_INDEX).all())]
        if copies and "labels" in out:  # evaluation's padding copies weigh nothing, whatever
            out["labels"] = torch.as_tensor(out["labels"]).clone()  # the collator made
            out["labels"][copies] = IGNORE_INDEX
        if "labels" not in out:
            raise WorkbookError("the data collator returns no labels (keys "
                                f"{sorted(out)})", "use a collator that makes labels "
                                "(DataCollatorForLanguageModeling(tokenizer, mlm=False) for a "
                                "causal LM) or give the rows a labels column")
        out = {k: torch.as_tensor(v) for k, v in out.items()}
        if rows and all(PROMPT in r for r in rows):  # padded as the collator padded input_ids
            width = out["input_ids"].shape[1]
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for b, r in enumerate(rows):
                n = min(len(r[PROMPT]), width)
                if tokenizer.padding_side == "left":
                    mask[b, width - n:] = r[PROMPT][-n:] if n else False
                else:
                    mask[b, :n] = r[PROMPT][:n]
            out[PROMPT] = mask
        return out

    def encode(ex: dict) -> dict[str, torch.Tensor]:
        row = data[ex["split"]][ex["index"]]
        one = tensors(row)
        if "labels" not in one and label_column not in one:  # the collator's labels, one row
            one["labels"] = collated([one])["labels"][0]
        if label_column in one and label_column != "labels":
            one["labels"] = one.pop(label_column)
        if prompt_of is not None:
            one[PROMPT] = torch.arange(len(one["input_ids"])) < prompt_of(row)
        return one

    def load() -> list[dict]:
        rows = []
        for split, dataset in data.items():
            for i in range(len(dataset)):
                row = dataset[i]
                ex = {"id": f"{split}-{i}", "split": split, "index": i,
                      "group": str(row[group_column]) if group_column else f"{split}-{i}"}
                if kind == "classification":
                    ex["label"] = label_names[int(row[label_column])]
                rows.append(ex)
        return rows

    fields: dict[str, Any] = {"lr": getattr(args, "learning_rate", None)}
    if args is not None:
        def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
            return torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad], lr=lr,
                weight_decay=getattr(args, "weight_decay", 0.0),
                betas=(getattr(args, "adam_beta1", 0.9), getattr(args, "adam_beta2", 0.999)),
                eps=getattr(args, "adam_epsilon", 1e-8))
        fields["build_optimizer"] = build_optimizer
    else:
        fields["build_optimizer"] = adamw
    fields.update(task_fields)
    first = collated([encode({"split": "train", "index": 0})])
    def decode(ids) -> str:  # token ids, or a classifier's class ids, for people
        if kind == "generation":
            return tokenizer.decode([int(i) for i in ids if int(i) >= 0])
        return ", ".join(label_names[int(i)] if 0 <= int(i) < len(label_names)
                         else f"<{int(i)}?>" for i in ids)

    shown = {"decode": decode, "decode_input": lambda ids: tokenizer.decode([int(i) for i in ids])}
    generation = {"label_shift": shift, "padding_side": tokenizer.padding_side,
                  "prompt_in_loss": prompt_of is None and task_fields.get("prompt_field")
                  is None} \
        if kind == "generation" else {"label_names": label_names, "label_field": "label"}
    return Task(name=name, kind=kind, load_examples=load, encode=encode, collate=collated,
                build_model=model_factory, model_inputs=tuple(k for k in INPUTS if k in first),
                split_of=lambda ex: ex["split"], **{**shown, **generation, **fields})
