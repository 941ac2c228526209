"""An image classifier trained by torchvision's reference recipe (`references/classification`:
`train.py --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 --norm-weight-decay 0.0
--lr-warmup-method linear --lr-warmup-epochs 1 --model-ema --model-ema-steps 2`), as a Task
with no glue. A small ResNet-style CNN stands in for ResNet-18 (torchvision is not installed
here) on 3x16x16 synthetic images of four shapes; mixup and cutmix are written as
`references/classification/transforms.py` writes them, drawing a mixing weight from a Beta
distribution for every collated batch. The recipe's three pieces each have a field:

- `train_collate`: mixup/cutmix, the script's `collate_fn`; evaluation keeps `collate`;
- `scheduler_interval="pass"`: the script's per-epoch schedule (linear warm-up, then cosine);
- `averaged_model` / `average_every`: the script's `ExponentialMovingAverage` (an
  `AveragedModel` with `get_ema_multi_avg_fn`, over parameters and buffers), updated every
  `--model-ema-steps` updates, evaluated beside the model and in every checkpoint.

    python -m workbook pilot --task examples.torchvision_recipe:task --smoke

The workbook counts targets by `labels` (class ids), so the mixed one-hot targets travel beside
them as `mixed_targets`; the loss (the script's `CrossEntropyLoss(label_smoothing=...)`) reads
them when present. Options: `label_smoothing`, `mixup_alpha`, `cutmix_alpha` (0 turns one off),
`ema_steps`, `ema_decay`, `ema_in_checkpoint=False` (planted: a save_state that leaves the
averaged model out, so a resume starts it afresh).
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import default_collate

import workbook as wb

CLASSES = ["blob", "horizontal", "vertical", "checker"]
SIZE = 16
LR = 0.05  # --lr (SGD with momentum, as the script's default optimizer)
EPOCHS = 10  # --epochs, when the run being built does not say how many passes it makes
WARMUP_EPOCHS = 1  # --lr-warmup-epochs
WARMUP_DECAY = 0.01  # --lr-warmup-decay: the warm-up's start factor


def images(sources: int = 64, copies: int = 3, seed: int = 0) -> tuple[torch.Tensor, list, list]:
    """`sources` base images (class = source % 4) in three channels, each with noisy copies."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(SIZE).float(), torch.arange(SIZE).float(),
                            indexing="ij")
    out, labels, groups = [], [], []
    for s in range(sources):
        label = s % len(CLASSES)
        period = 2.0 + float(torch.randint(0, 3, (1,), generator=g))
        cy, cx = (3 + 10 * torch.rand(2, generator=g)).tolist()
        base = [torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 6.0),
                0.5 + 0.5 * torch.sin(2 * math.pi * yy / period),
                0.5 + 0.5 * torch.sin(2 * math.pi * xx / period),
                ((yy // period + xx // period) % 2).float()][label]
        for _ in range(copies):
            out.append(base.expand(3, SIZE, SIZE) + 0.15 * torch.randn(3, SIZE, SIZE,
                                                                      generator=g))
            labels.append(label)
            groups.append(f"src{s:03d}")
    x = torch.stack(out)
    return (x - x.mean()) / x.std(), labels, groups


class Mixing(nn.Module):
    """What transforms.py's RandomMixup and RandomCutmix share: one-hot targets, the chance `p`
    of mixing at all, and the weight ~ Beta(alpha, alpha) (from `rng`, a script's own NumPy
    generator, when given: no seed reaches it)."""

    def __init__(self, num_classes: int, p: float = 1.0, alpha: float = 1.0, rng=None):
        super().__init__()
        self.num_classes, self.p, self.alpha, self.rng = num_classes, p, alpha, rng

    def weight(self) -> float:
        return float(self.rng.beta(self.alpha, self.alpha)) if self.rng is not None else \
            float(torch.distributions.Beta(self.alpha, self.alpha).sample())

    def forward(self, batch: torch.Tensor, target: torch.Tensor):
        if target.ndim == 1:
            target = F.one_hot(target, num_classes=self.num_classes).to(dtype=batch.dtype)
        batch, target = batch.clone(), target.clone()
        if torch.rand(1).item() >= self.p:
            return batch, target
        batch, lam = self.mix(batch, self.weight())
        return batch, target * lam + target.roll(1, 0) * (1.0 - lam)


class RandomMixup(Mixing):
    """transforms.py's RandomMixup: the batch mixed with itself rolled by one, weight ~ Beta."""

    def mix(self, batch: torch.Tensor, lam: float) -> tuple[torch.Tensor, float]:
        return batch * lam + batch.roll(1, 0) * (1.0 - lam), lam


class RandomCutmix(Mixing):
    """transforms.py's RandomCutmix: a box of the rolled batch pasted in, its area ~ Beta."""

    def mix(self, batch: torch.Tensor, lam: float) -> tuple[torch.Tensor, float]:
        h, w = batch.shape[-2:]
        r_x, r_y = int(torch.randint(w, (1,))), int(torch.randint(h, (1,)))
        r = 0.5 * math.sqrt(1.0 - lam)
        r_w, r_h = int(r * w), int(r * h)
        x1, y1 = max(r_x - r_w, 0), max(r_y - r_h, 0)
        x2, y2 = min(r_x + r_w, w), min(r_y + r_h, h)
        batch[:, :, y1:y2, x1:x2] = batch.roll(1, 0)[:, :, y1:y2, x1:x2]
        return batch, 1.0 - (x2 - x1) * (y2 - y1) / (w * h)


def mixup_cutmix_collate(batch: list[dict], mixing: list[nn.Module]) -> dict:
    """The script's collate_fn: default_collate, then one of the mixings chosen at random."""
    collated = default_collate(batch)
    chosen = mixing[int(torch.randint(len(mixing), (1,)))]
    image, mixed = chosen(collated["image"], collated["labels"])
    return {"image": image, "labels": collated["labels"], "mixed_targets": mixed}


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, and the shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class TinyResNet(nn.Module):
    def __init__(self, num_classes: int = len(CLASSES), width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = Block(width, width, 1)
        self.layer2 = Block(width, 2 * width, 2)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, image):
        return self.fc(self.layer2(self.layer1(self.stem(image))).mean(dim=(2, 3)))


def set_weight_decay(model: nn.Module, weight_decay: float = 1e-4,
                     norm_weight_decay: float = 0.0) -> list[dict]:
    """utils.set_weight_decay: norm layers' parameters in their own group."""
    norm, other = [], []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                (norm if isinstance(module, nn.BatchNorm2d) else other).append(p)
    return [{"params": other, "weight_decay": weight_decay},
            {"params": norm, "weight_decay": norm_weight_decay}]


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(set_weight_decay(model), lr=lr, momentum=0.9)


def build_scheduler(optimizer: torch.optim.Optimizer):
    """The script's SequentialLR: a linear warm-up for WARMUP_EPOCHS, then cosine annealing,
    sized in passes (the run being built says how many it makes)."""
    run = wb.loop.current_run()
    epochs = EPOCHS
    if run is not None and run.examples:
        per_pass = math.ceil(run.examples / run.shape.examples_per_update)
        epochs = max(math.ceil(run.updates / per_pass), 2)
    warmup = min(WARMUP_EPOCHS, epochs - 1)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=WARMUP_DECAY,
                                          total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs - warmup)],
        milestones=[warmup])


def loss(logits: torch.Tensor, batch: dict,
         label_smoothing: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """CrossEntropyLoss(label_smoothing=...) summed: over the mixed targets in training, the
    class ids (-100: no target) in evaluation; counted in examples."""
    labels = batch["labels"]
    summed = F.cross_entropy(logits.float(), batch.get("mixed_targets", labels),
                             reduction="sum", label_smoothing=label_smoothing)
    return summed, (labels != -100).sum()


def ema(model: nn.Module, decay: float) -> AveragedModel:
    """utils.ExponentialMovingAverage: parameters and buffers averaged."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def save_state(folder, objects, averaged: bool = True):
    """One torch.save file per object - without the averaged model when `averaged` is off."""
    for name, obj in objects.items():
        if obj is not None and (averaged or name != "averaged_model"):
            torch.save(obj.state_dict(), Path(folder) / f"{name}.pt")


def restore_state(folder, objects):
    for name, obj in objects.items():
        path = Path(folder) / f"{name}.pt"
        if obj is not None and path.exists():
            obj.load_state_dict(torch.load(path, weights_only=True))


def make_task(sources: int = 64, label_smoothing: float = 0.1, mixup_alpha: float = 0.2,
              cutmix_alpha: float = 1.0, ema_steps: int = 2, ema_decay: float = 0.9,
              ema_in_checkpoint: bool = True, own_checkpoint: bool = False) -> wb.Task:
    x, labels, groups = images(sources)
    mixing = [m(len(CLASSES), p=1.0, alpha=alpha) for m, alpha in
              ((RandomMixup, mixup_alpha), (RandomCutmix, cutmix_alpha)) if alpha > 0]
    own = own_checkpoint or not ema_in_checkpoint
    return wb.Task(
        name="torchvision-recipe", kind="classification",
        load_examples=lambda: [{"id": i, "source": groups[i], "shape": CLASSES[labels[i]]}
                               for i in range(len(labels))],
        encode=lambda ex: {"image": x[ex["id"]], "labels": torch.tensor(labels[ex["id"]])},
        collate=default_collate,
        train_collate=partial(mixup_cutmix_collate, mixing=mixing) if mixing else None,
        build_model=TinyResNet,
        decode=lambda ids: ", ".join(CLASSES[int(i)] if 0 <= int(i) < len(CLASSES)
                                     else f"<{int(i)}?>" for i in ids),
        loss=partial(loss, label_smoothing=label_smoothing), build_optimizer=build_optimizer,
        lr=LR,
        build_scheduler=build_scheduler, scheduler_interval="pass",
        averaged_model=partial(ema, decay=ema_decay), average_every=ema_steps,
        grad_clip=None,  # --clip-grad-norm: none by default
        save_state=partial(save_state, averaged=ema_in_checkpoint) if own else None,
        restore_state=restore_state if own else None,
        model_inputs=("image",), group_key="source", label_names=CLASSES, label_field="shape",
    )


task = make_task
