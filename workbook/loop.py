"""The one training loop. Overfit, gates, variants, studies and resume all call `train`."""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .data import Batch, Item, epoch_order, loader, micro_batches, plan_epoch
from .errors import WorkbookError
from .records import EvalRecord, StepRecord
from .task import Task


@dataclass
class TrainConfig:
    """How to train: the shape of an update, the budget, evaluation and the device."""

    micro_batch: int = 2  # examples per forward/backward pass
    accumulation: int = 8  # passes combined into one update
    updates: int = 200  # optimizer steps in the budget
    lr: float = 1e-3
    warmup_updates: int = 0  # linear warm-up, then constant
    seed: int = 0
    device: str = "auto"  # "cpu", "cuda" or "auto"
    eval_every: int = 0  # evaluate every N updates (0: never); steps, never seconds
    eval_batch: int = 32
    drop_partial: bool = False  # leave out the examples that do not fill a whole update
    grad_clip: float = 1.0  # max gradient norm (0: no clipping, norm still recorded)
    workers: int = 0  # DataLoader worker processes
    progress: bool = False  # show a tqdm bar

    def validate(self, n_train: int | None = None) -> "TrainConfig":
        for name in ("micro_batch", "accumulation", "updates", "eval_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise WorkbookError(f"{name} must be a positive integer, got {value!r}",
                                    f"set {name} to 1 or more")
        if not self.lr > 0:
            raise WorkbookError(f"lr must be positive, got {self.lr!r}", "set lr above 0")
        if self.eval_every < 0:
            raise WorkbookError(f"eval_every must be 0 or positive, got {self.eval_every}",
                                "use 0 to switch periodic evaluation off")
        if n_train is not None and self.micro_batch > n_train:
            raise WorkbookError(f"micro_batch {self.micro_batch} is larger than the "
                                f"{n_train} training examples",
                                "lower micro_batch or give the task more examples")
        if n_train is not None and self.drop_partial and \
                n_train < self.micro_batch * self.accumulation:
            raise WorkbookError(f"with drop_partial, one update needs "
                                f"{self.micro_batch * self.accumulation} examples but there are "
                                f"{n_train}", "lower micro_batch x accumulation or keep partial")
        resolve_device(self.device)
        return self


@dataclass
class TrainResult:
    """What a training run leaves: the model and optimizer, one record per update and eval."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps: list[StepRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    config: dict = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    """"auto" picks CUDA when present; asking for CUDA without one is an error, not a fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise WorkbookError("device 'cuda' was asked for but no CUDA GPU is visible",
                            "use device='cpu' or 'auto', or run on a machine with a GPU")
    if name != "cpu" and not name.startswith("cuda"):
        raise WorkbookError(f"unknown device {name!r}", "use 'cpu', 'cuda' or 'auto'")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) from one number."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def accumulate(task: Task, model: nn.Module, batches: Iterable[Batch],
               device: torch.device) -> tuple[float, int]:
    """Forward and backward every micro-batch of one update with summed losses, then divide the
    gradients by the number of targets of the WHOLE update, so 1 x 16, 2 x 8 and 16 x 1 agree.

    Returns (mean loss over the update's targets, number of targets).
    """
    loss_sum = torch.zeros((), device=device)
    targets = torch.zeros((), device=device, dtype=torch.long)
    for batch in batches:
        batch = batch.to(device)
        summed, count = task.loss(task.forward(model, batch.tensors), batch.tensors)
        summed.backward()
        loss_sum += summed.detach()
        targets += count
    n = int(targets)
    if n == 0:
        raise WorkbookError("an update had no contributing targets (every label is -100)",
                            "check truncation and label masking with notebook 01")
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, 1.0 / n)
    return float(loss_sum) / n, n


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, items: list[Item], eval_batch: int,
             device: torch.device, step: int = 0) -> EvalRecord:
    """Loss and metrics over exactly these items in eval mode; independent of `eval_batch`."""
    was_training = model.training
    model.eval()
    loss_sum, targets, sums = 0.0, 0, {}
    try:
        for batch in micro_batches(task, items, eval_batch):
            batch = batch.to(device)
            logits = task.forward(model, batch.tensors)
            summed, count = task.loss(logits, batch.tensors)
            loss_sum += float(summed)
            targets += int(count)
            for name, (num, den) in task.metrics(logits, batch.tensors).items():
                total = sums.setdefault(name, [0.0, 0.0])
                total[0] += num
                total[1] += den
    finally:
        model.train(was_training)
    metrics = {name: num / den if den else float("nan") for name, (num, den) in sums.items()}
    return EvalRecord(step, len(items), targets, loss_sum / max(targets, 1), metrics)


def _updates(task: Task, items: list[Item], cfg: TrainConfig):
    """Endless stream of (epoch, [micro-batches]) for one update each, pass after pass."""
    epoch = 0
    while True:
        groups = plan_epoch(epoch_order(len(items), cfg.seed, epoch), cfg.micro_batch,
                            cfg.accumulation, cfg.drop_partial)
        batches = iter(loader(task, items, [mb for g in groups for mb in g], cfg.workers))
        for group in groups:
            yield epoch, [next(batches) for _ in group]
        epoch += 1


def train(task: Task, items: list[Item], cfg: TrainConfig, *, model: nn.Module | None = None,
          val_items: list[Item] | None = None,
          on_update: Callable[[StepRecord], None] | None = None) -> TrainResult:
    """Train for `cfg.updates` updates and return the model with one record per update."""
    cfg.validate(len(items))
    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    model = (model if model is not None else task.build_model()).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = task.build_optimizer(params, cfg.lr)
    warmup = max(cfg.warmup_updates, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    result = TrainResult(model, optimizer, config=asdict(cfg))
    stream = _updates(task, items, cfg)
    bar = tqdm(total=cfg.updates, disable=not cfg.progress, desc=f"train {task.name}")
    for step in range(1, cfg.updates + 1):
        start = time.perf_counter()
        epoch, batches = next(stream)
        data_s = time.perf_counter() - start
        lr = optimizer.param_groups[0]["lr"]
        loss, targets = accumulate(task, model, batches, device)
        norm = nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ids = [i for b in batches for i in b.ids]
        record = StepRecord(step, epoch, len(batches), len(ids), targets, loss, lr,
                            float(norm), time.perf_counter() - start, data_s, ids)
        result.steps.append(record)
        if on_update is not None:
            on_update(record)
        if val_items and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.updates):
            result.evals.append(evaluate(task, model, val_items, cfg.eval_batch, device, step))
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
    bar.close()
    return result
