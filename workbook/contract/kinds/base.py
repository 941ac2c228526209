"""What a target kind decides, in one object: the contract and every notebook ask it instead of
testing the kind's name. A new kind is one module in this folder with a `Kind` subclass, and
its entry in `KINDS` (`kinds/__init__.py`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import pandas as pd
import torch
from torch import Tensor

from ..targets import target_accuracy, token_cross_entropy

if TYPE_CHECKING:
    from ..task import Task


class Kind:
    """A target kind: what a target is, how it is counted and scored, what an untrained model's
    loss is, and what 01 and 02 show of it. Subclasses set the flags and override the rest."""

    name: ClassVar[str]
    float_targets: ClassVar[bool] = False  # targets are values (regression), not ids
    per_position: ClassVar[bool] = False  # one target per input position, not per example
    causal: ClassVar[bool] = False  # a position sees its prefix only (generation)
    named_classes: ClassVar[bool] = False  # ids are classes named by label_names/label_field
    shifts_labels: ClassVar[bool] = False  # label_shift may be 1 (labels aligned with inputs)
    prompts: ClassVar[bool] = False  # examples have a prompt that may be left out of the loss
    plans_at_model_limit: ClassVar[bool] = False  # 03/08 plan at the model's length limit
    # the forward samples what is scored (a policy's completions): the loss counts what it
    # sampled, not the labels, and there is no fixed answer to give back (02: the loss falls)
    sampled: ClassVar[bool] = False
    default_loss: ClassVar[Callable] = staticmethod(token_cross_entropy)
    default_metrics: ClassVar[Callable] = staticmethod(target_accuracy)
    target_words: ClassVar[str] = "labels not equal to -100"  # what the loss counts

    def required(self, task: Task) -> list[str]:
        """The problems with the task's fields this kind needs (for `validate_task`)."""
        problems = []
        if task.label_shift == 1 and not self.shifts_labels:
            problems.append("`label_shift` must be 0 or 1 (1 only for generation), got 1")
        return problems

    def targets(self, labels: Tensor, shift: int) -> Tensor:
        """The labels each logit position is trained to predict; -100 where none."""
        return labels

    def predicted(self, outputs: Tensor, labels: Tensor) -> Tensor:
        """What the model predicts, laid out as the labels: the argmax id at every target."""
        return outputs.argmax(-1)

    def leading_dims(self, labels: Tensor | None, batch_size: int) -> tuple[int, ...]:
        """The leading dims of the logits of a batch: one row of logits per target."""
        return tuple(labels.shape) if labels is not None else (batch_size,)

    def logits_fit(self, t: Tensor, lead: tuple[int, ...]) -> bool:
        """Whether a float tensor of a model's tuple output is the logits: one more dim (the
        classes) after the batch's leading dims."""
        return t.dim() == len(lead) + 1 and tuple(t.shape[:len(lead)]) == lead

    def expected_initial_loss(self, num_outputs: int, labels: Tensor | None = None) -> float:
        """Loss per target of an untrained model that spreads probability evenly."""
        return math.log(num_outputs)

    def initial_loss_rule(self, num_outputs: int | None) -> str:
        return f"ln({num_outputs})"

    def context(self, row: Tensor, real: Tensor | None, position: int,
                inputs: list[Tensor]) -> Tensor:
        """What the model sees when it predicts the target at `position` (02's ambiguity):
        the whole input, and which of its positions, for a kind that reads it all."""
        return torch.cat([torch.tensor([position], dtype=torch.float64),
                          *[x.reshape(-1).double() for x in inputs]])  # ids and values alike

    def names_of(self, task: Task, ids: list[int]) -> list[str]:
        """Class names of the target ids of one example (01's round trip and histogram)."""
        return [task.decode([i]) for i in ids]

    def raw_names(self, task: Task, example: dict) -> list[str] | None:
        """Class names the raw example gives its targets; None where it gives none."""
        return None

    def round_trip(self, names: list[str], raw: list[str] | None) -> bool:
        """Whether the decoded class names of an example's targets are its raw ones."""
        return names == raw

    def class_shares(self, task: Task, raw: list[dict]) -> pd.Series | None:
        """Share of each class among the raw examples' targets (06's sample check)."""
        names = [n for ex in raw for n in (self.raw_names(task, ex) or [])]
        return pd.Series(names).value_counts(normalize=True) if names else None

    def reproduction(self, task: Task, model: Any, example: dict, item: Any,
                     batch: dict[str, Tensor]) -> dict:
        """02's row of what the memorised model gives back for one example."""
        return {}

    def constant_prediction(self, value: Tensor, logits: Tensor) -> Tensor:
        """06's chance: the prediction of a model that ignores its inputs, laid out as
        `logits` - every position the targets' log frequencies `value` (class ids), or their
        mean (a 0-dim `value`, float targets)."""
        if not value.dim():
            return torch.full_like(logits, float(value))
        prior = torch.full((logits.shape[-1],), -30.0, device=logits.device)
        prior[:value.shape[0]] = value[:logits.shape[-1]]
        return prior.expand_as(logits).contiguous()

    def figures(self, reproduction: pd.DataFrame) -> dict:
        """02's key figures this kind adds from its reproduction rows (none by default)."""
        return {}

    def overfit_subset(self, task: Task, raw: list[dict], n: int) -> list[dict]:
        """02's subset of `n` examples out of the first training examples `raw`: the first."""
        return raw[:n]

    def audits(self, task: Task, items: list) -> list:
        """01's findings that only this kind's targets can have (Flags), on encoded items."""
        return []

    def model_audits(self, task: Task, model: Any, items: list) -> list:
        """01's findings of this kind that need the task's model on a few encoded items."""
        return []


class NamedClasses(Kind):
    """Shared by the kinds whose ids are classes with names (label_names, label_field)."""

    named_classes = True

    def required(self, task: Task) -> list[str]:
        problems = super().required(task)
        if not task.label_names:
            problems.append(f"`label_names` (class id -> name) is required for {self.name}")
        if not task.label_field:
            problems.append(f"`label_field` (raw field with the class name) is required for "
                            f"{self.name}")
        return problems
