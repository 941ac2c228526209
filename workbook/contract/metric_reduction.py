"""How a framework combines an evaluation metric over data-parallel ranks, as an adapter
declares it for its `eval_step` (`Task.framework.metric_reductions`, {name: reduction}), and
the value a reduction gives from each rank's (sum, count). Notebook 09 judges each metric the
way its framework reduces it, against the same metric in one process."""

from __future__ import annotations

ROWS = "rows"  # numerators and denominators summed over ranks: a mean over rows (the default)
SUM = "sum"  # the ranks' values added: a count (Lightning's reduce_fx="sum" with sync_dist)
MEAN = "mean of ranks"  # the ranks' values averaged (Lightning's sync_dist=True, "mean")
MAX, MIN = "max", "min"  # Lightning's reduce_fx="max" / "min" with sync_dist
# a number logged at the epoch's end without sync_dist, computed from the rank's own state: each
# rank logs its own value (the logger and checkpointing read rank 0's). Judged over rows, as a
# synced mean over rows would give it: what no such sync gives (an F1) is named
OWN = "each rank's own"
# computed once from every rank's outputs gathered first (the HF Trainer's compute_metrics
# after gather_for_metrics, a torchmetrics Metric syncing its states): the one-process value
GATHERED = "gathered"

WORDS = {
    ROWS: "numerators and denominators summed over ranks (a mean over rows)",
    SUM: "the ranks' values added (a count)",
    MEAN: "the mean of the ranks' values (sync_dist=True)",
    MAX: "the largest rank's value", MIN: "the smallest rank's value",
    OWN: "each rank's own value, not synced (an epoch-end log without sync_dist), over rows",
    GATHERED: "computed once from every rank's outputs, gathered by the framework",
}


def rank_value(num: float, den: float) -> float:
    return num / den if den else float("nan")


def reduced(reduction: str, per_rank: list[tuple[float, float]]) -> float | None:
    """The value `reduction` gives from each rank's (sum, count); None for GATHERED (the
    framework computes it from the gathered outputs: the one-process value)."""
    if reduction == GATHERED:
        return None
    if reduction in (ROWS, OWN) or reduction not in WORDS:
        return rank_value(sum(n for n, _ in per_rank), sum(d for _, d in per_rank))
    values = [rank_value(n, d) for n, d in per_rank if d]
    if not values:
        return float("nan")
    return {SUM: sum, MAX: max, MIN: min}.get(reduction, lambda v: sum(v) / len(v))(values)
