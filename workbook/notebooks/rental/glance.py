"""Notebook 08's decision at a glance, read back from a run folder for the report: the
decision in one line (what to rent, how many, for how long, what it costs low-high, on demand
and on spot), the priced plans as one table, the points of the chart of cost against hours
(per GPU and strategy), the open risks (each with the notebook that settles it) and the launch
files."""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..registry import RENTAL, STUDY, entry, summary_of, verdict_line
from .conclusions import study_result
from .launch_files import FOLDER, PLACEHOLDER
from .stack import unverified


@dataclass
class Glance:
    line: str  # the decision in one line
    plans: pd.DataFrame  # the priced plans, in words: one row per GPU priced on and days
    points: pd.DataFrame  # per GPU and strategy that fits: hours, cost (with ranges), spot
    risks: list[tuple[str, str]] = field(default_factory=list)  # (what is open, its notebook)
    launch: dict = field(default_factory=dict)  # launch/index.json (none: {})


# the columns each table needs, and the ones it may lack (an older or partial folder)
PLAN = ("gpu", "priced_on", "days", "scheduled", "repeats", "hours", "cost", "gpus", "strategy")
SHEET = ("candidate", "gpu", "fits", "budget_hours", "cost", "strategy", "gpus")
OPTIONAL = ("hours_low", "hours_high", "cost_low", "cost_high", "spot_cost", "budget_hours_low",
            "budget_hours_high", "gpu_hours", "currency")


def _csv(folder: Path, name: str, needs: tuple[str, ...] = ()) -> pd.DataFrame:
    """A table of 08's folder with every optional column (NaN where it lacks one); empty when
    it is missing, unreadable or lacks a column it `needs`."""
    path = folder / f"{name}.csv"
    try:
        frame = pd.read_csv(path) if path.exists() else pd.DataFrame()
    except (ValueError, OSError):
        return pd.DataFrame()
    if frame.empty or not set(needs) <= set(frame.columns):
        return pd.DataFrame()
    return frame.assign(**{c: float("nan") for c in OPTIONAL if c not in frame}) if needs \
        else frame


def read(run_dir: str | Path, verdicts: dict[str, str]) -> Glance | None:
    """The glance of the run folder `run_dir` whose notebooks ended with `verdicts` ({stem:
    verdict}); None when 08 wrote no summary."""
    run_dir = Path(run_dir)
    summary = summary_of(run_dir, RENTAL.stem)
    if not isinstance(summary, dict) or not isinstance(summary.get("figures"), dict):
        return None
    folder = run_dir / RENTAL.stem
    figures = summary["figures"]
    sheet, plans = _csv(folder, "selection", SHEET), _csv(folder, "plan", PLAN)
    launch = _launch(folder)
    failed = [s for s, v in verdicts.items() if v != "pass"]
    line = decision_line(figures, sheet, plans)
    if failed:
        line = (f"Do not rent yet: notebook {', '.join(s[:2] for s in failed)} did not pass "
                "(the risks below say why). Once every notebook passes: " + line[0].lower()
                + line[1:])
    return Glance(line, plan_table(plans), chart_points(sheet, figures),
                  risks(run_dir, verdicts, figures, _csv(folder, "stack"), launch), launch)


def _launch(folder: Path) -> dict:
    try:
        index = json.loads((folder / FOLDER / "index.json").read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def money(value, currency: str) -> str:
    return "-" if value is None or pd.isna(value) else f"{currency} {value:,.2f}"


def ranged(mid, low, high, unit: str = "", digits: int = 1) -> str:
    """'32.5 h (32.4-34.9)': a figure and its range over the speed references."""
    if mid is None or pd.isna(mid):
        return "-"
    text = f"{mid:,.{digits}f}{unit}"
    if low is None or high is None or pd.isna(low) or pd.isna(high) or \
            round(low, digits) == round(high, digits):
        return text
    return f"{text} ({low:,.{digits}f}-{high:,.{digits}f})"


def decision_line(figures: dict, sheet: pd.DataFrame, plans: pd.DataFrame) -> str:
    """'Rent 4 x A100-80GB (FSDP2 full sharding x4) for candidate sharded: 7 runs of 3
    variants in 32.5 h (32.4-34.9), USD 167.51 (167.30-180.11) on demand, USD 60.40 on spot.'"""
    chosen, gpu = figures.get("chosen"), figures.get("recommended_gpu")
    if not chosen or not gpu:
        return ("Do not rent: no candidate fits the GPU planned on or any GPU of the list "
                "(notebook 08 says why).")
    return _decision(figures, sheet, plans, chosen, gpu) + floored(sheet)


def floored(sheet: pd.DataFrame) -> str:
    """What a sheet whose every fitting row is held at the launch floor cannot say."""
    fit = sheet[sheet.fits.astype(bool)] if len(sheet) and "fits" in sheet else sheet
    if len(fit) and "time_floored" in fit and fit.time_floored.fillna(False).astype(bool).all():
        return (" Every GPU's time per update is at the launch floor for this model, so there "
                "is no speed range and the GPUs differ only in price.")
    return ""


def _decision(figures: dict, sheet: pd.DataFrame, plans: pd.DataFrame, chosen: str,
              gpu: str) -> str:
    count = figures.get("recommended_gpus") or 1
    what = f"Rent {count} x {gpu} ({figures.get('recommended_strategy')}) for candidate " \
        f"{chosen}"
    first = plans[plans.priced_on.isin(("recommended", "recommended and planned on")) &
                  plans.scheduled.astype(bool)] if len(plans) else plans
    if len(first):
        first = first[first.days == first.days.min()]
        cur = _currency(sheet)
        runs = int(first.repeats.sum())
        spot = f"{money(first.spot_cost.sum(), cur)} on spot (interruptions included)" \
            if first.spot_cost.notna().all() else "no spot offer"
        return (f"{what}: {runs} run{'s' * (runs != 1)} of {len(first)} "
                f"variant{'s' * (len(first) != 1)} in "
                f"{ranged(*(first[c].sum() for c in ('hours', 'hours_low', 'hours_high')))} h, "
                f"{_cost(first.cost.sum(), first.cost_low.sum(), first.cost_high.sum(), cur)} "
                f"on demand, {spot}.")
    row = sheet[(sheet.candidate == chosen) & (sheet.gpu == gpu)] if len(sheet) else sheet
    if row.empty:
        return f"{what}."
    r, cur = row.iloc[0], _currency(sheet)
    return (f"{what}: one run in "
            f"{ranged(r.budget_hours, r.get('budget_hours_low'), r.get('budget_hours_high'))}"
            f" h, {_cost(r.cost, r.get('cost_low'), r.get('cost_high'), cur)} on demand, "
            f"{money(r.get('spot_cost'), cur)} on spot.")


def _cost(mid, low, high, currency: str) -> str:
    return "cost not given (no price)" if mid is None or pd.isna(mid) else \
        f"{currency} {ranged(mid, low, high, digits=2)}"


def _currency(sheet: pd.DataFrame) -> str:
    return str(sheet.currency.dropna().iloc[0]) if "currency" in sheet and \
        sheet.currency.notna().any() else "USD"


def plan_table(plans: pd.DataFrame) -> pd.DataFrame:
    """The priced plans in words: per GPU priced on and days (days that schedule the same
    runs share a row), the runs scheduled, hours and cost with their ranges, and spot."""
    if plans.empty:
        return pd.DataFrame()
    cur = "USD"
    rows = []
    for (gpu, role, days), plan in plans.groupby(["gpu", "priced_on", "days"], sort=False):
        done = plan[plan.scheduled.astype(bool)]
        rows.append({
            "GPUs": f"{int(done.gpus.max() if len(done) else plan.gpus.max())} x {gpu}",
            "strategy": ", ".join(dict.fromkeys(plan.strategy.astype(str))),
            "priced as": role, "days": str(days),
            "runs": f"{int(done.repeats.sum())} ({len(done)} of {len(plan)} variants)",
            "hours": ranged(*(done[c].sum() for c in ("hours", "hours_low", "hours_high"))),
            "on demand": _cost(done.cost.sum() if done.cost.notna().all() else None,
                               done.cost_low.sum(), done.cost_high.sum(), cur),
            "on spot": money(done.spot_cost.sum(), cur) if len(done) and
            done.spot_cost.notna().all() else "-"})
    table = pd.DataFrame(rows)
    same = [c for c in table.columns if c != "days"]
    return table.groupby(same, sort=False, as_index=False).agg(
        days=("days", ", ".join))[["GPUs", "strategy", "priced as", "days", "runs", "hours",
                                   "on demand", "on spot"]]


def chart_points(sheet: pd.DataFrame, figures: dict) -> pd.DataFrame:
    """The sheet's rows that fit, one per GPU and strategy (the cheapest candidate's): hours
    and cost of one run with their ranges, and spot; `recommended` marks the decision's."""
    if sheet.empty or "fits" not in sheet or "budget_hours" not in sheet:
        return pd.DataFrame()
    fit = sheet[sheet.fits.astype(bool) & sheet.budget_hours.notna()].copy()
    if fit.empty:
        return pd.DataFrame()
    fit["kind"] = fit.strategy.astype(str).str.replace(r" x\d+.*$", "", regex=True)
    key = "cost" if fit.cost.notna().all() else "budget_hours"
    fit["recommended"] = (fit.candidate == figures.get("chosen")) & \
        (fit.gpu == figures.get("recommended_gpu"))
    fit = fit.sort_values(["recommended", key], ascending=[False, True], kind="stable")
    return fit.drop_duplicates(["gpu", "kind"]).reset_index(drop=True)


def chart(points: pd.DataFrame) -> bytes | None:
    """A PNG: cost (or, without prices, hours) against hours of one run per GPU and strategy,
    the speed references' range as bars, spot as hollow marks, the recommendation ringed -
    or, every run taking the same hours (times at the launch floor), cost per GPU and strategy
    as bars (`_bars`)."""
    if points.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    priced = points.cost.notna().all()
    hours = points.budget_hours
    if len(points) > 1 and hours.max() - hours.min() <= 0.02 * hours.max():
        return _bars(points, priced, plt)
    fig, ax = plt.subplots(figsize=(5.6, 3.0), dpi=100)
    labelled: list[tuple[float, float]] = []
    every = points.cost if priced else points.gpu_hours
    span = (max(points.budget_hours.max() - points.budget_hours.min(), 1e-9),
            max(float(every.max() - every.min()), 1e-9))
    for n, (kind, group) in enumerate(points.groupby("kind", sort=False)):
        colour = f"C{n}"
        y = group.cost if priced else group.gpu_hours
        ax.errorbar(group.budget_hours, y, fmt="o", color=colour, label=kind, capsize=3,
                    xerr=[group.budget_hours - group.budget_hours_low.fillna(group.budget_hours),
                          group.budget_hours_high.fillna(group.budget_hours)
                          - group.budget_hours],
                    yerr=[y - group.cost_low.fillna(y), group.cost_high.fillna(y) - y]
                    if priced else None)
        if priced and group.spot_cost.notna().any():
            ax.scatter(group.budget_hours, group.spot_cost, facecolors="none",
                       edgecolors=colour, s=36, label=f"{kind}, spot")
        for r, yy in zip(group.itertuples(), y, strict=True):
            if not _apart((r.budget_hours, yy), labelled, span):
                continue  # a label on another's place says nothing: the legend and table do
            ax.annotate(f"{r.gpu}" + (f" x{int(r.gpus)}" if r.gpus and r.gpus > 1 else ""),
                        (r.budget_hours, yy), textcoords="offset points", xytext=(5, 3),
                        fontsize=7)
    best = points[points.recommended]
    if len(best):
        ax.scatter(best.budget_hours, best.cost if priced else best.gpu_hours, s=180,
                   facecolors="none", edgecolors="black", linewidths=1.5, label="recommended")
    cur = _currency(points)
    ax.set_xlabel("hours for one run of the budget")
    ax.set_ylabel(f"cost ({cur})" if priced else "GPU-hours")
    ax.set_title("One run per GPU and strategy (bars: the speeds' range)", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return _png(fig, plt)


def _bars(points: pd.DataFrame, priced: bool, plt) -> bytes:
    """Cost (or GPU-hours) of one run per GPU and strategy as bars, cheapest on top, spot as
    hollow marks, the recommendation in bold: the hours are the same for every row."""
    points = points.sort_values("cost" if priced else "gpu_hours", ascending=False)
    value = points.cost if priced else points.gpu_hours
    names = [f"{r.gpu}" + (f" x{int(r.gpus)}" if r.gpus and r.gpus > 1 else "") + f", {r.kind}"
             for r in points.itertuples()]
    fig, ax = plt.subplots(figsize=(5.6, 0.8 + 0.28 * len(points)), dpi=100)
    ax.barh(names, value, color=["black" if r else "C0" for r in points.recommended])
    if priced and points.spot_cost.notna().any():
        ax.scatter(points.spot_cost, names, facecolors="none", edgecolors="C1", s=30,
                   label="spot", zorder=3)
        ax.legend(fontsize=7, loc="lower right")
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel(f"cost ({_currency(points)})" if priced else "GPU-hours")
    why = " (every time per update at the launch floor)" if "time_floored" in points and \
        points.time_floored.fillna(False).astype(bool).all() else ""
    ax.set_title(f"One run: {points.budget_hours.iloc[0]:.2g} h on every GPU{why}; "
                 "black: recommended", fontsize=8)
    ax.grid(alpha=0.3, axis="x")
    return _png(fig, plt)


def _png(fig, plt) -> bytes:
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _apart(point: tuple[float, float], labelled: list[tuple[float, float]],
           span: tuple[float, float]) -> bool:
    """Whether a label at `point` keeps clear of those placed (a label's width, 30% of the
    hours' span, and 5% of the cost's); placed if so."""
    if any(abs(point[0] - x) < span[0] * 0.3 and abs(point[1] - y) < span[1] * 0.05
           for x, y in labelled):
        return False
    labelled.append(point)
    return True


def risks(run_dir: Path, verdicts: dict[str, str], figures: dict, stack: pd.DataFrame,
          launch: dict) -> list[tuple[str, str]]:
    """What is open, each with the notebook that settles it: a notebook that did not pass,
    what the stack check could not verify here (CUDA counters, NCCL, ...), a learning rate no
    study settled, candidates not sized, and a placeholder entry point."""
    out = []
    for stem, verdict in verdicts.items():
        if verdict != "pass":
            why = verdict_line(run_dir / stem).removeprefix("verdict: ")
            out.append((f"{entry(stem).title}: {why if verdict == 'fail' else verdict}", stem))
    if len(stack) and "verified" in stack:
        stack = stack.assign(verified=stack.verified.astype(str).str.lower() == "true")
        open_rows = stack[~stack.verified]
        where = open_rows.notebook if "notebook" in open_rows else [RENTAL.stem] * len(open_rows)
        out += list(zip(unverified(stack), where, strict=True))
    study = study_result(run_dir)
    if study["state"] != "ran" or not study["conclusive"]:
        said = re.sub(r"\*\*", "", study.get("said") or "")
        out.append((said or f"learning rate: {study['short']}", STUDY.stem))
    if figures.get("not_sized"):
        out.append((f"not sized, so not judged: {', '.join(map(str, figures['not_sized']))}",
                    RENTAL.stem))
    if launch.get("entry_point_is_placeholder"):
        out.append((f"the launch files run {PLACEHOLDER}, a placeholder: set 08's entry_point "
                    "to your training script", RENTAL.stem))
    return out
