"""Two plain-PyTorch tasks for notebook 06 (the learning-rate study), each written as the
public script or report it comes from, as a `wb.Task`:

- `mnist_adadelta`: pytorch/examples' `mnist/main.py` (https://github.com/pytorch/examples/blob/
  main/mnist/main.py) - its `Net` (two convolutions, max-pool, dropout, two linear layers,
  `log_softmax` + `F.nll_loss`) and its optimizer, `optim.Adadelta(model.parameters(),
  lr=args.lr)` with `--lr` default 1.0, on synthetic 12 x 12 "digits" (a fixed random stroke
  image per class plus noise; no torchvision, no download). Adadelta's step is scaled by lr, so
  at the workbook's default 1e-4 the weights barely move: the best rate is far above it.
  `script_lr=True` hands the script's lr 1.0 to the task, as a user copying the script would.
- `random_labels`: the "loss not decreasing" report (discuss.pytorch.org/t/cross-entropy-loss-
  is-not-decreasing/43814: the loss stays at 2.30 = ln 10, chance, whatever is tried) with its
  cause planted as the checklists name it - labels drawn independently of the inputs (the
  DataLoader shuffling labels but not inputs): no rate can lower the held-out loss below
  chance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import workbook as wb

CLASSES = [str(i) for i in range(10)]


class Net(nn.Module):
    """pytorch/examples mnist `Net`, shrunk for 12 x 12 inputs (32/64 channels -> 4/8)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return self.fc2(x)  # logits: the workbook's loss is cross-entropy (= nll of log_softmax)


def digits(n: int, seed: int = 0, random_labels: bool = False):
    g = torch.Generator().manual_seed(seed)
    prototypes = (torch.rand(10, 1, 12, 12, generator=g) > 0.7).float()
    labels = torch.randint(0, 10, (n,), generator=g)
    images = prototypes[labels] + 0.1 * torch.randn(n, 1, 12, 12, generator=g)
    images = (images - 0.1307) / 0.3081  # transforms.Normalize((0.1307,), (0.3081,))
    if random_labels:
        # independent of the images, every class equally often (no prior to learn either)
        labels = (torch.arange(n) % 10)[torch.randperm(n, generator=g)]
    return images, labels


def adadelta(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adadelta(model.parameters(), lr=lr)  # mnist/main.py


def make_task(kind: str = "mnist_adadelta", n: int = 512, script_lr: bool = False) -> wb.Task:
    images, labels = digits(n, random_labels=kind == "random_labels")
    extra = {"build_optimizer": adadelta} if kind == "mnist_adadelta" else {}
    if script_lr and kind == "mnist_adadelta":
        extra["lr"] = 1.0
    return wb.Task(
        name=f"blind-{kind.replace('_', '-')}", kind="classification",
        load_examples=lambda: [{"id": i, "group": i, "label": CLASSES[int(labels[i])]}
                               for i in range(n)],
        encode=lambda ex: {"image": images[ex["id"]], "labels": labels[ex["id"]]},
        collate=torch.utils.data.default_collate,
        build_model=Net,
        decode=lambda ids: ", ".join(CLASSES[int(i)] for i in ids),
        model_inputs=("image",), label_names=CLASSES, label_field="label", **extra)


task = make_task
