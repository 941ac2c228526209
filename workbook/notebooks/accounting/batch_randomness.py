"""Notebook 04's experiments on the campaign's own randomness: does the task's collate or its
train_step draw new random numbers for every batch (the same examples twice, under the same seed
and under another), and does it mix the examples of a batch (mixup, cutmix: an example's row
changes when the other examples of its batch change)? 04 then holds the draw fixed - one
collated batch, the same seed - or says the data differed; it never blames the loss for it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from ...contract.data import Item
from ...contract.task import Task
from ...training.deviation import relative_deviation
from .own_code_checks import one_draw, run_own_step

TINY = 1e-6  # relative differences at or below it are the same draw


@dataclass(frozen=True)
class Draws:
    """What two calls on the same examples showed, for the `where` that draws ("collate" or
    "train_step"): the relative difference under another seed and under the same seed, and
    whether an example's row depends on the batch's other examples (None: not testable)."""

    where: str
    examples: int
    other_seed: float
    same_seed: float
    mixes: bool | None
    changes_inputs: bool = False  # train_step: the model received other inputs than the batch's
    split_anew: float | None = None  # the loop's gradient, 2 micro-batches collated anew vs one
    piece: str = "collate"  # the task's field that collates training batches

    @property
    def draws(self) -> bool:
        return self.other_seed > TINY or self.same_seed > TINY

    @property
    def held(self) -> bool:
        """A seed holds the draw: two calls under the same seed are the same."""
        return self.same_seed <= TINY

    def measured(self) -> str:
        """What the experiment showed, in words."""
        what = (f"the same {self.examples} examples collated twice differ by "
                if self.where == "collate" else
                f"the same collated batch of {self.examples} examples given to it twice (the "
                f"same weights) gives gradients apart by ")
        said = what + (f"{self.other_seed:.3g} (relative) under another seed and " +
                       ("not at all under the same seed" if self.held else
                        f"by {self.same_seed:.3g} under the same seed too: it draws from a "
                        "source no seed here reaches (its own generator), so two runs read "
                        "different data"))
        if self.changes_inputs:
            said += "; the model received other inputs than the collated batch's"
        if self.mixes:
            said += ("; an example's row changes when the other examples of its batch change: "
                     "batch-level mixing such as mixup/cutmix")
        return said

    def words(self) -> str:
        """The note 04 gives: what was measured and what 04 did about it."""
        if self.where == "collate":
            anew = ("" if self.split_anew is None else
                    f" - collated anew per micro-batch, a split mixes other pairs with other "
                    f"weights and the loop's own exact gradient differs by "
                    f"{self.split_anew:.3g}, as expected: not a normalisation error")
            return (f"your {self.piece} draws new random numbers for every batch it collates: "
                    f"{self.measured()}. This is the campaign's own randomness, not a bug: 04 "
                    f"held it fixed - every comparison uses one collated batch, each split's "
                    f"micro-batches being rows of the whole update collated once{anew}")
        mixing = self.mixes or self.changes_inputs
        return (f"your train_step draws new random numbers on every call: {self.measured()}. "
                "The loss it returns and its gradient are over what it drew, so 04 does not "
                "compare them with `loss` on the collated batch or across splits" +
                (" (each micro-batch mixes other examples)" if self.mixes else "") +
                ": the data differed, which says nothing against your loss or your "
                "normalisation - to judge them, run 04 with " +
                ("the mixing off (e.g. mixup and cutmix alpha 0), or draw it in the collate, "
                 "where 04 holds one draw fixed" if mixing else "that randomness off"))


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The relative difference of two dicts of tensors (1 where their shapes differ)."""
    try:
        return relative_deviation({k: v.float() for k, v in a.items()},
                                  {k: v.float() for k, v in b.items()})
    except RuntimeError:
        return 1.0


def first_rows(tensors: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: v[:1] for k, v in tensors.items() if v.dim() and len(v) == n}


def collate_draws(task: Task, items: list[Item], seed: int = 0) -> Draws:
    """The task's training collate on the same `items` under the same seed, another seed, and
    the other examples in reverse order (does the first example's row depend on them?)."""
    n = len(items)
    piece = "train_collate" if task.train_collate is not None else "collate"

    def collated(its: list[Item], s: int) -> dict[str, torch.Tensor]:
        return one_draw(task, its, s).tensors

    first = collated(items, seed)
    same, other = difference(collated(items, seed), first), difference(collated(items, seed + 1),
                                                                       first)
    draws = Draws("collate", n, other, same, None, piece=piece)
    if draws.draws and draws.held and n > 2:
        swapped = collated([items[0], *items[:0:-1]], seed)
        draws = Draws("collate", n, other, same,
                      difference(first_rows(swapped, n), first_rows(first, n)) > TINY,
                      piece=piece)
    return draws


@contextlib.contextmanager
def received(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """The first tensor the model's first forward call received in the block."""
    got: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        if not got:
            got.extend([t.detach().clone() for t in (*args, *kwargs.values())
                        if isinstance(t, torch.Tensor)][:1])
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield got
    finally:
        handle.remove()


def step_draws(task: Task, items: list[Item], seed: int = 0) -> Draws:
    """The task's train_step on one collated batch of `items`, three times - the same seed
    twice, another once - then with the other rows in reverse order; what the model received
    is compared with the batch's first model input."""
    n = len(items)
    batch = one_draw(task, items, seed).tensors
    torch.manual_seed(seed)
    model = task.build_model().eval()

    def call(tensors: dict[str, torch.Tensor], s: int):
        with received(model) as got:
            grads = run_own_step(task, model, [tensors], s).grads
        return grads, got[0] if got else None

    first, seen = call(batch, seed)
    same, other = difference(call(batch, seed)[0], first), difference(call(batch, seed + 1)[0],
                                                                      first)
    given = batch.get(task.model_inputs[0]) if task.model_inputs else None
    changes = (seen is not None and given is not None and seen.shape == given.shape and
               difference({"x": seen}, {"x": given}) > TINY)
    draws = Draws("train_step", n, other, same, None, changes)
    if draws.draws and draws.held and changes and n > 2:
        order = torch.tensor([0, *range(n - 1, 0, -1)])
        swapped = {k: v.index_select(0, order) if v.dim() and len(v) == n else v
                   for k, v in batch.items()}
        _, seen_swapped = call(swapped, seed)
        mixes = seen_swapped is not None and \
            difference({"x": seen_swapped[:1]}, {"x": seen[:1]}) > TINY
        draws = Draws("train_step", n, other, same, mixes, changes)
    return draws
