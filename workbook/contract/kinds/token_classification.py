"""Token classification (named entities, part of speech): a class id per input position, each
position seeing the whole input; -100 on positions without a tag (padding, special tokens,
continuation pieces of a word). The raw example holds one class name per tagged position in
`label_field` (BIO-style names: B-PER, I-PER, O)."""

from __future__ import annotations

from ..targets import contributes
from .base import NamedClasses


class TokenClassification(NamedClasses):
    name = "token_classification"
    per_position = True

    def raw_names(self, task, example):
        tags = example[task.label_field]
        return [str(t) for t in (tags.split() if isinstance(tags, str) else tags)]

    def round_trip(self, names, raw):
        """Tag by tag over the tags both have: an example cut by truncation keeps its first
        tags, and they must still be the raw ones."""
        n = min(len(names), len(raw))
        return names[:n] == raw[:n] and (n > 0 or not raw)

    def reproduction(self, task, model, example, item, batch):
        labels = batch["labels"][0]
        keep = labels != -100
        predicted = task.forward(model, batch).argmax(-1)[0][keep]
        return {"target": " ".join(self.raw_names(task, example)),
                "predicted": " ".join(task.decode([int(i)]) for i in predicted),
                "tags": int(contributes(labels).sum())}
