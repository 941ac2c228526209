"""DPO as TRL's DPOTrainer runs it, as a Task of the "preference" kind: a pair is one example,
its chosen and rejected sequences collated by the trainer's own collator, and the model is the
policy beside its reference (`PreferencePair`) scoring both answers - so every notebook's loss,
accuracy, gradient and memory are DPO's own, the reference's forward included."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ...base.errors import WorkbookError
from ..task import Task
from .base import BesideReference, SplitRows
from .hf_trainer import argument_fields

ANSWERS = ("chosen", "rejected")
SEQUENCES = ("input_ids", "attention_mask", "completion_mask")  # per answer, as TRL collates
INPUTS = tuple(f"{a}_{k}" for a in ANSWERS for k in SEQUENCES)
PAIR = ("prompt_ids", "chosen_ids", "rejected_ids")  # a prepared row's tokens


def _answer_logps(model: nn.Module, ids: torch.Tensor, attention: torch.Tensor,
                  completion: torch.Tensor) -> torch.Tensor:
    """Each sequence's log-probability of its completion tokens (TRL's summed per-token
    log-probs of the answer, the prompt left out)."""
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
    picked = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (picked * completion[:, 1:]).sum(-1)


class PreferencePair(BesideReference):
    """The policy and its reference as one model: per pair, the chosen and the rejected
    answer's implicit rewards beta * (log pi(y|x) - log pi_ref(y|x)) as two logits, so DPO's
    sigmoid loss is their cross-entropy against the chosen one. The reference is a frozen
    copy, or - `reference` None, as DPOTrainer does for PEFT - the policy's own base with the
    adapters switched off; it runs without gradients."""

    def __init__(self, policy: nn.Module, reference: nn.Module | None, beta: float):
        super().__init__(policy, reference)
        self.beta = beta

    def forward(self, chosen_input_ids, chosen_attention_mask, chosen_completion_mask,
                rejected_input_ids, rejected_attention_mask, rejected_completion_mask):
        ids = torch.cat([chosen_input_ids, rejected_input_ids])
        attention = torch.cat([chosen_attention_mask, rejected_attention_mask])
        completion = torch.cat([chosen_completion_mask, rejected_completion_mask])
        policy = _answer_logps(self.policy, ids, attention, completion)
        with torch.no_grad():
            reference = self.on_reference(lambda m: _answer_logps(m, ids, attention, completion))
        chosen, rejected = (self.beta * (policy - reference)).chunk(2)
        return torch.stack([chosen, rejected], dim=-1)


def _checked(trainer: Any) -> list[str]:
    """What of the trainer's DPO setup the pilot runs differently, in words; a loss it does not
    compute is refused."""
    losses = list(getattr(trainer, "loss_types", None) or ["sigmoid"])
    if losses != ["sigmoid"]:
        raise WorkbookError(f"the DPOTrainer's loss_type {losses} is not mapped: the pilot "
                            "computes DPO's sigmoid loss", "pilot with loss_type='sigmoid' "
                            "(DPOConfig's default), or write a workbook.Task with your loss")
    if getattr(trainer, "ld_alpha", None) is not None:
        raise WorkbookError("the DPOTrainer's ld_alpha is not mapped: the pilot sums every "
                            "completion token's log-prob", "pilot with ld_alpha=None, or write "
                            "a workbook.Task with your loss")
    notes = []
    if getattr(trainer, "precompute_ref_logps", False):
        notes.append("from_trainer: precompute_ref_logps - the campaign reads the reference's "
                     "log-probs from the dataset; the pilot computes them in every forward, so "
                     "03/08 size one reference forward more than the campaign runs")
    return notes


class PreferenceAdapter(SplitRows):
    """A DPOTrainer as built, as a Task of the "preference" kind: `__init__` reads its prepared
    pairs (checked), collator, tokenizer and DPOConfig; the pairs are read by `load_examples`
    and `encode`, batched by `collate` (the trainer's collator on each `pair`), and the model
    is `build_model`'s `PreferencePair`; `task()` assembles them."""

    sequences = SEQUENCES  # what the collator lays out per answer

    def __init__(self, trainer: Any, fresh: Callable[[Callable[[Any], nn.Module]], nn.Module], *,
                 name: str, group_column: str | None, **task_fields: Any):
        self.notes = _checked(trainer)
        self.data = {"train": trainer.train_dataset, "validation": trainer.eval_dataset}
        self.group_column = group_column
        self.check_columns("DPOTrainer", PAIR, "build the trainer from prompt / chosen / "
                           "rejected rows (TRL tokenizes them): the pilot reads its prepared "
                           "datasets")
        self.trainer, self.fresh, self.name = trainer, fresh, name
        self.collator, self.tokenizer = trainer.data_collator, trainer.processing_class
        self.args, self.beta, self.task_fields = trainer.args, float(trainer.beta), task_fields

    def load_examples(self) -> list[dict]:
        """Every pair of both splits, the chosen answer preferred."""
        return self.examples(preferred="chosen")

    def encode(self, ex: dict) -> dict[str, torch.Tensor]:
        """Each answer's whole sequence, as the collator will lay it out (before truncation)."""
        row = self.data[ex["split"]][ex["index"]]
        prompt, out = row["prompt_ids"], {"labels": torch.tensor(0)}
        for answer in ANSWERS:
            given = row[f"{answer}_ids"]
            out[f"{answer}_input_ids"] = torch.tensor(prompt + given, dtype=torch.long)
            out[f"{answer}_attention_mask"] = torch.ones(len(prompt) + len(given),
                                                         dtype=torch.long)
            out[f"{answer}_completion_mask"] = torch.tensor([0] * len(prompt) + [1] * len(given))
        return out

    @staticmethod
    def pair(r: dict) -> dict[str, list[int]]:
        """An encoded example as the prepared row again, for the collator."""
        cut = int((r["chosen_completion_mask"] == 0).sum())
        return {"prompt_ids": r["chosen_input_ids"][:cut].tolist(),
                **{f"{a}_ids": r[f"{a}_input_ids"][cut:].tolist() for a in ANSWERS}}

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """The trainer's collator on the pairs (chosen rows first, then rejected, padded
        together), its two halves apart."""
        batch = self.collator([self.pair(r) for r in rows])
        out = {f"{a}_{k}": half for k in self.sequences
               for a, half in zip(ANSWERS, batch[k].chunk(2), strict=True)}
        return {**out, "labels": torch.stack([r["labels"] for r in rows])}

    def build_model(self) -> nn.Module:
        """The policy beside its reference, a copy of the trainer's as built (`fresh`)."""
        return self.fresh(lambda t: PreferencePair(t.model, t.ref_model, float(t.beta)))

    @staticmethod
    def decode(ids: Any) -> str:
        return ", ".join(ANSWERS[int(i)] for i in ids)

    def decode_input(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def assembled(self, kind: str, inputs: tuple[str, ...], notes: list[str],
                  **fields: Any) -> Task:
        """The Task of a pair of answers: the steps, the trainer's arguments' fields (their
        `notes` said), `fields` over them and the user's own `task_fields` over all."""
        fields = {**argument_fields(self.args, lambda: len(self.data["train"]), None,
                                    self.tokenizer, notes), **fields, **self.task_fields}
        return Task(name=self.name, kind=kind, load_examples=self.load_examples,
                    encode=self.encode, collate=self.collate, build_model=self.build_model,
                    model_inputs=inputs, split_of=self.split_of, label_names=list(ANSWERS),
                    label_field="preferred", padding_side="right", decode=self.decode,
                    decode_input=self.decode_input,
                    max_length=getattr(self.args, "max_length", None), **fields)

    def task(self) -> Task:
        task = self.assembled("preference", INPUTS, self.notes)
        task.framework.notes = [f"from_trainer: a {type(self.trainer).__name__}'s pairs as it "
                              "prepared them, its collator and DPOConfig; the model is the "
                              "policy beside its " + (
                                  "frozen reference copy" if self.trainer.ref_model is not None
                                  else "base with the adapters off as the reference")
                              + f", scoring each answer by beta ({self.beta:g}) times its "
                              "log-ratio", *self.notes]
        return task


def from_preference(trainer: Any, fresh: Callable[[Callable[[Any], nn.Module]], nn.Module], *,
                    name: str, group_column: str | None, **task_fields: Any) -> Task:
    """A Task of the "preference" kind from a DPOTrainer as built: its prepared pairs, its
    collator, tokenizer and DPOConfig; `fresh(pick)` returns a copy of `pick(trainer)`
    as built (the pilot's fresh model)."""
    return PreferenceAdapter(trainer, fresh, name=name, group_column=group_column,
                             **task_fields).task()
