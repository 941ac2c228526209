"""Preference pairs (DPO): a prompt with a chosen and a rejected answer. The model - the policy
beside its reference - scores both answers of a pair by their implicit rewards, beta times the
log-ratio of policy to reference, and the target is always the chosen one: class 0 of two. DPO's
sigmoid loss is the cross-entropy of those two scores, ln 2 while the policy equals its
reference; accuracy is the share of pairs whose chosen answer wins (TRL's reward accuracy)."""

from __future__ import annotations

import math

import torch

from ...storage.records import Flag
from .base import NamedClasses

ANSWERS = ("chosen", "rejected")


class Preference(NamedClasses):
    name = "preference"
    target_words = "preference pairs (the chosen answer is each pair's target)"
    loss_words = "DPO loss"

    def names_of(self, task, ids):
        return [task.decode(ids)]

    def raw_names(self, task, example):
        return [str(example[task.label_field])]

    def class_shares(self, task, raw):
        return None  # every pair's target is its chosen answer, by construction

    def initial_loss_rule(self, num_outputs):
        return f"ln({num_outputs}): the policy starts as its reference"

    def identical(self, ids: list, total: int) -> Flag:
        """01's finding for the pairs `ids` whose rejected answer is the chosen one."""
        return Flag("pair without preference", f"{len(ids)} of {total} pairs have a rejected "
                    f"answer equal to the chosen one (the same tokens): their {self.loss_words} "
                    "is ln 2 whatever the model does, and they only dilute the update", len(ids),
                    "remove them, or give each a rejected answer that differs", ids[:5])

    def constant_prediction(self, value, logits):
        """A model that ignores its inputs scores a pair's two answers alike (every target is
        "chosen" by construction, so the targets' frequencies say nothing): ln 2."""
        return torch.zeros_like(logits)

    def expected_initial_loss(self, num_outputs, labels=None):
        return math.log(num_outputs)

    def reproduction(self, task, model, example, item, batch):
        scores = task.forward(model, batch)[0]
        return {"target": "chosen", "predicted": ANSWERS[int(scores.argmax())],
                "reward_margin": round(float(scores[0] - scores[1]), 4)}

    def audits(self, task, items):
        """Pairs that carry no preference: the chosen answer equals the rejected one - as
        given, or once truncation at `max_length` cuts both where they still agree. Their loss
        stays ln 2 whatever the model learns."""
        same, cut = [], []
        limit = task.max_length
        for it in items:
            chosen, rejected = (it.tensors[f"{a}_input_ids"].tolist() for a in ANSWERS)
            if chosen == rejected:
                same.append(it.id)
            elif limit and chosen[:limit] == rejected[:limit]:
                cut.append(it.id)
        flags = [self.identical(same, len(items))] if same else []
        if cut:
            flags.append(Flag("pair without preference", f"{len(cut)} of {len(items)} pairs "
                              f"differ only after max_length={limit}: truncation leaves the "
                              "chosen and rejected sequences identical", len(cut),
                              "raise max_length past where the answers part, or shorten the "
                              "prompts", cut[:5]))
        return flags

