"""A task written the way users write theirs: batch norm and dropout in the model, a train_step
that begins with model.train() and clips, an evaluation loop of its own, a checkpoint that
carries the sampler and the step. Each option plants one classic
(tests/contract/test_own_code.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_

import workbook as wb
from examples.regression import Shuffle

CLASSES = ["low", "mid", "high"]


class Readings:
    """Twelve noisy features, three classes; a sensor is the group (unit of leakage)."""

    def __init__(self, n: int = 192):
        g = torch.Generator().manual_seed(0)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randn(n, 12, generator=g) + self.y[:, None].float()
        self.sensor = [f"s{i // 3}" for i in range(n)]


class Order(Shuffle):
    """A stateful shuffle (one generator advanced pass after pass) that remembers its seed."""

    def __init__(self, n: int, seed: int):
        super().__init__(n, seed)
        self.seed = seed


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(32, 3))


def make_train_step(mean_per_micro_batch: bool = False, label_smoothing: float = 0.0,
                    returns: str = "dict", clip_by_name: bool = False,
                    clip_norm: float = 1.0, divide_by: int = 1):
    def train_step(model, optimizer, micro_batches):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        total = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
        summed = 0.0
        for batch in micro_batches:
            logits = model(batch["x"])
            loss = nn.functional.cross_entropy(logits, batch["labels"], reduction="sum",
                                               label_smoothing=label_smoothing)
            # planted: each micro-batch's mean back-propagated as is (k times the gradient)
            # planted `divide_by`: divided again by hand, e.g. by the accumulation steps
            (loss / len(batch["labels"]) if mean_per_micro_batch else
             loss / total / divide_by).backward()
            summed += float(loss.detach()) / divide_by
        # as public scripts write it: imported by name, or through the module
        (clip_grad_norm_ if clip_by_name else torch.nn.utils.clip_grad_norm_)(
            model.parameters(), clip_norm)
        optimizer.step()
        mean = torch.tensor(summed / total)
        return {"loss": mean} if returns == "dict" else float(mean)
    return train_step


def make_eval_step(counts_padding: bool = False, leaves_eval_mode: bool = False,
                   no_eval_mode: bool = False):
    def eval_step(model, batch):
        was_training = model.training
        if not no_eval_mode:
            model.eval()
        with torch.no_grad():
            hits = model(batch["x"]).argmax(-1) == batch["labels"]
        weight = torch.ones_like(batch["example_weight"]) if counts_padding \
            else batch["example_weight"]
        if not leaves_eval_mode:
            model.train(was_training)
        return {"accuracy": (float((hits.float() * weight).sum()), float(weight.sum()))}
    return eval_step


def save_state(folder: Path, objects: dict) -> None:
    torch.save({name: obj.state_dict() for name, obj in objects.items() if obj is not None},
               Path(folder) / "training.pt")


def head_groups(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The head at ten times the body's rate, reached by position as scripts do."""
    head = list(model[-1].parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    return torch.optim.AdamW([{"params": body}, {"params": head, "lr": 10 * lr}], lr=lr)


def make_restore(reseeds_sampler: bool = False):
    def restore_state(folder: Path, objects: dict) -> None:
        state = torch.load(Path(folder) / "training.pt", weights_only=True)
        for name, obj in objects.items():
            if obj is not None and name in state:
                obj.load_state_dict(state[name])
        if reseeds_sampler and objects["sampler"] is not None:  # the order starts over
            objects["sampler"].generator.manual_seed(objects["sampler"].seed)
    return restore_state


def make_task(mean_per_micro_batch: bool = False, label_smoothing: float = 0.0,
              returns: str = "dict", eval_counts_padding: bool = False,
              eval_leaves_eval_mode: bool = False, eval_without_eval_mode: bool = False,
              restore_reseeds_sampler: bool = False, clip_by_name: bool = False,
              clip_norm: float = 1.0, head_lr_groups: bool = False,
              divide_by: int = 1) -> wb.Task:
    data = Readings()
    return wb.Task(
        name="careful-readings", kind="classification",
        load_examples=lambda: [{"id": i, "sensor": data.sensor[i],
                                "level": CLASSES[int(data.y[i])]} for i in range(len(data.y))],
        encode=lambda ex: {"x": data.x[ex["id"]], "labels": data.y[ex["id"]]},
        collate=torch.utils.data.default_collate, build_model=build_model,
        decode=lambda ids: ", ".join(CLASSES[int(i)] for i in ids),
        label_names=CLASSES, label_field="level", group_key="sensor", model_inputs=("x",),
        lr=3e-3,
        train_step=make_train_step(mean_per_micro_batch, label_smoothing, returns,
                                   clip_by_name, clip_norm, divide_by),
        eval_step=make_eval_step(eval_counts_padding, eval_leaves_eval_mode,
                                 eval_without_eval_mode),
        save_state=save_state, restore_state=make_restore(restore_reseeds_sampler),
        make_sampler=Order, **({"build_optimizer": head_groups} if head_lr_groups else {}))


task = make_task
