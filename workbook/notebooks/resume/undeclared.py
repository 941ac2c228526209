"""Notebook 07's test for state an update carries to the next that the task does not declare
(an RNN's hidden state kept in a train_step's closure or on the model, as scripts keep it): a
resumed process starts it afresh, so the resume reads the same examples and is not exact.
Measured by running one update twice from the same parameters, optimizer and random state."""

from __future__ import annotations

import copy
import inspect

import torch

from ...contract.data import Item, encode_example, micro_batches
from ...contract.outputs import forward_owner
from ...contract.pipeline import open_pipeline
from ...contract.task import Task
from ...training.deviation import max_difference
from ...training.loop import Stepper, TrainConfig, build_stepper, runs_own_step, seed_everything

STATE_NAMES = ("hx", "h0", "state", "memory", "mems", "carry")  # besides "...hidden..."
TOLERANCE = 1e-6  # relative: one update run twice in one process agrees to rounding
DECLARE = ("declare it: state=wb.CarriedState(init=lambda model, rows: "
           "model.init_hidden(rows)) and leave the model call to the workbook's update (no "
           "state of your own in train_step): it passes the state to the forward per stream, "
           "detaches it and saves it in every checkpoint (docs/own-task.md, \"State carried "
           "across batches\"); or save and restore it in save_state/restore_state")


def state_argument(model: torch.nn.Module) -> str | None:
    """The name of the forward's argument that looks like a carried state ("hidden", "hx",
    "memory", ...), else None."""
    try:
        names = inspect.signature(forward_owner(model).forward).parameters
    except (TypeError, ValueError):
        return None
    return next((n for n in names if "hidden" in n.lower() or n in STATE_NAMES), None)


def first_update(task: Task, items: list[Item], cfg: TrainConfig, limit: int = 0) -> list:
    """The micro-batches of one update of the run's shape, from its first training examples."""
    size = cfg.shape.micro_batch * cfg.shape.accumulation
    if cfg.pipeline:
        pipe = open_pipeline(task, cfg.seed, micro_batch=cfg.shape.micro_batch, limit=limit)
        items = []
        for _, _, raw in pipe.read():
            if raw is None or len(items) >= size:
                break
            items.append(encode_example(task, raw))
    return list(micro_batches(task, items[:size], cfg.shape.micro_batch))


def twice(stepper: Stepper, batches: list, own: bool, seed: int) -> list[tuple[float, dict]]:
    """(loss, parameters after) of the same update run twice from the same parameters,
    optimizer, schedule and random state."""
    start = [copy.deepcopy(x.state_dict()) for x in
             (stepper.model, stepper.scheduler, stepper.optimizer)]
    out = []
    for _ in range(2):
        for x, state in zip((stepper.model, stepper.scheduler, stepper.optimizer), start,
                            strict=True):
            x.load_state_dict(copy.deepcopy(state))
        seed_everything(seed)
        if own:
            loss = stepper.own_update(batches)[0]
        else:
            summed, targets = stepper.accumulate(batches)
            stepper.step()
            loss = float(summed) / targets
        out.append((loss, {k: v.detach().float().clone()
                           for k, v in stepper.model.state_dict().items()}))
    return out


def undeclared_state(task: Task, items: list[Item], cfg: TrainConfig, limit: int = 0) -> str:
    """'' unless the task declares no carried state and its update (its train_step, else the
    workbook's) gives another loss or other parameters when run twice from the same state on
    the same batches: it carries state from one call to the next, which a resumed process
    starts afresh. Where the update cannot be run twice, a forward taking a state argument is
    said as a suspicion, with the test to run."""
    if task.state is not None:
        return ""
    own = runs_own_step(task, cfg)
    who = "the task's train_step" if own else "the workbook's update of the task's model"
    try:
        stepper = build_stepper(task, cfg)
    except Exception:  # the runs compared built it: nothing to say beyond their error
        return ""
    argument = state_argument(stepper.model)
    takes = f"; the model's forward takes {argument!r}" if argument else ""
    try:
        (first, a), (second, b) = twice(stepper, first_update(task, items, cfg, limit), own,
                                        cfg.seed)
    except Exception as exc:  # the experiment could not run: a suspicion at most
        if not argument:
            return ""
        return (f"the same examples, other parameters, and the model's forward takes "
                f"{argument!r} while the task declares no carried state: a state your loop "
                "carries from batch to batch starts afresh in a resumed process (not "
                f"confirmed: running one update twice failed, {type(exc).__name__}) - test it: "
                f"run {who} twice from the same model, optimizer and random state on the same "
                "batch; if the two losses differ, " + DECLARE)
    moved = max_difference(a, b)
    scale = max(max((float(v.abs().max()) for v in a.values() if v.numel()), default=0.0), 1.0)
    same_loss = abs(first - second) <= TOLERANCE * max(abs(first), 1.0)
    if same_loss and moved <= TOLERANCE * scale:
        return ""
    if same_loss and not argument:  # the forward saw the same state: the step is what differs
        return nondeterministic(stepper.model, first, moved)
    return (f"the same examples, other parameters: {who}, run twice from the same parameters, "
            f"optimizer and random state on the same update, gave loss "
            f"{first:.6g} then {second:.6g} (parameters apart by up to {moved:.3g}){takes}: it "
            "carries state from one call to the next that the task does not declare (an RNN's "
            "hidden state kept in the step's closure or on the model), which a resumed process "
            "starts afresh - " + DECLARE)


def nondeterministic(model: torch.nn.Module, loss: float, moved: float) -> str:
    """The same update run twice gives the same loss but other parameters: the backward or the
    optimizer step is not deterministic on this device, not a carried state."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    fix = ("set CUBLAS_WORKSPACE_CONFIG=:4096:8 before the process starts and call "
           "torch.use_deterministic_algorithms(True) (it names any operation with no "
           "deterministic kernel)" if device.type == "cuda" else
           "call torch.use_deterministic_algorithms(True) and keep the thread count of the "
           "first run")
    return (f"the same examples, other parameters: one update run twice from the same "
            f"parameters, optimizer and random state gave the same loss {loss:.6g} but "
            f"parameters apart by up to {moved:.3g}: the backward or the optimizer step is not "
            f"deterministic on {device.type} (e.g. atomic adds in a scatter or embedding "
            f"backward), so no resume can be exact - {fix}, or judge with resume_tolerance "
            f"above {moved:.3g}")
