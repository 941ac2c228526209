"""Figures for the notebooks; each returns a matplotlib Figure and saves it when asked."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Patch
from matplotlib.ticker import LogLocator, ScalarFormatter

from ..storage.artifacts import replace_file

VERDICT_COLOURS = {"pass": "tab:green", "warn": "tab:orange", "fail": "tab:red"}


def _plain_log_axis(axis) -> None:
    """Log scale with plain tick labels (5.5, not 5.5x10^0)."""
    formatter = ScalarFormatter()
    formatter.set_scientific(False)
    axis.set_major_formatter(formatter)
    axis.set_minor_formatter(formatter)
    axis.set_minor_locator(LogLocator(subs="all", numticks=12))


def _done(fig, save: Path | None):
    fig.tight_layout()
    if save is not None:  # rendered in memory, then written whole (a full disk leaves none)
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=100, format=Path(save).suffix.lstrip(".") or "png")
        replace_file(save, buffer.getvalue(), "figure")
    plt.close(fig)
    return fig


def loss_curve(steps: pd.DataFrame, *, threshold: float | None = None,
               expected_initial: float | None = None, title: str = "training loss",
               save: Path | None = None, expected_label: str = "ln(outputs)"):
    """Loss per update, with the threshold and the expected initial loss as reference lines."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps.step, steps.loss, label="loss per update")
    if threshold is not None:
        ax.axhline(threshold, color="green", ls="--", lw=1, label=f"threshold {threshold:.3g}")
    if expected_initial is not None:
        ax.axhline(expected_initial, color="grey", ls=":", lw=1,
                   label=f"{expected_label} = {expected_initial:.2f}")
    ax.set(xlabel="update", ylabel="loss", title=title, yscale="log")
    ax.legend(fontsize="small")
    return _done(fig, save)


def coverage_histogram(coverage: pd.DataFrame, save: Path | None = None):
    """How many targets each example contributes to the loss, per split (`coverage`: one row
    per split and target count, with how many `examples` gave it)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for split, rows in coverage.groupby("split", sort=False):
        ax.hist(rows.targets, weights=rows.examples, alpha=0.5, label=split, density=True,
                bins=range(0, int(coverage.targets.max()) + 2))
    ax.set(xlabel="contributing targets per example", ylabel="share of examples",
           title="loss coverage")
    ax.legend(fontsize="small")
    return _done(fig, save)


def class_histogram(classes: pd.DataFrame, save: Path | None = None):
    """Share of each class per split (a rare class must appear in every split)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    (classes / classes.sum()).plot.bar(ax=ax)
    ax.set(ylabel="share of split", title="classes per split")
    return _done(fig, save)


def gate_memory(table: pd.DataFrame, save: Path | None = None):
    """Peak memory per phase, allocated and reserved side by side (never stacked: reserved
    already contains allocated), and time per phase."""
    fig, (mem, tim) = plt.subplots(1, 2, figsize=(10, 3.4))
    x = range(len(table))
    mib = 2**20
    mem.bar([i - 0.2 for i in x], table.peak_allocated_bytes.astype(float) / mib, 0.4,
            label="peak allocated (live tensors)")
    if table.peak_reserved_bytes.notna().any():
        mem.bar([i + 0.2 for i in x], table.peak_reserved_bytes.astype(float) / mib, 0.4,
                label="peak reserved (allocator)")
    mem.set_xticks(list(x), table.phase, rotation=45, ha="right")
    top = (table.peak_allocated_bytes.astype(float).max() / mib) or 1.0
    mem.set(ylabel="peak memory (MiB)", title="memory per phase", ylim=(0, top * 1.35))
    mem.legend(fontsize="small", loc="upper left", ncols=2)  # above the bars: ylim leaves room
    colors = table.verdict.map(VERDICT_COLOURS).fillna("tab:grey")
    tim.bar(list(x), table.time_s, color=colors)
    tim.set_xticks(list(x), table.phase, rotation=45, ha="right")
    tim.set(ylabel="time (s)", title="time per phase", ylim=(0, (table.time_s.max() or 1) * 1.35))
    tim.legend(handles=[Patch(color=c, label=v) for v, c in VERDICT_COLOURS.items()
                        if v in set(table.verdict)], title="verdict", fontsize="small",
               loc="upper left", ncols=3)
    return _done(fig, save)


def variant_tradeoff(table: pd.DataFrame, save: Path | None = None):
    """Peak memory against time per update for each measured variant, the control marked."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    rows = table[table.status == "measured"].reset_index(drop=True)
    for n, r in enumerate(rows.itertuples(), start=1):  # numbered points, names in the legend
        point = ax.scatter(r.time_per_update_s, r.peak_bytes / 2**20, s=60 if n > 1 else 140,
                           marker="o" if n > 1 else "*", label=f"{n}: {r.id}")
        ax.annotate(str(n), (r.time_per_update_s, r.peak_bytes / 2**20), fontsize="small",
                    xytext=(5, 3 + 7 * (n % 2)), textcoords="offset points",
                    color=point.get_facecolor()[0])
    ax.set(xlabel="time per update (s)", ylabel="peak memory (MiB)",
           title="memory variants (* = the control)")
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _done(fig, save)


def study_curves(curves: pd.DataFrame, evals: pd.DataFrame, trials: pd.DataFrame,
                 save: Path | None = None):
    """Training loss per trial with its evaluation points; a diverged trial ends in an x."""
    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    for t in trials.itertuples():
        label = f"#{t.id} lr={t.lr:g} seed={t.seed}"
        mine = curves[curves.trial == t.id]
        line, = train_ax.plot(mine.step, mine.loss.clip(upper=1e3), lw=1, label=label)
        if t.status == "diverged" and len(mine):
            train_ax.plot(mine.step.iloc[-1], min(mine.loss.iloc[-1], 1e3), "x", ms=10,
                          color=line.get_color())
        points = evals[(evals.trial == t.id) & (evals.scope != "full-best")]
        eval_ax.plot(points.step, points.loss, "o-", color=line.get_color(), label=label)
    diverged = (trials.status == "diverged").any()
    train_ax.set(xlabel="update", ylabel="training loss (log scale)", yscale="log",
                 title="training loss" + (" (x = diverged)" if diverged else ""))
    _plain_log_axis(train_ax.yaxis)
    train_ax.legend(fontsize="x-small")
    eval_ax.set(xlabel="update", ylabel="validation loss", title="evaluations (fixed steps)")
    eval_ax.legend(fontsize="x-small")
    return _done(fig, save)


def resume_overlay(details: dict, save: Path | None = None):
    """Loss of the uninterrupted run and of each resumed run, the resume points marked."""
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ref = pd.DataFrame(details["reference"])
    ax.plot(ref.step, ref.loss, "k-", lw=3, alpha=0.3, label="uninterrupted")
    for case, table in details.items():
        if not isinstance(table, pd.DataFrame):  # the references and the final weights
            continue
        ax.plot(table.step, table.loss_resumed, "o--", ms=4, label=f"resumed ({case})")
        ax.axvline(table.step.iloc[0] - 0.5, color="grey", ls=":", lw=1)
    ax.set(xlabel="update", ylabel="loss", title="resume: the curves must coincide")
    ax.legend(fontsize="small")
    return _done(fig, save)


def lr_summary(summary: pd.DataFrame, trials: pd.DataFrame, metric: str,
               save: Path | None = None):
    """Per learning rate: every seed's best value as a dot, the mean with the spread as a bar
    (only from two or more seeds: a `summary` without `best_std` has one seed each)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    done = trials.dropna(subset=["best_metric"])
    spread = "best_std" in summary
    if spread:
        ok = summary.dropna(subset=["best_mean"])
        ax.errorbar(ok.lr, ok.best_mean, yerr=ok.best_std.fillna(0), fmt="_", ms=18,
                    color="tab:blue", capsize=4, label="mean +/- std", zorder=1)
    ax.scatter(done.lr, done.best_metric, color="black", s=16, label="each seed", zorder=2)
    diverged = trials[trials.status == "diverged"]
    for n, t in enumerate(diverged.itertuples()):
        ax.axvline(t.lr, color="red", ls=":", lw=1, label="diverged trial" if n == 0 else None)
    ax.set(xlabel="learning rate (log scale)", ylabel=f"best {metric}",
           title="per learning rate" if spread else "per learning rate (one seed: no spread)")
    if len(done) or len(diverged):
        ax.set_xscale("log")
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no trial produced a value", ha="center", transform=ax.transAxes)
    return _done(fig, save)


def _loss_scale(ax, x: pd.Series, loss: pd.Series, smoothed: pd.Series) -> None:
    """A range test's y-limits from the curve before it diverged: the top 1.5x the smoothed
    start (above its lowest point), the bottom its lowest point shown with a margin - never
    below 0 unless a loss shown is (the task's own loss says whether it can be: minus a reward
    is, a cross-entropy is not). The losses above the top or not finite (the diverged tail)
    are red marks on the top edge, so the tail is shown without setting the scale."""
    finite = smoothed[np.isfinite(smoothed)]
    if finite.empty:
        top = float(loss[np.isfinite(loss)].median()) if np.isfinite(loss).any() else 1.0
    else:
        start = float(finite.iloc[: max(1, len(smoothed) // 10)].max())
        least = float(finite.min())
        top = max(start + abs(start) / 2, least + abs(least) / 10)
    shown = pd.concat([loss, smoothed])
    shown = shown[np.isfinite(shown) & (shown <= top)]
    low = float(shown.min()) if len(shown) else min(top, 0.0)
    top = top if top > low else low + max(abs(low), 1.0)
    bottom = low - (top - low) / 20
    ax.set_ylim(max(bottom, 0.0) if low >= 0 else bottom, top)
    off = ~np.isfinite(loss) | (loss > top)
    if off.any():  # on the top edge: x in data, y in axes units
        ax.plot(x[off], [1.0] * int(off.sum()), "^", color="tab:red", ms=6, clip_on=False,
                transform=ax.get_xaxis_transform(),
                label=f"loss off the scale (> {top:.3g} or not finite)")


def range_test(curve: pd.DataFrame, suggestion: float | None, grid: list[float],
               save: Path | None = None):
    """A range test's loss per rate (each update's and the smoothed), the suggestion and the
    rates the study then tries; the diverged tail marked, not setting the scale."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(curve.lr, curve.loss, lw=0.8, color="tab:gray", alpha=0.6, label="loss per update")
    ax.plot(curve.lr, curve.smoothed, lw=1.6, color="tab:blue", label="smoothed")
    if suggestion is not None:
        ax.axvline(suggestion, color="tab:green", lw=1.2, label=f"suggested {suggestion:g}")
    for n, lr in enumerate(lr for lr in grid if lr != suggestion):
        ax.axvline(lr, color="tab:green", ls=":", lw=1, label="also tried" if n == 0 else None)
    if len(curve):
        _loss_scale(ax, curve.lr, curve.loss.astype(float), curve.smoothed.astype(float))
    ax.set(xlabel="learning rate (log scale)", ylabel="training loss", xscale="log",
           title="learning-rate range test")
    ax.legend(fontsize="small")
    return _done(fig, save)
