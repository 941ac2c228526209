"""A plain-PyTorch regression task written without the workbook in mind: an MLP with MSE on
tabular features (a house-price-like target from eight features), wrapped as a `wb.Task` of kind
"regression". Targets are float tensors; the default loss is the summed squared error over the
target values that are not NaN, the metric the mean absolute error. The task brings its own
learning rate (`lr=3e-3`, used by every notebook whose `lr` is 0), its own optimizer with
parameter groups by name, its own checkpoint code (`save_state`/`restore_state`), its own data
order (`make_sampler`) and its own update (`train_step`), which notebooks 03, 04 and 07 run and
check.

    python -m workbook pilot --task examples.regression:task --smoke

Planted bugs for the tests (task options): `nan_inputs=True` (a few feature rows hold NaN),
`dropout_in_eval=True` (a dropout layer that ignores eval()), `mean_loss=True` (the loss returns
the batch mean with a count of 1, so accumulation weighs micro-batches, not examples),
`forget_head=True` (the optimizer leaves out the output layer), `ckpt_without_optimizer=True`
(save_state leaves out the optimizer state), `slow_getitem=True` (5 ms of work per example),
`sampler_reseeded=True` (its own sampler keeps no state: a resumed run restarts the order),
`step_mean_per_micro_batch=True` (its own train_step back-propagates each micro-batch's mean).
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

import workbook as wb

FEATURES = 8


class Houses(Dataset):
    """Synthetic, seeded: eight standardised features, one target (a smooth function plus noise);
    the neighbourhood is the group (examples of one neighbourhood are near-duplicates)."""

    def __init__(self, n: int = 512, nan_inputs: bool = False, slow: bool = False):
        g = torch.Generator().manual_seed(0)
        self.slow = slow
        self.x = torch.randn(n, FEATURES, generator=g)
        w = torch.linspace(-1.0, 1.0, FEATURES)
        self.y = (self.x @ w + torch.sin(2 * self.x[:, 0]) + 0.1 * torch.randn(n, generator=g))
        self.y = self.y[:, None]  # one target per example
        if nan_inputs:
            self.x[::97, 3] = math.nan
        self.neighbourhood = [f"n{i // 4}" for i in range(n)]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if self.slow:
            time.sleep(0.005)  # a planted bug: per-example work (decoding, augmentation, I/O)
        return {"features": self.x[i], "labels": self.y[i]}


class AlwaysDropout(nn.Dropout):
    """A planted bug: dropout that ignores eval()."""

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.dropout(x, self.p, training=True)


class Shuffle:
    """The task's own data order: one generator seeded once and advanced pass after pass (no
    set_epoch), its state in `state_dict` so a checkpoint carries it. `keeps_state=False` plants
    the classic: a sampler with no state, reseeded from the seed when a run resumes."""

    def __init__(self, n: int, seed: int, keeps_state: bool = True):
        self.n, self.generator = n, torch.Generator().manual_seed(seed)
        if not keeps_state:
            self.state_dict = self.load_state_dict = None

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.generator).tolist())

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def build_model(dropout_in_eval: bool = False) -> nn.Module:
    drop = AlwaysDropout(0.2) if dropout_in_eval else nn.Dropout(0.0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), drop, nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 1))


def build_optimizer(model: nn.Module, lr: float, forget_head: bool = False):
    """AdamW with parameter groups by name: weight decay on weight matrices, none on biases.
    `forget_head=True` plants a bug: the output layer is left out of the optimizer."""
    named = [(n, p) for n, p in model.named_parameters()
             if p.requires_grad and not (forget_head and n.startswith("5."))]
    return torch.optim.AdamW([
        {"params": [p for _, p in named if p.ndim > 1], "weight_decay": 0.01},
        {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0}], lr=lr)


def train_step(model: nn.Module, optimizer, micro_batches: list[dict],
               mean_per_micro_batch: bool = False) -> float:
    """The task's own update: squared error summed over every micro-batch, divided once by the
    update's target count, one optimizer step. `mean_per_micro_batch=True` plants the classic:
    each micro-batch's mean is back-propagated as is, so the gradient grows with the number of
    micro-batches."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(int(b["labels"].numel()) for b in micro_batches)
    summed = 0.0
    for batch in micro_batches:
        error = (model(batch["features"]).reshape(batch["labels"].shape) - batch["labels"]) ** 2
        loss = error.mean() if mean_per_micro_batch else error.sum() / total
        loss.backward()
        summed += float(error.detach().sum())
    optimizer.step()
    return summed / total


def save_state(folder: Path, objects: dict, skip_optimizer: bool = False) -> None:
    """The task's own checkpoint: one file of state dicts, loadable with weights_only=True.
    `skip_optimizer=True` plants the classic: a checkpoint without the optimizer state."""
    state = {name: obj.state_dict() for name, obj in objects.items()
             if obj is not None and not (skip_optimizer and name == "optimizer")}
    torch.save(state, Path(folder) / "training_state.pt")


def restore_state(folder: Path, objects: dict) -> None:
    """Load what `save_state` wrote back into the same objects."""
    state = torch.load(Path(folder) / "training_state.pt", weights_only=True)
    for name, obj in objects.items():
        if obj is not None and name in state:
            obj.load_state_dict(state[name])


def mean_squared_error(outputs: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """A planted bug: the batch mean with a count of 1."""
    return nn.functional.mse_loss(outputs, batch["labels"]), torch.tensor(1)


def make_task(n: int = 512, nan_inputs: bool = False, dropout_in_eval: bool = False,
              mean_loss: bool = False, forget_head: bool = False,
              ckpt_without_optimizer: bool = False, slow_getitem: bool = False,
              sampler_reseeded: bool = False, step_mean_per_micro_batch: bool = False) -> wb.Task:
    data = Houses(n, nan_inputs, slow_getitem)
    extra = {"loss": mean_squared_error} if mean_loss else {}
    return wb.Task(
        name="houses-regression", kind="regression",
        load_examples=lambda: [{"id": i, "neighbourhood": data.neighbourhood[i]}
                               for i in range(len(data))],
        encode=lambda ex: data[ex["id"]],
        collate=torch.utils.data.default_collate,
        build_model=lambda: build_model(dropout_in_eval),
        decode=lambda values: ", ".join(f"{v:.3g}" for v in values),
        build_optimizer=partial(build_optimizer, forget_head=forget_head), lr=3e-3,
        save_state=partial(save_state, skip_optimizer=ckpt_without_optimizer),
        restore_state=restore_state,
        make_sampler=lambda n, seed: Shuffle(n, seed, keeps_state=not sampler_reseeded),
        train_step=partial(train_step, mean_per_micro_batch=step_mean_per_micro_batch),
        group_key="neighbourhood", model_inputs=("features",), **extra)


task = make_task
