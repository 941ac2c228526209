"""The shape of one update, declared once for every layer: the contract's run being built
(`run.RunLength`), the loop's `TrainConfig`, the launches of notebook 09 and every notebook's
configuration embed it as `shape`. `training/loop.py` re-exports it (`loop.UpdateShape`,
`wb.UpdateShape`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..storage import schemas
from ..storage.schemas import Count, StrictBool

Precision = Literal["fp32", "bf16", "fp16"]  # PRECISIONS' names, as a file may hold them

# the precisions an update can run in, with the autocast dtype of each (None: no autocast)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
MIN_WORLD, MAX_WORLD = 2, 64  # the GPUs an FSDP world (notebook 08's sizing) spreads over
FIX = ("give micro_batch, accumulation and replicas of 1 or more, a precision of "
       f"{', '.join(PRECISIONS)} and activation_checkpointing True or False")


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
        """A shape stored as a dict (a recipe, a design, a launch's settings) back, checked."""
        return schemas.built(cls, data, "update shape", FIX)

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
        """The shape, its fields checked by their types (a WorkbookError naming each problem)."""
        return schemas.checked(self, "update shape", FIX)
