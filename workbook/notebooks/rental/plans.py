"""Notebook 08's plans: the cheapest GPU per candidate, the first candidate that fits the GPU to
rent, and the variants (with their learning rates) packed into 3/7/30 days."""

from __future__ import annotations

import pandas as pd

from ...base.errors import WorkbookError


def pack(variants: list[dict], sheet: pd.DataFrame, gpu_name: str, days: int,
         reserve_share: float, priced_on: str = "") -> pd.DataFrame:
    """Variants by priority into `days` of one rental of `gpu_name`, keeping `reserve_share` of
    the time for evaluation, export and the unexpected. What does not fit is listed, not
    dropped. `priced_on` says what the GPU is to the decision ("recommended", "planned on");
    a variant's `lr`/`lr_from` and `planned_as` (`planned_variants`) are carried over."""
    usable = days * 24 * (1 - reserve_share)
    rows, clock = [], 0.0
    if not variants:
        return pd.DataFrame(columns=PLAN_COLUMNS)
    for v in sorted(variants, key=lambda v: v["priority"]):
        match = sheet[(sheet.candidate == v["candidate"]) & (sheet.gpu == gpu_name)]
        if match.empty:
            raise WorkbookError(f"variant {v['name']!r} names candidate {v['candidate']!r}, "
                                "which the selection sheet does not have",
                                f"use one of {sorted(set(sheet.candidate))}")
        row = match.iloc[0]
        repeats = v.get("repeats", 1)
        hours = 0.0 if pd.isna(row.budget_hours) else row.budget_hours * repeats
        fits = bool(row.fits) and clock + hours <= usable
        lr = v.get("lr")
        rows.append({"days": days, "priced_on": priced_on, "priority": v["priority"],
                     "variant": v["name"], "candidate": v["candidate"], "gpu": gpu_name,
                     "gpus": plain_count(row.get("gpus")), "strategy": row.get("strategy"),
                     "lr": float(lr) if isinstance(lr, (int, float)) else None,
                     "lr_from": v.get("lr_from", ""), "repeats": repeats,
                     "hours": round(hours, 3), "cost": _times(row.get("cost"), repeats, 2),
                     **{f"{k}_{end}": _times(row.get(f"{c}_{end}"), repeats, digits)
                        for k, c, digits in (("hours", "budget_hours", 3), ("cost", "cost", 2))
                        for end in ("low", "high")},
                     "spot_cost": _times(row.get("spot_cost"), repeats, 2),
                     "offer": row.get("offer"), "price_from": row.get("price_from"),
                     "speed_from": row.get("speed_from"),
                     "start_hour": round(clock, 3) if fits else None,
                     "end_hour": round(clock + hours, 3) if fits else None,
                     "scheduled": fits,
                     "why_not": "-" if fits else (
                         row.get("note") if not sized(row) else
                         "does not fit the GPU's memory" if not row.fits else
                         f"needs {hours:.1f} h, {usable - clock:.1f} h of the {usable:.0f} "
                         "usable hours left"),
                     "planned_as": v.get("planned_as", "")})
        if fits:
            clock += hours
    return pd.DataFrame(rows, columns=PLAN_COLUMNS)


PLAN_COLUMNS = ["days", "priced_on", "priority", "variant", "candidate", "gpu", "gpus",
                "strategy", "lr", "lr_from", "repeats", "hours", "cost", "hours_low",
                "hours_high", "cost_low", "cost_high", "spot_cost", "offer", "price_from",
                "speed_from", "start_hour", "end_hour", "scheduled", "why_not", "planned_as"]


def _times(value, repeats: int, digits: int) -> float | None:
    """A sheet figure for `repeats` runs (None when the sheet has none)."""
    return None if value is None or pd.isna(value) else round(float(value) * repeats, digits)

# what a plan's GPU is to the decision, in the words of the conclusion
RECOMMENDED, PLANNED, BOTH = "recommended", "planned on", "recommended and planned on"


def priced_gpus(chosen: dict | None, options: pd.DataFrame,
                rental_gpu: str) -> list[tuple[str, str]]:
    """The GPUs the 3/7/30-day plans are priced on, each with what it is to the decision: the
    GPU the decision recommends for the chosen candidate (the cheapest that fits it), and the
    GPU planned on (`rental_gpu`) when that is another one."""
    recommended = None
    if chosen is not None and len(options):
        best = options.set_index("candidate").cheapest_gpu.get(chosen["candidate"])
        recommended = None if best is None or pd.isna(best) else best
    if recommended is None:
        return [(rental_gpu, PLANNED)]
    if recommended == rental_gpu:
        return [(rental_gpu, BOTH)]
    return [(recommended, RECOMMENDED), (rental_gpu, PLANNED)]


def planned_variants(variants: list[dict], sheet: pd.DataFrame, stand_ins: dict[str, str],
                     study: dict, task_lr: float | None = None) -> list[dict]:
    """The variants as they are planned: each with its learning rate (`lr`, `lr_from`:
    `variant_lr`), and - when its candidate fits no GPU of the list alone and a sharded
    candidate trains the same update (`stand_ins`: {candidate: sharded candidate}) - planned
    on that sharded candidate, which `planned_as` says."""
    out = []
    for v in variants:
        lr, lr_from = variant_lr(v, study, task_lr)
        planned = {**v, "lr": lr, "lr_from": lr_from, "planned_as": ""}
        stand_in = stand_ins.get(v["candidate"])
        if stand_in and not sheet[sheet.candidate == v["candidate"]].fits.any():
            planned.update(candidate=stand_in, planned_as=(
                f"candidate {v['candidate']} fits no single GPU: its update sharded "
                f"(candidate {stand_in})"))
        out.append(planned)
    return out


def variant_lr(variant: dict, study: dict, task_lr: float | None = None
               ) -> tuple[float | None, str]:
    """A variant's learning rate and where it comes from: "study" is the rate notebook 06's
    study supports, "control" its control (the task's own lr when 06 did not run), 0 the
    task's own lr, another number is given; no `lr`: none (None, "")."""
    lr = variant.get("lr")
    if lr is None:
        return None, ""
    short = study.get("short", "06 did not run")
    if lr == 0:
        return (task_lr, "the task's lr") if task_lr else (None, "none: the task gives no lr")
    if lr == "study":
        if study.get("lr") is None:
            return None, f"none: {short}"
        words = "06's control, which remains the best" if study.get("control_best") else \
            "06's best"
        return study["lr"], words + ("" if study.get("conclusive") else ", provisional")
    if lr == "control":
        if study.get("control_lr") is not None:
            return study["control_lr"], "06's control"
        return (task_lr, f"the task's lr ({short})") if task_lr else (None, f"none: {short}")
    return float(lr), "given"


def sized(row: pd.Series) -> bool:
    """Whether the prediction sized this sheet row (a row without a predicted peak has a note
    that says why not)."""
    note = row.get("note")
    return not pd.isna(row.get("predicted_peak_gib")) or not (isinstance(note, str) and note)


def not_sized(sheet: pd.DataFrame) -> dict[str, str]:
    """Candidates the prediction could not size, in the order given, with the reason."""
    if "predicted_peak_gib" not in sheet or "note" not in sheet:
        return {}
    rows = sheet[sheet.predicted_peak_gib.isna()]
    return dict(zip(rows.candidate, rows.note, strict=True))


def _spend(row: pd.Series) -> float:
    """Unrounded cost of a sheet row: hours x GPUs paid for x price (GPU-hours when no price
    is given)."""
    price = row.get("price_per_hour")
    if price is None or pd.isna(price):
        return row.gpu_hours
    paid = row.get("paid_gpus")
    return (row.budget_hours * paid if paid is not None and not pd.isna(paid) and
            not pd.isna(row.get("budget_hours")) else row.gpu_hours) * price


# the cheapest GPU's figures (its sheet row's, `hours` its budget_hours) as cheapest_<name>
CHEAPEST = ("gpu", "gpus", "strategy", "micro_batch", "accumulation", "required_gib",
            "gpu_hours", "cost", "hours", "offer", "price_from", "cost_low", "cost_high",
            "spot_cost", "spot_offer", "speed_from")


def cheapest(sheet: pd.DataFrame, rental_gpu: str) -> pd.DataFrame:
    """Per candidate: the cheapest GPU that fits with headroom (by the budget's cost, or its
    hours when no prices are given), beside the GPU asked for, and why they differ."""
    rows = []
    for name, group in sheet.groupby("candidate", sort=False):
        fitting = group[group.fits]
        asked = group[group.gpu == rental_gpu].iloc[0]
        # by cost where every fitting GPU has one; a GPU without time or cost comes last
        key = "cost" if len(fitting) and fitting.cost.notna().all() else "gpu_hours"
        order = fitting.apply(_spend, axis=1) if key == "cost" and len(fitting) else \
            fitting[key]
        best = fitting.loc[order.sort_values(kind="stable", na_position="last").index[0]] \
            if len(fitting) else None
        if best is None:
            reason = asked.note if not sized(asked) else "fits no GPU of the list"
        elif pd.isna(best[key]):
            reason = (f"{best.gpu} fits with {best.headroom_gib:.1f} GiB to spare; no time or "
                      f"cost to compare ({best.note})")
        elif best.gpu == rental_gpu:
            reason = f"{rental_gpu} is the cheapest GPU that fits"
        elif not asked.fits:
            reason = (f"{rental_gpu} lacks memory ({asked.required_gib:.1f} GiB needed); "
                      f"{best.gpu} fits with {best.headroom_gib:.1f} GiB to spare")
        else:
            ratio = _spend(asked) / _spend(best)
            reason = (f"{best.gpu} fits with {best.headroom_gib:.1f} GiB to spare and costs "
                      f"{ratio:.1f}x less than {rental_gpu} for this budget")
        if best is not None and not pd.isna(best[key]):
            reason += floored_words(fitting, key)
        rows.append({"candidate": name,
                     **{f"cheapest_{k}": None if best is None else
                        best.get("budget_hours" if k == "hours" else k) for k in CHEAPEST},
                     "asked_gpu": rental_gpu, "asked_fits": bool(asked.fits),
                     "asked_cost": asked.cost, "currency": asked.currency, "why": reason})
    return pd.DataFrame(rows)


def floored_words(fitting: pd.DataFrame, key: str) -> str:
    """'; by price alone: ...' when every fitting GPU's time per update is held at the launch
    floor (`time_floored`): the GPUs then take the same hours, and the choice says nothing of
    speed; '' otherwise."""
    timed = fitting[fitting.time_per_update_s.notna()] if "time_per_update_s" in fitting \
        else fitting.iloc[0:0]
    if timed.empty or "time_floored" not in timed or not timed.time_floored.astype(bool).all():
        return ""
    floor = f"{timed.time_per_update_s.iloc[0] * 1000:.0f} ms"
    if len(timed) == 1:
        return (f"; its time per update is the {floor} launch floor (the model is too small "
                "for its FLOPs to set the time)")
    return (f"; {'by price alone' if key == 'cost' else 'not by speed'}: every GPU's time per "
            f"update is the {floor} launch floor (the model is too small for its FLOPs to set "
            "the time), so this sheet cannot tell the GPUs' speeds apart")


def choose(sheet: pd.DataFrame, rental_gpu: str) -> dict | None:
    """The first candidate (in the order given) that fits the rental GPU."""
    fitting = sheet[(sheet.gpu == rental_gpu) & sheet.fits]
    return fitting.iloc[0].to_dict() if len(fitting) else None


def plain_count(value):
    """A count from a table cell as a plain int (None for a missing one), for JSON."""
    return None if value is None or pd.isna(value) else int(value)
