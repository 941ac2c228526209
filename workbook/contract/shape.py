"""The shape of one update, declared once for every layer: the contract's run being built
(`run.RunLength`), the loop's `TrainConfig`, the launches of notebook 09 and every notebook's
configuration embed it as `shape`. `training/loop.py` re-exports it (`loop.UpdateShape`,
`wb.UpdateShape`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..base.errors import WorkbookError
from ..storage.schemas import Count, StrictBool

Precision = Literal["fp32", "bf16", "fp16"]  # PRECISIONS' names, as a file may hold them

# the precisions an update can run in, with the autocast dtype of each (None: no autocast)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

@dataclass(frozen=True)
class UpdateShape:
    """The shape of one update, the one declaration embedded by every configuration that trains
    or sizes one (the loop's `TrainConfig`, the gates' settings, memory variants, rental
    candidates, the study design, the data-parallel launch): micro-batch x accumulation x
    replicas, the precision and activation checkpointing. The sequence length belongs to the
    sized batches (`predict.Plan`), not to the update: the loop trains on the examples as the
    task encodes them."""

    micro_batch: Count = 2  # examples per forward/backward pass (per replica)
    accumulation: Count = 1  # passes combined into one update
    precision: Precision = "fp32"  # "fp32", "bf16" (autocast) or "fp16" (autocast +
    # GradScaler, CUDA)
    activation_checkpointing: StrictBool = False  # recompute the task's blocks in backward
    replicas: Count = 1  # data-parallel processes, each making micro_batch x accumulation

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UpdateShape:
        """A shape stored as a dict (a recipe, a design, a launch's settings) back."""
        if not isinstance(data, dict):
            raise WorkbookError(f"an update shape must be an object, got {str(data)[:80]!r}",
                                'give it as {"micro_batch": 2, "accumulation": 8, ...}')
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise WorkbookError(f"unknown update-shape fields {unknown}",
                                f"use {sorted(cls.__dataclass_fields__)}")
        return cls(**data).validate()

    @classmethod
    def nested(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A stored configuration with its shape under "shape": one written before the shape
        was one field (flat micro_batch, accumulation, ...) is moved there."""
        if not isinstance(data, dict) or "shape" in data:
            return data
        fields = cls.__dataclass_fields__
        return {**{k: v for k, v in data.items() if k not in fields},
                "shape": {k: v for k, v in data.items() if k in fields}}

    @property
    def examples_per_update(self) -> int:
        return self.micro_batch * self.accumulation * self.replicas

    def validate(self) -> UpdateShape:
        for name in ("micro_batch", "accumulation", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WorkbookError(f"{name} must be a positive integer, got {value!r}",
                                    f"set {name} to 1 or more")
        if self.precision not in PRECISIONS:
            raise WorkbookError(f"unknown precision {self.precision!r}",
                                f"use one of {list(PRECISIONS)}")
        if not isinstance(self.activation_checkpointing, bool):
            raise WorkbookError("activation_checkpointing must be True or False, got "
                                f"{self.activation_checkpointing!r}", "set it to True or False")
        return self
