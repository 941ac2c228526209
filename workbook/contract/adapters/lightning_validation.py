"""The evaluation step of `from_lightning`: Lightning's validation loop run batch by batch - the
hooks around `validation_step` (eval mode and no grad, then the modes put back), what they log
weighted by the logged `batch_size`, and an epoch-end log reported as a whole-epoch value."""

from __future__ import annotations

import copy
import dataclasses
import math
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...base.errors import WorkbookError
from ..run import EXAMPLE_WEIGHT
from .lightning_hooks import call_piece, fire, modes_of
from .lightning_trainer import LightningRun, Logged, logged_value
from .torch import LABELS

if TYPE_CHECKING:
    from .lightning import LightningAdapter


@dataclasses.dataclass
class ValidationEpoch:
    """One validation epoch Lightning would run, opened by the first batch of an evaluation.
    The loop evaluates batch by batch and says neither where an evaluation starts nor where
    it ends, so a new one is told from the last by what changes between evaluations: the
    weights (an update or a restore), the updates counted, the device, the mode the model
    is handed in and the evaluation batch size; a batch with padding copies is an
    evaluation's last. An epoch-end log is reported telescoped: batch k adds E_k * N_k -
    E_(k-1) * N_(k-1) over its n_k rows (E_k the epoch-end value over the first k batches,
    N_k their rows), so the loop's sum over the evaluation is the whole epoch's value."""

    key: tuple
    modes: list[bool]  # every submodule's mode after on_validation_model_eval
    batch_idx: int = 0
    rows: int = 0
    reported: dict[str, float] = dataclasses.field(default_factory=dict)
    summed: dict[str, float] = dataclasses.field(default_factory=dict)  # reduce_fx="sum" logs
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)  # logged Metric objects
    last: bool = False


def weights_key(module: nn.Module) -> int:
    """Changes when any parameter or buffer is replaced or changed in place (an optimizer
    step, a restore)."""
    return hash(tuple((id(t), t._version) for t in (*module.parameters(), *module.buffers())
                      if not t.is_inference()))


def modes(module: nn.Module) -> list[bool]:
    return [m.training for m in module.modules()]


def set_modes(module: nn.Module, given: list[bool]) -> None:
    for m, mode in zip(module.modules(), given, strict=True):
        m.training = mode


def shadow(module: nn.Module) -> nn.Module:
    """A copy of the module sharing its parameters (buffers and every other state copied), to
    run on_validation_epoch_end mid-epoch without touching the epoch's own state (a hook that
    resets its accumulator or clears its outputs)."""
    memo = {id(p): p for p in module.parameters()}
    return copy.deepcopy(module, memo)


class Validation:
    """The Task's `eval_step(model, batch) -> {metric: (sum, count)}` for a LightningModule;
    `reductions` says how Lightning reduces each logged metric over data-parallel ranks
    (the task declares it: `Task.framework.metric_reductions`). It holds each module's open
    validation epoch."""

    def __init__(self, adapter: LightningAdapter, ends_epoch: bool):
        self.adapter = adapter
        self.ends_epoch = ends_epoch  # the module overrides on_validation_epoch_end
        self.reductions: dict[str, str] = {}
        self.open: weakref.WeakKeyDictionary[nn.Module, ValidationEpoch] = \
            weakref.WeakKeyDictionary()

    def forget(self, module: nn.Module) -> None:
        """Drop the module's open epoch without ending it (its weights were restored)."""
        self.open.pop(module, None)

    def close(self, module: nn.Module, run: LightningRun) -> dict:
        """End the module's open validation epoch as Lightning ends one: on_validation_epoch_end
        (what it logs is returned), the logged metric objects reset, on_validation_end and
        on_validation_model_train - the modes the pilot set are back after."""
        epoch = self.open.pop(module, None)
        if epoch is None:
            return {}
        callbacks, found = self.adapter.callbacks, modes(module)
        try:
            with self.adapter.fit.hooks(module, run, "validate") as seen, torch.no_grad():
                set_modes(module, epoch.modes)
                fire("on_validation_epoch_end", module, callbacks)
                ended = dict(seen)
                for metric in epoch.metrics.values():
                    if callable(getattr(metric, "reset", None)):
                        metric.reset()
                fire("on_validation_end", module, callbacks)
                fire("on_validation_model_train", module, callbacks)
        finally:
            set_modes(module, found)
        return ended

    def epoch_so_far(self, module: nn.Module, run: LightningRun) -> dict:
        """What on_validation_epoch_end would log now, run on a shadow of the module."""
        copied = shadow(module)
        with self.adapter.fit.hooks(copied, run, "validate") as seen, torch.no_grad():
            call_piece("on_validation_epoch_end", copied.on_validation_epoch_end)
        return dict(seen)

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple]:
        adapter = self.adapter
        module = adapter.unwrap(model)
        run = adapter.fit.run_of(module)
        callbacks = adapter.callbacks
        weight = batch.get(EXAMPLE_WEIGHT)
        keep = weight > 0 if weight is not None else None  # Lightning's last batch is short
        rows = int(keep.sum()) if keep is not None else len(batch[LABELS])
        key = (len(batch[LABELS]), weights_key(module), run.global_step, module.training,
               str(batch[LABELS].device))
        epoch = self.open.get(module)
        if epoch is not None and (epoch.last or epoch.key != key):
            self.close(module, run)
            epoch = None
        found = modes(module)  # Lightning's validation loop: eval mode, no grad, then back
        given = adapter.users(batch, keep)
        try:
            with adapter.fit.hooks(module, run, "validate") as seen, torch.no_grad():
                if epoch is None:
                    fire("on_validation_model_eval", module, callbacks)
                    fire("on_validation_start", module, callbacks)
                    fire("on_validation_epoch_start", module, callbacks)
                    epoch = self.open[module] = ValidationEpoch(key, modes(module))
                    seen.clear()
                else:
                    set_modes(module, epoch.modes)
                index = epoch.batch_idx
                fire("on_validation_batch_start", module, callbacks, given, index,
                     evaluating=modes_of(module))
                returned = fire("validation_step", module, callbacks, given, index,
                                evaluating=modes_of(module))
                fire("on_validation_batch_end", module, callbacks, returned, given, index,
                     evaluating=modes_of(module))
                stepped = dict(seen)
                whole = {n: logged_value(got.metric)[0] for n, got in stepped.items()
                         if got.metric is not None}  # metric objects: their value over the epoch
            epoch.batch_idx += 1
            epoch.rows += rows
            epoch.last = keep is not None and not bool(keep.all())
            epoch.metrics.update({n: got.metric for n, got in stepped.items()
                                  if got.metric is not None})
            for n, got in stepped.items():  # a step log summed over the epoch (a count)
                if got.metric is None and got.reduce_fx == "sum" and math.isfinite(got.value):
                    epoch.summed[n] = whole[n] = epoch.summed.get(n, 0.0) + got.value
            ended = self.close(module, run) if epoch.last else \
                self.epoch_so_far(module, run) if self.ends_epoch else {}
        finally:
            set_modes(module, found)
        whole.update({n: got.value for n, got in ended.items()})
        self.reductions.update({n: got.reduction(n in ended) for n, got in
                                (*stepped.items(), *ended.items())})
        if not stepped and not whole and isinstance(returned, torch.Tensor) and \
                returned.dim() == 0:
            stepped["val_loss"] = Logged(float(returned), None, "mean", None)
        if not stepped and not whole:
            raise WorkbookError("validation_step logs nothing and returns no loss",
                                "self.log('val_loss', loss) in validation_step (or the epoch's "
                                "metric in on_validation_epoch_end), as Lightning's "
                                "checkpointing and early stopping need")
        return self.reported(epoch, stepped, whole, rows)

    @staticmethod
    def reported(epoch: ValidationEpoch, stepped: dict[str, Logged], whole: dict[str, float],
                 rows: int) -> dict[str, tuple]:
        """{metric: (sum, count)} for the loop: a step log weighted by its batch size, an epoch
        value telescoped so the evaluation's sum is the epoch's."""
        out = {}
        for metric, got in stepped.items():
            if got.metric is not None or got.reduce_fx != "mean" or \
                    not math.isfinite(got.value):
                continue
            count = rows if got.size is None else got.size
            out[metric] = (got.value * count, count)
        for metric, value in whole.items():
            if not math.isfinite(value):
                continue
            total = value * epoch.rows
            out[metric] = (total - epoch.reported.get(metric, 0.0), rows)
            epoch.reported[metric] = total
        return out
