"""Notebook 04's checks of the task's own code as a campaign calls it: its `train_step` (the
gradient it steps with, clipping held off, the loss it returns) and its `eval_step`."""

from __future__ import annotations

import contextlib
import math
import random
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import pandas as pd
import torch

from ...base.errors import WorkbookError
from ...contract.data import Batch, Item, collate_items, micro_batches
from ...contract.task import Task, own_code
from ...training.loop import HeldBehaviour, loss_of


class GradientRecorder(torch.optim.SGD):
    """The optimizer handed to a task's own `train_step` in the check: `step()` records the
    gradients and changes no parameter (learning rate 0)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model.parameters(), lr=0.0)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.grads: dict[str, torch.Tensor] = {}
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        self.grads = {self.names[id(p)]: p.grad.detach().clone() for g in self.param_groups
                      for p in g["params"] if p.grad is not None}


@contextlib.contextmanager
def clipping_held_off(*own_code: Any) -> Iterator[None]:
    """PyTorch's gradient clipping measures and returns the norm but changes no gradient inside
    the block: clipping rescales a gradient that is N times too large to the same norm as the
    right one, which would hide a normalisation error from the comparison. Every binding is
    held - `torch.nn.utils.clip_grad_norm_`, a module's `from torch.nn.utils import
    clip_grad_norm_` (any imported module's namespace) and the closures of `own_code`."""
    utils = torch.nn.utils

    def norm_only(parameters, max_norm, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        return utils.get_total_norm([p.grad for p in params if p.grad is not None])

    held = {id(utils.clip_grad.clip_grad_norm_): norm_only,
            id(utils.clip_grad.clip_grad_value_): lambda *a, **k: None}
    swapped: list[tuple[Any, Any, Any]] = []  # (namespace or cell, name, original)
    for module in list(sys.modules.values()):
        space = getattr(module, "__dict__", None)
        if not isinstance(space, dict) or held.keys().isdisjoint(map(id, space.values())):
            continue  # (the test at C speed: half the time of a scan of 4,000 modules' names)
        for name, value in list(space.items()):
            if id(value) in held:
                swapped.append((space, name, value))
    for fn in own_code:
        for cell in getattr(getattr(fn, "__wrapped__", fn), "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if id(cell.cell_contents) in held:
                    swapped.append((cell, None, cell.cell_contents))
    for where, name, value in swapped:
        if name is None:
            where.cell_contents = held[id(value)]
        else:
            where[name] = held[id(value)]
    try:
        yield
    finally:
        for where, name, value in reversed(swapped):
            if name is None:
                where.cell_contents = value
            else:
                where[name] = value


@dataclass
class OwnStep:
    """One call of the task's `train_step` as the check ran it: the gradient it stepped with,
    the loss it returned, and whether it asked for training mode (held in eval behaviour)."""

    grads: dict[str, torch.Tensor]
    returned: Any  # what the step returned: the loss, as a tensor, a float or a dict
    sets_train_mode: bool


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Torch's CPU generator, Python's `random` and NumPy's global generator seeded with `seed`
    inside the block - where a task's collate or step draws (torchvision's `RandomChoice` draws
    from `random`) - and each given back after."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def split_batches(task: Task, items: list[Item], micro_batch: int, whole: Batch | None = None,
                  seed: int = 0) -> list[Batch]:
    """`items` as micro-batches of `micro_batch`, collated under `seed` - or, given `whole`
    (the update collated once, for a collate that draws per batch: mixup, cutmix), its rows,
    so that every split sees the same draw."""
    if whole is None:
        with seeded(seed):
            return list(micro_batches(task, items, micro_batch))
    n = len(whole)
    return [Batch(whole.ids[i:i + micro_batch],
                  {k: v[i:i + micro_batch] if v.dim() and len(v) == n else v
                   for k, v in whole.tensors.items()})
            for i in range(0, n, micro_batch)]


def one_draw(task: Task, items: list[Item], seed: int = 0) -> Batch:
    """The whole update collated once as a training batch (`Task.train_collate`), under
    `seed`."""
    with seeded(seed):
        return collate_items(task, items, training=True)


def run_own_step(task: Task, model: torch.nn.Module, batches: list[dict[str, torch.Tensor]],
                 seed: int = 0) -> OwnStep:
    """One call of the task's `train_step` for an update over `batches` (its micro-batches),
    with an optimizer that records the gradient and changes nothing. Dropout, batch norm and
    every mode-dependent layer are held in eval behaviour whatever mode the step sets, clipping
    is held off and the random state is the same for every call; the step must step the
    optimizer exactly once."""
    model.zero_grad(set_to_none=True)
    recorder = GradientRecorder(model)
    with seeded(seed), HeldBehaviour(model) as held, clipping_held_off(task.train_step):
        returned = own_code("train_step", task.train_step, model, recorder, batches,
                            receives="(model, optimizer, [batch dict per micro-batch])")
    if recorder.steps != 1:
        raise WorkbookError(f"the task's train_step called optimizer.step() {recorder.steps} "
                            f"times for one update of {len(batches)} micro-batches",
                            "step once per update, after the last micro-batch")
    return OwnStep(recorder.grads, returned, held.sets_train_mode)


def own_step_gradients(task: Task, model: torch.nn.Module, items: list[Item],
                       micro_batch: int, whole: Batch | None = None) -> dict[str, torch.Tensor]:
    """The gradient one call of the task's `train_step` applies (see `run_own_step`)."""
    batches = split_batches(task, items, micro_batch, whole)
    return run_own_step(task, model, [b.tensors for b in batches]).grads


def step_loss_check(task: Task, items: list[Item], tolerance: float = 1e-4,
                    seed: int = 0) -> pd.DataFrame:
    """The loss the task's `train_step` returns for one micro-batch of `items` against the
    task's `loss` on the same batch and weights (the recording optimizer changes nothing; both
    in eval behaviour): a step that computes another loss - it drops the attention mask, adds a
    term, reads other inputs - trains another objective than the one every check judges."""
    torch.manual_seed(seed)
    model = task.build_model().eval()
    batch = one_draw(task, items, seed)  # one collated batch for both
    with torch.no_grad():
        summed, count = task.loss(task.forward(model, batch.tensors), batch.tensors)
    step = run_own_step(task, model, [batch.tensors], seed)
    expected, loss = float(summed) / max(float(count), 1e-12), loss_of(step.returned)
    diff = abs(loss - expected) / max(abs(expected), 1e-12)
    # the gradient of the task's loss on the same batch, in the same behaviour: a step whose
    # loss and gradient are both 1/k of the task's divides by k before back-propagating
    model.zero_grad(set_to_none=True)
    with seeded(seed), HeldBehaviour(model):
        summed, count = task.loss(task.forward(model, batch.tensors), batch.tensors)
        (summed / max(float(count), 1e-12)).backward()
    own = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                         if p.grad is not None] or [torch.zeros(1)])
    model.zero_grad(set_to_none=True)
    stepped = torch.nn.utils.get_total_norm(list(step.grads.values()) or [torch.zeros(1)])
    grad_ratio = float(stepped / own) if float(own) > 0 else math.nan
    divisor = divided_by(loss / expected if expected else math.nan, grad_ratio)
    explain = getattr(task.train_step, "explain_loss", None)
    return pd.DataFrame([{"examples": len(items), "train_step_loss": loss,
                          "task_loss": expected, "relative_difference": diff,
                          "agree": diff <= tolerance, "gradient_ratio": grad_ratio,
                          "divided_by": divisor,
                          "cause": explain(divisor) if explain and divisor else None,
                          "train_step_sets_train_mode": step.sets_train_mode}])


def divided_by(loss_ratio: float, grad_ratio: float, tolerance: float = 1e-3) -> int | None:
    """k when a step's loss and the gradient it steps with are both 1/k of the task's (k > 1,
    each within `tolerance`): the step divides its loss by k before back-propagating it."""
    if not (loss_ratio > 0 and grad_ratio > 0):
        return None
    k = round(1 / loss_ratio)
    if k < 2 or any(abs(r * k - 1) > tolerance for r in (loss_ratio, grad_ratio)):
        return None
    return k


def evaluation_check(task: Task, items: list[Item], tolerance: float = 1e-5,
                     sets_train_mode: bool = False, seed: int = 0) -> pd.DataFrame:
    """The task's own `eval_step` as a campaign calls it - between updates, the model in
    training mode - over the same examples in one batch and in batches whose last one is
    padded with zero-weight copies. Per metric: its sums must not depend on the batching (a
    count that grows counts the copies), must not depend on the mode the model was in (else it
    evaluates with dropout and batch statistics on), and the model must be left in training
    mode (unless the task's train_step sets it again, `sets_train_mode`)."""
    from ...training.evaluation import evaluation_batches, metric_sums

    n = len(items)
    padded = next((b for b in (3, 4, 5, 7) if n % b), None) if n > 1 else None
    torch.manual_seed(seed)
    model = task.build_model()
    targets = sum(task.target_count(it.tensors["labels"]) for it in items)

    ran_training: list[str] = []  # mode-dependent layers that ran in training mode
    hooks = [m.register_forward_pre_hook(
        lambda mod, _, name=name: ran_training.append(name) if mod.training else None)
        for name, m in mode_dependent_layers(model)]

    def sums(batch_size: int, mode: bool) -> tuple[dict[str, list[float]], bool]:
        total: dict[str, list[float]] = {}
        left_training = True
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for batch in evaluation_batches(task, items, batch_size, torch.device("cpu")):
                model.train(mode)
                with torch.no_grad():
                    got = metric_sums(task, model, None, batch.tensors)
                left_training = left_training and model.training
                for name, (num, den) in got.items():
                    acc = total.setdefault(name, [0.0, 0.0])
                    acc[0], acc[1] = acc[0] + num, acc[1] + den
        model.train(True)
        return total, left_training

    try:
        whole, left_training = sums(n, True)
        in_eval, _ = sums(n, False)
        batched, _ = sums(padded, True) if padded else (whole, True)
    finally:
        for h in hooks:
            h.remove()

    def same(a: list[float], b: list[float]) -> bool:
        return all(abs(x - y) <= tolerance * max(abs(x), abs(y), 1.0)
                   for x, y in zip(a, b, strict=True))

    rows = []
    for name, (num, den) in whole.items():
        other = batched.get(name, [math.nan, math.nan])
        rows.append({"metric": name, "value": num / den if den else math.nan, "count": den,
                     "examples": n, "targets": targets,
                     "batches": f"1 x {n} / {math.ceil(n / padded)} x {padded}" if padded
                     else f"1 x {n}", "count_batched": other[1],
                     "same_over_batching": same([num, den], other),
                     "same_over_mode": same([num, den], in_eval.get(name, [math.nan] * 2))
                     and not ran_training,
                     "layers_in_training_mode": ", ".join(sorted(set(ran_training))[:4]),
                     "leaves_training_mode": left_training,
                     "train_step_sets_train_mode": sets_train_mode,
                     "ok": same([num, den], other) and not ran_training and
                     same([num, den], in_eval.get(name, [math.nan] * 2)) and
                     (left_training or sets_train_mode)})
    return pd.DataFrame(rows)


def mode_dependent_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The layers whose output depends on training mode: dropout, batch norm (and instance
    norm that tracks statistics), and attention or other modules with a dropout rate above 0."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd
    from torch.nn.modules.instancenorm import _InstanceNorm

    def depends(m: torch.nn.Module) -> bool:
        if isinstance(m, _DropoutNd):
            return m.p > 0
        if isinstance(m, (_BatchNorm, _InstanceNorm)):
            return m.track_running_stats
        return any(isinstance(v, float) and v > 0 for k, v in vars(m).items()
                   if "dropout" in k)
    return [(f"{name} ({type(m).__name__})" if name else type(m).__name__, m)
            for name, m in model.named_modules() if depends(m)]


def evaluation_findings(evaluation: pd.DataFrame | None) -> list[str]:
    """What is wrong with the task's eval_step, in words (empty when nothing is)."""
    if evaluation is None or evaluation.empty:
        return []
    found = []
    for row in evaluation.itertuples():
        if not row.same_over_batching and (row.same_over_mode or
                                           row.count_batched != row.count):
            grew = row.count_batched > row.count
            found.append(f"eval_step's {row.metric!r} changes with the evaluation batch (count "
                         f"{row.count:g} in one batch, {row.count_batched:g} in "
                         f"{row.batches.split(' / ')[-1]})" + (
                             ": it counts the padding copies of the last partial batch - "
                             "weigh rows by batch['example_weight'] (0 for a copy) or skip "
                             "labels of -100/NaN" if grew else ""))
        if not row.same_over_mode:
            where = (f" ({row.layers_in_training_mode} ran in training mode)"
                     if row.layers_in_training_mode else "")
            found.append(f"eval_step's {row.metric!r} depends on the mode the model was in: "
                         f"it evaluates with dropout and batch statistics on{where} - call "
                         "model.eval() inside it (and restore the mode after)")
    if not (evaluation.leaves_training_mode | evaluation.train_step_sets_train_mode).all():
        found.append("eval_step leaves the model in eval mode: the updates after the first "
                     "evaluation train without dropout and with frozen batch-norm statistics "
                     "- restore the mode it found (model.train(was_training))")
    return found
