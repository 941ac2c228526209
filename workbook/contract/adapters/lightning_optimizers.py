"""What `configure_optimizers` returns, as `from_lightning` runs it: one optimizer, its
scheduler stepped as Lightning steps it (`Schedule`), and the rate the module configured."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...base.errors import WorkbookError


@dataclasses.dataclass
class Schedule:
    """The scheduler `configure_optimizers` returned, stepped as Lightning steps it: every
    `frequency` updates (`interval` "step") or passes over the train set ("epoch"). The
    workbook steps it once per update; `train_step` counts the examples each update saw.
    A scheduler whose `total_steps` is the stand-in's `estimated_stepping_batches` holds its
    last rate when a measurement makes more updates than its configuration says (03's gates
    make two on a configuration of one); any other total is the module's own and steps on."""

    scheduler: Any
    interval: str
    frequency: int
    examples_per_pass: int = 1
    examples_seen: int = 0
    updates: int = 0
    pending: int = 0  # examples of the update just made, counted by train_step
    estimated: int | None = None  # the estimated_stepping_batches the module was given
    held: int = 0  # steps not taken past that total

    def step(self) -> None:
        passes = self.examples_seen // self.examples_per_pass
        self.updates += 1
        self.examples_seen += self.pending
        self.pending = 0
        due = [self.updates] if self.interval == "step" else \
            range(passes + 1, self.examples_seen // self.examples_per_pass + 1)
        total = getattr(self.scheduler, "total_steps", None)
        for count in due:
            if count % self.frequency:
                continue
            if total is not None and total == self.estimated and \
                    getattr(self.scheduler, "last_epoch", 0) >= total:
                self.held += 1
                continue
            self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "examples_seen": self.examples_seen,
                "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.examples_seen, self.updates = state["examples_seen"], state["updates"]


def optimizer_and_schedule(configured: Any) -> tuple[torch.optim.Optimizer, Schedule | None]:
    """Lightning's return forms of configure_optimizers, with one optimizer."""
    schedulers: list = []
    if isinstance(configured, dict):
        optimizers, schedulers = [configured.get("optimizer")], [configured.get("lr_scheduler")]
    elif isinstance(configured, (list, tuple)) and len(configured) == 2 and all(
            isinstance(part, (list, tuple)) for part in configured):
        optimizers, schedulers = list(configured[0]), list(configured[1])
    elif isinstance(configured, (list, tuple)):
        optimizers = list(configured)
    else:
        optimizers = [configured]
    schedulers = [s for s in schedulers if s is not None]
    if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
        raise WorkbookError(f"configure_optimizers returns {len(optimizers)} optimizers "
                            f"({', '.join(type(o).__name__ for o in optimizers)})",
                            "the pilot maps one optimizer with at most one scheduler (GANs and "
                            "manual optimization: write a workbook.Task with its own train_step)")
    if len(schedulers) > 1:
        raise WorkbookError(f"configure_optimizers returns {len(schedulers)} schedulers",
                            "return one scheduler (chain them with SequentialLR)")
    if not schedulers:
        return optimizers[0], None
    given = schedulers[0] if isinstance(schedulers[0], dict) else {"scheduler": schedulers[0]}
    scheduler = given.get("scheduler")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or given.get("monitor"):
        raise WorkbookError("configure_optimizers returns a scheduler that monitors a metric "
                            "(ReduceLROnPlateau)", "the pilot's runs are too short for it: drop "
                            "it for the pilot, or give a schedule by update count")
    interval = given.get("interval", "epoch")
    if interval not in ("step", "epoch"):
        raise WorkbookError(f"the scheduler's interval is {interval!r}",
                            "give interval 'step' or 'epoch', as Lightning takes")
    return optimizers[0], Schedule(scheduler, interval, int(given.get("frequency", 1)))


SIZES = ("total_steps", "T_max", "total_iters")  # what a schedule's length is called


def stepped_per_pass_but_sized_per_update(schedule: Schedule | None, updates: int,
                                          passes: int) -> WorkbookError | None:
    """A schedule sized in updates (its total_steps / T_max / total_iters is the stand-in's
    estimated_stepping_batches) that Lightning steps once per epoch: over the run it takes
    only a step a pass, so a one-cycle stays at its start and never warms up."""
    if schedule is None or schedule.interval != "epoch" or updates <= passes:
        return None
    inner = schedule.scheduler
    size = next((n for n in SIZES if getattr(inner, n, None) == updates), None)
    if size is None:
        return None
    name, lr = type(inner).__name__, inner.get_last_lr()[0]
    return WorkbookError(
        f"configure_optimizers sizes {name} in updates ({size}={updates}, "
        f"trainer.estimated_stepping_batches) but steps it once per epoch (\"interval\": "
        f"\"epoch\"): a run of {updates} updates in {passes} pass{'es' if passes > 1 else ''} "
        f"takes {passes} of its "
        f"{updates} steps, so the learning rate stays near its start ({lr:.3g})"
        + (" and never reaches max_lr" if hasattr(inner, "total_steps") else ""),
        '"interval": "step" in the lr_scheduler dict (Lightning then steps it after every '
        "update), or size it in epochs (trainer.max_epochs)")


def own_lr(optimizer: torch.optim.Optimizer, schedule: Schedule | None) -> float:
    """The rate the module configured, as the workbook reads a schedule's start (its
    `initial_lr`): the scheduler's base rate (before a warm-up lowered it; a one-cycle
    schedule's max_lr / div_factor), else the optimizer's."""
    if schedule is not None and hasattr(schedule.scheduler, "base_lrs"):
        return float(schedule.scheduler.base_lrs[0])
    return float(optimizer.param_groups[0]["lr"])
