"""The run being built, as a task's own factories see it: the loop sets it around the task's
`build_optimizer` / `build_scheduler`; the framework adapters size their schedules by it."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from .shape import UpdateShape

DEFAULT_UPDATES = 200  # a run's optimizer steps when nothing says otherwise (TrainConfig.updates)
EXAMPLE_WEIGHT = "example_weight"  # evaluation batches: 1 per real example, 0 per padding copy


@dataclass(frozen=True)
class RunLength:
    """The run whose optimizer and schedule are being built: what a task's `build_optimizer` /
    `build_scheduler` may size a schedule by (Lightning's `estimated_stepping_batches`, a
    Trainer's `num_training_steps`). `examples` is None where the run's data is not known
    (a stepper built outside `train`)."""

    updates: int
    shape: UpdateShape
    examples: int | None = None
    drop_partial: bool = False


_RUN: contextvars.ContextVar[RunLength | None] = contextvars.ContextVar("run", default=None)


def current_run() -> RunLength | None:
    """The run being built while `build_stepper` calls the task's optimizer and schedule
    factories; None anywhere else."""
    return _RUN.get()


def building(run: RunLength) -> contextvars.Token:
    """Set the run being built (the loop's `build_stepper`); reset it with `done(token)`."""
    return _RUN.set(run)


def done(token: contextvars.Token) -> None:
    _RUN.reset(token)
