"""The work of each training phase, written once: the gates run it on real tensors and measure
it, the prediction runs it on fake tensors (no memory allocated) and tracks it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..contract.data import Batch, Item, collate_items
from ..contract.outputs import eval_mode
from ..contract.task import Task
from .devices import PRECISIONS, resolve_device
from .loop import Stepper, TrainConfig, UpdateShape, build_stepper
from .memory import measure, rebased, state_tensors, storage_bytes

TRAINING_PHASES = ("forward + loss", "backward", "update (first)", "update (later)", "validation")
CHECKPOINT_SAVE = "checkpoint save"  # under FSDP, the phase after the training phases: a DCP save
SHARDED_PHASES = (*TRAINING_PHASES, CHECKPOINT_SAVE)


@dataclass
class Plan:
    """A configuration to size: the shape of an update and of evaluation."""

    shape: UpdateShape
    length: int | None = None  # positions per sequence (None: the data's longest)
    eval_batch: int | None = None  # default: the micro-batch
    eval_length: int | None = None  # default: `length`

    def label(self) -> str:
        shape = self.shape
        return (f"mb{shape.micro_batch} x acc{shape.accumulation} len{self.length or 'data'} "
                f"{shape.precision}{' +ckpt' if shape.activation_checkpointing else ''}")


def multi_tensor_step(optimizer: torch.optim.Optimizer) -> None:
    """The multi-tensor step where the optimizer leaves the choice to PyTorch (foreach=None:
    multi-tensor on CUDA, per tensor on the CPU): the rental's step and its temporaries, sized
    and measured alike."""
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = True


def targets_of(task: Task, batch: Batch) -> int:
    """Contributing targets of a (real) batch, counted from its labels as the task aligns
    them."""
    return task.target_count(batch.tensors["labels"])


def longest(task: Task, items: list[Item], n: int) -> list[Item]:
    """The n longest items (cycled when there are fewer): the worst case for memory."""
    ranked = sorted(items, key=lambda it: task.length(it.tensors), reverse=True)
    return [ranked[i % len(ranked)] for i in range(n)]


def shaped_batch(task: Task, items: list[Item], micro_batch: int,
                 length: int | None = None) -> Batch:
    """A micro-batch of the longest items, stretched to `length` positions when asked, to size
    configurations beyond the data. Each stretched row is one real sequence (its per-position
    tensors tiled, every position attended, positions counting up) and the task's own collate
    pads and masks the batch. A batch of two rows or more is padded, as a campaign's batches
    are (the last row one position short when none is): models such as Hugging Face's take a
    different, larger attention path for a padded batch, and that is the one to size - unless
    every item has one length (fixed-length blocks, `run_clm`'s `group_texts`): that collate is
    never given rows of two lengths (`default_data_collator` stacks them), so none is shortened.
    Tasks without an attention mask have no sequence: `length` does not apply to them."""
    chosen = longest(task, items, micro_batch)
    batch = collate_items(task, chosen)
    main, mask = task.main_input(batch.tensors), batch.tensors.get("attention_mask")
    # a sequence task pads and masks; anything else (fixed features) has no length to stretch
    seq = main.shape[1] if mask is not None and mask.shape == main.shape[:2] else None
    padded = micro_batch > 1 and len({task.length(it.tensors) for it in items}) > 1
    if seq is None or (length in (None, seq) and (not padded or not bool(mask.all()))):
        return batch
    length = length or seq
    rows = [stretch(task, it, length - (i == micro_batch - 1 and padded))
            for i, it in enumerate(chosen)]
    return collate_items(task, rows)


def sized_batches(task: Task, train: list[Item], val: list[Item],
                 plan: Plan) -> tuple[Batch, list[Batch], Batch]:
    """Real batches of the planned shapes: the phase batch, one update's group, an eval batch."""
    micro = plan.shape.micro_batch
    batch = shaped_batch(task, train, micro, plan.length)
    group = [shaped_batch(task, train[i:] + train[:i], micro, plan.length)
             for i in range(plan.shape.accumulation)]
    eval_batch = shaped_batch(task, val, plan.eval_batch or micro,
                              plan.eval_length or plan.length)
    return batch, group, eval_batch


def stretch(task: Task, item: Item, length: int) -> Item:
    """One example tiled to `length` positions: every tensor laid out along the sequence is
    repeated and cut; an attention mask becomes all ones and position ids count up (a tiled mask
    would leave holes, tiled positions would restart - read as packed sequences)."""
    n = task.length(item.tensors)
    tensors = {}
    for key, t in item.tensors.items():  # a plain value encode returned (an int label) stays
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == n:
            t = t.repeat(math.ceil(length / n), *[1] * (t.dim() - 1))[:length]
            if key == "attention_mask":
                t = torch.ones_like(t)
            elif key == "position_ids":
                t = torch.arange(length).to(t)
        tensors[key] = t
    return Item(item.id, tensors)


@dataclass
class Workload:
    """One micro-batch, one update's micro-batches and one eval batch, and the phases over them.
    Each phase leaves in `state` what the next needs (the loss graph, the logits)."""

    stepper: Stepper
    batch: Batch
    group: list[Batch]
    eval_batch: Batch
    targets: int
    group_targets: int
    state: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        """Every batch tensor, alive for the whole run."""
        batches = [self.batch, *self.group, self.eval_batch]
        return [t for b in batches for t in b.tensors.values()]

    def forward(self) -> None:
        logits, loss_sum, count = self.stepper.forward_loss(self.batch)
        self.state.update(logits=logits.detach(), loss_sum=loss_sum, count=count)

    def backward(self) -> None:
        loss_sum = self.state.pop("loss_sum")
        self.state.pop("logits")
        self.stepper.backward(loss_sum)
        self.state["loss"] = loss_sum.detach()
        del loss_sum
        self.stepper.normalise(self.targets)

    def update_first(self) -> None:
        self.state["grad_norm"] = self.stepper.step()

    def update_later(self) -> None:
        loss_sum, _ = self.stepper.accumulate(self.group, self.group_targets)
        self.state["later_loss"] = loss_sum
        self.state["grad_norm"] = self.stepper.step()

    def validation(self) -> None:
        model, dtype = self.stepper.model, PRECISIONS[self.stepper.precision]
        with eval_mode(model), torch.autocast(self.stepper.device.type, dtype=dtype,
                                              enabled=dtype is not None):
            self.state["eval_logits"] = self.stepper.task.forward(model, self.eval_batch.tensors)

    def run(self, phase: str) -> None:
        {"forward + loss": self.forward, "backward": self.backward,
         "update (first)": self.update_first, "update (later)": self.update_later,
         "validation": self.validation}[phase]()


def measured_peaks(task: Task, cfg: TrainConfig, batch: Batch, group: list[Batch],
                   eval_batch: Batch) -> dict[str, int]:
    """Peak allocated bytes of every training phase of one real workload on the configured
    device, measured as the gates measure them (each phase from what the previous one left)."""
    device = resolve_device(cfg.device)
    stepper = build_stepper(task, cfg)
    work = Workload(stepper, batch.to(device), [b.to(device) for b in group],
                    eval_batch.to(device), targets_of(task, batch),
                    sum(targets_of(task, b) for b in group))
    live = storage_bytes(state_tensors(stepper.model, stepper.optimizer, work.tensors()))
    peaks = {}
    for phase in TRAINING_PHASES:
        with measure(device) as held:
            work.run(phase)
        reading = rebased(held.reading, live)
        live, peaks[phase] = reading.allocated_bytes, reading.peak_allocated_bytes
    return peaks
