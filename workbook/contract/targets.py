"""What a loss is given and counts: the "no target" label, label shifts, and the default losses
and metrics of the kinds (summed, with their counts, so any batching sums exactly)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

IGNORE_INDEX = -100  # shared by torch.nn.functional.cross_entropy and Hugging Face labels


def shift_labels(labels: Tensor, shift: int) -> Tensor:
    """Labels moved to the positions whose logits predict them: with `shift` 1 (the Hugging
    Face causal-LM convention, labels aligned with input_ids) position t predicts labels[t + 1];
    the last positions get -100."""
    if not shift:
        return labels
    return nn.functional.pad(labels[..., shift:], (0, shift), value=IGNORE_INDEX)


def token_cross_entropy(logits: Tensor, batch: dict[str, Tensor],
                        shift: int = 0) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy over positions whose label is not -100, and how many there are
    (`shift`: see `shift_labels`)."""
    labels = shift_labels(batch["labels"], shift)
    loss = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    return loss, (labels != IGNORE_INDEX).sum()


def target_accuracy(logits: Tensor, batch: dict[str, Tensor],
                    shift: int = 0) -> dict[str, tuple[float, float]]:
    """Accuracy over contributing targets as (correct, total), so any batching sums exactly."""
    labels = shift_labels(batch["labels"], shift)
    keep = labels != IGNORE_INDEX
    correct = (logits.argmax(-1) == labels) & keep
    return {"accuracy": (float(correct.sum()), float(keep.sum()))}


def contributes(labels: Tensor) -> Tensor:
    """Which targets count: labels other than -100 (class and token ids), or not NaN (the float
    targets of regression - a padding copy's targets are NaN)."""
    return ~labels.isnan() if labels.is_floating_point() else labels != IGNORE_INDEX


def squared_error(outputs: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Regression: summed squared error over the target values that are not NaN, and how many
    there are."""
    diff, keep = _errors(outputs, batch["labels"])
    return (diff * diff).sum(), keep.sum()


def absolute_error(outputs: Tensor, batch: dict[str, Tensor]) -> dict[str, tuple[float, float]]:
    """Regression: mean absolute error as (summed |error|, number of target values)."""
    diff, keep = _errors(outputs, batch["labels"])
    return {"mae": (float(diff.abs().sum()), float(keep.sum()))}


def _errors(outputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Output minus target where the target counts, 0 elsewhere (no data-dependent shapes:
    the memory prediction runs this on fake tensors)."""
    keep = contributes(labels)
    diff = outputs.float().reshape(labels.shape) - labels.float().nan_to_num()
    return torch.where(keep, diff, torch.zeros_like(diff)), keep
