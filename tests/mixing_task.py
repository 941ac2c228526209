"""An image classifier trained in torchvision's references/classification idiom: mixup and cutmix
drawn anew for every collated batch (examples/torchvision_recipe.py's `RandomMixup` /
`RandomCutmix`, as the reference's transforms.py writes them, chosen by `RandomChoice` from
Python's `random`), soft targets and label smoothing in the loss, the script's own step
brought in as `train_step`. Options: `mixing` - "collate" (the reference: `collate_fn =
mixupcutmix(*default_collate(batch))`), "step" (the mixing moved into the step, one collate
serving training and evaluation) or "" (off: the clean twin); `unseeded` mixes up only, its
weight from the script's own NumPy generator, which no seed reaches; `mean_per_micro_batch`
plants the classic wrong normalisation (tests/notebooks/test_accounting.py)."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import default_collate

import workbook as wb
from examples.torchvision_recipe import RandomCutmix, RandomMixup

CLASSES = ["cat", "dog", "ship", "truck"]


class RandomChoice:
    """torchvision.transforms.RandomChoice: one of the transforms, by Python's `random`."""

    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, *args):
        return random.choice(self.transforms)(*args)


def build_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, len(CLASSES)))


def smoothed_loss(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.CrossEntropyLoss(label_smoothing=0.1) summed: class ids or mixed (soft) targets."""
    loss = F.cross_entropy(logits.float(), batch["labels"], reduction="sum",
                           label_smoothing=0.1)
    return loss, torch.tensor(float(len(batch["labels"])))


def make_task(mixing: str = "collate", mean_per_micro_batch: bool = False,
              unseeded: bool = False) -> wb.Task:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, len(CLASSES), (96,), generator=g)
    x = torch.randn(96, 3, 8, 8, generator=g) + y[:, None, None, None].float()
    if unseeded:  # mixup alone, its weight from the script's own generator
        mixupcutmix = RandomChoice([RandomMixup(len(CLASSES), p=1.0, alpha=0.2,
                                                rng=np.random.default_rng())])
    else:
        mixupcutmix = RandomChoice([RandomMixup(len(CLASSES), p=1.0, alpha=0.2),
                                    RandomCutmix(len(CLASSES), p=1.0, alpha=1.0)])

    def collate(examples):
        images, target = default_collate(examples)
        if mixing == "collate":
            images, target = mixupcutmix(images, target)
        return {"x": images, "labels": target}

    def train_step(model, optimizer, micro_batches):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        total = sum(len(b["labels"]) for b in micro_batches)
        summed = 0.0
        for batch in micro_batches:
            images, target = batch["x"], batch["labels"]
            if mixing == "step":
                images, target = mixupcutmix(images, target)
            loss, _ = smoothed_loss(model(images), {"labels": target})
            (loss / len(target) if mean_per_micro_batch else loss / total).backward()
            summed += float(loss.detach())
        optimizer.step()
        return torch.tensor(summed / total)

    return wb.Task(
        name="mixup-cutmix", kind="classification",
        load_examples=lambda: [{"id": i, "group": f"g{i // 2}", "label": CLASSES[int(y[i])]}
                               for i in range(len(y))],
        encode=lambda ex: {"x": x[ex["id"]], "labels": y[ex["id"]]},
        collate=lambda items: collate([(it["x"], it["labels"]) for it in items]),
        build_model=build_model, decode=lambda ids: ", ".join(CLASSES[int(i)] for i in ids),
        loss=smoothed_loss, label_names=CLASSES, label_field="label", model_inputs=("x",),
        train_step=train_step)


task = make_task
