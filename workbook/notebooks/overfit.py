"""Notebook 02: overfit a tiny subset. It proves the mechanics, never generalisation."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import pandas as pd
import torch

from ..base.errors import WorkbookError
from ..contract import fine_tuning
from ..contract.data import Item, collate_items, encode_examples, prepare
from ..contract.outputs import eval_mode
from ..contract.state import whole_update
from ..contract.targets import contributes
from ..contract.task import Task
from ..storage.records import StepRecord, to_frame
from ..training.devices import resolve_device
from ..training.evaluation import evaluate, outputs_of
from ..training.loop import (
    TrainConfig,
    UpdateShape,
    loss_rise,
    runs_own_step,
    seed_everything,
    train,
    update_by,
)
from .parameters import OverfitParams
from .registry import OVERFIT

# 02's learning rate when its `lr` is 0 and the task declares no Task.lr: the samples memorise
# 8 examples in 150 updates (4 in the 80 of --smoke) at it with a wide margin, while the general
# fallback 1e-3 leaves the generation sample's smoke run at 0.048 against the bar of 0.05
FALLBACK_LR = 3e-3
LR_FROM = {"task": "the task's Task.lr", "parameter": "the lr parameter",
           "fallback": "02's fallback; the task declares no Task.lr"}
# the rule of notebook 06: the median loss of the last 5 updates above 3 x the first update's
DIVERGENCE_MULTIPLE = 3.0
MEMORISED_EVERY = 10  # updates between the early-stop checks once the loss is under its bar
NO_FLOOR = 1e-6  # a least loss per target under this is 0: a plain cross-entropy's


@dataclass
class OverfitResult:
    """The loss curve, the verdict checks, and what the trained model gives back per example."""

    task: Task
    steps: pd.DataFrame
    checks: pd.DataFrame
    reproduction: pd.DataFrame
    figures: dict
    diagnosis: str = ""  # the failure in words, the most basic first ("" when it passes)

    @property
    def verdict(self) -> str:
        return "pass" if bool(self.checks.passed.all()) else "fail"


def learning_rate(task: Task, lr: float, lr_from: str = "") -> tuple[float, str]:
    """The learning rate 02 trains at and where it comes from: `lr` when given ("parameter",
    or `lr_from`), for 0 the task's own Task.lr ("task"), else 02's FALLBACK_LR ("fallback")."""
    if not lr:
        return (float(task.lr), "task") if task.lr else (FALLBACK_LR, "fallback")
    return float(lr), lr_from or "parameter"


def learning_rate_of(params: OverfitParams, task: Task) -> tuple[float, str]:
    """`learning_rate` for checked parameters: workbook.params filled an lr of 0 (with
    Task.lr, else 02's fallback) and says where it came from in `lr_from`."""
    return learning_rate(task, params.lr, params.lr_from or "")


def divergence(steps: list[StepRecord]) -> str:
    """Why these updates diverged, in numbers ("" when they did not): after a first update
    with a finite loss and gradient (before it the learning rate has done nothing, so a
    non-finite value there is the model's or the loss's), a non-finite loss or gradient, or
    a rise by `loop.loss_rise` (06's rule).
    Slow learning never rises, so it is never called divergence."""
    first = steps[0] if steps else None
    if first is None or not (math.isfinite(first.loss) and math.isfinite(first.grad_norm)):
        return ""
    last = steps[-1]
    finite = [s.loss for s in steps if math.isfinite(s.loss)]
    peak = last.loss if not math.isfinite(last.loss) else max(finite)
    went = (f"the loss {'rose' if peak > first.loss else 'went'} from {first.loss:.4g} "
            f"to {peak:.4g}")
    within = f"within the first {last.step} updates"
    if len(steps) > 1 and not math.isfinite(last.loss):
        return f"{went} (non-finite) {within}"
    if len(steps) > 1 and not math.isfinite(last.grad_norm):
        return f"{went} and the gradient norm became non-finite ({last.grad_norm}) {within}"
    if loss_rise([s.loss for s in steps], DIVERGENCE_MULTIPLE):
        return f"{went} {within}"
    return ""


def divergence_message(found: str, lr: float, lr_from: str) -> str:
    """The sentence a user reads first when the learning rate diverges."""
    lower = 1e-3 if lr > 1e-3 else lr / 10
    where = {"task": "fix Task.lr in the task", "fallback": "set Task.lr in the task"}.get(
        lr_from, "lower the lr parameter")
    return (f"your learning rate diverges: {found} at lr {lr:g} ({LR_FROM[lr_from]}); try "
            f"{lower:g} ({where}, or give the pilot -p lr={lower:g}), then lower it 10x at a "
            "time until 02 passes")


VARIANCE_SAMPLE = 1024  # training examples whose regression targets give their spread


def target_variance(task: Task, train_split: list[dict], most: int = VARIANCE_SAMPLE) -> float:
    """The variance of the training examples' regression targets (of `most` examples spread
    evenly over those given: 02 reads the first VARIANCE_SAMPLE of the split), the loss of
    predicting their mean; 1.0 when there is no spread to read."""
    sample = train_split[::max(1, math.ceil(len(train_split) / most))]
    labels = [it.tensors["labels"].reshape(-1).float() for it in encode_examples(task, sample)]
    values = torch.cat(labels) if labels else torch.zeros(0)
    values = values[contributes(values)]
    spread = float(values.var()) if values.numel() > 1 else 0.0
    return spread if spread > 0 and math.isfinite(spread) else 1.0


def ambiguity(task: Task, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, int]:
    """Targets no model can memorise: in this subset the same context is followed by different
    ids (a language model trained on whole texts: two texts that start alike). The context of
    a generation target is the input up to the position that predicts it (padding left out); of
    a classification target, the whole input. Returns the mask of those targets (the labels'
    shape, after `label_shift`), the least loss per target any model can reach on the subset
    (each context's entropy over its targets) and how many targets are ambiguous."""
    labels = task.targets(batch["labels"])
    keep = contributes(labels)
    if task.target_kind.float_targets:  # values, not ids: no context is followed by two
        return torch.zeros_like(keep), 0.0, 0
    inputs = task.main_input(batch)
    mask = batch.get("attention_mask", torch.ones_like(inputs))
    flat = labels.reshape(len(labels), -1)
    contexts: dict[tuple, list[tuple[int, int, int]]] = {}
    for b in range(len(flat)):
        row = inputs[b].reshape(-1)
        real = mask[b].reshape(-1).bool() if mask.shape == inputs.shape else None
        for t in torch.nonzero(keep.reshape(len(flat), -1)[b]).reshape(-1).tolist():
            seen = task.target_kind.context(row, real, t, [batch[k][b] for k in
                                                           task.model_inputs if k in batch])
            contexts.setdefault(tuple(seen.tolist()), []).append((b, t, int(flat[b, t])))
    ambiguous = torch.zeros_like(flat, dtype=torch.bool)
    floor = 0.0
    for targets in contexts.values():
        counts = Counter(v for _, _, v in targets)
        if len(counts) > 1:
            floor += sum(n * math.log(len(targets) / n) for n in counts.values())
            for b, t, _ in targets:
                ambiguous[b, t] = True
    total = int(keep.sum())
    return ambiguous.reshape(labels.shape), floor / max(total, 1), int(ambiguous.sum())


def least_loss(task: Task, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> float:
    """The least loss per target the task's own `loss` reaches on these targets with every
    example memorised: 0 for a plain cross-entropy, above 0 under label smoothing (for K classes
    -(1-e+e/K)ln(1-e+e/K) - (K-1)(e/K)ln(e/K)) or soft targets. Measured on the loss itself, at
    logits shaped as the model's: each target a margin s above every other output (the best s),
    then free logits from there (L-BFGS). 0 where the loss cannot be evaluated so."""
    targets = task.targets(batch["labels"])
    if task.target_kind.float_targets or targets.shape != logits.shape[:-1]:
        return 0.0
    hot = torch.zeros(logits.shape).scatter_(  # 1 at each contributing target, else 0
        -1, targets.clamp(0, logits.shape[-1] - 1).unsqueeze(-1),
        contributes(targets).float().unsqueeze(-1))

    def per_target(z: torch.Tensor) -> torch.Tensor:
        summed, count = task.loss(z, batch)
        return summed.float() / max(float(count), 1.0)
    try:
        with torch.no_grad():
            high = 40.0  # a margin still falling at its end is taken further (a scaled loss)
            while high < 1e6 and per_target(2 * high * hot) < per_target(high * hot):
                high *= 2
            if float(per_target(high * hot)) < NO_FLOOR:  # the targets alone: no floor
                return 0.0
            low = 0.0  # the loss is convex in s: a golden-section search
            for _ in range(40):
                a, b = low + 0.382 * (high - low), low + 0.618 * (high - low)
                low, high = (low, b) if per_target(a * hot) < per_target(b * hot) else (a, high)
            least = float(per_target((low + high) / 2 * hot))
        z = ((low + high) / 2 * hot).requires_grad_(True)
        search = torch.optim.LBFGS([z], max_iter=50, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            search.zero_grad()
            value = per_target(z)
            value.backward()
            return value
        search.step(closure)
        least = min(least, float(per_target(z.detach())))
    except Exception:  # a loss that needs more than logits and the batch: no floor measured
        return 0.0
    return least if least >= NO_FLOOR else 0.0


def reproduced(task: Task, model: torch.nn.Module, items: list[Item], device: torch.device,
               tolerance: float) -> pd.DataFrame:
    """Per example, on one eval-mode forward of the whole subset (the mode and batch the final
    loss is measured on): does it give its targets back? Regression: every target within
    `tolerance` (sqrt of the loss bar: each target's own squared error under the bar the mean
    must meet). Ids: the argmax at every contributing position (with teacher forcing, greedy
    decoding); a target's loss under the bar (< ln 2) implies it, as p > exp(-bar) > 1/2."""
    batch = collate_items(task, items).to(device).tensors
    labels = task.targets(batch["labels"])
    with eval_mode(model):
        outputs = outputs_of(task, model, items, device).float()
    keep = contributes(labels).reshape(len(items), -1)
    if task.target_kind.float_targets:
        error = (task.predicted(outputs, labels) - labels.float()).abs().reshape(len(items), -1)
        worst = torch.where(keep, error, torch.zeros_like(error)).max(1).values
        return pd.DataFrame({"exact_ids": (worst <= tolerance).tolist(),
                             "max_abs_error": worst.tolist()})
    # a target whose context is followed by other ids elsewhere in the subset cannot be given
    # back by any model: it is not asked for (its least loss is in the bar)
    keep = keep & ~ambiguity(task, batch)[0].to(keep.device).reshape(len(items), -1)
    wrong = ((task.predicted(outputs, labels) != labels).reshape(len(items), -1) & keep)
    size = outputs.shape[-1]  # an id beyond the output layer has no probability (01 flags it)
    p = outputs.log_softmax(-1).gather(-1, labels.clamp(0, size - 1).unsqueeze(-1)).exp()
    p = p.reshape(len(items), -1).masked_fill((labels >= size).reshape(len(items), -1), math.nan)
    p = torch.where(keep, p, torch.ones_like(p))
    return pd.DataFrame({"exact_ids": (~wrong.any(1)).tolist(),
                         "min_target_p": p.min(1).values.tolist()})


def overfit(task: Task, examples: int = 8, updates: int = 150, lr: float = 0.0,
            loss_threshold: float = 0.05, init_tolerance: float = 0.5, seed: int = 0,
            device: str = "cpu", progress: bool = False, lr_from: str = "") -> OverfitResult:
    """Train on `examples` of the first training examples (a classifier's drawn across its
    classes, `Kind.overfit_subset`) until memorised and check the mechanics:
    initial loss near ln(outputs), no divergence, finite at every step, below the threshold,
    the targets back. `lr` 0: the task's Task.lr, else FALLBACK_LR (see `learning_rate`)."""
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise WorkbookError(f"examples must be a positive integer, got {examples!r}",
                            "set examples to the size of the subset to memorise (8 is usual)")
    lr, lr_from = learning_rate(task, lr, lr_from)
    # the subset and the targets' spread need the first VARIANCE_SAMPLE training examples at
    # most: the rest of the split is never read (a stream of any length)
    train_split = prepare(task, encode=(), limits={"train": max(examples, VARIANCE_SAMPLE)},
                          keep=("train",)).raw["train"]
    if examples > len(train_split):
        raise WorkbookError(f"examples={examples} is more than the {len(train_split)} examples "
                            "of the training split", "02 memorises a small subset: give "
                            f"examples 8 (the usual), at most {len(train_split)}")
    raw = task.target_kind.overfit_subset(task, train_split, examples)  # across classes
    items = encode_examples(task, raw)
    cfg = TrainConfig(
        UpdateShape(*whole_update(task, items)), updates=updates, lr=lr, seed=seed,
        device=device, grad_clip=task.grad_clip or 0.0, progress=progress)
    clipping = "clipping as the task's train_step does" if runs_own_step(task, cfg) else \
        task.clipping()
    cfg.validate(len(train_split))
    dev = resolve_device(device)
    seed_everything(seed)
    model = task.build_model().to(dev)
    initial = evaluate(task, model, items, len(items), dev)
    with eval_mode(model):
        outputs = int(task.forward(model, collate_items(task, items[:1]).to(dev)
                                   .tensors).shape[-1])
    labels = collate_items(task, items).tensors["labels"]
    start = fine_tuning.initial_loss(task, model, outputs, labels, lambda: evaluate(
        task, model, items, len(items), dev).loss)
    judged_start = start.expected is not None
    expected = start.expected if judged_start else initial.loss
    # the bar for "memorised": absolute for ids (nats per target), and for regression relative
    # to the loss of predicting the mean of the training targets - their spread, the units the
    # task's targets live in (not the subset's: 8 rows of one group are near-duplicates)
    scale = target_variance(task, train_split) if task.target_kind.float_targets else 1.0
    # ids that follow the same context differently in the subset: their least loss is added
    subset = collate_items(task, items).tensors
    _, floor, ambiguous = ambiguity(task, subset)
    with eval_mode(model):  # the least the task's own loss reaches on these targets
        own_floor = least_loss(task, outputs_of(task, model, items, dev).float().cpu(), subset)
    bar = loss_threshold * scale + floor + own_floor
    tolerance = math.sqrt(bar)  # per regression target, in the targets' units
    seen: list[StepRecord] = []
    sampled = task.target_kind.sampled  # a policy's sampled completions, scored by rewards

    def watch(record: StepRecord, stepper, _) -> str | None:
        seen.append(record)
        if divergence(seen):
            return divergence(seen)  # a diverged run stops: the rest would be noise
        if sampled:
            return None  # nothing to give back: the reward is judged at the end
        if record.loss < bar and len(seen) % MEMORISED_EVERY == 0 and memorised(
                task, stepper.model, items, dev, bar, tolerance, own_floor):
            return "memorised"  # the rest of the budget would only confirm it
        return None

    result = train(task, items, cfg, model=model, on_update=watch)
    diverged = divergence(result.steps)
    final = evaluate(task, result.model, items, len(items), dev, len(result.steps))
    steps = to_frame(result.steps).drop(columns=["example_ids"])
    judged = reproduced(task, result.model, items, dev, tolerance) if not sampled else \
        pd.DataFrame({"exact_ids": [True] * len(items)})
    exact = judged.exact_ids.tolist()
    rows = []
    for ex, it, judge in zip(raw, items, judged.to_dict("records"), strict=True):
        judge = {} if sampled else judge
        row = {"example": it.id, **judge}
        batch = collate_items(task, [it]).to(dev).tensors
        with eval_mode(result.model):
            row.update(task.target_kind.reproduction(task, result.model, ex, it, batch))
        rows.append(row)
    reproduction = pd.DataFrame(rows)
    finite = bool(steps.loss.map(math.isfinite).all() and steps.grad_norm.map(math.isfinite).all())
    # regression: the gap in the units of the training targets' spread too - untrained outputs
    # near 0 are far, relatively, from a subset's targets that are themselves near 0
    reach = max(expected, scale) if task.target_kind.float_targets else expected
    init_gap = abs(initial.loss - expected) / max(reach, 1e-12)
    init_tolerance = start.tolerance or init_tolerance
    regression = task.target_kind.float_targets
    rule = ("mean(target^2)" if regression else "ln(outputs)") if start.rule == \
        task.initial_loss_rule(outputs) else start.rule
    message = divergence_message(diverged, lr, lr_from) if diverged else ""
    falling = still_falling(steps.loss.tolist())
    # the mechanics all work and the loss is on its way: the budget, not the loop, fell short -
    # with every example back, or with the loss still falling fast (under half its start)
    unfinished = (not diverged and finite and final.loss >= bar and falling
                  and final.loss < (initial.loss if all(exact) else FAST_FALL * initial.loss))
    checks = pd.DataFrame([
        {"check": "initial loss near " + rule if judged_start else "initial loss",
         "value": round(initial.loss, 4),
         "expected": (f"{expected:.4f} +/- " + (f"{init_tolerance * reach:.4g}" if regression
                                                 else f"{init_tolerance * 100:.2g}%"))
         if judged_start else "-",
         "passed": init_gap <= init_tolerance,
         "detail": start.rule if not judged_start else fine_tuning.NOT_IDENTITY
         if start.tolerance and init_gap > init_tolerance else ""},
        {"check": "learning rate does not diverge", "value": f"lr {lr:g} ({lr_from}), {clipping}",
         "expected": f"no rise above {DIVERGENCE_MULTIPLE:g} x the first losses, finite",
         "passed": not diverged, "detail": message},
        {"check": "loss finite at every step", "value": finite, "expected": True,
         "passed": finite, "detail": ""},
        {"check": "final loss below threshold" + (
            " x the loss of predicting the mean" if regression else ""),
         "value": round(final.loss, 4), "expected": f"< {bar:.4g}",
         "passed": final.loss < bar or unfinished,
         "detail": not_conclusive(initial.loss, final.loss, bar, len(result.steps),
                                  sum(exact), len(exact)) if unfinished else
         floor_words(own_floor, loss_threshold * scale) if own_floor else ""},
        {"check": "targets reproduced within sqrt(final loss bar)" if regression
         else "exact target ids reproduced", "value": f"{sum(exact)}/{len(exact)}",
         "expected": f"{len(exact)}/{len(exact)}" + (f", |error| <= {tolerance:.4g}"
                                                     if regression else ""),
         "passed": all(exact) or unfinished,
         "detail": "not conclusive: the loss is still falling fast (see above)"
         if unfinished and not all(exact) else
         f"{ambiguous} targets follow a context that other ids follow elsewhere in "
                   f"the subset (no model gives both): not asked for, and their least loss "
                   f"{floor:.4g} per target is in the loss bar" if ambiguous else ""},
    ])
    if sampled:  # no answer to give back: the reward must rise (learnability)
        checks = pd.concat([checks.iloc[:3], pd.DataFrame([reward_rise(
            initial.loss, final.loss, loss_threshold, len(result.steps))])], ignore_index=True)
    if "greedy_exact" in reproduction:
        greedy = int(reproduction.greedy_exact.sum())
        checks.loc[len(checks)] = {"check": "greedy decoding gives the responses back",
                                   "value": f"{greedy}/{len(items)}",
                                   "expected": f"{len(items)}/{len(items)}",
                                   "passed": greedy == len(items) or unfinished,
                                   "detail": "not conclusive: the loss is still falling fast"
                                   if unfinished and greedy < len(items) else ""}
    figures = {"examples": len(items), "updates": updates, "updates_run": len(result.steps),
               "lr": lr, "lr_from": lr_from, "update_by": update_by(task, cfg),
               "initial_loss": round(initial.loss, 4), "expected_initial_loss":
               round(expected, 4) if judged_start else None,
               "final_loss": round(final.loss, 4), "exact_examples": sum(exact),
               "finite": finite, "lr_diverges": bool(diverged),
               "loss_threshold": loss_threshold, "final_loss_bar": round(bar, 6),
               "ambiguous_targets": ambiguous, "least_loss": round(floor + own_floor, 6),
               "loss_floor": round(own_floor, 6), "grad_clip": cfg.grad_clip or None,
               "clipping": clipping,
               "initial_loss_rule": rule,
               "memorised": final.loss < bar and all(exact), "conclusive": not unfinished,
               "stopped_memorised": result.stop_reason == "memorised"}
    figures.update(task.target_kind.figures(reproduction))
    if sampled:
        figures.update(initial_reward=round(-initial.loss, 4), final_reward=round(-final.loss, 4),
                       memorised=None)
    if regression:
        figures["target_variance"] = round(scale, 6)
        figures["reproduction_tolerance"] = round(tolerance, 6)
    return OverfitResult(task, steps, checks, reproduction, figures,
                         message or _diagnosis(checks, initial.loss, final.loss, bar, updates, lr,
                                               own_floor, [s.lr for s in result.steps]))


def reward_rise(initial: float, final: float, threshold: float, updates: int) -> dict:
    """02's check for a policy scored by rewards (its loss is minus the mean reward, on the
    same seeded draws before and after): the mean reward rises by at least `threshold` x
    max(1, |the initial reward|) - a reward the policy can learn is learnt."""
    need = threshold * max(1.0, abs(initial))
    rose = -final - -initial
    passed = math.isfinite(rose) and rose >= need
    return {"check": "mean reward rises (learnability)",
            "value": f"{-initial:.4g} -> {-final:.4g}", "expected": f"rises by >= {need:.3g}",
            "passed": passed, "detail": "" if passed else (
                f"the mean reward moved by {rose:.4g} in {updates} updates: the policy does not "
                "learn its reward on these prompts - see 01's groups with equal rewards (no "
                "advantage, no gradient) and truncated completions, or compare learning rates "
                "with notebook 06")}


def memorised(task: Task, model: torch.nn.Module, items: list[Item], device: torch.device,
              bar: float, tolerance: float, least: float = 0.0) -> bool:
    """Memorised with a margin, on the final judgement's terms (eval mode, the whole subset):
    the loss under half way from the least the task's loss reaches (`least`) to its bar, and
    every target given back."""
    was = model.training
    try:
        return (evaluate(task, model, items, len(items), device).loss < (least + bar) / 2
                and bool(reproduced(task, model, items, device, tolerance).exact_ids.all()))
    finally:
        model.train(was)


FAST_FALL = 0.5  # a loss under this share of its start, still falling: the budget fell short


def still_falling(losses: list[float], share: float = 0.2, drop: float = 0.1) -> bool:
    """The loss still falling steadily at the end of the run: the mean of its last fifth at
    least 10% under the fifth before, and its last tenth under the tenth before that."""
    n = max(int(len(losses) * share), 2)
    if len(losses) < 2 * n or not all(map(math.isfinite, losses[-2 * n:])):
        return False
    half = n // 2
    return (fmean(losses[-n:]) <= (1 - drop) * fmean(losses[-2 * n:-n])
            and fmean(losses[-half:]) < fmean(losses[-2 * half:-half]))


def not_conclusive(initial: float, final: float, bar: float, updates: int, exact: int,
                   examples: int) -> str:
    how = ("every example is reproduced and the loss is still falling steadily"
           if exact == examples else f"the loss is still falling fast and {exact} of "
           f"{examples} examples are reproduced so far")
    return (f"not conclusive: give it more updates - {how} ({initial:.4g} to {final:.4g} in "
            f"{updates} updates, bar {bar:.4g}); with updates={2 * updates} it should pass "
            "(the run stops as soon as the subset is memorised)")


def floor_words(least: float, margin: float) -> str:
    """Why the bar stands above the threshold: the least loss of the task's own loss."""
    return (f"the bar is {margin:.4g} above {least:.4g}, the least loss per target your loss "
            "reaches on these targets even with every example memorised (measured on the "
            "task's loss at the best logits: label smoothing or soft targets keep the target's "
            "probability under 1)")


def _diagnosis(checks: pd.DataFrame, initial: float, final: float, bar: float,
               updates: int, lr: float, least: float = 0.0, ran: list | None = None) -> str:
    """The failure in words when the learning rate does not diverge ("" on a pass); `ran`, the
    learning rate each update ran at (the optimizer's first group, read by the loop)."""
    failed = checks.loc[~checks.passed, "check"].tolist()
    if not failed:
        return ""
    if ran and not any(ran):
        return (f"not learning: the optimizer ran at learning rate 0 in all {len(ran)} updates "
                f"(read from its first param group; {lr:g} was asked): the task's "
                "build_optimizer or schedule set it to 0, so nothing can train - give the "
                "optimizer a nonzero learning rate (e.g. a lr scaled by batch_size // 256 is 0 "
                "below 256 examples)")
    if any(c.startswith("final loss") for c in failed) and math.isfinite(final) \
            and final < initial:
        return (f"not memorised: the loss fell from {initial:.4g} to {final:.4g} in {updates} "
                f"updates at lr {lr:g}, not below the bar {bar:.4g}"
                + (f" ({least:.4g} of it the least your loss reaches)" if least else "")
                + ", without diverging; give it "
                "more updates, or compare learning rates with notebook 06")
    return "failed: " + "; ".join(failed)


def run(params: OverfitParams | Mapping[str, Any], out_dir: Path | None = None,
        progress: bool = False) -> OverfitResult:
    """Notebook 02 from its parameters (it writes nothing until `save`)."""
    params = OVERFIT.check(params)
    task = params.load_task()
    lr, lr_from = learning_rate_of(params, task)
    return overfit(task, examples=params.examples, updates=params.updates, lr=lr,
                   lr_from=lr_from, loss_threshold=params.loss_threshold,
                   init_tolerance=params.init_tolerance, seed=params.seed,
                   device=params.device, progress=progress)


def save(result: OverfitResult, out_dir: Path) -> str:
    """Write the curve, checks, reproduction table and `summary.json` of notebook 02; the
    verdict. A diverging learning rate is the summary's `headline`: the report leads with it."""
    from ..storage.runs import save_table, write_summary

    save_table(result.steps, out_dir, "steps")
    save_table(result.checks, out_dir, "checks")
    save_table(result.reproduction, out_dir, "reproduction")
    extra = {"headline": result.diagnosis} if result.figures["lr_diverges"] else {}
    write_summary(out_dir, result.verdict, result.figures, task=result.task.name,
                  failed=result.checks.loc[~result.checks.passed, "check"].tolist(),
                  diagnosis=result.diagnosis, **extra)
    return result.verdict
