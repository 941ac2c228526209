"""What learning nothing from the inputs scores: the validation loss of a constant prediction,
the validation targets' own frequencies (their mean, for values), through the task's own loss.
No model that ignores its inputs does better on these examples, so a study whose best
validation loss does not clear it by a margin learned nothing a rate could be chosen by (a
random-labels task drifts a few hundredths below it at larger rates: fitting noise)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...base.errors import reason
from ...contract.data import Item
from ...contract.outputs import eval_mode
from ...contract.targets import contributes
from ...contract.task import Task
from ...training.evaluation import evaluation_batches

MARGIN = 0.05  # a best validation loss within this share of chance is no learning


@dataclass
class Chance:
    """The constant prediction's validation loss (None: not measured, `how` says why)."""

    loss: float | None
    how: str
    untrained: float | None = None  # the same examples' loss under the untrained model

    def learned(self, best_loss: float) -> bool:
        """Whether a validation loss clears chance by more than `MARGIN` of it."""
        return self.loss is None or best_loss < self.loss * (1 - MARGIN)


def constant(task: Task, items: list[Item]) -> torch.Tensor:
    """The constant prediction: log frequencies of the items' target ids (an id never seen
    there gets 1e-12), or the targets' mean for float targets."""
    targets = [task.targets(it.tensors["labels"]) for it in items]
    kept = torch.cat([t[contributes(t)].reshape(-1) for t in targets])
    if task.target_kind.float_targets:
        return kept.float().mean()
    counts = torch.bincount(kept.long()).float()
    return (counts / counts.sum()).clamp_min(1e-12).log()


@torch.no_grad()
def chance_loss(task: Task, items: list[Item], eval_batch: int,
                device: torch.device) -> Chance:
    """The validation loss of the constant prediction on `items`, in the task's own loss
    (the model runs once per batch, only for the shape of its output)."""
    try:
        value = constant(task, items).to(device)
        torch.manual_seed(0)
        model = task.build_model().to(device)
        summed = count = untrained = 0.0
        with eval_mode(model):
            for batch in evaluation_batches(task, items, eval_batch, device):
                logits = task.forward(model, batch.tensors).float()
                fixed = task.target_kind.constant_prediction(value, logits)
                loss, n = task.loss(fixed, batch.tensors)
                summed, count = summed + float(loss), count + float(n)
                untrained += float(task.loss(logits, batch.tensors)[0])
    except Exception as exc:  # a kind this reading does not fit (preference pairs)
        return Chance(None, f"not measured: {reason(exc, 120)}")
    if not count:
        return Chance(None, "not measured: no validation targets")
    what = "the mean of the targets" if not value.dim() else "the targets' own frequencies"
    return Chance(summed / count, f"the validation loss of a constant prediction ({what})",
                  untrained / count)
