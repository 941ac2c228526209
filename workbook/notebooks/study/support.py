"""What notebook 06's study supports, read from its trial table: the best learning rate, the
warnings that make it provisional, the grid's extension at an edge (one rate beyond it per
step, the grid's own ratio, within the design's `extra_trials`) and "no rate learns" (the best
validation loss does not clear the chance loss, `chance.py`)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from .chance import MARGIN, Chance


def grid(lrs: list[float]) -> str:
    return ", ".join(f"{lr:g}" for lr in sorted(set(lrs)))


def tried(trials: pd.DataFrame, design: Any) -> list[float]:
    """Every rate planned or run, ascending: the design's and the extension's."""
    return sorted(set(design.lrs) | {float(lr) for lr in trials.get("lr", [])})


def extension_trials(trials: pd.DataFrame, design: Any) -> list[dict]:
    """The (lr, seed) trials run beyond the design's grid, in the order first run."""
    planned = set(design.lrs)
    out: list[dict] = []
    for lr, seed in zip(trials.get("lr", []), trials.get("seed", []), strict=True):
        trial = {"lr": float(lr), "seed": int(seed)}
        if trial["lr"] not in planned and trial not in out:
            out.append(trial)
    return out


MAX_STEP = 10.0  # an extension never steps further than this ratio past the edge
REACHED = 0.5  # trials whose schedule never let them run at half their rate did not try it


def beyond(lrs: list[float], direction: str) -> float:
    """The next rate past the grid's edge (`lrs` ascending), at the ratio of its two outermost
    rates (3 with one rate; at most `MAX_STEP`), rounded to two digits."""
    if direction == "upward":
        ratio = min(lrs[-1] / lrs[-2] if len(lrs) > 1 else 3.0, MAX_STEP)
        return float(f"{lrs[-1] * ratio:.2g}")
    ratio = min(lrs[1] / lrs[0] if len(lrs) > 1 else 3.0, MAX_STEP)
    return float(f"{lrs[0] / ratio:.2g}")


def closing(curves: pd.DataFrame | None, trials: pd.DataFrame, best_lr: float,
            design: Any) -> tuple[list[dict], bool]:
    """Whether the ranking could change with a longer budget, read from the validation curves
    (`curves`: trial, step, value): each other finished rate's gap to the best rate (seeds
    averaged; as a ratio for a positive metric to minimise, else a difference) at its last two
    evaluations. A rate closes when, at the pace of that last interval, it would pass the best
    within another budget of the study's length (or already has). Returns the closing rates
    (lr, gap, was, over: updates between the two evaluations, passes: the update it would pass
    at), nearest first, and whether every other rate could be read (two evaluations each)."""
    if curves is None or curves.empty:
        return [], False
    ran = trials[trials.status == "finished"][["id", "lr"]]
    mean = curves.merge(ran, left_on="trial", right_on="id").groupby(
        ["lr", "step"]).value.mean().unstack("step")
    if best_lr not in mean.index or len(mean) < 2:
        return [], False
    ratio = design.mode == "min" and bool((mean.stack() > 0).all())
    gap = (mean.map(math.log) - mean.loc[best_lr].map(math.log)) if ratio else \
        (mean - mean.loc[best_lr]) * (1 if design.mode == "min" else -1)
    out, read = [], True
    for lr, row in gap.drop(index=best_lr).iterrows():
        row = row.dropna()
        if len(row) < 2:
            read = False
            continue
        (s0, was), (s1, now) = list(row.items())[-2:]
        pace = (was - now) / (s1 - s0)  # per update; positive while it closes
        passes = s1 if now <= 0 else s1 + now / pace if pace > 0 else math.inf
        if passes <= s1 + design.updates:
            out.append({"lr": float(lr), "over": int(s1 - s0), "passes": round(passes),
                        "gap": math.exp(now) if ratio else now,
                        "was": math.exp(was) if ratio else was, "ratio": ratio})
    return sorted(out, key=lambda c: c["passes"]), read


def gap_said(c: dict, metric: str) -> str:
    if (c["gap"] <= 1) if c["ratio"] else (c["gap"] <= 0):
        return (f"its validation {metric} ended at or below the best's, whose lowest came "
                "earlier")
    if c["ratio"]:
        return (f"its validation {metric} went from {c['was']:.2f}x the best's to "
                f"{c['gap']:.2f}x over the last {c['over']} updates")
    return (f"its validation {metric} went from {c['was']:.4g} to {c['gap']:.4g} behind the "
            f"best's over the last {c['over']} updates")


def findings(trials: pd.DataFrame, design: Any, chance: Chance | None = None,
             best_loss: float | None = None, curves: pd.DataFrame | None = None,
             swept: Any = None, reached: dict[int, float] | None = None) -> dict[str, Any]:
    """What the study supports, from its trial table (`Study.trial_table`): the best learning
    rate, how many seeds stand behind it, and the warnings that make it provisional - the best
    at the edge of the rates tried ("extend the range upward" or "downward", and whether the
    study's budget of extra trials ran out), the best trial still improving at its last update
    (too short a budget to call a winner) unless the validation `curves` show the ranking
    held (`closing`: no other rate closing on the best fast enough to pass it within another
    budget; then it is said, not warned), a single learning rate. With `chance` and the
    study's `best_loss` (its best validation loss), a best that does not clear chance by
    `MARGIN` is "no rate learns": no rate is supported - unless the best trial, still improving
    at its last update, fell from the untrained model's loss (`chance.untrained`) by more than
    it still lacks: too short a budget to tell, said as a warning. A range test (`swept`) that
    found the optimizer setting its own step leaves no rate to choose; trials whose schedule
    never let them reach `REACHED` of their rates (`reached`: the schedule's largest factor per
    trial) tried none of them. Keys: best_lr,
    best_metric, best_trial, control_lr, control_remains_best, seeds, closing (rates closing on
    the best), rate_ignored, lrs (tried), extended (rates the study added), extra_trials (its
    budget), best_at_edge ("upward", "downward" or ""), still_improving (trial ids), warnings,
    no_rate_learns, chance_loss, conclusive (no warning), supported_lr (the rate to plan on;
    None when none can be chosen) and finding (in one sentence)."""
    control = design.lrs[0]
    lrs = tried(trials, design)
    extra = extension_trials(trials, design)
    extended = sorted({t["lr"] for t in extra})
    seeds = len(design.seeds)
    done = trials.dropna(subset=["best_metric"])
    out: dict[str, Any] = {"control_lr": control, "lrs": lrs, "seeds": seeds,
                           "extended": extended, "extra_trials": design.extra_trials,
                           "best_at_edge": "", "still_improving": [], "closing": [],
                           "warnings": [], "rate_ignored": False, "schedule_reached": None,
                           "no_rate_learns": False,
                           "chance_loss": None if chance is None else chance.loss}
    if done.empty:
        every = bool(len(trials)) and bool((trials.status == "diverged").all())
        out.update(best_lr=None, best_metric=None, best_trial=None, conclusive=False,
                   supported_lr=None, control_remains_best=False, finding=(
                       f"every learning rate tried diverged ({grid(lrs)}): nothing "
                       "was learned to compare - lower the range (check the task's lr for a "
                       "typo, e.g. 1e3 for 1e-3)") if every else
                   "no trial produced a metric: no learning rate can be chosen yet")
        return out
    row = done.sort_values("best_metric", ascending=design.mode == "min", kind="stable").iloc[0]
    best_lr, best_id = float(row.lr), int(row.id)
    # still improving: a finished trial whose best evaluation is its last one, after an
    # earlier evaluation (a single evaluation shows no trend)
    finished = done[done.status == "finished"]
    improving = finished[(finished.best_step == finished.stop_step) &
                         (finished.stop_step > design.eval_every)]
    out["still_improving"] = [int(i) for i in improving.id]
    peak = (reached or {}).get(best_id)
    out["schedule_reached"] = peak
    if peak is not None and peak < REACHED:  # before "no rate learns": it explains it too
        out.update(best_lr=best_lr, best_metric=float(row.best_metric), best_trial=best_id,
                   conclusive=False, supported_lr=None, control_remains_best=False,
                   finding=(
                       "the rates were not reached: the task's own schedule held the trials at "
                       f"most {peak * 100:.2g}% of their rates over the study's "
                       f"{design.updates} updates (lr {best_lr:g} ran at "
                       f"{best_lr * peak:.3g} at most, read from the optimizer at every "
                       "update) - its warm-up outlasts the study, which compared the warm-up's "
                       "first steps, not the rates: give 06 more updates than the warm-up, or "
                       "a warm-up sized to the run (a share of it, as warmup_ratio does)."))
        return out
    near_chance = chance is not None and best_loss is not None and \
        not chance.learned(best_loss)
    start = chance.untrained if chance is not None else None
    # short of even a constant prediction, having moved from the untrained model's loss: the
    # trials had not yet learned the targets' frequencies, so nothing can be told of the rest
    climbing = near_chance and start is not None and best_loss > chance.loss and \
        start - best_loss > MARGIN * abs(start)
    heading = near_chance and best_id in out["still_improving"] and start is not None and \
        start - best_loss > best_loss - chance.loss * (1 - MARGIN)
    if climbing:
        out["warnings"].append(
            f"the best validation loss, {best_loss:.4g}, is still above chance "
            f"({chance.loss:.4g}, {chance.how}) after falling from the untrained model's "
            f"{start:.4g}: in {design.updates} updates no trial reached even a constant "
            "prediction's loss - lengthen the budget before reading it as 'no rate learns'")
    elif heading:  # too short a budget to tell
        out["warnings"].append(
            f"the best validation loss, {best_loss:.4g}, is not yet {MARGIN:.0%} below chance "
            f"({chance.loss:.4g}, {chance.how}), but the best trial was still improving at "
            f"its last update ({int(row.stop_step)} of {design.updates}): lengthen the budget "
            "before reading it as 'no rate learns'")
    elif near_chance:
        out.update(best_lr=best_lr, best_metric=float(row.best_metric), best_trial=best_id,
                   conclusive=False, supported_lr=None, control_remains_best=False,
                   no_rate_learns=True, finding=(
                       f"no rate learns: at no rate tried ({grid(lrs)}) did the validation "
                       f"loss get {MARGIN:.0%} below chance - its best, {best_loss:.4g}, "
                       f"against {chance.loss:.4g}, {chance.how}; a loss at or near chance is "
                       "noise, not learning: check that the labels belong to their inputs "
                       "(notebook 01) and that the model can fit a few examples (notebook "
                       "02)."))
        return out
    ignored = getattr(swept, "rate_ignored", "")
    out["rate_ignored"] = bool(ignored)
    if ignored:
        out.update(best_lr=best_lr, best_metric=float(row.best_metric), best_trial=best_id,
                   conclusive=False, supported_lr=None, control_remains_best=False,
                   finding=f"no rate to choose: {ignored}; its one trial, at lr {best_lr:g}, "
                   f"reached a validation {design.metric} of {float(row.best_metric):.4g}.")
        return out
    warnings = out["warnings"]
    if len(lrs) == 1:
        warnings.append(f"one learning rate tried ({best_lr:g}): nothing was compared - add "
                        "rates below and above it")
    elif best_lr in (lrs[-1], lrs[0]):
        up = best_lr == lrs[-1]
        out["best_at_edge"] = "upward" if up else "downward"
        warnings.append(f"the best lr {best_lr:g} is the {'largest' if up else 'smallest'} "
                        f"tried ({grid(lrs)}): a {'larger' if up else 'smaller'} one may be "
                        f"better - extend the range {out['best_at_edge']}" +
                        (f"; the study's budget of {design.extra_trials} extra trials ran out"
                         if design.extra_trials else ""))
    closers, read = closing(curves, trials, best_lr, design)
    out["closing"] = [c["lr"] for c in closers]
    held = ""
    if closers:
        c = closers[0]
        warnings.append(f"lr {c['lr']:g} closes on the best (lr {best_lr:g}): "
                        f"{gap_said(c, design.metric)}" + (
                            f"; at that pace it passes the best near update {c['passes']}"
                            if c["passes"] > design.updates else "") +
                        " - lengthen the budget to tell")
    elif best_id in out["still_improving"]:
        who = (f"every trial ({len(improving)} of {len(trials)})" if len(improving) ==
               len(trials) else f"the best trial ({best_id})")
        if read:
            held = (f"; {who} was still improving at its last update, but the ranking held: "
                    f"no other rate closed on lr {best_lr:g} fast enough to pass it within "
                    f"another {design.updates} updates - the winner stands at this budget")
        else:
            warnings.append(f"{who} was still improving at its last update "
                            f"({int(row.stop_step)} of {design.updates}): the budget is too "
                            "short to call a winner - lengthen it")
    beat = best_lr != control
    verdict = (f"lr {best_lr:g} beat the control (lr {control:g})" if beat else
               f"the control (lr {control:g}) remains the best choice")
    seeds_said = "one seed, so no spread" if seeds == 1 else \
        f"{seeds} seeds (mean and spread per learning rate)"
    finding = (f"{verdict}: best validation {design.metric} {float(row.best_metric):.4g} "
               f"(trial {best_id}), on {seeds_said}")
    if extended:
        finding += (f"; the study extended its grid by itself to {grid(extended)} "
                    f"({len(extra)} of its {design.extra_trials} extra trials), its best "
                    "having sat at the edge")
    finding += held
    if swept is not None and swept.suggestion is None and len(swept.curve) and not near_chance:
        finding += (f"; the range test saw no fall over its {len(swept.curve)} updates, yet "
                    f"lr {best_lr:g} learned over the study's {design.updates}: the sweep was "
                    "too short to show this task's fall")
    if warnings:
        finding += "; provisional - " + "; ".join(warnings)
    out.update(best_lr=best_lr, best_metric=float(row.best_metric), best_trial=best_id,
               control_remains_best=not beat, conclusive=not warnings, supported_lr=best_lr,
               finding=finding + ".")
    return out


def next_trials(trials: pd.DataFrame, design: Any, found: dict[str, Any]) -> list[dict]:
    """The trials to add now: at an edge of the rates tried (and some rate learning), the next
    rate beyond it on every seed, when they fit the design's `extra_trials`; else none."""
    direction = found["best_at_edge"]
    if not direction or found["no_rate_learns"]:
        return []
    if len(extension_trials(trials, design)) + len(design.seeds) > design.extra_trials:
        return []
    lr = beyond(found["lrs"], direction)
    return [{"lr": lr, "seed": seed} for seed in design.seeds]
