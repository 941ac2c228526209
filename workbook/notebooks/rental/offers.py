"""Notebook 08's spread across providers: for each candidate's cheapest GPU, every provider's
cheapest offer of the catalog, on-demand and spot side by side, priced for the budget."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..registry import GATES
from .prices import Catalog, Spot, spread

OFFER_COLUMNS = ["candidate", "gpu", "gpus", "provider", "offer", "instances",
                 "price_per_used_gpu_hour", "cost",
                 "spot_offer", "spot_price_per_used_gpu_hour", "spot_cost", "budget_hours",
                 "currency"]


def offers_table(catalog: Catalog, options: pd.DataFrame, sheet: pd.DataFrame,
                 spot: Spot | None = None, eval_every: int = 1) -> pd.DataFrame:
    """One row per candidate (with a cheapest GPU) and provider offering that GPU: the
    provider's cheapest whole-instance offer for the candidate's GPUs and what the budget
    costs on it, on-demand and on spot (with `spot`'s interruptions), cheapest first."""
    rows = []
    for r in options.dropna(subset=["cheapest_gpu"]).itertuples():
        hours = r.cheapest_hours
        if hours is None or pd.isna(hours):
            continue
        count = int(r.cheapest_gpus or 1)
        row = sheet[(sheet.candidate == r.candidate) & (sheet.gpu == r.cheapest_gpu)]
        update_s = row.time_per_update_s.iloc[0] if len(row) else 0.0
        extra = 1 + (spot.overhead(update_s * eval_every) if spot else 0.0)
        for p in spread(catalog, r.cheapest_gpu, count).itertuples():
            rows.append({"candidate": r.candidate, "gpu": r.cheapest_gpu, "gpus": count,
                         "provider": p.provider, "offer": p.offer, "instances": p.instances,
                         "price_per_used_gpu_hour": p.price_per_used_gpu_hour,
                         "cost": _cost(hours, count, p.price_per_used_gpu_hour),
                         "spot_offer": p.spot_offer,
                         "spot_price_per_used_gpu_hour": p.spot_price_per_used_gpu_hour,
                         "spot_cost": _cost(hours * extra, count, p.spot_price_per_used_gpu_hour),
                         "budget_hours": round(hours, 3), "currency": r.currency})
    return pd.DataFrame(rows, columns=OFFER_COLUMNS)


def _cost(hours: float, count: int, per_gpu: float | None) -> float | None:
    return None if per_gpu is None or pd.isna(per_gpu) else round(hours * count * per_gpu, 2)


def resume_seconds(run_dir: str | Path) -> float | None:
    """The time notebook 03's resume gate took in this run folder (restoring the checkpoint of
    the model it trained), None when 03 did not run or the gate failed."""
    path = Path(run_dir) / GATES.stem / "gates.csv"
    if not path.is_file():
        return None
    gates = pd.read_csv(path)
    row = gates[(gates.phase == "resume") & (gates.verdict == "pass")]
    return float(row.time_s.iloc[0]) if len(row) else None
