"""Regression: float targets per example (NaN where none), scored by squared error; an untrained
model's outputs sit near 0."""

from __future__ import annotations

from ..targets import absolute_error, contributes, squared_error
from .base import Kind


class Regression(Kind):
    name = "regression"
    float_targets = True
    plans_at_model_limit = True
    default_loss = staticmethod(squared_error)
    default_metrics = staticmethod(absolute_error)
    target_words = "target values that are not NaN"

    def predicted(self, outputs, labels):
        return outputs.reshape(labels.shape)

    def leading_dims(self, labels, batch_size):
        return (batch_size,)

    def logits_fit(self, t, lead):
        return t.dim() >= len(lead) and tuple(t.shape[:len(lead)]) == lead

    def expected_initial_loss(self, num_outputs, labels=None):
        values = labels[contributes(labels)].float() if labels is not None else None
        return float((values**2).mean()) if values is not None and values.numel() else 1.0

    def initial_loss_rule(self, num_outputs):
        return "mean(target^2): outputs near 0"

    def reproduction(self, task, model, example, item, batch):
        return {"predicted": task.decode(task.forward(model, batch).reshape(-1).tolist()),
                "target": task.decode(item.tensors["labels"].reshape(-1).tolist())}
