"""A tabular regression MLP written the way a PyTorch user writes one, wrapped as a `wb.Task`:
ten synthetic, seeded features per row and one float target; rows of one customer are
near-duplicates, so the customer is the group. The model is Linear + BatchNorm1d + ReLU +
Dropout(0.1) blocks. The task brings its own update (`train_step`: `model.train()` first, each
micro-batch's mean squared error weighed by its share of the update's targets, clipping at 1.0,
one step, a float back), evaluation (`eval_step`: loss and mae as (sum, count)), checkpoint
(one nanoGPT-like dict in `checkpoint.pt`), sampler (`random.Random`, its state carried),
learning rate and AdamW with parameter groups by name.

    python -m workbook pilot --task examples.mlp_dropout:task --smoke

Planted bugs (task options): `step_mean_per_micro_batch` (each micro-batch's mean is
back-propagated as is), `eval_counts_padding` (eval_step counts the padding copies: every row
of the batch, example_weight ignored), `eval_leaves_eval_mode` (eval_step leaves the model in
eval mode), `restore_reseeds_sampler` (restore_state reseeds the sampler instead of loading its
state), `lr_typo` (lr 1e3 instead of 1e-3), `ckpt_without_optimizer` (no optimizer state).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import workbook as wb

N_FEATURES = 10
LR = 1e-3
MAX_GRAD_NORM = 1.0


def make_table(customers: int = 128, rows_per_customer: int = 4, seed: int = 0):
    """Features: a customer profile plus small per-row noise; target: a smooth function."""
    g = torch.Generator().manual_seed(seed)
    profile = torch.randn(customers, N_FEATURES, generator=g)
    x = profile.repeat_interleave(rows_per_customer, 0)
    x = x + 0.1 * torch.randn(x.shape, generator=g)
    w = torch.linspace(1.0, -1.0, N_FEATURES)
    y = x @ w / 2 + torch.tanh(x[:, 0] * x[:, 1]) + 0.05 * torch.randn(len(x), generator=g)
    groups = [f"c{i // rows_per_customer:04d}" for i in range(len(x))]
    return x, y[:, None], groups


def build_model(hidden: int = 64, p: float = 0.1) -> nn.Module:
    return nn.Sequential(OrderedDict([
        ("fc1", nn.Linear(N_FEATURES, hidden)), ("bn1", nn.BatchNorm1d(hidden)),
        ("act1", nn.ReLU()), ("drop1", nn.Dropout(p)),
        ("fc2", nn.Linear(hidden, hidden)), ("bn2", nn.BatchNorm1d(hidden)),
        ("act2", nn.ReLU()), ("drop2", nn.Dropout(p)),
        ("out", nn.Linear(hidden, 1))]))


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW: decay on the Linear weights, none on biases and batch norm ("bn*")."""
    groups = {"decay": [], "no_decay": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        key = "no_decay" if name.startswith("bn") or name.endswith(".bias") else "decay"
        groups[key].append(p)
    return torch.optim.AdamW([{"params": groups["decay"], "weight_decay": 0.01},
                              {"params": groups["no_decay"], "weight_decay": 0.0}], lr=lr)


def train_step(model, optimizer, micro_batches, mean_per_micro_batch=False):
    model.train()
    optimizer.zero_grad()
    total = sum(mb["labels"].numel() for mb in micro_batches)
    loss_sum = 0.0
    for mb in micro_batches:
        pred = model(mb["x"])
        loss = F.mse_loss(pred, mb["labels"])  # mean over this micro-batch
        weight = 1.0 if mean_per_micro_batch else mb["labels"].numel() / total
        (loss * weight).backward()
        loss_sum += loss.item() * mb["labels"].numel()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    return loss_sum / total


def eval_step(model, batch, counts_padding=False, leaves_eval_mode=False):
    was_training = model.training
    model.eval()
    with torch.no_grad():
        pred = model(batch["x"])
    y = batch["labels"]
    real = ~torch.isnan(y)
    if "example_weight" in batch and not counts_padding:
        real = real & (batch["example_weight"] > 0).reshape(-1, 1)
    err = torch.where(real, pred - torch.nan_to_num(y), torch.zeros_like(pred))
    n = y.numel() if counts_padding else int(real.sum())
    if not leaves_eval_mode:
        model.train(was_training)
    return {"loss": ((err ** 2).sum().item(), n), "mae": (err.abs().sum().item(), n)}


class EpochShuffler:
    """A new shuffle per pass from one `random.Random`; its state is the sampler's state."""

    def __init__(self, n, seed):
        self.n, self.seed = n, seed
        self.rng = random.Random(seed)

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)

    def __len__(self):
        return self.n

    def state_dict(self):
        version, internal, gauss = self.rng.getstate()
        return {"version": version, "internal": torch.tensor(internal), "gauss": gauss}

    def load_state_dict(self, state):
        internal = tuple(int(v) for v in state["internal"])
        self.rng.setstate((state["version"], internal, state["gauss"]))


def save_state(folder, objects, skip_optimizer=False):
    checkpoint = {}
    for name in ("model", "optimizer", "scheduler", "scaler", "sampler", "step"):
        if objects.get(name) is not None and not (skip_optimizer and name == "optimizer"):
            checkpoint[name] = objects[name].state_dict()
    torch.save(checkpoint, Path(folder) / "checkpoint.pt")


def restore_state(folder, objects, reseed_sampler=False):
    checkpoint = torch.load(Path(folder) / "checkpoint.pt", map_location="cpu",
                            weights_only=True)
    for name, state in checkpoint.items():
        obj = objects.get(name)
        if obj is None:
            continue
        if name == "sampler" and reseed_sampler:
            obj.rng.seed(obj.seed)  # the bug: the order starts over
        else:
            obj.load_state_dict(state)


def make_task(customers: int = 128, step_mean_per_micro_batch: bool = False,
              eval_counts_padding: bool = False, eval_leaves_eval_mode: bool = False,
              restore_reseeds_sampler: bool = False, lr_typo: bool = False,
              ckpt_without_optimizer: bool = False) -> wb.Task:
    x, y, groups = make_table(customers)
    return wb.Task(
        name="mlp-dropout", kind="regression",
        load_examples=lambda: [{"id": i, "customer": groups[i]} for i in range(len(y))],
        encode=lambda ex: {"x": x[ex["id"]], "labels": y[ex["id"]]},
        collate=torch.utils.data.default_collate,
        build_model=build_model,
        decode=lambda values: ", ".join(f"{float(v):.3f}" for v in values),
        build_optimizer=build_optimizer, lr=1e3 if lr_typo else LR,
        train_step=partial(train_step, mean_per_micro_batch=step_mean_per_micro_batch),
        eval_step=partial(eval_step, counts_padding=eval_counts_padding,
                          leaves_eval_mode=eval_leaves_eval_mode),
        make_sampler=EpochShuffler,
        save_state=partial(save_state, skip_optimizer=ckpt_without_optimizer),
        restore_state=partial(restore_state, reseed_sampler=restore_reseeds_sampler),
        model_inputs=("x",), group_key="customer")


task = make_task
