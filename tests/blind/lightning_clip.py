"""A LightningModule and its LightningDataModule trained with the Trainer's own gradient
clipping, `Trainer(gradient_clip_val=0.3)` (gradient_clip_algorithm "norm", the default),
handed to `workbook.adapters.from_lightning(..., gradient_clip_val=0.3)` as the Trainer gets
them. The module is the docs' shape: `training_step` returns the loss, `configure_optimizers`
an Adam optimizer; the data are (x, y) tuples of a 5-class problem whose raw gradients at
initialisation are far above 0.3, so the clip value decides every step's size.

Source: Lightning-AI/pytorch-lightning#18669 ("--trainer.gradient_clip_val doesn't work?": the
logged gradient norms stay above the clip value), and hiyouga/LlamaFactory#3996 (the same
question for TrainingArguments' max_grad_norm: the logged norm is the one before clipping).

The check: notebook 02's overfit run makes its updates with the user's clip value (0.3), not
the pilot's own 1.0 - every update's gradient, as applied, has a norm of at most 0.3, and 02
says which clip value it applied. `gradient_clip_val=None` is the run without clipping.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import workbook as wb

CLASSES = ["a", "b", "c", "d", "e"]


class Points(Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.arange(n) % len(CLASSES)
        centres = 4.0 * torch.randn(len(CLASSES), 8, generator=g)
        self.x = centres[self.y] + torch.randn(n, 8, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def lit_module():
    import lightning.pytorch as pl

    class LitClassifier(pl.LightningModule):
        def __init__(self, lr: float = 1e-2):
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, len(CLASSES)))
            self.criterion = nn.CrossEntropyLoss()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.criterion(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", self.criterion(self(x), y))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    return LitClassifier()


def datamodule():
    import lightning.pytorch as pl

    class PointsData(pl.LightningDataModule):
        def setup(self, stage=None):
            self.train, self.val = Points(60, 0), Points(15, 1)

        def train_dataloader(self):
            return DataLoader(self.train, batch_size=8, shuffle=True)

        def val_dataloader(self):
            return DataLoader(self.val, batch_size=8)

    return PointsData()


def task(gradient_clip_val: float | None = 0.3) -> wb.Task:
    return wb.adapters.from_lightning(
        lit_module, datamodule(), name="lit-clip", kind="classification",
        fields=("x", "labels"), criterion=nn.CrossEntropyLoss(), label_names=CLASSES,
        gradient_clip_val=gradient_clip_val)
