"""Why a training update raised, in words that name the cause: batch norm given a micro-batch
of one example, a carried state still attached to the previous batch's graph."""

from __future__ import annotations

from typing import Any

from ..base.errors import WorkbookError
from ..contract.data import Batch
from ..contract.state import not_detached
from ..contract.task import Task


def update_failure(exc: Exception, task: Task, batches: list[Batch], examples: int | None,
                   shape: Any) -> WorkbookError | None:
    """The error to show for an update that raised `exc`, or None to let it pass as it is."""
    return single_example_batch_norm(exc, batches, examples, shape) or \
        not_detached(exc, task.state)


def single_example_batch_norm(exc: Exception, batches: list[Batch], examples: int | None,
                              shape: Any) -> WorkbookError | None:
    """The error to show when batch norm refused a micro-batch of one example in training (the
    last micro-batch of a pass): the campaign meets it at the same place, so say where."""
    text = str(exc.__cause__ or exc) if isinstance(exc, WorkbookError) else str(exc)
    if "Expected more than 1 value per channel when training" not in text:
        return None
    sizes = [len(b) for b in batches]
    return WorkbookError(
        f"batch norm cannot train on a micro-batch of 1 example (this update's micro-batches "
        f"hold {sizes}: {examples} training examples in updates of {shape.micro_batch} x "
        f"{shape.accumulation} leave one over at the end of each pass) - the campaign "
        "meets the same at the end of every pass",
        "drop the partial update (drop_partial=True, DataLoader drop_last=True), or choose a "
        "micro-batch or number of examples that leaves no single example")
