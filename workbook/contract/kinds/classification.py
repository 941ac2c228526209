"""Classification: one class id per example, named by `label_names`; the raw example holds the
class name in `label_field`. A collate that mixes examples (mixup, cutmix) gives each row a soft
target, the class probabilities: one target per row, its largest class."""

from __future__ import annotations

from .base import NamedClasses


class Classification(NamedClasses):
    name = "classification"

    def targets(self, labels, shift):
        return labels.argmax(-1) if labels.is_floating_point() and labels.dim() > 1 else labels

    def names_of(self, task, ids):
        return [task.decode(ids)]

    def raw_names(self, task, example):
        return [str(example[task.label_field])]

    def overfit_subset(self, task, raw, n):
        """The first `n` examples when they hold every class of the first training examples
        (or `n` classes); else round-robin over those classes, in the order they first appear
        (a folder dataset lists its classes one after another: its first `n` examples are
        often one class, which a constant output memorises)."""
        by_class: dict[str, list[dict]] = {}
        for ex in raw:
            by_class.setdefault(str(ex[task.label_field]), []).append(ex)
        if len({str(ex[task.label_field]) for ex in raw[:n]}) >= min(n, len(by_class)):
            return raw[:n]
        queues = [iter(q) for q in by_class.values()]
        picked: list[dict] = []
        while len(picked) < n and queues:
            for q in list(queues):
                ex = next(q, None)
                if ex is None:
                    queues.remove(q)
                elif len(picked) < n:
                    picked.append(ex)
        return picked

    def reproduction(self, task, model, example, item, batch):
        return {"target": str(example[task.label_field]),
                "predicted": task.decode([int(task.forward(model, batch).argmax(-1)[0])])}
