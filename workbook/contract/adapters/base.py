"""What every adapter is: a small class that reads a user's framework objects once, in
`__init__`, and gives the Task's fields as named steps, each a method that can be called and
tested alone:

- reading the datasets: `load_examples` (or `load_stream`) and `encode`;
- the batch structure: `collate`, and the batch as the user's code receives it;
- the optimizer and schedule: `build_optimizer`, `build_scheduler`;
- training and evaluation: `train_step`, `eval_step`;
- checkpoints: `save_state`, `restore_state`.

`task()` assembles the steps the framework has into a `Task`; the public `from_*` function
builds the adapter and returns its task. A step the framework does not own is left to the
workbook's default (the field stays None)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..task import Task


class Adapter:
    """A framework's code as a Task (see the module's docstring for the steps)."""

    def task(self) -> Task:
        raise NotImplementedError

    @staticmethod
    def unwrap(model: nn.Module) -> Any:
        """The user's module inside a DistributedDataParallel wrapper (09 passes one)."""
        return getattr(model, "module", model)
