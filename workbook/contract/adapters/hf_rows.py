"""The rows of `from_hf`'s datasets as the Trainer holds them: a split checked to be tokenized
rows (`split_rows`), a split read by iterating (`RowStream`, never indexed nor held), a row that is
evaluation's padding (`padding_row`), and the batch a padding-free collator flattens, laid out
one row per example again (`unflattened`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ...base.errors import WorkbookError
from ..targets import IGNORE_INDEX
from .torch import Stream, streams


def split_rows(dataset: Any, split: str) -> Any:
    """A split's rows: none, a `RowStream`, or the indexed dataset with its first row checked."""
    if dataset is None:
        return []
    if streams(dataset):
        return RowStream(dataset, split)
    if len(dataset) and not isinstance(dataset[0], dict):
        raise WorkbookError(f"rows of the {split} dataset are {type(dataset[0]).__name__}, not "
                            "dicts of token ids", "tokenize it first (dataset.map(tokenize))")
    if len(dataset) and "input_ids" not in dataset[0]:
        raise no_input_ids(split, dataset[0])
    return dataset


# tokenized preference pairs, as TRL prepares them (and its legacy names): read by from_trainer
PAIRED = ("chosen_ids", "rejected_ids", "chosen_input_ids", "rejected_input_ids")


def no_input_ids(name: str, row: Mapping) -> WorkbookError:
    """The refusal of a row without input_ids, naming what the row holds instead: tokenized
    chosen / rejected pairs are a preference or reward trainer's, which from_trainer reads."""
    columns = sorted(row)
    paired = [c for c in PAIRED if c in row]
    if paired:
        return WorkbookError(f"rows of the {name} dataset are tokenized pairs ({', '.join(paired)}"
                             f"; columns {columns}), not single sequences with input_ids: "
                             "from_hf reads one sequence per row", "hand the trainer your "
                             "script builds to from_trainer (a RewardTrainer or DPOTrainer: "
                             "workbook.adapters.from_trainer(make_trainer, name=...)), which "
                             "reads its pairs")
    return WorkbookError(f"rows of the {name} dataset have no input_ids (columns {columns})",
                         "tokenize it first (dataset.map(tokenize))")


class RowStream(Stream):
    """A split of `from_hf` read by iterating (`torch.Stream`): each row checked to be a dict
    of columns, the first to have input_ids; a split may have none (from_hf refuses a train or
    eval split without rows)."""

    unit, may_be_empty = "row", True
    wants = ("a dataset (a datasets.Dataset, an IterableDataset or a list of dicts)",
             "the dataset your Trainer gets")
    again = ("a datasets.IterableDataset (load_dataset(..., streaming=True)), a torch "
             "IterableDataset or a class whose __iter__ opens the data anew")

    def __init__(self, dataset: Any, split: str):
        super().__init__(dataset, split)
        if self.first is not None and "input_ids" not in self.first:
            raise no_input_ids("eval" if split == "validation" else split, self.first)

    @staticmethod
    def named(split: str | None) -> str:
        return f"the {'eval' if split == 'validation' else split} dataset"

    def items(self) -> Iterator[tuple[int, dict]]:
        for i, row in super().items():
            if not isinstance(row, Mapping):
                raise WorkbookError(f"rows of {self.name} are {type(row).__name__}, not dicts "
                                    f"of token ids (row {i})",
                                    "tokenize it first (dataset.map(tokenize))")
            yield i, dict(row)


def train_rows(dataset: Any, args: Any) -> int:
    """The train rows the Trainer's own count of updates reads: a stream without a length
    needs `max_steps`, as the Trainer itself refuses one without it."""
    rows = dataset.length() if isinstance(dataset, RowStream) else len(dataset)
    if rows is None and not (getattr(args, "max_steps", -1) or -1) > 0:
        raise WorkbookError("from_hf: the train dataset is a stream without a length and the "
                            "TrainingArguments set no max_steps, which the Trainer refuses "
                            "too (it cannot count the updates of an epoch)",
                            "set max_steps=N in TrainingArguments: the updates the campaign "
                            "makes")
    return rows or 0


def first_row(dataset: Any) -> dict | None:
    """A split's first row (None: it has none)."""
    if isinstance(dataset, RowStream):
        return dataset.first
    return dataset[0] if len(dataset) else None


def padding_row(label: Any) -> bool:
    """A row whose label is -100 everywhere: padding (an eval set filled up to a multiple of
    the eval batch, as the Hugging Face convention pads), never an example."""
    if label is None:
        return False
    values = np.asarray(label)
    return values.size > 0 and values.dtype.kind in "iu" and bool((values == IGNORE_INDEX).all())


# what a padding-free collator adds for its one flattened row (FlashAttention's varlen
# arguments): it describes that layout only, and the model finds documents by position_ids
FLAT_LAYOUT = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def unflattened(collate: Callable, rows: list[dict], pad_id: int) -> dict:
    """The batch a padding-free collator (TRL's `padding_free`, packing "bfd") makes of
    `rows`, one row per example: it flattens every row into one sequence whose position_ids
    restart at each document, and the pilot counts and pads per example. Each row is collated
    alone and padded on the right (labels -100, positions 0: a padded position is a one-token
    document nobody attends to) - the same attention as the flattened batch."""
    parts = [dict(collate([r])) for r in rows]
    width = max(int(torch.as_tensor(p["input_ids"]).shape[-1]) for p in parts)
    fill = {"labels": IGNORE_INDEX, "input_ids": pad_id}
    out = {}
    for key in parts[0]:
        if key in FLAT_LAYOUT:
            continue
        pieces = [torch.as_tensor(p[key]) for p in parts]
        out[key] = torch.cat([nn.functional.pad(t, (0, width - t.shape[-1]),
                                                value=fill.get(key, 0)) for t in pieces])
    return out
