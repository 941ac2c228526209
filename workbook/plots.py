"""Figures for the notebooks; each returns a matplotlib Figure and saves it when asked."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd


def _done(fig, save: Path | None):
    fig.tight_layout()
    if save is not None:
        fig.savefig(save, dpi=100)
    plt.close(fig)
    return fig


def loss_curve(steps: pd.DataFrame, *, threshold: float | None = None,
               expected_initial: float | None = None, title: str = "training loss",
               save: Path | None = None):
    """Loss per update, with the threshold and the expected initial loss as reference lines."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps.step, steps.loss, label="loss per update")
    if threshold is not None:
        ax.axhline(threshold, color="green", ls="--", lw=1, label=f"threshold {threshold}")
    if expected_initial is not None:
        ax.axhline(expected_initial, color="grey", ls=":", lw=1,
                   label=f"ln(outputs) = {expected_initial:.2f}")
    ax.set(xlabel="update", ylabel="loss", title=title, yscale="log")
    ax.legend(fontsize="small")
    return _done(fig, save)


def coverage_histogram(coverage: pd.DataFrame, save: Path | None = None):
    """How many targets each example contributes to the loss, per split."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for split, rows in coverage.groupby("split", sort=False):
        ax.hist(rows.targets, bins=range(0, int(coverage.targets.max()) + 2), alpha=0.5,
                label=split, density=True)
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
    mem.set(ylabel="MiB", title="memory per phase")
    mem.legend(fontsize="small")
    colors = table.verdict.map({"pass": "tab:green", "warn": "tab:orange", "fail": "tab:red"})
    tim.bar(list(x), table.time_s, color=colors)
    tim.set_xticks(list(x), table.phase, rotation=45, ha="right")
    tim.set(ylabel="seconds", title="time per phase (colour = verdict)")
    return _done(fig, save)


def variant_tradeoff(table: pd.DataFrame, save: Path | None = None):
    """Peak memory against time per update for each measured variant, the control marked."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    rows = table[table.status == "measured"]
    ax.scatter(rows.time_per_update_s, rows.peak_bytes / 2**20, color="tab:blue")
    for r in rows.itertuples():
        ax.annotate(r.id, (r.time_per_update_s, r.peak_bytes / 2**20), fontsize="small",
                    xytext=(4, 2), textcoords="offset points")
    control = rows.iloc[0]
    ax.scatter([control.time_per_update_s], [control.peak_bytes / 2**20], s=160,
               facecolors="none", edgecolors="red", label="control")
    ax.set(xlabel="time per update (s)", ylabel="peak memory (MiB)", title="memory variants")
    ax.legend(fontsize="small")
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
    train_ax.set(xlabel="update", ylabel="training loss", yscale="log",
                 title="training loss (x = diverged)")
    eval_ax.set(xlabel="update", ylabel="validation loss", title="evaluations (fixed steps)")
    eval_ax.legend(fontsize="x-small")
    return _done(fig, save)


def resume_overlay(details: dict, save: Path | None = None):
    """Loss of the uninterrupted run and of each resumed run, the resume points marked."""
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ref = pd.DataFrame(details["reference"])
    ax.plot(ref.step, ref.loss, "k-", lw=3, alpha=0.3, label="uninterrupted")
    for case, table in details.items():
        if case in ("reference", "weights"):
            continue
        ax.plot(table.step, table.loss_resumed, "o--", ms=4, label=f"resumed ({case})")
        ax.axvline(table.step.iloc[0] - 0.5, color="grey", ls=":", lw=1)
    ax.set(xlabel="update", ylabel="loss", title="resume: the curves must coincide")
    ax.legend(fontsize="small")
    return _done(fig, save)


def lr_summary(summary: pd.DataFrame, trials: pd.DataFrame, metric: str,
               save: Path | None = None):
    """Per learning rate: every seed's best value as a dot, the mean with the spread as a bar."""
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    done = trials.dropna(subset=["best_metric"])
    ax.scatter(done.lr, done.best_metric, color="grey", s=14, label="each seed")
    ok = summary.dropna(subset=["best_mean"])
    ax.errorbar(ok.lr, ok.best_mean, yerr=ok.best_std.fillna(0), fmt="o", color="tab:blue",
                capsize=4, label="mean +/- std")
    for t in trials[trials.status == "diverged"].itertuples():
        ax.axvline(t.lr, color="red", ls=":", lw=1)
    ax.set(xscale="log", xlabel="learning rate", ylabel=f"best {metric}",
           title="per learning rate (red: a diverged trial)")
    ax.legend(fontsize="small")
    return _done(fig, save)
