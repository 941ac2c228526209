"""The update a Trainer makes with the user's own loss: a `compute_loss` their trainer class
defines, or the `compute_loss_func` they pass. `Trainer.training_step` is copied in what
decides the gradient - the update's target count as `num_items_in_batch`, the division by the
accumulation steps only for a loss not taken as normalised already, clipping at
`max_grad_norm` - so notebook 04 judges the loss code the campaign runs. A copy, not a call
of `trainer.training_step`: that call makes the same update bit for bit on the CPU, but it
moves the batch to `args.device` (04 steps a CPU copy of the model, also on a GPU machine) and
back-propagates through the trainer's accelerator (under `fp16` its GradScaler scales the loss
and only the trainer's own prepared optimizer unscales it), neither of which the pilot's model
and optimizer share."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# where the Trainer classes' own compute_loss live: an override from elsewhere is the user's
LIBRARIES = ("transformers.", "trl.")


def own_loss(trainer: Any) -> str | None:
    """How `trainer` computes its loss when it is the user's code, in words; None when it is
    the library's (the model's own loss, which the pilot computes from the logits)."""
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "the compute_loss_func it was given"
    defined = next(k for k in type(trainer).__mro__ if "compute_loss" in vars(k))
    if not defined.__module__.startswith(LIBRARIES):
        return f"{defined.__name__}.compute_loss"
    return None


class TrainerStep:
    """`train_step(model, optimizer, micro_batches)` as `Trainer.training_step` makes one
    update over them, calling the trainer's `compute_loss` on the pilot's model."""

    def __init__(self, trainer: Any, inputs: tuple[str, ...], shift: int):
        self.trainer, self.inputs, self.shift = trainer, (*inputs, "labels"), shift
        self.where = own_loss(trainer)
        self.described = f"the gradient of an update through {self.where}"  # for findings

    def _given(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: batch[k] for k in self.inputs if k in batch}

    def items(self, micro_batches: list[dict]) -> torch.Tensor:
        """The update's targets, counted as the Trainer counts `num_items_in_batch` (summed
        over the processes when the pilot runs several)."""
        count = sum(b["labels"][..., self.shift:].ne(-100).sum() for b in micro_batches)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(count)
        return count

    def scaled(self, num_items: Any) -> bool:
        """Whether the Trainer takes compute_loss's value as normalised already (not divided
        by the accumulation steps): its own rule, or the class's `loss_is_scaled_for_ga`."""
        trainer = self.trainer
        given = getattr(trainer, "loss_is_scaled_for_ga", None)
        if given is not None:
            return bool(given)
        return bool(getattr(trainer, "model_accepts_loss_kwargs", False) and
                    num_items is not None) or trainer.compute_loss_func is not None

    def loss(self, model: nn.Module, batch: dict, num_items: Any) -> torch.Tensor:
        value = self.trainer.compute_loss(model, self._given(batch),
                                          num_items_in_batch=num_items)
        return value[0] if isinstance(value, tuple) else value

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 micro_batches: list[dict]) -> torch.Tensor:
        model.train()
        num_items = self.items(micro_batches)
        divide = 1 if self.scaled(num_items) else len(micro_batches)
        total = torch.zeros(())
        for batch in micro_batches:
            loss = self.loss(model, batch, num_items) / divide
            loss.backward()
            total = total + loss.detach().float().cpu()
        clip = getattr(self.trainer.args, "max_grad_norm", None)
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    def explain_split(self, model: nn.Module, micro_batches: list[dict]) -> str | None:
        """Why this update's gradient depends on how it is split, in the Trainer's terms: a
        compute_loss whose value does not depend on `num_items_in_batch` returns each
        micro-batch's own mean (transformers#37766)."""
        batch = micro_batches[0]
        n = self.items([batch])
        with torch.no_grad():
            one, two = (float(self.loss(model, batch, n * k)) for k in (1, 2))
        if abs(one - two) > 1e-6 * max(abs(one), 1e-12):
            return None  # it divides by what it is given: the cause is elsewhere
        if self.scaled(n):
            return (f"{self.where} ignores num_items_in_batch: it returns each micro-batch's "
                    "own mean, and the Trainer, which takes the loss of a model that accepts "
                    "loss kwargs as normalised already, does not divide it by the "
                    "accumulation steps (transformers#37766) - every update's gradient is "
                    "about gradient_accumulation_steps times too large and micro-batches "
                    "with few targets weigh as much as full ones: sum the per-token losses "
                    "and divide by num_items_in_batch when it is given")
        return (f"{self.where} ignores num_items_in_batch: it returns each micro-batch's own "
                "mean and the Trainer divides it by the accumulation steps, so micro-batches "
                "with few targets weigh as much as full ones: sum the per-token losses and "
                "divide by num_items_in_batch when it is given")
