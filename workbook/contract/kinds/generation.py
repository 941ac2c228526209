"""Generation: a token id per position, each position seeing only its prefix; labels may be
aligned with the inputs (`label_shift` 1, Hugging Face causal LMs) and a prompt may be left out
of the loss."""

from __future__ import annotations

from ..targets import shift_labels
from .base import Kind


class Generation(Kind):
    name = "generation"
    per_position = True
    causal = True
    shifts_labels = True
    prompts = True
    plans_at_model_limit = True

    def targets(self, labels, shift):
        return shift_labels(labels, shift)

    def context(self, row, real, position, inputs):
        return row[:position + 1] if real is None else row[:position + 1][real[:position + 1]]

    def reproduction(self, task, model, example, item, batch):
        if task.generate is None:
            return {}
        target, greedy = example[task.response_field], task.generate(model, example)
        return {"target": target, "greedy": greedy, "greedy_exact": greedy == target}
