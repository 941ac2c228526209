"""What a forward returned, read: the logits and the model's own loss where the task says or
where they are found (`model_outputs`), and how a model's forward takes the batch's inputs."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import Tensor, nn

from ..base.errors import WorkbookError
from .kinds import Kind

if TYPE_CHECKING:
    from .task import Task


@dataclass
class ModelOutputs:
    """What the pilot reads from one forward: the logits, and the model's own loss (None when
    it computes none)."""

    logits: Tensor
    loss: Tensor | None = None


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode without gradients inside the block; the model's previous mode comes back
    after it, also when the block raises."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def describe(value: Any, depth: int = 0) -> str:
    """A model's output for a message: types and tensor shapes, not values."""
    if isinstance(value, Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if value is None or depth > 1:
        return "None" if value is None else type(value).__name__
    if isinstance(value, Mapping):
        inner = ", ".join(f"{k}={describe(v, depth + 1)}" for k, v in list(value.items())[:6])
        return f"{type(value).__name__}({inner})"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v, depth + 1) for v in value[:6])
        return f"{type(value).__name__}({inner}{', ...' if len(value) > 6 else ''})"
    return type(value).__name__


def _leading(task: "Task", batch: dict[str, Tensor]) -> tuple[int, ...]:
    """The leading dims a logits tensor of this batch has: the labels' shape (generation and
    classification: one row of logits per target), else the batch size."""
    return task.target_kind.leading_dims(batch.get("labels"),
                                         int(task.main_input(batch).shape[0]))


def _fits(t: Any, lead: tuple[int, ...], kind: Kind) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point() and kind.logits_fit(t, lead)


def _pick(task: "Task", output: Any, where: int | str, name: str) -> Any:
    """output[where] (tuple index, dict key) or output.where (attribute), or the error naming
    what the model returned and the field."""
    try:
        if isinstance(where, str) and not isinstance(output, Mapping):
            return getattr(output, where)
        return output[where]
    except (AttributeError, KeyError, IndexError, TypeError):
        raise WorkbookError(f"the model of {task.name!r} returned {describe(output)}, which has "
                            f"no {where!r} (the task's {name}={where!r})",
                            f"set {name} to where its output holds it: an index into a tuple "
                            "or a key/attribute name") from None


def _find_logits(task: "Task", output: Any, batch: dict[str, Tensor]) -> Tensor:
    if isinstance(output, Tensor):
        return output
    found = output.get("logits") if isinstance(output, Mapping) else \
        getattr(output, "logits", None)
    if isinstance(found, Tensor):
        return found
    if isinstance(output, (tuple, list)):
        lead = _leading(task, batch)
        tensors = [t for t in output if isinstance(t, Tensor) and t.is_floating_point()]
        fitting = [i for i, t in enumerate(output) if _fits(t, lead, task.target_kind)]
        if fitting:
            return output[fitting[0]]
        last = _last_position_only(task, tensors[0], batch) if tensors else ""
        raise WorkbookError(
            f"the model of {task.name!r} returned {describe(output)}: none of its float "
            f"tensors has the batch's leading dims {list(lead)}" + (f" - {last}" if last else ""),
            _pass_targets(task) if last else "say where the logits are: logits_at=<index> (and "
            "loss_at=<index> for the model's own loss)")
    raise WorkbookError(
        f"the model of {task.name!r} returned {describe(output)}: the workbook reads logits "
        "from a tensor, an output with `.logits`, a dict with 'logits' or a tuple",
        "say where the logits are: logits_at=<key, attribute or index>")


def _find_loss(output: Any, logits: Tensor) -> Tensor | None:
    if isinstance(output, Mapping):
        found = output.get("loss")
    elif isinstance(output, (tuple, list)):
        scalars = [t for t in output if isinstance(t, Tensor) and t is not logits
                   and t.is_floating_point() and t.dim() == 0]
        found = scalars[0] if len(scalars) == 1 else None
    else:
        found = getattr(output, "loss", None)
    return found if isinstance(found, Tensor) else None


def _last_position_only(task: "Task", logits: Tensor, batch: dict[str, Tensor]) -> str:
    """Why generation logits cover one position of many, in words; "" when they do not."""
    labels = batch.get("labels")
    if not task.target_kind.causal or labels is None or labels.dim() != 2 or \
            logits.dim() != 3 or logits.shape[1] != 1 or labels.shape[1] == 1:
        return ""
    return (f"its logits {describe(logits)} cover 1 position of {labels.shape[1]}: a forward "
            "that computes every position's logits only when it is given the targets "
            "(nanoGPT's `self.lm_head(x[:, [-1], :])` without them) needs the labels")


def _pass_targets(task: "Task") -> str:
    main = task.model_inputs[0]
    return (f"pass the labels to the forward: model_inputs=({main!r}, 'labels') - they reach a "
            "parameter named `targets` (or set forward_names={'labels': '<parameter>'})")


def model_outputs(task: "Task", output: Any, batch: dict[str, Tensor]) -> ModelOutputs:
    """The logits and the model's own loss in what a forward returned: where `logits_at` and
    `loss_at` say, else found when unambiguous (`Task.logits_at`); anything else is a
    WorkbookError naming what was returned and the field to set."""
    logits = _pick(task, output, task.logits_at, "logits_at") if task.logits_at is not None \
        else _find_logits(task, output, batch)
    if not isinstance(logits, Tensor) or logits.dim() == 0:
        raise WorkbookError(f"the model of {task.name!r} returned {describe(output)}; its "
                            f"logits_at={task.logits_at!r} holds {describe(logits)}, not a "
                            "tensor of logits" + (" (one number: its loss?)"
                                                  if isinstance(logits, Tensor) else ""),
                            "set logits_at to the index or key of the logits tensor")
    last = _last_position_only(task, logits, batch)
    if last:
        raise WorkbookError(f"the model of {task.name!r} returned {describe(output)}: {last}",
                            _pass_targets(task))
    loss = _pick(task, output, task.loss_at, "loss_at") if task.loss_at is not None \
        else _find_loss(output, logits)
    if loss is not None and not isinstance(loss, Tensor):
        raise WorkbookError(f"the model of {task.name!r} returned {describe(output)}; its "
                            f"loss_at={task.loss_at!r} holds {describe(loss)}, not a tensor",
                            "set loss_at to the index or key of the model's loss, or leave it "
                            "None")
    return ModelOutputs(logits, loss)


def forward_owner(model: nn.Module) -> nn.Module:
    """The module whose forward receives the inputs: inside DistributedDataParallel,
    DataParallel, torch.compile and an AveragedModel (EMA, SWA), which pass them through."""
    from torch.optim.swa_utils import AveragedModel

    for _ in range(8):
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel,
                                AveragedModel)):
            model = model.module
        else:
            break
    return model


@functools.lru_cache(maxsize=64)
def accepted(fn: Callable) -> tuple[str, ...]:
    """The argument names `fn` takes - a model class's forward, a task factory, a pipeline -
    ("**" when it takes any keyword, or its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable
        return ("**",)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return ("**",)
    return tuple(p.name for p in params if p.name != "self" and
                 p.kind is not inspect.Parameter.VAR_POSITIONAL)


@functools.lru_cache(maxsize=64)
def positional_parameters(model_type: type) -> tuple[str, ...]:
    """The forward's parameters that may be passed by position, in order."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(model_type.forward).parameters.values()
                 if p.name != "self" and p.kind in positional)


def batch_major(output: Any, rows_steps: tuple[int, ...]) -> Any:
    """A time-major forward's output (`Task.time_major`) laid out as the batch: every tensor
    of [time, rows, ...] becomes [rows, time, ...], and one flattened to [time * rows, ...]
    (word_language_model's `decoded.view(-1, ntoken)`) the same."""
    rows, steps = rows_steps

    def turned(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.dim() == 0:
            return t
        if t.dim() >= 2 and tuple(t.shape[:2]) == (steps, rows):
            return t.transpose(0, 1)
        if t.shape[0] == steps * rows and (steps, rows) != (1, 1):
            return t.reshape(steps, rows, *t.shape[1:]).transpose(0, 1)
        return t

    if isinstance(output, Mapping):
        return type(output)({k: turned(v) for k, v in output.items()}) \
            if isinstance(output, dict) else {k: turned(v) for k, v in output.items()}
    if isinstance(output, (tuple, list)):
        return tuple(turned(v) for v in output)
    return turned(output)
