"""Sample classification task: short texts in five classes, one of them rare (about 4%).

The class map comes from an explicit file (class name -> id); groups are authors, and every
example carries a timestamp.
"""

from __future__ import annotations

import json
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from ..base.errors import WorkbookError
from ..contract.data import JsonlRows
from ..contract.task import Task
from . import DATA_DIR
from . import tokenizer as tok
from .ghost_batch_norm import GhostBatchNorm
from .models import TrigramClassifier


def read_label_map(path) -> dict[str, int]:
    """Class name -> id, checked to be the ids 0..K-1 exactly once each."""
    mapping = json.loads(open(path, encoding="utf-8").read())
    if sorted(mapping.values()) != list(range(len(mapping))):
        raise WorkbookError(f"label map {path} ids are not 0..{len(mapping) - 1} once each",
                            "number the classes 0, 1, 2, ... without gaps or repeats")
    return mapping


def encode(example: dict, label_map: dict[str, int], max_length: int) -> dict[str, Tensor]:
    """Text bytes (cut to `max_length`) and the class id of the raw label."""
    label = example["label"]
    if label not in label_map:
        raise WorkbookError(f"class {label!r} is not in the label map",
                            "add it to classification_labels.json")
    return {"input_ids": torch.tensor(tok.encode(example["text"])[:max_length]),
            "labels": torch.tensor(label_map[label])}


def collate(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right-pad texts with <pad>; the attention mask is 0 on padding; labels stack."""
    ones = [torch.ones_like(it["input_ids"]) for it in items]
    return {"input_ids": pad_sequence([it["input_ids"] for it in items], batch_first=True,
                                      padding_value=tok.PAD),
            "attention_mask": pad_sequence(ones, batch_first=True, padding_value=0),
            "labels": torch.stack([it["labels"] for it in items])}


def build_model(classes: int, d_model: int, dropout: float, batch_norm: str,
                virtual_batch: int) -> TrigramClassifier:
    """The classifier, with no norm, batch norm or ghost batch norm on the pooled features."""
    norms = {"none": lambda: None, "batch": lambda: nn.BatchNorm1d(d_model),
             "ghost": lambda: GhostBatchNorm(d_model, virtual_batch)}
    return TrigramClassifier(tok.VOCAB_SIZE, classes, d_model, dropout=dropout,
                             norm=norms[batch_norm]())


def make_task(max_length: int = 128, d_model: int = 64, dropout: float = 0.1,
              batch_norm: str = "none", virtual_batch: int = 4, data_file: str = "",
              label_file: str = "") -> Task:
    """The classification sample; options change truncation, model size, normalisation
    ("none", "batch" or "ghost" with `virtual_batch` examples per statistic) and the files."""
    if batch_norm not in ("none", "batch", "ghost"):
        raise WorkbookError(f"batch_norm {batch_norm!r} is not known",
                            "use 'none', 'batch' or 'ghost'")
    label_map = read_label_map(label_file or DATA_DIR / "classification_labels.json")
    names = [name for name, _ in sorted(label_map.items(), key=lambda kv: kv[1])]
    return Task(
        name="sample-classification",
        kind="classification",
        load_examples=partial(JsonlRows, data_file or DATA_DIR / "classification.jsonl"),
        encode=partial(encode, label_map=label_map, max_length=max_length),
        collate=collate,
        build_model=partial(build_model, len(names), d_model, dropout, batch_norm,
                            virtual_batch),
        decode=lambda ids: ", ".join(names[int(i)] if 0 <= int(i) < len(names) else f"<{i}?>"
                                     for i in ids),
        decode_input=tok.decode,
        group_key="author",
        label_names=names,
        label_field="label",
    )


task = make_task
