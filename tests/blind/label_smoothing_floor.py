"""An image classifier set up the way torchvision's `references/classification/train.py`
sets one up - an image `Dataset` of `(image, target)` tuples, `criterion =
nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)` (the recipes use 0.1), SGD with
momentum 0.9 and weight decay 1e-4 on every parameter - with a small CNN in place of a
torchvision model (torchvision is not installed here), over 6 classes, handed to
`workbook.adapters.from_torch` as it stands.

Source: pytorch/pytorch#130342 ("CrossEntropyLoss with label_smoothing > 0 does not reach its
minimum when the loss is zero": the least loss is -(1 - a) log(1 - a + a/K) - (K - 1) a/K
log(a/K), about 0.50 for a = 0.1 and K = 6), also pytorch/pytorch#148884.

Clean (`bug=None`): a model that gives back every example exactly cannot go under that floor,
so notebook 02 must not call it "not memorised". Planted (`bug="lr_floor_division"`): the
learning rate scaled with the batch as `args.lr * (args.batch_size // 256)` - integer division,
so at batch 32 the optimizer runs at learning rate 0 and the model really cannot learn: 02 must
fail.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

import workbook as wb

CLASSES = ["airplane", "bird", "cat", "deer", "frog", "ship"]


class TinyImages(Dataset):
    """(image, target) tuples, as an ImageFolder gives them: 3 x 16 x 16 images, each class a
    coloured blob at its own place plus noise."""

    def __init__(self, per_class: int = 12, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.samples = []
        for i in range(per_class * len(CLASSES)):
            target = i % len(CLASSES)
            image = 0.3 * torch.randn(3, 16, 16, generator=g)
            row, col = divmod(target, 3)
            image[target % 3, 2 + 6 * row: 8 + 6 * row, 1 + 5 * col: 6 + 5 * col] += 1.5
            self.samples.append((image, target))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.samples[index]


class SmallNet(nn.Module):
    def __init__(self, num_classes: int = len(CLASSES)):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))


def task(bug: str | None = None, label_smoothing: float = 0.1, lr: float = 0.05,
         batch_size: int = 32) -> wb.Task:
    def build_optimizer(model, lr_):
        if bug == "lr_floor_division":
            lr_ = lr_ * (batch_size // 256)     # "linear scaling" with integer division: 0
        return torch.optim.SGD(model.parameters(), lr=lr_, momentum=0.9, weight_decay=1e-4)

    splits = {"train": TinyImages(12, seed=0), "validation": TinyImages(2, seed=1)}
    return wb.adapters.from_torch(
        splits, SmallNet, nn.CrossEntropyLoss(label_smoothing=label_smoothing),
        name="tv-reference-cls", fields=("image", "labels"), label_names=CLASSES,
        build_optimizer=build_optimizer, lr=lr, options={"bug": bug})
