"""Notebook 08's conclusion in words: the rental decision, the learning rate from notebook 06,
the other notebooks' verdicts and the 3/7/30-day plans, every figure rounded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from ..registry import (
    ACCOUNTING,
    GATES,
    INSPECTION,
    OVERFIT,
    RESUME,
    STUDY,
    VARIANTS,
    summary_of,
    verdict_line,
)
from .plans import BOTH, PLANNED, RECOMMENDED
from .stack import unverified


def article(name: str) -> str:
    """'a' or 'an' before a GPU name: names read letter by letter (an L4, an A100, an H200,
    a T4) by the letter's sound, words (a small, an older) by their first vowel."""
    spelled = len(name) > 1 and name[0].isupper() and (name[1].isdigit() or name[1].isupper()
                                                        or name[1] == "-")
    if spelled:
        return "an" if name[0] in "AEFHILMNORSX" else "a"
    return "an" if name[:1].lower() in "aeiou" else "a"


def money(amount: float | None, currency: str) -> str:
    return "cost not given (no price)" if amount is None or pd.isna(amount) else \
        f"{currency} {amount:,.2f}"


def offered(best, currency: str) -> str:
    """', on <offer> (<catalog date>), USD a-b over the speed references' range; on spot USD
    c (<offer>, interruptions included)' for a candidate's cheapest GPU ('' without offer)."""
    offer = best.get("cheapest_offer")
    if offer is None or pd.isna(offer):
        return ""
    low, high = best.get("cheapest_cost_low"), best.get("cheapest_cost_high")
    spread = f", {money(low, currency)} to {money(high, currency)} over the speeds' range" \
        if low is not None and not pd.isna(low) and low != high else ""
    spot, spot_offer = best.get("cheapest_spot_cost"), best.get("cheapest_spot_offer")
    on_spot = f"; on spot {money(spot, currency)} ({spot_offer}, interruptions included)" \
        if spot is not None and not pd.isna(spot) else "; no spot offer in the catalog"
    return f", priced on {offer}, {best.get('cheapest_price_from')}{spread}{on_spot}"


def ranged(done: pd.DataFrame, currency: str) -> str:
    """' (1.2-1.9 h, USD 3.10-4.80 over the speeds' range; priced on <offers> of <date>)' for
    the scheduled rows of a plan; '' when the plan has no range or no row."""
    if done.empty or "hours_low" not in done or done.hours_low.isna().any():
        return ""
    lo, hi = done.hours_low.sum(), done.hours_high.sum()
    offers = "; ".join(dict.fromkeys(f"{o}, {f}" for o, f in zip(
        done.offer.fillna("no offer"), done.price_from.fillna("no price"), strict=True)))
    if round(lo, 1) == round(hi, 1):
        return f" (no range: the speeds' spread changes no hour; priced on {offers})"
    costs = "" if done.cost_low.isna().any() else \
        f", {money(done.cost_low.sum(), currency)}-{money(done.cost_high.sum(), currency)}"
    return f" ({lo:.1f}-{hi:.1f} h{costs} over the speeds' range; priced on {offers})"


def resting_on(basis: dict | None) -> str:
    """What times and costs rest on, in one sentence."""
    if not basis:
        return ("Times rest on an assumed utilisation, costs on assumed prices, memory on a "
                "fake-tensor prediction plus stated overheads.")
    typed = f"; typed prices for {', '.join(basis['typed'])} win over it" \
        if basis.get("typed") else ""
    generation = f"; {basis['generation']}" if basis.get("generation") else ""
    return (f"Times rest on {basis['speeds']} ({basis.get('calibration') or 'not calibrated'})"
            f"{generation}; costs on the {basis['catalog']}{typed}; memory on a fake-tensor "
            "prediction plus stated overheads.")


def hours(value: float | None) -> str:
    return "time not known" if value is None or pd.isna(value) else f"{value:.1f} h"


def decision_unsized(unsized: dict[str, str], candidates: int, rental_gpu: str) -> str:
    """What the conclusion says of the candidates the prediction could not size: the decision
    itself when none could be, else a sentence naming them and why."""
    by_reason: dict[str, list[str]] = {}
    for name, why in unsized.items():
        by_reason.setdefault(why, []).append(name)
    reasons = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())
    if len(unsized) == candidates:
        which, one = ("the only candidate", "it") if candidates == 1 else \
            (f"any of the {candidates} candidates", "one")
        return (f"**No candidate could be sized**: the memory prediction could not size {which}, "
                f"so this sheet cannot say whether {one} fits the {rental_gpu} - do not rent on "
                "it. Size by measuring instead (notebook 03 with a candidate's plan_* settings, "
                f"on a machine that holds it). Why: {reasons}.")
    return f" Not sized, so not judged: {reasons}."


def per_gpu(required_gib: float | None, count: int) -> str:
    """', X GiB per GPU needed with headroom' for a row of several GPUs."""
    if required_gib is None or pd.isna(required_gib):
        return ""
    return f", {required_gib:.1f} GiB {'per GPU ' if count > 1 else ''}needed with headroom"


def gpu_hours(value: float | None, count: int) -> str:
    return "" if count == 1 or value is None or pd.isna(value) else \
        f" on {count} GPUs, {value:,.0f} GPU-hours"


def study_result(run_dir, task_lr: float | None = None) -> dict[str, Any]:
    """Notebook 06's result as this plan uses it, from its summary.json in the run folder.
    `state`: "ran" (a learning rate is supported; `conclusive` False when 06 warned - a best lr
    at the edge of the grid, a best trial still improving), "no result" (06 ran, no rate can be
    chosen), "error" (06 stopped, or its summary cannot be read) or "not run". `lr` is the rate
    to plan on (None without one), `control_lr` 06's control, `short` the state in a few
    words, `said` the decision's sentence on the learning rate and `study` the study's line
    (None when 06 gave no figures)."""
    out: dict[str, Any] = {"state": "not run", "lr": None, "control_lr": None,
                           "control_best": False, "conclusive": False, "warnings": [],
                           "seeds": None, "study": None, "short": "06 did not run"}
    own = f" (the task's own lr is {task_lr:g}, untested against others)" if task_lr else ""
    summary = summary_of(run_dir, STUDY.stem)
    if summary is not None and not isinstance(summary, dict):
        summary = {"error": f"{STUDY.stem}/summary.json cannot be read"}
    if summary is None:
        out["said"] = ("**Learning rate: not chosen by a study** - notebook 06 did not run in "
                       f"this run folder{own}: run it before the campaign.")
        return out
    fig = summary.get("figures") if isinstance(summary.get("figures"), dict) else {}
    if summary.get("verdict") == "error" or not fig:
        why = str(summary.get("error") or "no figures")[:120]
        out.update(state="error", short="06 stopped with an error",
                   said=f"**Learning rate: not chosen by a study** - notebook 06 stopped with "
                        f"an error ({why}){own}: fix it and run it before the campaign.")
        return out
    control = fig.get("control_lr")
    lr = fig.get("supported_lr", fig.get("best_lr"))
    warnings = [str(w) for w in fig.get("warnings") or []]
    seeds = fig.get("seeds")
    out.update(control_lr=control, warnings=warnings, seeds=seeds, study=study_line(fig))
    if lr is None:
        finding = fig.get("finding") or "no trial produced a metric"
        out.update(state="no result", short="06 found no rate",
                   said=f"**Learning rate: not chosen** - notebook 06's study is "
                        f"inconclusive: {finding}.")
        return out
    conclusive = bool(fig.get("conclusive", not warnings))
    control_best = control is not None and lr == control
    out.update(state="ran", lr=lr, control_best=control_best, conclusive=conclusive,
               short="06's result")
    why = ("the control: notebook 06's study found no better rate" if control_best else
           f"the best of notebook 06's study, which beat the control (lr {control:g})"
           if control is not None else "the best of notebook 06's study")
    one = " on one seed" if seeds == 1 else f" over {seeds} seeds" if seeds else ""
    if conclusive:
        out["said"] = f"**Learning rate: {lr:g}**, {why}{one}."
    else:
        out["said"] = (f"**Learning rate: {lr:g} for now**, {why}{one} - provisional: "
                       + "; ".join(warnings) + ". Settle it before the campaign.")
    return out


def study_line(fig: dict) -> str:
    """'Learning-rate study: ...' from 06's figures: the trials, the best value and lr, the
    verdict, the seeds, and how many warnings (the decision's learning-rate sentence, always
    written before it, says them)."""
    statuses = ", ".join(f"{n} {status}" for status, n in (fig.get("statuses") or {}).items())
    found = (f"best validation {fig['metric']} {fig['best_metric']:.3f} at lr "
             f"{fig['best_lr']:g} (trial {fig['best_trial']})"
             if fig.get("best_metric") is not None else "no trial produced a metric")
    seeds = fig.get("seeds")
    if seeds == 1:
        found += ", one seed (no spread)"
    elif seeds:
        found += f", {seeds} seeds"
    verdict = (f"the control (lr {fig['control_lr']:g}) remains the best choice"
               if fig.get("control_remains_best") else
               f"lr {fig['best_lr']:g} beat the control (lr {fig['control_lr']:g})"
               if fig.get("best_lr") is not None else "no learning rate can be chosen yet")
    warnings = fig.get("warnings") or []
    return (f"Learning-rate study: {fig.get('trials')} trials ({statuses}); {found}; "
            f"{verdict}" + (f" ({len(warnings)} warning{'s' if len(warnings) > 1 else ''}: "
                            "see the learning rate above)" if warnings else "") + ".")


def duration(hours_: float) -> str:
    """A whole plan's hours in words: under an hour, under a day, or days."""
    if hours_ < 1:
        return f"{hours_:.1f} h ({max(1, round(hours_ * 60))} minutes), under an hour"
    if hours_ < 24:
        return f"{hours_:.1f} h, under a day"
    return f"{hours_:.1f} h ({hours_ / 24:.1f} days)"


def variant_words(r) -> str:
    """'control at lr 0.0001 x3' for a plan row."""
    lr = getattr(r, "lr", None)
    return (f"{r.variant}" + (f" at lr {lr:g}" if lr is not None and not pd.isna(lr) else "")
            + (f" x{int(r.repeats)}" if r.repeats and int(r.repeats) > 1 else ""))


def plan_lines(plans: pd.DataFrame, rental_gpu: str, currency: str) -> list[str]:
    """The conclusion's 3/7/30-day lines, per GPU priced on (saying which is recommended and
    which was planned on). When the longer plans schedule nothing more (every variant fits the
    shortest, or what is left out is so for another reason than time) one line says they are
    the same, with the whole budget's hours in words ("under an hour: rent by the hour")."""
    if plans.empty:
        return ["- no variants given: nothing to plan into 3, 7 or 30 days"]
    if "priced_on" not in plans:
        plans = plans.assign(priced_on="")
    roles = {RECOMMENDED: " (recommended)", PLANNED: " (the GPU you planned on)",
             BOTH: " (recommended; the GPU you planned on)"}
    lines = []
    for (gpu_name, role), group in plans.groupby(["gpu", "priced_on"], sort=False):
        where = f"on the {gpu_name}{roles.get(role, '')}"
        by_days = dict(list(group.groupby("days")))
        shortest = by_days[min(by_days)]
        # the same in every plan, and nothing left out for want of time: one line, in hours
        same = all(plan.scheduled.tolist() == shortest.scheduled.tolist()
                   for plan in by_days.values()) and not shortest[~shortest.scheduled] \
            .why_not.astype(str).str.startswith("needs ").any()
        if len(by_days) > 1 and same:
            done, left = shortest[shortest.scheduled], shortest[~shortest.scheduled]
            total = done.hours.sum()
            cost = done.cost.sum() if done.cost.notna().all() else None
            days = sorted(by_days)
            named = ", ".join(map(str, days[:-1])) + f" and {days[-1]}"
            which = ", ".join(variant_words(r) for r in done.itertuples())
            fit = (f"every variant ({which}) fits" if left.empty else
                   f"{len(done)} of {len(shortest)} variants ({which}) fit")
            rent = ("rent by the hour, not by the day" if total < 24 else
                    f"a rental longer than {days[0]} days adds nothing")
            lines.append(
                f"- {named}-day plans {where}: " + (
                    f"all the same - {fit} in {days[0]} days: {total:.1f} h, "
                    f"{money(cost, currency)} in all{ranged(done, currency)}" if len(done) else
                    f"none of the {len(shortest)} variants scheduled")
                + ("; not scheduled in any: " + "; ".join(f"{r.variant} ({r.why_not})"
                                                          for r in left.itertuples())
                   if len(left) else "") + "." +
                (f" The whole budget takes {duration(total)}: {rent}." if len(done) else ""))
            continue
        for days, plan in by_days.items():
            done = plan[plan.scheduled]
            left = plan[~plan.scheduled]
            cost = done.cost.sum() if done.cost.notna().all() else None
            which = ", ".join(variant_words(r) for r in done.itertuples())
            lines.append(f"- {days}-day plan {where}: {len(done)} of {len(plan)} variants "
                         "scheduled" + (f" ({which})" if len(done) else "") +
                         f", {done.hours.sum():.1f} h, {money(cost, currency)}"
                         + ranged(done, currency)
                         + ("; not scheduled: " + "; ".join(f"{r.variant} ({r.why_not})"
                                                            for r in left.itertuples())
                            if len(left) else ""))
    sharded = plans[plans.planned_as.fillna("") != ""] if "planned_as" in plans else plans[:0]
    if len(sharded):
        names = list(dict.fromkeys(sharded.variant))
        many = len(names) > 1
        whose = "their candidates fit" if many else "its candidate fits"
        lines.append(f"- {', '.join(names)}: {whose} no single GPU, so "
                     f"{'they are' if many else 'it is'} planned on "
                     f"candidate {sharded.candidate.iloc[0]}, the same update sharded.")
    return lines


EARLIER_NOTEBOOKS = ((INSPECTION, "inspection"), (OVERFIT, "overfit"), (GATES, "phase gates"),
                     (ACCOUNTING, "batch accounting"), (VARIANTS, "memory variants"),
                     (RESUME, "resume and reload"))


def first_failure(run_dir) -> str | None:
    """The first notebook of this run before 08 that did not pass, with why and its fix where
    the notebook wrote one (01's first flag, 03's first failed gate); None when all passed."""
    for entry, label in EARLIER_NOTEBOOKS:
        stem = entry.stem
        s = summary_of(run_dir, stem)
        if not isinstance(s, dict) or s.get("verdict") == "pass":
            continue
        folder = Path(run_dir) / stem
        why = str(s.get("error") or "") if s.get("verdict") != "fail" else \
            verdict_line(folder).removeprefix("verdict: fail").removeprefix(" - ")
        fix = ""
        with_fix = {INSPECTION.stem: ("flags.json", "fix"),
                    GATES.stem: ("gates.json", "remediation")}
        if stem in with_fix:
            name, key = with_fix[stem]
            try:
                rows = json.loads((folder / name).read_text())
            except (OSError, ValueError):
                rows = []
            fixes = [r.get(key) for r in rows if isinstance(r, dict) and r.get(key) and
                     r.get("verdict", "fail") == "fail"]
            fix = str(fixes[0]) if fixes else ""
        state = "failed" if s.get("verdict") == "fail" else f"ended with {s.get('verdict')!s}"
        return (f"notebook {stem[:2]} ({label}) {state}" + (f": {why[:300]}" if why else "")
                + (f" - fix: {fix[:300]}" if fix else ""))
    return None


def conclusion(run_dir, chosen: dict | None, rental_gpu: str, plans: pd.DataFrame,
               stack: pd.DataFrame, options: pd.DataFrame,
               unsized: dict[str, str] | None = None,
               models_lines: list[str] | None = None, study: dict | None = None,
               basis: dict | None = None) -> str:
    """The campaign's conclusion in words, every figure rounded, from this notebook's sheet and
    the summaries of the other notebooks of this run where they exist (`unsized`: the
    candidates the prediction could not size, with the reason; `study`: 06's result as
    `study_result` reads it from the run folder, by default). The plans are told per GPU
    priced on, recommended or planned on (`priced_gpus`); `basis` says what the prices and
    speeds rest on (the catalog, typed prices, the speed references, 03's calibration)."""
    study = study if study is not None else study_result(run_dir)
    lines = ["# Rental decision", ""]
    failure = first_failure(run_dir)
    if failure:  # no plan outweighs a check that failed: it leads, and nothing says "Rent"
        lines += [f"**Do not rent yet**: {failure}. Fix it and run the pilot again; the plan "
                  "below is what it would be once every notebook passes.", ""]
    currency = options.currency.iloc[0] if len(options) else "USD"
    unsized = unsized or {}
    if chosen is None and unsized and len(unsized) == len(options):
        lines.append(decision_unsized(unsized, len(options), rental_gpu))
    elif chosen is None:
        fits_elsewhere = options.dropna(subset=["cheapest_gpu"])
        nowhere = "No candidate that could be sized" if unsized else "No candidate"
        lines.append(f"No candidate fits the {rental_gpu}: do not rent it for this plan." + (
            " Candidates that fit another GPU: " + "; ".join(
                f"{r.candidate} on {r.cheapest_gpu} ({money(r.cheapest_cost, r.currency)})"
                for r in fits_elsewhere.itertuples()) + "." if len(fits_elsewhere) else
            f" {nowhere} fits any GPU of the list: reduce the micro-batch or the length, or "
            "turn on activation checkpointing (notebook 05).")
            + (decision_unsized(unsized, len(options), rental_gpu) if unsized else ""))
    else:
        best = options.set_index("candidate").loc[chosen["candidate"]]
        lead = "Once it passes, the plan is" if failure else "**Rent"

        def shape(strategy, micro, acc):
            return (f"{strategy}, {chosen['precision']}, micro-batch {int(micro)} x accumulation "
                f"{int(acc)}")

        if best.cheapest_gpu != rental_gpu:
            gpu_name = best.cheapest_gpu
            count = int(best.get("cheapest_gpus") or 1)
            what = f"{article(gpu_name)} {gpu_name}" if count == 1 else f"{count} x {gpu_name}"
            how = shape(best.cheapest_strategy, best.cheapest_micro_batch,
                        best.cheapest_accumulation)
            spent = hours(best.cheapest_hours) + gpu_hours(best.cheapest_gpu_hours, count)
            lines.append(f"{lead} {what}{'**' * (not failure)} for candidate "
                         f"**{chosen['candidate']}** ({how}"
                         f"{per_gpu(best.cheapest_required_gib, count)}): the cheapest GPU that "
                         "fits it with headroom, "
                         f"{money(best.cheapest_cost, currency)} for the budget "
                         f"({spent}){offered(best, currency)}. You planned on the {rental_gpu} "
                         f"({money(best.asked_cost, currency)}); {best.why}.")
        else:
            count = int(chosen.get("gpus") or 1)
            what = f"{article(rental_gpu)} {rental_gpu}" if count == 1 else \
                f"{count} x {rental_gpu}"
            how = shape(chosen["strategy"], chosen["micro_batch"], chosen["accumulation"])
            lines.append(f"{lead} {what}{'**' * (not failure)} for candidate "
                         f"**{chosen['candidate']}** ({how}): "
                         f"{chosen['required_gib']:.2f} GiB needed with headroom"
                         f"{' per GPU' if count > 1 else ''}, "
                         f"{chosen['headroom_gib']:.1f} GiB to spare, "
                         f"{money(chosen.get('cost'), currency)} for the budget "
                         f"({hours(chosen['budget_hours'])}"
                         f"{gpu_hours(chosen.get('gpu_hours'), count)})"
                         f"{offered(best, currency)}; {best.why}.")
        lines += ["", study["said"]]
        if models_lines:
            lines += ["", "Sized for: " + "; ".join(models_lines) + "."]
        lines += ["", f"Expected result: {chosen['expected'] or 'not stated'}."]
        if unsized:
            lines += ["", decision_unsized(unsized, len(options), rental_gpu).strip()]
    if chosen is None:
        lines += ["", study["said"]]
    if study.get("study"):
        lines += ["", study["study"]]
    verdicts = []
    for entry, label in EARLIER_NOTEBOOKS:
        s = summary_of(run_dir, entry.stem)
        if isinstance(s, dict) and s.get("verdict"):  # an error too: never read as a pass
            verdicts.append(f"{label} {s['verdict']}" + (
                f" ({str(s.get('error', ''))[:120]})" if s["verdict"] != "pass" and
                s.get("error") else ""))
    if verdicts:
        lines += ["", "Other notebooks of this run: " + ", ".join(verdicts) + "."]
    lines += ["", *plan_lines(plans, rental_gpu, currency)]
    todo = unverified(stack)
    lines += ["", "Still to verify on the rental before adopting it: " +
              ("; ".join(todo) if todo else "nothing beyond matching the versions listed") + ".",
              "", "This sheet plans; it predicts neither duration nor quality. "
              + resting_on(basis)]
    return "\n".join(lines) + "\n"
