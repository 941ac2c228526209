"""A LightningModule whose epoch metric is computed from per-rank state in
`on_validation_epoch_end`: a confusion matrix kept as a buffer, filled in `validation_step`,
turned into a macro-F1 at the epoch's end. `sync` - "none" (planted: logged without sync_dist,
each rank logs its own shard's F1), "torchmetrics" (the clean twin: a torchmetrics
`MulticlassF1Score` logged as the object, its states synced before compute) or "step" (each
batch's F1 logged in `validation_step` with sync_dist=True: Lightning's epoch mean of a step
log) - see tests/notebooks/test_framework_controls.py."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import workbook as wb

CLASSES = ["a", "b", "c"]


class Rows(pl.LightningDataModule):
    def setup(self, stage: str | None = None):
        g = torch.Generator().manual_seed(3)
        y = torch.multinomial(torch.tensor([0.6, 0.3, 0.1]), 320, replacement=True, generator=g)
        x = torch.randn(3, 6, generator=g)[y] * 0.6 + torch.randn(320, 6, generator=g)
        self.train_set = TensorDataset(x[:200], y[:200])
        self.val_set = TensorDataset(x[200:], y[200:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=16, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=16)


def macro_f1(confusion: torch.Tensor) -> torch.Tensor:
    """Macro-F1 of a confusion matrix (rows: targets, columns: predictions)."""
    tp = confusion.diag()
    return (2 * tp / (confusion.sum(0) + confusion.sum(1)).clamp(min=1)).mean()


class ConfusionF1(pl.LightningModule):
    def __init__(self, sync: str = "none"):
        super().__init__()
        self.sync = sync
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, len(CLASSES)))
        self.register_buffer("confusion", torch.zeros(len(CLASSES), len(CLASSES)))
        if sync == "torchmetrics":
            from torchmetrics.classification import MulticlassF1Score

            self.val_f1 = MulticlassF1Score(num_classes=len(CLASSES), average="macro")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        preds = logits.argmax(-1)
        if self.sync == "torchmetrics":
            self.val_f1.update(preds, y)
        elif self.sync == "step":
            batch = torch.bincount(y * 3 + preds, minlength=9).view(3, 3).float()
            self.log("val_macro_f1", macro_f1(batch), sync_dist=True)
        else:
            self.confusion += torch.bincount(y * 3 + preds, minlength=9).view(3, 3).float()

    def on_validation_epoch_end(self):
        if self.sync == "torchmetrics":
            self.log("val_macro_f1", self.val_f1)
        elif self.sync == "none":
            self.log("val_macro_f1", macro_f1(self.confusion))  # planted: this rank's only
            self.confusion.zero_()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_task(sync: str = "none") -> wb.Task:
    return wb.adapters.from_lightning(lambda: ConfusionF1(sync), Rows(), name="confusion-f1",
                                      kind="classification", fields=("x", "labels"),
                                      criterion=nn.CrossEntropyLoss(), label_names=CLASSES)


task = make_task
