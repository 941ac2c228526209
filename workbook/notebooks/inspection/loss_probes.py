"""Notebook 01's loss probes: the task's loss on real logits (its target count, the positions
it reads, its label alignment), the model's own loss and its shift, targets that copy the
input, and padding or chance that changes outputs."""

from __future__ import annotations

import math

import torch

from ...contract.data import Item, collate_items
from ...contract.outputs import ModelOutputs
from ...contract.targets import IGNORE_INDEX, contributes, token_cross_entropy
from ...contract.task import Task
from ...storage.records import Flag
from .forward_failure import model_failure


def loss_probe(task: Task, model: torch.nn.Module, items: list[Item],
               outputs: ModelOutputs) -> list[Flag]:
    """Call the task's loss on real logits (`outputs`: the model's on these items, collated),
    then scramble the logits where nothing should count (label -100 or padding): the loss and
    its target count must not change."""
    batch = collate_items(task, items).tensors
    with torch.no_grad():
        logits = outputs.logits.float()
        try:
            loss, count = task.loss(logits, batch)
        except Exception as exc:  # e.g. a label id beyond the output layer
            return [model_failure(task, model, batch, items, exc, outputs=logits.shape[-1],
                                  step="loss")]
        labels = batch["labels"]
        own = own_loss_flags(task, outputs.loss, loss, count, items)
        if task.target_kind.float_targets:
            return (_count_flags(task, labels, count) + own
                    + padding_probe(task, model, items, logits)
                    + _padding_copy_flags(task, logits, batch, loss, count, items))
        loss2, count2 = _scrambled_loss(task, logits, batch, task.label_shift)
    flags = _count_flags(task, labels, count) + own
    if not torch.isclose(loss, loss2, rtol=1e-5, atol=1e-5) or int(count2) != int(count):
        flags.append(_misread(task, logits, batch, loss, loss2, items))
    if not task.target_kind.sampled:  # a policy draws each prompt's completions unpadded:
        # a batch that changes its rewards is a reward reading its batch (the kind's audit)
        flags += padding_probe(task, model, items, logits)
    return flags


def own_loss_flags(task: Task, own: torch.Tensor | None, loss: torch.Tensor, count,
                   items: list[Item]) -> list[Flag]:
    """A model that computes its own loss (given the labels, as nanoGPT's forward(idx,
    targets) and Hugging Face models do): on the same batch it must equal the task's loss per
    target - the campaign trains on the model's, every check of the pilot reads the task's."""
    if own is None:
        return []
    ids = [it.id for it in items[:5]]
    if own.numel() != 1:
        return [Flag("model's own loss", f"the model's own loss is a tensor of shape "
                     f"{list(own.shape)}, not one number", 1, "return the mean over the "
                     "targets (a 0-d tensor), or set loss_at to where that is", ids)]
    mean = float(loss) / float(count) if float(count) else float("nan")
    if math.isclose(float(own), mean, rel_tol=2e-5, abs_tol=1e-6):
        return []
    return [Flag("model's own loss", f"the model's own loss {float(own):.4f} is not the task's "
                 f"loss {mean:.4f} ({float(loss):.4g} summed over {float(count):g} targets) on "
                 "the same batch: the campaign trains on the model's loss, the pilot checks "
                 "the task's", 1,
                 "make them read the same targets: labels shifted in the data are not shifted "
                 "again inside the forward, and both ignore -100 (or set the task's loss to "
                 "what the model computes)", ids)]


def _count_flags(task: Task, labels: torch.Tensor, count) -> list[Flag]:
    """The loss's target count must be the number of targets (a mean with count 1 weighs
    micro-batches instead of targets when updates accumulate)."""
    expected = task.target_count(labels)
    if float(count) == expected or task.target_kind.sampled:  # counts what the forward drew
        return []
    what = task.target_kind.target_words
    return [Flag("loss target count", f"loss reports {float(count):g} targets, the batch has "
                 f"{expected} {what}", abs(int(float(count)) - expected),
                 f"return (summed loss, number of {what}) from the task's loss - not a mean")]


def _padding_copy_flags(task: Task, logits: torch.Tensor, batch: dict, loss: torch.Tensor,
                        count, items: list[Item]) -> list[Flag]:
    """Regression: evaluation pads its last batch with copies whose targets are NaN; the loss
    must skip them (finite, and the count drops by the copy's targets)."""
    labels = batch["labels"].clone()
    labels[0] = float("nan")
    probe = {**batch, "labels": labels}
    loss2, count2 = task.loss(logits, probe)
    dropped = int(contributes(batch["labels"][0]).sum())
    if math.isfinite(float(loss2)) and float(count2) == float(count) - dropped:
        return []
    return [Flag("loss reads padding copies", f"with NaN targets on one example (as on the "
                 f"padding copies of an evaluation's last batch) the loss is {float(loss2):.4g} "
                 f"over {float(count2):g} targets", 1,
                 "skip NaN targets in the loss (labels.isnan()), as the default loss does",
                 [items[0].id])]


def _scrambled_loss(task: Task, logits: torch.Tensor, batch: dict, shift: int):
    """The loss with the logits scrambled where no target (aligned by `shift`) reads them."""
    labels = batch["labels"]
    ignored = task.target_kind.targets(labels, shift) == IGNORE_INDEX
    if labels.dim() > 1 and "attention_mask" in batch:
        ignored = ignored | (batch["attention_mask"] == 0)
    scrambled = logits + 50 * torch.randn_like(logits) * ignored.unsqueeze(-1)
    return task.loss(scrambled, batch)


def _misread(task: Task, logits: torch.Tensor, batch: dict, loss: torch.Tensor,
             loss2: torch.Tensor, items: list[Item]) -> Flag:
    """The loss read logits no declared target reads: is it the other label alignment?"""
    other = 1 - task.label_shift
    if task.target_kind.shifts_labels and batch["labels"].dim() > 1:
        loss3, _ = _scrambled_loss(task, logits, batch, other)
        if torch.isclose(loss, loss3, rtol=1e-5, atol=1e-5):
            said = {0: "labels aligned with the logits (position t predicts labels[t])",
                    1: "labels shifted by one (position t predicts labels[t + 1], the Hugging "
                       "Face causal-LM convention)"}
            own = task.loss_computed_by()
            return Flag("label alignment", f"the loss uses {said[other]}, but the task "
                        f"declares label_shift={task.label_shift}: every per-token check would "
                        "pair positions with the wrong targets", 1,
                        f"set label_shift={other} in the Task (or make the loss match the "
                        "declaration)" + (f"; {own} computes the loss the campaign trains "
                                          "on: check it aligns the labels as the declaration "
                                          "says" if own else ""), [it.id for it in items])
    return Flag("loss reads ignored positions", f"the loss changed from {float(loss):.4f} to "
                f"{float(loss2):.4f} when only ignored/padded positions changed", 1,
                "compute the loss only where labels != -100 (ignore_index=-100)",
                [it.id for it in items])


def own_loss_shift(task: Task, items: list[Item], out: ModelOutputs | None) -> int | None:
    """Generation whose model computes its own loss: the label shift that loss applies (0: it
    reads labels[t] at position t, as nanoGPT's; 1: it shifts them, as Hugging Face causal LMs
    do), read by comparing it with the cross-entropy at each shift (`out`: the model's outputs
    on these items, None when its forward failed); None otherwise."""
    if not task.target_kind.shifts_labels or task.loss_computed_by() is None or not items or \
            out is None or out.loss is None or out.loss.numel() != 1 or out.logits.dim() != 3:
        return None
    batch = collate_items(task, items).tensors
    for shift in (0, 1):
        summed, count = token_cross_entropy(out.logits.float(), batch, shift)
        if float(count) and math.isclose(float(out.loss), float(summed) / float(count),
                                         rel_tol=2e-5, abs_tol=1e-6):
            return shift
    return None


def copy_audit(task: Task, items: list[Item], share: float = 0.9,
               model_shift: int | None = None) -> list[Flag]:
    """Generation: when nearly every position is trained to output its own input token, the
    model learns to copy - labels aligned with input_ids (the Hugging Face convention) while
    neither the loss nor `label_shift` moves them by one."""
    if not task.target_kind.shifts_labels or not items:
        return []
    copying = total = 0
    for it in items[:64]:
        ids, targets = task.main_input(it.tensors).reshape(-1), task.targets(it.tensors["labels"])
        targets = targets.reshape(-1)
        if ids.shape != targets.shape:
            return []
        keep = targets != IGNORE_INDEX
        copying += int((targets[keep] == ids[keep]).sum())
        total += int(keep.sum())
    if not total or copying / total < share:
        return []
    own = task.loss_computed_by() if model_shift != 1 else None  # a model that shifts
    fix = ("shift the targets by one where the data are made (targets = the tokens one "
           f"position on: y = data[i + 1:i + 1 + T]): {own} computes the loss the campaign "
           "trains on, which label_shift does not move" if own else
           "labels aligned with input_ids need a shift by one: set label_shift=1 (the default "
           "loss then shifts), or shift them in encode")
    return [Flag("targets copy the input", f"{copying} of {total} targets equal the input token "
                 "at the same position: the model is trained to copy its input, not to predict "
                 "the next token", 1, fix, [it.id for it in items[:5]])]


def padding_probe(task: Task, model: torch.nn.Module, items: list[Item],
                  batched: torch.Tensor) -> list[Flag]:
    """An example's outputs must not depend on the padding its batch neighbours add (nor on
    chance: a model whose eval outputs vary between two identical calls is named as such)."""
    changed = []
    batch = collate_items(task, items).tensors
    side = task.side(batch)
    with torch.no_grad():
        if not torch.equal(task.forward(model, batch).float(), batched):
            return [Flag("random outputs in eval mode", "two forward passes on the same batch "
                         "in eval mode disagree: dropout (or another random layer) stays "
                         "active in evaluation", 1, "make random layers follow "
                         "model.eval() (nn.Dropout does; a functional dropout needs "
                         "training=self.training)", [it.id for it in items[:5]])]
        for b, it in enumerate(items):
            one = collate_items(task, [it]).tensors
            try:
                alone = task.forward(model, one).float()[0]
            except Exception as exc:  # batched it ran: this example alone does not
                return [model_failure(task, model, one, [it], exc)]
            mine = task.real_part(batched[b], alone.shape[0], side) if alone.dim() > 1 \
                else batched[b]
            if not torch.allclose(alone, mine, rtol=1e-4, atol=1e-4):
                changed.append(it.id)
    if not changed:
        return []
    return [Flag("padding changes outputs", f"{len(changed)} examples get other outputs when "
                 f"batched with longer ones ({side}-padded)", len(changed),
                 "pass the attention mask to the model and mask padding in attention/pooling"
                 + ("; with left padding, derive position ids from the mask"
                    if side == "left" else ""),
                 changed[:5])]
