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

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from ...base.errors import WorkbookError
from ..task import Task

RATES = ("lr", "initial_lr", "max_lr", "min_lr")  # group keys a scheduler reads its rate from


def rescale(optimizer: torch.optim.Optimizer, scheduler: Any, ratio: float) -> None:
    """Every rate the user's code configured times `ratio` (the study's lr over their own):
    the groups keep their ratios and the schedule (None: none yet) its shape."""
    for group in optimizer.param_groups:
        for key in RATES:
            if isinstance(group.get(key), (int, float, torch.Tensor)):
                group[key] = group[key] * ratio
    for name in ("base_lrs", "_last_lr"):
        if isinstance(getattr(scheduler, name, None), list):
            setattr(scheduler, name, [v * ratio for v in getattr(scheduler, name)])


class Adapter:
    """A framework's code as a Task (see the module's docstring for the steps)."""

    def task(self) -> Task:
        raise NotImplementedError

    @staticmethod
    def unwrap(model: nn.Module) -> Any:
        """The user's module inside a DistributedDataParallel wrapper (09 passes one)."""
        return getattr(model, "module", model)


class SplitRows(Adapter):
    """An adapter whose examples are the rows of a trainer's prepared datasets, one per split
    (`data`, train first), each row's group read from `group_column` (TRL keeps a dataset's
    columns)."""

    data: dict[str, Any]
    group_column: str | None

    def check_columns(self, trainer: str, needed: tuple[str, ...], fix: str) -> None:
        """Refuse rows of `data` that lack a `needed` column (`fix` says how to give them) or
        the group column."""
        group = self.group_column
        for split, rows in self.data.items():
            columns = getattr(rows, "column_names", None) or []
            missing = [c for c in needed if c not in columns]
            if missing:
                raise WorkbookError(f"the {trainer}'s prepared {split} rows lack {missing} "
                                    f"(columns {columns})", fix)
            if group is not None and group not in columns:
                raise WorkbookError(f"the {trainer}'s prepared {split} rows have no {group!r} "
                                    f"column (columns {columns})",
                                    f"keep {group!r} in the dataset you give the trainer")

    def examples(self, **fields: Any) -> list[dict]:
        """Every row of every split as an example carrying `fields`; the group column read
        once per split, not row by row."""
        return [{"id": f"{split}-{i}", "split": split, "index": i, **fields,
                 "group": str(groups[i]) if groups is not None else f"{split}-{i}"}
                for split, rows in self.data.items()
                for groups in [rows[self.group_column] if self.group_column else None]
                for i in range(len(rows))]

    @staticmethod
    def split_of(ex: dict) -> str:
        return ex["split"]


class BesideReference(nn.Module):
    """A policy and its reference as one model (DPO's pair, GRPO's policy): the reference,
    when there is one, is frozen and stays in eval mode whatever mode the model is put in; the
    attributes named in `SHARED` (the PEFT adapters) are the policy's."""

    SHARED: ClassVar[tuple[str, ...]] = ("peft_config", "disable_adapter")

    def __init__(self, policy: nn.Module, reference: nn.Module | None):
        super().__init__()
        self.policy, self.reference = policy, reference
        if reference is not None:
            reference.requires_grad_(False)

    def __getattr__(self, name: str) -> Any:
        if name in type(self).SHARED:
            return getattr(self._modules["policy"], name)
        return super().__getattr__(name)

    def on_reference(self, run: Callable[[nn.Module], Any]) -> Any:
        """`run(reference)`: its frozen copy, or the policy with its adapters off."""
        if self.reference is not None:
            return run(self.reference)
        with self.policy.disable_adapter():
            return run(self.policy)

    def train(self, mode: bool = True) -> "BesideReference":
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()
        return self
