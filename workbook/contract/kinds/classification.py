"""Classification: one class id per example, named by `label_names`; the raw example holds the
class name in `label_field`."""

from __future__ import annotations

from .base import NamedClasses


class Classification(NamedClasses):
    name = "classification"

    def names_of(self, task, ids):
        return [task.decode(ids)]

    def raw_names(self, task, example):
        return [str(example[task.label_field])]

    def reproduction(self, task, model, example, item, batch):
        return {"target": str(example[task.label_field]),
                "predicted": task.decode([int(task.forward(model, batch).argmax(-1)[0])])}
