"""An image classifier trained the way torchvision's `references/classification/train.py` trains
one with `--mixup-alpha 0.2 --cutmix-alpha 1.0`: the train loader's `collate_fn` is
`lambda batch: mixupcutmix(*default_collate(batch))`, where `mixupcutmix` is
`RandomChoice([RandomMixup(num_classes, p=1.0, alpha=mixup_alpha), RandomCutmix(num_classes,
p=1.0, alpha=cutmix_alpha)])` - one draw of the mixing per collated batch (which transform, its
lambda from a Beta(alpha, alpha), the cut box), the batch mixed with itself rolled by one, the
targets turned into soft one-hot rows. `train_one_epoch` is the task's `train_step`: `output =
model(image); loss = criterion(output, target)` with `nn.CrossEntropyLoss(label_smoothing=0.1)`
on those soft targets. torchvision is not needed: `RandomMixup` and `RandomCutmix` are written
out here as the reference's `transforms.py` writes them (`torch.distributions.Beta` for the
lambda).

Source: pytorch/vision#5388-era reference scripts (`references/classification/transforms.py`,
`RandomMixup`/`RandomCutmix`), the batch-level augmentation of the "How to train
state-of-the-art models" recipe; the mixing is random per collated batch, so the same examples
collated twice are two different batches.

Planted (`mixup_alpha=0.2, cutmix_alpha=1.0`, the recipe's values): notebook 04 collates the
same examples into one batch and into micro-batches and finds the gradients and losses apart -
the cause is the random batch-level mixing, not the step. Clean twin (`mixup_alpha=0,
cutmix_alpha=0`): the reference without `--mixup-alpha`/`--cutmix-alpha` (default_collate,
one-hot targets).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import workbook as wb

NUM_CLASSES = 4
CLASSES = ["circle", "square", "cross", "stripe"]


class RandomMixup(nn.Module):
    """Mixup on a batch (batch, target): the batch mixed with itself rolled by one."""

    def __init__(self, num_classes: int, p: float = 0.5, alpha: float = 1.0):
        super().__init__()
        self.num_classes, self.p, self.alpha = num_classes, p, alpha

    def forward(self, batch: torch.Tensor, target: torch.Tensor):
        batch = batch.clone()
        if target.ndim == 1:
            target = F.one_hot(target, num_classes=self.num_classes).to(dtype=batch.dtype)
        if torch.rand(1).item() >= self.p:
            return batch, target
        batch_rolled, target_rolled = batch.roll(1, 0), target.roll(1, 0)
        lambda_param = float(torch.distributions.Beta(self.alpha, self.alpha).sample())
        batch = batch.mul(lambda_param).add(batch_rolled.mul(1.0 - lambda_param))
        target = target.mul(lambda_param).add(target_rolled.mul(1.0 - lambda_param))
        return batch, target


class RandomCutmix(nn.Module):
    """CutMix on a batch: a box of the rolled batch pasted in, targets mixed by its area."""

    def __init__(self, num_classes: int, p: float = 0.5, alpha: float = 1.0):
        super().__init__()
        self.num_classes, self.p, self.alpha = num_classes, p, alpha

    def forward(self, batch: torch.Tensor, target: torch.Tensor):
        batch = batch.clone()
        if target.ndim == 1:
            target = F.one_hot(target, num_classes=self.num_classes).to(dtype=batch.dtype)
        if torch.rand(1).item() >= self.p:
            return batch, target
        batch_rolled, target_rolled = batch.roll(1, 0), target.roll(1, 0)
        lambda_param = float(torch.distributions.Beta(self.alpha, self.alpha).sample())
        H, W = batch.shape[-2:]
        r_x, r_y = torch.randint(W, (1,)), torch.randint(H, (1,))
        r = 0.5 * math.sqrt(1.0 - lambda_param)
        r_w_half, r_h_half = int(r * W), int(r * H)
        x1, y1 = int(torch.clamp(r_x - r_w_half, min=0)), int(torch.clamp(r_y - r_h_half, min=0))
        x2, y2 = int(torch.clamp(r_x + r_w_half, max=W)), int(torch.clamp(r_y + r_h_half, max=H))
        batch[:, :, y1:y2, x1:x2] = batch_rolled[:, :, y1:y2, x1:x2]
        lambda_param = float(1.0 - (x2 - x1) * (y2 - y1) / (W * H))
        target = target.mul(lambda_param).add(target_rolled.mul(1.0 - lambda_param))
        return batch, target


class RandomChoice(nn.Module):
    def __init__(self, transforms: list):
        super().__init__()
        self.transforms = transforms

    def forward(self, *args):
        return self.transforms[int(torch.randint(len(self.transforms), (1,)))](*args)


def images() -> list[dict]:
    """32 8x8 three-channel pictures of four shapes, with noise."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(40):
        k = i % NUM_CLASSES
        img = torch.zeros(3, 8, 8)
        if k == 0:
            yy, xx = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
            img[:, ((yy - 3.5) ** 2 + (xx - 3.5) ** 2) < 8] = 1.0
        elif k == 1:
            img[:, 2:6, 2:6] = 1.0
        elif k == 2:
            img[:, 3:5, :] = 1.0
            img[:, :, 3:5] = 1.0
        else:
            img[:, ::2, :] = 1.0
        img = img + 0.3 * torch.randn(3, 8, 8, generator=g)
        out.append({"id": i, "group": i, "image": img, "label": CLASSES[k]})
    return out


IMAGES = images()


def split_of(example: dict) -> str:
    return "train" if example["id"] < 32 else "validation" if example["id"] < 36 else "test"


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.fc = nn.Linear(32, NUM_CLASSES)

    def forward(self, image):
        return self.fc(self.features(image))


def task(mixup_alpha: float = 0.2, cutmix_alpha: float = 1.0) -> wb.Task:
    mixup_transforms = []
    if mixup_alpha > 0.0:
        mixup_transforms.append(RandomMixup(NUM_CLASSES, p=1.0, alpha=mixup_alpha))
    if cutmix_alpha > 0.0:
        mixup_transforms.append(RandomCutmix(NUM_CLASSES, p=1.0, alpha=cutmix_alpha))
    mixupcutmix = RandomChoice(mixup_transforms) if mixup_transforms else None

    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    def collate_fn(batch: list[dict]) -> dict:
        image = torch.stack([b["image"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        real = labels >= 0  # the workbook's padding copies carry -100
        target = F.one_hot(labels.clamp(min=0), NUM_CLASSES).float() * real[:, None]
        if mixupcutmix is not None:
            image, target = mixupcutmix(image, target)
        return {"image": image, "labels": labels, "target": target}

    def loss(logits, batch):
        real = batch["labels"] >= 0
        per_row = F.cross_entropy(logits, batch["target"], label_smoothing=0.1,
                                  reduction="none")
        return (per_row * real).sum(), real.sum()

    def train_step(model, optimizer, micro_batches):  # train_one_epoch, one update
        model.train()
        optimizer.zero_grad()
        rows = sum(len(b["image"]) for b in micro_batches)
        total = 0.0
        for batch in micro_batches:
            output = model(batch["image"])
            loss_value = criterion(output, batch["target"]) * len(batch["image"]) / rows
            loss_value.backward()
            total += loss_value.item()
        optimizer.step()
        return total

    return wb.Task(
        name="mixup-collate", kind="classification",
        load_examples=lambda: list(IMAGES),
        encode=lambda ex: {"image": ex["image"],
                           "labels": torch.tensor(CLASSES.index(ex["label"]))},
        collate=collate_fn, build_model=SmallNet,
        decode=lambda ids: ", ".join(CLASSES[int(i)] for i in ids),
        model_inputs=("image",), label_names=CLASSES, label_field="label",
        split_of=split_of, loss=loss, train_step=train_step, lr=1e-2,
        build_optimizer=lambda model, lr: torch.optim.SGD(model.parameters(), lr=lr,
                                                          momentum=0.9, weight_decay=1e-4))
