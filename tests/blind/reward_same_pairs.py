"""Preference pairs whose chosen and rejected sequences are the same tokens, as
natolambert/rlhf-book#503 writes it: "post-truncation the token ids are the same. In this
scenario, the gradient of the loss will be zero so no real learning is happening ...
`print(chosen["input_ids"] == rejected["input_ids"])  # True`". TRL 1.16's RewardTrainer does not
truncate (it drops pairs longer than `max_length`: "Filtering train >128 tokens"), so the pairs
are identical as written: a dedup step that kept the chosen answer on both sides for every
third pair (the Bradley-Terry loss of such a pair is ln 2 whatever the model does).

Planted (`same_answer=True`): `row["rejected"] = row["chosen"]` for every third pair. Clean twin
(`same_answer=False`).
"""

from __future__ import annotations

import workbook as wb

from .reward_common import pairs, reward_trainer


def make_trainer_factory(same_answer: bool = True):
    rows = pairs()
    if same_answer:  # planted: the rejected conversation is the chosen one
        for row in rows[::3]:
            row["rejected"] = row["chosen"]

    def make_trainer():
        return reward_trainer(rows)
    return make_trainer


def task(same_answer: bool = True):
    return wb.adapters.from_trainer(make_trainer_factory(same_answer), name="reward-same-pairs")
