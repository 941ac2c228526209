"""Record types: every measurement is one small dataclass, stored and shown as a table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd


@dataclass
class StepRecord:
    """One optimizer update of the training loop."""

    step: int
    epoch: int
    micro_batches: int
    examples: int
    targets: int
    loss: float
    lr: float
    grad_norm: float
    time_s: float
    data_s: float
    example_ids: list[Any] = field(default_factory=list)


@dataclass
class EvalRecord:
    """One evaluation at a fixed step: loss and metrics over exactly the examples given."""

    step: int
    examples: int
    targets: int
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    per_class: dict[str, list[int]] = field(default_factory=dict)  # class -> [correct, total]
    # the task's averaged model (Task.averaged_model) on the same examples: "loss" and metrics
    averaged: dict[str, float] = field(default_factory=dict)


@dataclass
class Flag:
    """A check that found a problem: what, how many, which examples, and the fix."""

    check: str
    message: str
    count: int
    fix: str
    examples: list[Any] = field(default_factory=list)


def to_frame(records: list[Any]) -> pd.DataFrame:
    """Records -> DataFrame; nested metric dicts become `metric.<name>` columns, an averaged
    model's `averaged_model.<name>` columns."""
    rows = []
    for record in records:
        row = asdict(record)
        for name, value in row.pop("metrics", {}).items():
            row[f"metric.{name}"] = value
        for name, value in row.pop("averaged", {}).items():
            row[f"averaged_model.{name}"] = value
        row.pop("per_class", None)
        rows.append(row)
    return pd.DataFrame(rows)
