"""Notebook 03's update gates: what an update must have done, and - for trainable tensors that
did not change - the cause, tested on the task's own model and optimizer in a debugger's order
(in the optimizer, the learning rate the update ran at, a gradient, the float resolution)
before it is named; an untested cause is worded as a suspicion with its test."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...contract import fine_tuning
from ...contract.data import Batch
from ...training import checkpoint as ckpt
from ...training.loop import RUNAWAY_MULTIPLE, Stepper
from .diagnosis import decay_on_norms
from .settings import REMEDIATION


@dataclass
class BeforeUpdate:
    """What the update gate compares with, read just before the update: every parameter and
    the learning rate each param group runs the update at (the task's schedule applied)."""

    params: dict[str, torch.Tensor]
    lrs: list[float]

    @classmethod
    def of(cls, stepper: Stepper) -> "BeforeUpdate":
        return cls({n: p.detach().clone() for n, p in stepper.model.named_parameters()},
                   [float(g["lr"]) for g in stepper.optimizer.param_groups])


@dataclass
class Finding:
    """One tested cause: "fail", "warn" or "pass" (a note), the measurement in words, the fix."""

    verdict: str
    words: str
    fix: str = ""


def _listed(names: list[str]) -> str:
    return (f"{len(names)} trainable tensor{'s' * (len(names) != 1)} ({', '.join(names[:5])}"
            f"{', ...' * (len(names) > 5)})")


def unchanged_causes(stepper: Stepper, names: list[str], before: BeforeUpdate,
                     batches: list[Batch], targets: int, clip_scale: float,
                     first: bool) -> list[Finding]:
    """Why the trainable tensors `names` (all in the optimizer) did not change in the update
    just made, tested in a debugger's order: the learning rate their group ran at, their
    gradient on the update's batches, and one update of copies replayed in float64 and in their
    own dtype (below their float resolution). Only a confirmed cause is named as the cause."""
    optimizer, params = stepper.optimizer, dict(stepper.model.named_parameters())
    group_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
    group = {n: group_of[id(params[n])] for n in names}
    findings = _zero_lr(optimizer, [n for n in names if before.lrs[group[n]] == 0], group,
                        first)
    rest = [n for n in names if before.lrs[group[n]] > 0]
    if not rest:
        return findings
    grads = probe_gradients(stepper, batches, targets, [params[n] for n in rest])
    dead = [n for n, g in zip(rest, grads, strict=True) if g is None or not bool(g.any())]
    if dead:
        findings.append(Finding("fail", f"{_listed(dead)} did not change: their gradient is 0 "
                                "on this update's batches (measured again): no gradient "
                                "reaches them - a detach(), a branch multiplied by 0, or an "
                                "output the loss never uses",
                                "trace how these tensors reach the loss"))
    by_group: dict[int, list] = {}
    for n, g in zip(rest, grads, strict=True):
        if n not in dead:
            by_group.setdefault(group[n], []).append((n, params[n], before.params[n],
                                                      g * clip_scale))
    for k, members in by_group.items():
        findings += _resolution(optimizer, k, members, before.lrs[k], first)
    return findings


def _zero_lr(optimizer: torch.optim.Optimizer, names: list[str], group: dict[str, int],
             first: bool) -> list[Finding]:
    """Tensors whose param group ran the update at lr 0: a schedule that starts from 0 (a note
    on the first update; a warning if it is still 0 after), or a group set to lr 0 (a fault)."""
    groups = optimizer.param_groups
    scheduled = [n for n in names if groups[group[n]].get("initial_lr", 0) > 0]
    fixed = [n for n in names if n not in scheduled]
    out = []
    if scheduled:
        nxt = max(float(groups[group[n]]["lr"]) for n in scheduled)
        words = (f"{_listed(scheduled)} did not change because the learning rate was 0 at this "
                 "update: the task's schedule starts from 0 (a warm-up from 0, as every Hugging "
                 "Face warm-up schedule - get_scheduler(..., num_warmup_steps=N) - gives its "
                 "first update), not a fault of your code")
        if first and nxt > 0:
            out.append(Finding("pass", f"{words}; the next update runs at lr {nxt:g} and the "
                               "later update's gate judges it"))
        else:
            out.append(Finding("warn", f"{words}; still 0 here, next {nxt:g}: no update of the "
                               "gates moved them", "check that the task's schedule rises "
                               "above 0 (a warm-up from 0 spends its first updates on nothing)"))
    if fixed:
        out.append(Finding("fail", f"{_listed(fixed)} did not change: their param group has lr "
                           "0 from the start, so they never train",
                           "give that param group a learning rate, or freeze the tensors "
                           "(requires_grad=False)"))
    return out


def probe_gradients(stepper: Stepper, batches: list[Batch], targets: int,
                    params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    """The gradient of each of `params` on `batches` (normalised by `targets`), measured again
    on the model as it is; its random state, buffers and gradients are put back after."""
    model = stepper.model
    rng, saved = ckpt.rng_state(), [(p, p.grad) for p in model.parameters()]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    scale = float(stepper.scaler.get_scale()) if stepper.scaler is not None else 1.0
    try:
        for p, _ in saved:
            p.grad = None
        for batch in batches:
            _, summed, _ = stepper.forward_loss(batch)
            (summed * scale).backward()
        return [None if p.grad is None else p.grad.detach() / (scale * targets) for p in params]
    finally:
        for p, g in saved:
            p.grad = g
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        ckpt.set_rng_state(rng, "the random state before the gradient probe")


def replayed(optimizer: torch.optim.Optimizer, k: int, members: list, lr: float,
             dtype: torch.dtype | None, fresh: bool) -> list[torch.Tensor]:
    """One update of copies of `members` ((name, parameter, value before, gradient)) in
    `dtype` (None: their own) by a new optimizer of the task's class with group `k`'s settings
    at `lr`, from an empty state (`fresh`: as the first update) or a copy of the optimizer's
    state now (one more update); the changes, in float64."""
    settings = {key: v for key, v in optimizer.param_groups[k].items()
                if key not in ("params", "initial_lr")}
    for key, value in (("foreach", False), ("fused", None), ("capturable", False)):
        if key in settings:
            settings[key] = value
    copies = []
    for _, _, value, grad in members:
        c = value.detach().to(dtype or value.dtype).clone().requires_grad_(True)
        c.grad = grad.to(c.dtype)
        copies.append(c)
    twin = type(optimizer)([{"params": copies, **settings, "lr": lr}])
    for (_, param, _, _), c in zip(members, copies, strict=True):
        if not fresh:  # the state's moments in the copy's dtype; its step counter as it is
            twin.state[c] = {key: v.to(c.dtype, copy=True) if key != "step" and
                             torch.is_tensor(v) and v.is_floating_point() else copy.deepcopy(v)
                             for key, v in optimizer.state.get(param, {}).items()}
    twin.step()
    return [c.detach().double() - value.double() for (_, _, value, _), c
            in zip(members, copies, strict=True)]


def spacing(values: torch.Tensor) -> float:
    """The gap between neighbouring values of the tensor's dtype near its median magnitude."""
    info = torch.finfo(values.dtype)
    typical = float(values.detach().abs().float().median())
    return info.eps * 2.0 ** math.floor(math.log2(max(typical, info.tiny)))


def _resolution(optimizer: torch.optim.Optimizer, k: int, members: list, lr: float,
                first: bool) -> list[Finding]:
    """Replay the update of a group's unchanged tensors on copies, in float64 and in their own
    dtype - from an empty state on the first update; after it, from a copy of the optimizer's
    state or an empty one: moved in float64 but not in their dtype confirms an update under
    their float resolution (a note where the schedule's base lr moves them, else a warning)."""
    names = [n for n, _, _, _ in members]
    below: dict[str, tuple[float, bool]] = {}  # name -> (its float64 change, state kept empty)
    moved = dict.fromkeys(names, 0.0)  # name -> its largest float64 change
    try:
        for fresh in ([True] if first else [False, True]):
            exact = replayed(optimizer, k, members, lr, torch.float64, fresh)
            own = replayed(optimizer, k, members, lr, None, fresh)
            for name, d, o in zip(names, exact, own, strict=True):
                change = float(d.abs().max())
                moved[name] = max(moved[name], change)
                if change > 0 and not bool(o.any()):
                    below.setdefault(name, (change, fresh))
    except Exception as exc:  # an optimizer that cannot be rebuilt from its group's settings
        return [Finding("fail", f"{_listed(names)} did not change, though in the optimizer "
                        f"(param group {k}, lr {lr:g}) with a nonzero gradient; the cause is "
                        f"not confirmed: replaying the update with {type(optimizer).__name__} "
                        f"failed ({type(exc).__name__}: {str(exc)[:120]})",
                        "test: step a copy of the optimizer on these tensors alone and compare "
                        "them before and after; if they move, something in the step skips them")]
    out = []
    if below:
        small = [m for m in members if m[0] in below]
        dtypes = "/".join(sorted({str(v.dtype).replace("torch.", "") for _, _, v, _ in small}))
        words = (f"{_listed(list(below))} changed by less than their float resolution: the "
                 f"update at lr {lr:g}, replayed on copies in float64, moves them by at most "
                 f"{max(c for c, _ in below.values()):.2g}, under the {dtypes} spacing "
                 f"{min(spacing(v) for _, _, v, _ in small):.2g} near their values (the copies "
                 f"in {dtypes} do not move either) - not a fault of the optimizer")
        base = float(optimizer.param_groups[k].get("initial_lr", lr))
        fresh = any(f for _, f in below.values())
        if base > lr and any(bool(d.any()) for d in replayed(optimizer, k, small, base, None,
                                                              fresh)):
            out.append(Finding("pass", f"{words}; at the schedule's base lr {base:g} they move"))
        else:
            out.append(Finding("warn", f"{words}; at lr {max(base, lr):g}, the schedule's base, "
                               "they do not move either: in this dtype they will not train",
                               "keep these tensors in float32 (master weights), or raise "
                               "their learning rate" if any(torch.finfo(v.dtype).bits < 32
                                                            for _, _, v, _ in small) else
                               f"raise their learning rate: in {dtypes} an update this small "
                               "is lost"))
    other = [n for n in names if n not in below]
    if other:
        out.append(Finding("fail", f"{_listed(other)} did not change, though in the optimizer "
                           f"(param group {k}, lr {lr:g}) with a nonzero gradient, and the "
                           f"update replayed on copies moves them by up to "
                           f"{max(moved[n] for n in other):.2g}: the "
                           "cause is not confirmed - suspect the step itself (an optimizer "
                           "that skips a group, a hook or callback that writes them back, a "
                           "GradScaler that skipped the step)",
                           "test: step the optimizer on these tensors alone and compare them "
                           "before and after"))
    return out


def update_check(expected_step: int, run: Any, before: BeforeUpdate, _) -> tuple[str, ...]:
    """Judge the update just made by the gates' `run` (a GateRun): every trainable tensor in
    the optimizer and moved - or the tested cause of those that did not -, nothing frozen
    moved, the step counter, the schedule's lr, a finite gradient that does not run away.
    (verdict, detail) on a pass, (verdict, detail, remediation) otherwise."""
    model, optimizer = run.work.stepper.model, run.work.stepper.optimizer
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    after = dict(model.named_parameters())
    trainable = [n for n, p in after.items() if p.requires_grad]
    left_out = [n for n in trainable if id(after[n]) not in in_optimizer]
    unchanged = [n for n in trainable if torch.equal(before.params[n], after[n])]
    waiting = fine_tuning.waiting_for_partner(before.params) & set(unchanged)
    unchanged = [n for n in unchanged if n not in waiting and n not in left_out]
    frozen_moved = [n for n, p in after.items()
                    if not p.requires_grad and not torch.equal(before.params[n], p)]
    steps = {int(st["step"]) for st in optimizer.state.values() if "step" in st}
    lr, now = before.lrs[0], optimizer.param_groups[0]["lr"]  # the update's lr, the next's
    norm = float(run.work.state["grad_norm"])
    clip = run.settings.grad_clip
    work = run.work  # the update's batches: its causes are tested on them
    batches, targets = ([work.batch], work.targets) if expected_step == 1 else \
        (work.group, work.group_targets)
    findings = unchanged_causes(run.work.stepper, unchanged, before, batches, targets,
                                min(1.0, clip / (norm + 1e-6)) if clip else 1.0,
                                expected_step == 1) if unchanged else []
    problems = [f"trainable parameters not in the optimizer: {left_out[:5]}"] if left_out else []
    problems += [f.words for f in findings if f.verdict == "fail"]
    if frozen_moved:
        problems.append(f"frozen parameters changed: {frozen_moved[:5]}")
    if steps and steps != {expected_step}:
        problems.append(f"optimizer step counter {sorted(steps)}, expected {expected_step}")
    if run.task.build_scheduler is None:
        scheduled, base = run.settings.lr, run.settings.lr
    else:  # the task's own schedule: at its own rate now, from the lr this run asked for
        scheduled = run.work.stepper.scheduler.get_last_lr()[0]
        base = optimizer.param_groups[0].get("initial_lr", run.settings.lr)
    if not math.isclose(now, scheduled, rel_tol=1e-9):
        problems.append(f"lr {now} is not the scheduled {scheduled}")
    if not math.isclose(base, run.settings.lr, rel_tol=1e-9):
        problems.append(f"the task's schedule starts from lr {base}, not the {run.settings.lr} "
                        "this run asked for")
    if not math.isfinite(norm):
        problems.append(f"gradient norm {norm}")
    first = run.work.state.setdefault("first_grad_norm", norm)
    if expected_step > 1 and norm == 0:
        problems.append(f"gradient norm 0 after the first update at lr {lr:g}: no gradient "
                        "reaches the parameters any more (dead units - most often a learning "
                        "rate far too large; 02 says whether it diverges)")
    elif expected_step > 1 and norm > RUNAWAY_MULTIPLE * first > 0:
        problems.append(f"gradient norm rose from {first:.3g} to {norm:.3g} in one update at lr "
                        f"{lr:g}: the learning rate diverges (02 says so too) - lower it")
    verdict = "fail" if problems else "warn" if any(f.verdict == "warn" for f in findings) \
        else "pass"
    fixes = [f.fix for f in findings if f.verdict == verdict and f.fix]
    phase = "update (first)" if expected_step == 1 else "update (later)"
    remedy = "; ".join(([REMEDIATION[phase]] if len(problems) > len(fixes) else []) + fixes)
    if problems:
        return "fail", "; ".join(problems), remedy
    detail = (f"{len(trainable) - len(waiting) - len(unchanged)} tensors changed, step counter "
              f"{expected_step}, lr {lr:g}, grad norm {norm:.3g}")
    if waiting:
        detail += (f"; {len(waiting)} LoRA A tensors wait for their B, which starts at zero "
                   "(they move from the next update, which this gate judges there)")
    detail = "; ".join([detail, *(f.words for f in findings)])
    decayed = decay_on_norms(run.task, model, optimizer) if expected_step == 1 else None
    detail = f"{detail}; {decayed}" if decayed else detail  # a note, never a finding
    detail = f"{detail}; {run.task.clipping()}"
    return (verdict, detail) if verdict == "pass" else (verdict, detail, remedy)


def timed_update(run: Any, _) -> None:
    """The later update of the gates' `run`, with the seconds spent generating in it where the
    model reports its phases' seconds (`phase_seconds`, GRPO's policy): `run.generation` is
    (generation seconds, update seconds), measured here."""
    seconds = getattr(run.work.stepper.model, "phase_seconds", None)
    before = seconds().get("generation", 0.0) if callable(seconds) else None
    start = time.perf_counter()
    run.work.update_later()
    if before is not None and seconds().get("generation", 0.0) > before:
        run.generation = (seconds()["generation"] - before, time.perf_counter() - start)


def later_update_check(run: Any, before: BeforeUpdate, result: Any) -> tuple[str, ...]:
    """`update_check` of the second update, with generation's share of it where measured."""
    verdict, detail, *remedy = update_check(2, run, before, result)
    if run.generation:
        spent, whole = run.generation
        detail += (f"; generation {spent:.3g} s of the update's {whole:.3g} s: "
                   f"{spent / whole:.0%} of a step (08 prices the campaign with it)")
    return (verdict, detail, *remedy)
