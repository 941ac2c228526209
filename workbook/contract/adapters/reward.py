"""Reward models as TRL's RewardTrainer trains them, as a Task of the "ranking" kind: a pair is
one example, its chosen and rejected sequences collated by the trainer's own collator (both
halves padded together) and scored in ONE forward of twice the micro-batch (`RewardPair`), as
`RewardTrainer.compute_loss` does - so 03 and 08 size the doubled forward. The score of a
sequence is what the sequence-classification model reads at its last token that is not
`config.pad_token_id`; the loss is -log sigmoid(chosen - rejected), plus
`center_rewards_coefficient` x mean((chosen + rejected)^2) where the RewardConfig sets it.
What only a reward model can get wrong is checked on the user's own model and pairs
(`pair_checks`): where the score is read in a padded batch, and whether the score head
trains under LoRA."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from ...base.errors import WorkbookError
from ...storage.records import Flag
from ..targets import token_cross_entropy
from ..task import Task
from .base import BesideReference
from .preference import ANSWERS, PreferenceAdapter

SEQUENCES = ("input_ids", "attention_mask")  # per answer
INPUTS = tuple(f"{a}_{k}" for a in ANSWERS for k in SEQUENCES)
PAIR = ("chosen_ids", "rejected_ids")  # a prepared row's tokens
HEADS = ("score", "classifier")  # the sequence-classification head, as transformers names it
SAME_SCORE = 1e-4  # a row's score alone and padded in a batch: float noise is far below
SAME_SCORE_HALF = 3e-2  # the same in bf16 / fp16 weights, whose kernels differ by batch shape
FIRST_PAIRS = 8  # the pairs 01's first loss is measured on
FAR_ABOVE = 1.5  # a first loss above 1.5 x ln 2: not a fresh head's (02's tolerance is 0.5)


class RewardPair(nn.Module):
    """A sequence-classification model with one label scoring both answers of each pair in one
    forward: the chosen and rejected sequences stacked (2 x the pairs), their scores returned
    as two logits per pair, chosen first."""

    def __init__(self, scorer: nn.Module):
        super().__init__()
        self.scorer = scorer

    def __getattr__(self, name: str) -> Any:
        if name in BesideReference.SHARED:  # the scorer's adapters, if any
            return getattr(self._modules["scorer"], name)
        return super().__getattr__(name)

    def forward(self, chosen_input_ids, chosen_attention_mask, rejected_input_ids,
                rejected_attention_mask):
        scores = self.scorer(input_ids=torch.cat([chosen_input_ids, rejected_input_ids]),
                             attention_mask=torch.cat([chosen_attention_mask,
                                                       rejected_attention_mask]),
                             use_cache=False).logits.squeeze(-1)
        return torch.stack(scores.chunk(2), dim=-1)


def centred_loss(coefficient: float) -> Callable:
    """RewardTrainer's loss with `center_rewards_coefficient`: the pairs' summed
    -log sigmoid(chosen - rejected) plus the coefficient times their summed squared score sum."""
    def loss(scores: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        total, count = token_cross_entropy(scores, batch)
        return total + coefficient * (scores.float().sum(-1) ** 2).sum(), count
    return loss


def head_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The score head's parameters (`score` or `classifier`, PEFT's copies included)."""
    return {n: p for n, p in model.named_parameters() if set(n.split(".")) & set(HEADS)}


def _sequence(scores_of: Callable, tokens: torch.Tensor) -> torch.Tensor:
    return scores_of(tokens[None], torch.ones_like(tokens)[None])[0]


class RewardAdapter(PreferenceAdapter):
    """A RewardTrainer as built, as a Task of the "ranking" kind: `__init__` reads its prepared
    pairs (checked), collator, tokenizer and RewardConfig; `encode` and `collate` (its
    `sequences`) lay out each answer's tokens as the collator does, `build_model` is the
    `RewardPair` over a copy of the trainer's scorer, `untruncated_pair` and `pair_checks` back
    01's findings; `task()` assembles them."""

    sequences = SEQUENCES

    def __init__(self, trainer: Any, fresh: Callable[[Callable[[Any], nn.Module]], nn.Module],
                 evaluation: Any, *, name: str, group_column: str | None, **task_fields: Any):
        self.data = {"train": trainer.train_dataset, "validation": evaluation}
        for split, rows in self.data.items():
            if "margin" in (getattr(rows, "column_names", None) or []):
                raise WorkbookError(f"the RewardTrainer's {split} pairs carry a 'margin' column: "
                                    "the pilot computes the loss without a margin",
                                    "pilot without the margin column (dataset."
                                    "remove_columns('margin')), or write a workbook.Task with "
                                    "your loss")
        self.group_column = group_column
        self.check_columns("RewardTrainer", PAIR, "build the trainer from chosen / rejected "
                           "rows (TRL tokenizes them) or from chosen_ids / rejected_ids")
        self.trainer, self.fresh, self.name = trainer, fresh, name
        self.collator, self.tokenizer = trainer.data_collator, trainer.processing_class
        self.args, self.task_fields = trainer.args, task_fields
        self.centre = getattr(self.args, "center_rewards_coefficient", None)

    def encode(self, ex: dict) -> dict[str, torch.Tensor]:
        """Each answer's whole sequence (RewardTrainer joins an explicit prompt to both)."""
        row = self.data[ex["split"]][ex["index"]]
        out = {"labels": torch.tensor(0)}
        for answer in ANSWERS:
            given = row[f"{answer}_ids"]
            out[f"{answer}_input_ids"] = torch.tensor(given, dtype=torch.long)
            out[f"{answer}_attention_mask"] = torch.ones(len(given), dtype=torch.long)
        return out

    @staticmethod
    def pair(r: dict) -> dict[str, list[int]]:
        """An encoded example as the prepared row again, for the collator."""
        return {f"{a}_ids": r[f"{a}_input_ids"][r[f"{a}_attention_mask"].bool()].tolist()
                for a in ANSWERS}

    def build_model(self) -> nn.Module:
        """The trainer's scorer as built (a copy: `fresh`), scoring both answers of a pair."""
        return self.fresh(lambda t: RewardPair(t.model))

    def tokens(self, text: Any) -> list[int]:
        """A text (or a conversation) tokenized whole, without truncation."""
        if isinstance(text, list):
            out = self.tokenizer.apply_chat_template(text, tokenize=True)
        else:
            out = self.tokenizer(text, truncation=False)
        return list(out["input_ids"] if isinstance(out, Mapping) else out)

    def untruncated_pair(self, item: Any) -> tuple[list[int], list[int]] | None:
        """The pair's chosen and rejected texts (the prompt joined, as RewardTrainer does)
        tokenized without truncation; None where the prepared row keeps no text."""
        if item.raw is None:
            return None
        row = self.data[item.raw["split"]][item.raw["index"]]
        texts = [row.get(a) for a in ANSWERS]
        if any(not isinstance(t, (str, list)) for t in texts):
            return None
        prompt = row.get("prompt")
        chosen, rejected = (self.tokens(prompt + t if prompt is not None else t) for t in texts)
        return chosen, rejected

    def pair_checks(self, items: list) -> list[Flag]:
        """01's checks on the trainer's own model: where the score is read in a padded batch
        (`score_position`) and whether the score head trains (`frozen_head`)."""
        scorer = self.trainer.model
        was = scorer.training
        try:
            return (self.first_loss(scorer, items) + self.score_position(scorer, items)
                    + self.frozen_head(scorer, items))
        finally:
            scorer.train(was)

    def first_loss(self, scorer: nn.Module, items: list) -> list[Flag]:
        """The first loss on the pilot's first pairs against ln 2, what a fresh score head
        gives (its scores small and alike): far above it, the head is zeroed and the loss
        measured again - back at ln 2, the head's start is the cause (confirmed)."""
        if not items:
            return []
        batch = self.collate([it.tensors for it in items[:FIRST_PAIRS]])
        device = next(scorer.parameters()).device
        model, labels = RewardPair(scorer).eval(), {"labels": batch["labels"].to(device)}

        def loss() -> float:
            with torch.no_grad():
                total, count = token_cross_entropy(
                    model(**{k: batch[k].to(device) for k in INPUTS}), labels)
            return float(total / count)

        first, heads = loss(), head_parameters(scorer)
        if not math.isfinite(first) or first <= FAR_ABOVE * math.log(2):
            return []
        kept = {n: p.detach().clone() for n, p in heads.items()}
        try:
            with torch.no_grad():
                for p in heads.values():
                    p.zero_()
            zeroed = loss()
        finally:
            with torch.no_grad():
                for n, p in heads.items():
                    p.copy_(kept[n])
        spread = ", ".join(sorted({f"{float(v.float().std()):.3g}" for v in kept.values()
                                   if v.dim() > 1}))
        if heads and abs(zeroed - math.log(2)) < 1e-3:
            return [Flag("first loss far from ln 2", f"the first loss on {len(batch['labels'])} "
                         f"pairs is {first:.4g}, not ln 2 = 0.6931 as a fresh score head gives: "
                         f"the head starts with weights of std {spread} (transformers "
                         "initialises it at initializer_range, 0.02), so its random scores "
                         "already rank the pairs, confidently and at random; with the head "
                         f"zeroed the loss is {zeroed:.4f} (confirmed)", len(kept),
                         "leave the score head as the model builds it, or re-initialise it "
                         "at the config's initializer_range", sorted(kept)[:5])]
        return [Flag("first loss far from ln 2", f"the first loss on {len(batch['labels'])} "
                     f"pairs is {first:.4g}, not ln 2 = 0.6931 as a fresh score head gives, "
                     + (f"and stays {zeroed:.4g} with the head zeroed: suspected - the "
                        "scores do not come from the head alone" if heads else
                        "and no score head was found to test"), 1,
                     "test: score a pair's chosen and rejected sequences alone and compare "
                     "with the batch; print model.score's weights", [])]

    def score_position(self, scorer: nn.Module, items: list) -> list[Flag]:
        """Each answer scored alone and padded in one batch of the shortest and longest pairs
        by the trainer's collator: the model reads the score at the last token that is not
        `config.pad_token_id`, so a collator that pads with another id moves the reading onto
        the padding. A difference is a cause only where the read position is shown to move."""
        probe = sorted(items, key=lambda it: len(it.tensors["chosen_input_ids"]))
        probe = probe[:2] + probe[-2:] if len(probe) > 4 else probe
        if len(probe) < 2:
            return []
        batch = self.collator([self.pair(it.tensors) for it in probe])
        device = next(scorer.parameters()).device
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)

        def scores_of(i: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return scorer(input_ids=i, attention_mask=m, use_cache=False).logits[:, 0].float()

        scorer.eval()
        with torch.no_grad():
            padded = scores_of(ids, mask)
            alone = torch.stack([_sequence(scores_of, row[m.bool()]) for row, m in
                                 zip(ids, mask, strict=True)])
        gap = (padded - alone).abs()
        half = next(scorer.parameters()).dtype in (torch.float16, torch.bfloat16)
        moved = gap > (SAME_SCORE_HALF if half else SAME_SCORE) * (1 + alone.abs())
        pad = getattr(getattr(scorer, "config", None), "pad_token_id", None)
        positions = torch.arange(ids.shape[1], device=device)
        ends = (mask.long() * positions).argmax(-1)  # the last real token, either padding side
        reads = ((ids != pad).long() * positions).argmax(-1) if pad is not None \
            else torch.full_like(ends, ids.shape[1] - 1)
        # read off their last token, and moved past the noise of the rows read on it (the
        # batch's own floor: half precision's kernels differ by batch shape)
        on_end = reads == ends
        beyond = gap > 2 * gap[on_end].max() if bool(on_end.any()) else torch.zeros_like(moved)
        wrong = ~on_end & (moved | beyond)
        moved |= wrong
        if not bool(moved.any()):
            return []
        used = sorted({int(v) for v in ids[mask == 0].tolist()})
        n = int(moved.sum())
        if bool(wrong.any()):
            row = int(wrong.nonzero()[0])
            return [Flag("score read on padding", f"the model reads each sequence's score at "
                         f"its last token that is not config.pad_token_id={pad}, but the "
                         f"trainer's collator pads with {used}: in a batch of {len(probe)} "
                         f"pairs, {int(wrong.sum())} of {len(ids)} padded sequences are scored "
                         f"at a padding position (sequence {row}: read at {int(reads[row])}, "
                         f"its last token at {int(ends[row])}) and score "
                         f"{float(padded[row]):.4g} instead of {float(alone[row]):.4g} alone - "
                         "every pair's reward then depends on how much padding its batch "
                         "gave it", n, "pad with the tokenizer's pad token: "
                         "DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id) "
                         "(RewardTrainer's default), or set model.config.pad_token_id to the "
                         "id the collator pads with", [])]
        return [Flag("score read on padding", f"{n} of {len(ids)} sequences score "
                     f"differently padded in a batch than alone (largest gap "
                     f"{float(gap.max()):.3g}), although the model reads the last real token: "
                     "suspected - the padding reaches the score through attention or "
                     "position ids", n, "test: score one pair alone and in a batch with "
                     "attention_mask checked to be 0 on every padding position, and compare "
                     "position_ids", [])]

    def frozen_head(self, scorer: nn.Module, items: list) -> list[Flag]:
        """Under adapters, whether an update moves the score head: one signed step on the
        pilot's first pairs, every trainable tensor restored after. PEFT freezes the head
        unless `task_type='SEQ_CLS'` or `modules_to_save` names it, and the reward is then
        read through the head's random start for the whole campaign."""
        heads = head_parameters(scorer)
        if not items:
            return []
        trainable = {n: p for n, p in scorer.named_parameters() if p.requires_grad}
        if not heads or not trainable or any(p.requires_grad for p in heads.values()) \
                or not hasattr(scorer, "peft_config"):
            return []
        kept = {n: p.detach().clone() for n, p in {**trainable, **heads}.items()}
        model, batch = RewardPair(scorer), self.collate([it.tensors for it in items[:4]])
        device = next(scorer.parameters()).device
        scorer.train()
        try:
            loss, count = token_cross_entropy(model(**{k: batch[k].to(device) for k in INPUTS}),
                                              {"labels": batch["labels"].to(device)})
            (loss / count).backward()
            with torch.no_grad():
                for p in trainable.values():
                    if p.grad is not None:
                        p -= 1e-3 * p.grad.sign()
                moved = [n for n, p in trainable.items() if not torch.equal(p, kept[n])]
                still = [n for n, p in heads.items() if torch.equal(p, kept[n])]
        finally:
            with torch.no_grad():
                for n, p in trainable.items():
                    p.copy_(kept[n])
                    p.grad = None
        if not moved or len(still) < len(heads):
            return []
        configs = scorer.peft_config.values()
        said = "; ".join(f"task_type={getattr(c, 'task_type', None)!r}, modules_to_save="
                         f"{getattr(c, 'modules_to_save', None)!r}" for c in configs)
        return [Flag("score head frozen", f"the score head ({', '.join(sorted(heads))}) does "
                     f"not train: PEFT froze it ({said}); one update moved {len(moved)} "
                     "adapter tensors and left the head as initialised - a random projection "
                     "the whole campaign reads every reward through", len(heads),
                     "LoraConfig(task_type='SEQ_CLS', ...) (PEFT then trains the head), or "
                     "modules_to_save=['score']", sorted(heads)[:5])]

    def task(self) -> Task:
        notes: list[str] = []
        task = self.assembled("ranking", INPUTS, notes, **(
            {"loss": centred_loss(float(self.centre))} if self.centre is not None else {}))
        facts = task.framework
        facts.notes = [
            f"from_trainer: a {type(self.trainer).__name__}'s pairs as it prepared them, its "
            f"collator and RewardConfig; the model ({type(self.trainer.model).__name__}) scores "
            "the chosen and rejected sequences of a micro-batch in one forward of twice its "
            "rows, as the campaign does, so 03 and 08 size that doubled forward"
            + (f"; the loss adds center_rewards_coefficient={self.centre:g} x mean((chosen + "
               "rejected)^2)" if self.centre is not None else ""), *notes]
        facts.untruncated_pair, facts.pair_checks = self.untruncated_pair, self.pair_checks
        return task


def from_reward(trainer: Any, fresh: Callable[[Callable[[Any], nn.Module]], nn.Module],
                evaluation: Any, *, name: str, group_column: str | None,
                **task_fields: Any) -> Task:
    """A Task of the "ranking" kind from a RewardTrainer as built: its prepared pairs, its one
    eval dataset `evaluation`, collator, tokenizer and RewardConfig; `fresh(pick)` gives a copy
    of `pick(trainer)` as built (the pilot's fresh model)."""
    return RewardAdapter(trainer, fresh, evaluation, name=name, group_column=group_column,
                         **task_fields).task()
