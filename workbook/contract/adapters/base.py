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

from typing import Any, ClassVar

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

    def train(self, mode: bool = True) -> "BesideReference":
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()
        return self
