"""A LightningModule and LightningDataModule in the idioms of Lightning's documentation, piloted
with `workbook.adapters.from_lightning` as they are: a classifier of tabular rows (an MLP with
BatchNorm and dropout), a DataModule with `prepare_data` (writes the data set once, as a
download would), `setup(stage)` (`random_split` with a seeded generator), `train_dataloader` /
`val_dataloader` and a collate returning `(x, y, w)` - a sample weight after the target; a
`training_step` whose loss is the sample-weighted mean over the batch's rows; `OneCycleLR` on
`self.trainer.estimated_stepping_batches` stepped per update (Lightning's documented recipe);
epoch-level metrics as the docs write them - an accumulator in the torchmetrics style (reset in
`on_validation_epoch_start`, `compute()` logged in `on_validation_epoch_end`) and a list of
`validation_step` outputs (each row's weighted loss) averaged at the epoch's end, then cleared.

    python -m workbook pilot --task examples.lightning_docs:task --smoke

Planted bugs (task options), each named by a notebook:
- `weighted_mean_step`: `training_step` divides the weighted loss by the batch's sum of weights,
  so under `accumulate_grad_batches` each micro-batch's mean weighs as much as any other
  whatever its weights - the update's gradient depends on how it is split (04's normalisation
  check), and the loss is not the task's (04's step-loss check).
- `val_mean_of_batch_means`: `on_validation_epoch_end` logs the mean of the per-batch
  accuracies (`torch.stack(self.validation_step_outputs).mean()`), so the epoch's `val_acc`
  weighs a short last batch as a full one and changes with the evaluation batch (04's
  evaluation check).
- `macro_f1`: `on_validation_epoch_end` also logs a macro-F1 of the epoch's predictions. One
  process reports it exactly (the whole epoch's value); under data parallelism each rank
  computes it from its own outputs, and no sum over ranks gives the epoch's F1 (Lightning's
  `sync_dist=True` averages the ranks' values): 09's "evaluation reduced as sums over ranks"
  names it. Gather the outputs first (`self.all_gather`) or accumulate confusion counts.
- `bn_train_in_validation`: `validation_step` calls `self.train()`: the batch norm normalises
  each validation batch with its own statistics and moves the running ones (a batch of one row
  fails); named as that, whether the step fails or not (04).
- `callback_eval="train_epoch_start"`: a `Callback` whose `on_train_epoch_start` calls
  `pl_module.eval()` (a batch-norm freeze gone wide): every update after it trains without
  dropout and with frozen statistics, which Lightning does not undo (04 names the callback).
  Its clean twin `callback_eval="validation_end"` does the same in `on_validation_end`, which
  Lightning undoes (it restores the modes it found after validation): nothing to name.
- `epoch_interval`: the `OneCycleLR` sized by `estimated_stepping_batches` is returned with
  `"interval": "epoch"`: stepped once a pass, it stays at its start (04 names it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, random_split

import workbook as wb

FEATURES, CLASSES = 16, 3


class WeightedRows(Dataset):
    """(features, class, sample weight) per row."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor):
        self.x, self.y, self.w = x, y, w

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i], self.w[i]


def weighted_collate(items):
    """The batch as (x, y, w): the sample weight after the target."""
    xs, ys, ws = zip(*items, strict=True)
    return torch.stack(xs), torch.stack(ys), torch.stack(ws)


class RowsDataModule(pl.LightningDataModule):
    def __init__(self, data_dir: str | None = None, rows: int = 600, batch_size: int = 32,
                 val_fraction: float = 0.2):
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = Path(data_dir or Path(tempfile.gettempdir()) / "workbook-lightning-docs")

    @property
    def path(self) -> Path:
        return self.data_dir / f"rows-{self.hparams.rows}-v2.pt"

    def prepare_data(self):
        # download, once: here the rows are drawn with a fixed seed and saved
        if self.path.exists():
            return
        g = torch.Generator().manual_seed(0)
        n = self.hparams.rows
        y = torch.multinomial(torch.tensor([0.5, 0.3, 0.2]), n, replacement=True, generator=g)
        centres = torch.randn(CLASSES, FEATURES, generator=g) * 0.35
        x = centres[y] + torch.randn(n, FEATURES, generator=g)
        w = 0.5 + torch.rand(n, generator=g)  # an annotator's confidence, mean 1
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        torch.save({"x": x, "y": y, "w": w / w.mean()}, tmp)
        os.replace(tmp, self.path)

    def setup(self, stage: str | None = None):
        data = torch.load(self.path, weights_only=True)
        full = WeightedRows(data["x"], data["y"], data["w"])
        n_val = int(len(full) * self.hparams.val_fraction)
        self.train_set, self.val_set = random_split(
            full, [len(full) - n_val, n_val], generator=torch.Generator().manual_seed(42))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True,
                          collate_fn=weighted_collate)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size,
                          collate_fn=weighted_collate)


class Accuracy(nn.Module):
    """An accumulator in the style of torchmetrics' Metric: update / compute / reset."""

    def __init__(self):
        super().__init__()
        self.reset()

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.correct = self.correct + (preds == target).sum()
        self.total = self.total + target.numel()

    def compute(self) -> torch.Tensor:
        return self.correct.float() / max(int(self.total), 1)

    def reset(self) -> None:
        self.correct, self.total = torch.tensor(0), torch.tensor(0)


def macro_f1(preds: torch.Tensor, target: torch.Tensor, classes: int) -> torch.Tensor:
    scores = []
    for c in range(classes):
        tp = ((preds == c) & (target == c)).sum()
        fp = ((preds == c) & (target != c)).sum()
        fn = ((preds != c) & (target == c)).sum()
        scores.append(2 * tp / (2 * tp + fp + fn).clamp(min=1))
    return torch.stack(scores).float().mean()


class LitClassifier(pl.LightningModule):
    def __init__(self, hidden: int = 64, dropout: float = 0.2, lr: float = 1e-2,
                 weight_decay: float = 1e-4, weighted_mean_step: bool = False,
                 val_mean_of_batch_means: bool = False, macro_f1: bool = False,
                 bn_train_in_validation: bool = False, epoch_interval: bool = False,
                 label_names: tuple[str, ...] = ("common", "middle", "rare")):
        super().__init__()
        self.save_hyperparameters()
        self.label_names = list(label_names)  # class id -> name, for the logged class metrics
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                 nn.Dropout(dropout), nn.Linear(hidden, CLASSES))
        self.val_acc = Accuracy()
        self.validation_step_outputs = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, w = batch
        losses = F.cross_entropy(self(x), y, reduction="none") * w
        if self.hparams.weighted_mean_step:
            loss = losses.sum() / w.sum()
        else:
            loss = losses.mean()
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def on_validation_epoch_start(self):
        self.val_acc.reset()

    def validation_step(self, batch, batch_idx):
        if self.hparams.bn_train_in_validation:
            self.train()
        x, y, w = batch
        logits = self(x)
        losses = F.cross_entropy(logits, y, reduction="none")
        self.log("val_loss", losses.mean(), prog_bar=True)
        preds = logits.argmax(dim=-1)
        self.val_acc.update(preds, y)
        if self.hparams.val_mean_of_batch_means:
            self.validation_step_outputs.append((preds == y).float().mean())
        else:
            self.validation_step_outputs.append({"weighted_loss": losses * w, "preds": preds,
                                                 "target": y})

    def on_validation_epoch_end(self):
        outputs = self.validation_step_outputs
        if self.hparams.val_mean_of_batch_means:
            self.log("val_acc", torch.stack(outputs).mean())
        else:
            self.log("val_acc", self.val_acc.compute())
            self.log("val_weighted_loss", torch.cat([o["weighted_loss"] for o in outputs]).mean())
            # the rows validated: a count, summed over ranks (not averaged)
            self.log("val_n", float(sum(len(o["target"]) for o in outputs)), reduce_fx="sum",
                     sync_dist=True)
            if self.hparams.macro_f1:
                preds = torch.cat([o["preds"] for o in outputs])
                target = torch.cat([o["target"] for o in outputs])
                self.log("val_f1", macro_f1(preds, target, CLASSES), sync_dist=True)
        outputs.clear()  # free memory

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr,
                                      weight_decay=self.hparams.weight_decay)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr,
            total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler,
                                 "interval": "epoch" if self.hparams.epoch_interval else "step"}}


def weighted_loss(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The pilot's loss as training_step computes it: the rows' weighted cross-entropy summed,
    with the number of rows (padding copies, label -100, weigh nothing)."""
    y, w = batch["labels"], batch["w"]
    keep = y != -100
    losses = F.cross_entropy(logits.float(), torch.where(keep, y, 0), reduction="none")
    return torch.where(keep, losses * w, 0.0).sum(), keep.sum()


class EvalModeCallback(pl.Callback):
    """Puts the module in eval mode in one hook: `on_train_epoch_start` (it lasts for the
    updates) or `on_validation_end` (Lightning restores the modes after validation)."""

    def __init__(self, hook: str):
        self.hook = hook

    def on_train_epoch_start(self, trainer, pl_module):
        if self.hook == "train_epoch_start":
            pl_module.eval()

    def on_validation_end(self, trainer, pl_module):
        if self.hook == "validation_end":
            pl_module.eval()


def make_task(rows: int = 600, weighted_mean_step: bool = False,
              val_mean_of_batch_means: bool = False, macro_f1: bool = False,
              bn_train_in_validation: bool = False, callback_eval: str = "",
              epoch_interval: bool = False, shifted_label_names: bool = False) -> wb.Task:
    # planted: the module's class names in another order than the data's class ids
    names = ("middle", "rare", "common") if shifted_label_names else ("common", "middle", "rare")
    return wb.adapters.from_lightning(
        lambda: LitClassifier(label_names=names, weighted_mean_step=weighted_mean_step,
                              val_mean_of_batch_means=val_mean_of_batch_means,
                              macro_f1=macro_f1, bn_train_in_validation=bn_train_in_validation,
                              epoch_interval=epoch_interval),
        RowsDataModule(rows=rows), name="lightning-docs", kind="classification",
        fields=("x", "labels", "w"), loss=weighted_loss,
        label_names=["common", "middle", "rare"],
        callbacks=[EvalModeCallback(callback_eval)] if callback_eval else [])


task = make_task
