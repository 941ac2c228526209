"""Pairwise ranking (a reward model, TRL's RewardTrainer): one scalar score per sequence, and a
pair's chosen answer should score above its rejected one. The two scores of a pair are its two
logits, so the Bradley-Terry loss -log sigmoid(chosen - rejected) is their cross-entropy against
the chosen one: ln 2 while a fresh score head scores both answers alike. Accuracy is the share
of pairs whose chosen answer scores higher, the margin the mean of chosen minus rejected (TRL's
`accuracy` and `margin`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...storage.records import Flag
from ..targets import IGNORE_INDEX
from .preference import ANSWERS, Preference


def pair_metrics(scores: Tensor, batch: dict[str, Tensor]) -> dict[str, tuple[float, float]]:
    """Accuracy (chosen above rejected) and the summed margin chosen - rejected, each as
    (sum, pairs) over the pairs that count (a padding copy's label is -100), so any batching
    and any split over ranks sums exactly."""
    margin = (scores[:, 0] - scores[:, 1]).float()[batch["labels"] != IGNORE_INDEX]
    pairs = float(margin.numel())
    return {"accuracy": (float((margin > 0).sum()), pairs), "margin": (float(margin.sum()), pairs)}


class Ranking(Preference):
    name = "ranking"
    target_words = "ranked pairs (each pair's chosen answer should score above its rejected one)"
    loss_words = "ranking loss"
    default_metrics = staticmethod(pair_metrics)

    def initial_loss_rule(self, num_outputs):
        return f"ln({num_outputs}): a fresh score head scores both answers of a pair alike"

    def figures(self, reproduction) -> dict:
        """02's key figures of the memorised pairs: accuracy and mean margin."""
        if reproduction is None or "reward_margin" not in reproduction:
            return {}
        margins = reproduction["reward_margin"].astype(float)
        return {"pair_accuracy": round(float((margins > 0).mean()), 4),
                "mean_margin": round(float(margins.mean()), 4)}

    def audits(self, task, items):
        """Pairs whose chosen and rejected sequences are the same tokens - as given, or made
        so by a truncation the prepared rows already carry (confirmed by re-tokenizing the
        pair's text without truncation: `task.framework.untruncated_pair`) - and what the
        adapter checks on the model itself (`task.framework.pair_checks`: where the score is
        read, whether the head trains)."""
        same, cut = [], []
        untruncated = task.framework.untruncated_pair
        for it in items:
            chosen, rejected = (it.tensors[f"{a}_input_ids"] for a in ANSWERS)
            if not torch.equal(chosen, rejected):
                continue
            whole = untruncated(it) if untruncated is not None else None
            (cut if whole is not None and whole[0] != whole[1] else same).append(it.id)
        flags = [self.identical(same, len(items))] if same else []
        if cut:
            flags.append(Flag("pair without preference", f"{len(cut)} of {len(items)} pairs "
                              "are identical token sequences only because their tokenization "
                              "was truncated: re-tokenized without truncation, their chosen "
                              "and rejected texts differ (the answers part after the cut)",
                              len(cut), "tokenize without truncation (RewardTrainer drops the "
                              "pairs longer than max_length instead), or raise the truncation "
                              "length past where the answers part", cut[:5]))
        checks = task.framework.pair_checks
        return flags + (checks(items) if checks is not None else [])
