"""A LightningModule that keeps its validation counts on itself and logs the epoch's accuracy
from `on_validation_epoch_end` without synchronising it, as the Lightning questions write it:

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self(x).argmax(dim=1)
        self.val_correct += (preds == y).sum()
        self.val_total += y.numel()

    def on_validation_epoch_end(self):
        self.log("val_acc", self.val_correct / self.val_total)   # no sync_dist
        self.val_correct.zero_(); self.val_total.zero_()

Under DDP each rank validates its own shard, so each rank's `val_acc` is the accuracy of that
shard only, and what is logged (rank 0's, or whichever rank the logger keeps) is not the
epoch's accuracy; Lightning only warns "It is recommended to use `self.log('val_acc', ...,
sync_dist=True)` when logging on epoch level in distributed setting".

Sources: Lightning-AI/pytorch-lightning#19620 (that warning, on a metric logged at epoch level)
and Lightning-AI/pytorch-lightning#4529 ("self.log with Metric in ddp": a metric computed in the
epoch-end hook and logged, "rank = 0"), with #4702 ("is the logged value averaged across GPUs?"
- "It is averaged if you set sync_dist=True").

Planted (`val_log="epoch_end_unsynced"`; `"epoch_end_sync_false"` writes `sync_dist=False`
out). Clean twin (`val_log="step"`): the accuracy logged from `validation_step` with
`on_epoch=True, batch_size=len(y), sync_dist=True`, Lightning's weighted epoch mean.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbook as wb

CLASSES = ["a", "b", "c"]


class LitClassifier(pl.LightningModule):
    def __init__(self, lr: float = 1e-2, val_log: str = "epoch_end_unsynced"):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
        self.register_buffer("val_correct", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("val_total", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), batch_size=len(y), sync_dist=True)
        preds = logits.argmax(dim=1)
        if self.hparams.val_log == "step":
            self.log("val_acc", (preds == y).float().mean(), on_epoch=True,
                     batch_size=len(y), sync_dist=True)
            return
        self.val_correct += (preds == y).sum()
        self.val_total += y.numel()

    def on_validation_epoch_end(self):
        if self.hparams.val_log == "step":
            return
        acc = self.val_correct.float() / self.val_total.clamp(min=1)
        if self.hparams.val_log == "epoch_end_sync_false":
            self.log("val_acc", acc, sync_dist=False)
        else:
            self.log("val_acc", acc)
        self.val_correct.zero_()
        self.val_total.zero_()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class PointsDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 8):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str | None = None):
        g = torch.Generator().manual_seed(0)
        centres = torch.randn(3, 8, generator=g)
        y = torch.arange(90) % 3
        x = centres[y] + 0.9 * torch.randn(90, 8, generator=g)
        self.train_set = TensorDataset(x[:60], y[:60])
        self.val_set = TensorDataset(x[60:], y[60:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


def task(val_log: str = "epoch_end_unsynced") -> wb.Task:
    return wb.adapters.from_lightning(
        lambda: LitClassifier(val_log=val_log), PointsDataModule(batch_size=8),
        name="lit-epoch-end-rank", kind="classification", fields=("x", "labels"),
        criterion=nn.CrossEntropyLoss(), label_names=CLASSES)
