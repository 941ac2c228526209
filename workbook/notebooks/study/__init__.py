"""Notebook 06: a learning-rate comparison as a tracked study. Without a grid, a range test on
the task's own update chooses it (`range_test`). The design is written before the first trial
and cannot change afterwards; every trial keeps its row in the ledger, diverged ones included;
evaluation runs at fixed step intervals; each trial keeps its top-N checkpoints and the best is
chosen afterwards; a best rate at the grid's edge extends it by the design's own rule, within
its budget of extra trials (`support`)."""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ...base.errors import WorkbookError
from ...contract.data import Item, collate_items, prepare
from ...contract.outputs import eval_mode
from ...contract.targets import contributes
from ...contract.task import Task, load_recorded_task, load_task
from ...storage import schemas
from ...storage.artifacts import replace_file
from ...storage.files import write_json
from ...storage.ledger import Ledger
from ...storage.processes import command_line, task_args
from ...storage.records import EvalRecord, StepRecord
from ...storage.runs import seal_file, shown
from ...training import checkpoint as ckpt
from ...training.devices import resolve_device
from ...training.evaluation import evaluate
from ...training.loop import Stepper, TrainConfig, loss_rise, train
from ..parameters import StudyParams
from ..registry import STUDY
from . import range_test
from .chance import Chance, chance_loss
from .design import DESIGN, StudyDesign, design_from_params, read_design
from .support import extension_trials, findings, next_trials


def eval_sample(task: Task, val: list[Item], raw: list[dict], size: int, seed: int = 0
                ) -> tuple[list[Item], pd.DataFrame]:
    """A fixed random sample of the validation set, and its skew against the full set
    (class shares, lengths)."""
    if not size or size >= len(val):
        return val, pd.DataFrame()
    picked = sorted(random.Random(seed).sample(range(len(val)), size))
    sample = [val[i] for i in picked]
    rows = []
    lengths = pd.Series([task.length(it.tensors) for it in val])
    rows.append({"property": "mean length", "full": round(lengths.mean(), 3),
                 "sample": round(lengths[picked].mean(), 3)})
    full = task.target_kind.class_shares(task, raw)
    if full is not None:
        part = task.target_kind.class_shares(task, [raw[i] for i in picked])
        part = part if part is not None else pd.Series(dtype=float)
        for name in full.index:
            rows.append({"property": f"share of {name}", "full": round(full[name], 4),
                         "sample": round(part.get(name, 0.0), 4)})
    skew = pd.DataFrame(rows)
    skew["difference"] = (skew["sample"] - skew["full"]).round(4)
    return sample, skew


def periodicity(steps: list[int], values: list[float], period_updates: int,
                threshold: float = 0.6) -> dict:
    """Does the validation curve repeat every pass? The changes between evaluations are
    correlated with the changes one period later; a strong correlation suggests training data
    that is not shuffled or evaluation data that overlaps training."""
    if len(steps) < 3:
        return {"tested": False, "reason": "fewer than 3 evaluations"}
    interval = steps[1] - steps[0]
    lag = round(period_updates / interval) if interval else 0
    diffs = pd.Series(values).diff().dropna().reset_index(drop=True)
    if lag < 1 or len(diffs) < 2 * lag + 2:
        return {"tested": False, "reason": f"needs at least two passes of evaluations "
                f"({2 * lag + 3} at this interval), has {len(steps)}"}
    corr = float(diffs.autocorr(lag))
    return {"tested": True, "lag_evaluations": lag, "autocorrelation": round(corr, 3),
            "periodic": bool(corr > threshold)}


def trial_params(text: Any, where: Any) -> dict:
    """A trial's parameters as the ledger holds them (JSON {"lr", "seed"}), checked."""
    fix = "the ledger was edited; start a new study (a new out_dir)"
    data = schemas.parse_json(str(text), where, "trial parameters", fix)
    return schemas.check(schemas.TrialParams, data, where, "trial's parameters", fix).model_dump()


class Study:
    """A study folder: `design.json`, `ledger.sqlite`, and `trials/<id>/` for each trial."""

    def __init__(self, folder: str | Path, design: StudyDesign | None = None,
                 task: str | None = None, task_options: dict | None = None,
                 sweep: range_test.RangeSettings | None = None):
        """A new study from its `design`, or (design None) an existing one reopened: then the caller
        names the task (`task`, `task_options`), which must be the one design.json records - a
        task path read from a folder is never imported. A design without rates gets them from
        a range test (`sweep`'s settings, else the defaults) before it is written; a study
        reopened with such a design keeps the rates its range test chose."""
        self.folder = Path(folder)
        path = self.folder / DESIGN
        self.range_test = range_test.load(self.folder)
        if path.exists():
            stored = read_design(path)
            if design is not None and not design.lrs:
                design = replace(design, lrs=stored.lrs)
            if design is not None and asdict(design) != asdict(stored):
                changed = sorted(k for k, v in asdict(design).items() if asdict(stored)[k] != v)
                raise WorkbookError(f"study {stored.name!r} in {self.folder} was planned before "
                                    f"its first trial; the design cannot change ({changed})",
                                    "start a new study (a new out_dir) for a new design")
            self.design = stored
        elif design is None:
            raise WorkbookError(f"{self.folder} holds no study (no {DESIGN})",
                                "create the study with its design first (notebook 06)")
        else:
            self.design = design
        self.task = load_task(design.task, **design.task_options) if design is not None else \
            load_recorded_task(asdict(self.design), task, task_options, f"study {self.folder}")
        data = prepare(self.task)
        splits = self.raw = data.raw
        self.train_items, self.val_items = data.train, data.validation
        self.design.validate(self.task, self.val_items)
        if not self.design.lrs:  # the rates from a range test, saved before the design
            settings = (sweep or range_test.RangeSettings(
                seed=self.design.seeds[0], device=self.design.device)).check()
            self.folder.mkdir(parents=True, exist_ok=True)
            self.design.lrs = self._rates(settings)
        self.sample, self.skew = eval_sample(self.task, self.val_items, splits["validation"],
                                             self.design.eval_sample)
        self.sampled = len(self.sample) < len(self.val_items)
        if not path.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            write_json(path, asdict(self.design))  # written before any trial starts
            seal_file(path)
        self.ledger = Ledger(self.folder / "ledger.sqlite")
        self.ledger.add_study(self.design.name, str(path), self.design.notes)
        self._clean_partials()

    def _rates(self, settings: range_test.RangeSettings) -> list[float]:
        """The grid around the range test's suggestion (the test run now, or the one this
        folder holds); five rates a decade apart (`range_test.fallback_grid`) when it suggests
        none."""
        if self.range_test is None:
            self.range_test = range_test.sweep(self.task, self.train_items, self.design.shape,
                                               settings)
            if self.range_test.rate_ignored:  # one trial: what it learns, against chance
                self.range_test.grid = [self.task.lr or self.range_test.optimizer_lr or 1e-3]
                self.range_test.said += f"; the study runs one trial, at lr " \
                    f"{self.range_test.grid[0]:g}, to see what it learns"
            elif self.range_test.suggestion is None:
                rates, said = range_test.fallback_grid(self.task, self.range_test)
                self.range_test.grid = rates
                self.range_test.said += f"; the study tries {said}"
            else:
                range_test.with_own_rate(self.range_test, self.task.lr)
            self.range_test.save(self.folder)
        return list(self.range_test.grid)

    def _clean_partials(self) -> None:
        """Half-written checkpoint folders of interrupted trials are never kept (they were never
        recorded in the ledger, so nothing points at them)."""
        trials = self.ledger.frame("trials")
        for tid in trials.id[trials.status == "interrupted"]:
            for partial in (self.folder / "trials" / str(tid)).glob(".*.partial-*"):
                shutil.rmtree(partial, ignore_errors=True)

    def repro(self, lr: float, seed: int, repeats: int | None = None) -> str:
        cmd = [shown(sys.executable), "-m", "workbook", "trial", "--study",
               shown(self.folder, in_run=False),
               *task_args(self.design.task, self.design.task_options), "--lr", repr(lr),
               "--seed", str(seed)]
        return command_line(cmd + (["--repeats", str(repeats)] if repeats else []))

    def run_all(self, progress: bool = False) -> list[int]:
        """Run every planned trial not yet run, then, while the best rate sits at an edge of
        the rates tried, the next rate beyond it (`support.next_trials`, within the design's
        `extra_trials`); a diverged or failed trial does not stop the rest."""
        planned = self.design.trials() + extension_trials(self.trial_table(), self.design)
        ran = self._run_missing(planned, progress)
        while more := next_trials(self.trial_table(), self.design, self.supported()):
            ran += self._run_missing(more, progress)
        return ran

    def _run_missing(self, planned: list[dict], progress: bool) -> list[int]:
        """Run the `planned` trials not yet run. An interrupted trial is not done: it runs again
        as a new trial that repeats it (the interrupted row and its checkpoints stay)."""
        trials = list(self.trial_table().itertuples())
        done = {(t.lr, t.seed) for t in trials if t.status != "interrupted"}
        interrupted = {(t.lr, t.seed): int(t.id) for t in trials if t.status == "interrupted"}
        return [self.run_trial(t["lr"], t["seed"], interrupted.get((t["lr"], t["seed"])),
                               progress=progress)
                for t in planned if (t["lr"], t["seed"]) not in done]

    def run_trial(self, lr: float, seed: int, repeats: int | None = None,
                  progress: bool = False) -> int:
        """One trial, recorded from its first step; returns its id."""
        if not lr > 0:
            raise WorkbookError(f"learning rate {lr} is not positive", "give a positive lr")
        design, ledger = self.design, self.ledger
        tid = ledger.start_trial(design.name, {"lr": lr, "seed": seed},
                                 self.repro(lr, seed, repeats), repeats)
        folder = self.folder / "trials" / str(tid)
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            raise WorkbookError(f"trial folder {folder} already exists but the ledger does not "
                                "know it", "the study folder was edited; start a new study (a "
                                "new out_dir)") from None
        cfg = TrainConfig(
            design.shape, updates=design.updates, lr=lr, seed=seed, device=design.device,
            eval_every=design.eval_every, eval_batch=design.eval_batch, progress=progress)
        pending: list[dict] = []
        losses: list[float] = []  # every update's, for the divergence rule
        kept: list[tuple[float, int, Path]] = []  # (metric, step, path) of checkpoints on disk
        best: list = [None, None, None]  # metric, step, path

        def on_update(record: StepRecord, stepper: Stepper, *_) -> str | None:
            given = stepper.optimizer.param_groups[0].get("initial_lr") or record.lr
            pending.append({**{k: getattr(record, k) for k in
                               ("step", "loss", "lr", "examples", "targets", "time_s")},
                            "scheduled": record.lr / given if given else None})
            losses.append(record.loss)
            if not math.isfinite(record.loss):
                return f"non-finite loss ({record.loss}) at update {record.step}"
            return loss_rise(losses, design.divergence_multiple) or None

        def on_eval(record: EvalRecord, stepper: Stepper) -> None:
            ledger.add_steps(tid, pending)
            pending.clear()
            scope = "sample" if self.sampled else "full"
            ledger.add_eval(tid, record.step, scope, record.loss,
                            {**record.metrics, **{f"averaged_model.{k}": v for k, v in
                                                  record.averaged.items()}},
                            record.per_class)  # the task's averaged model beside the model
            self._save_predictions(stepper.model, folder, record.step)
            value = record.loss if design.metric == "loss" else record.metrics[design.metric]
            if not math.isfinite(value):
                return
            path = folder / f"step-{record.step:06d}"
            ckpt.save_checkpoint(path, stepper.model, stepper.optimizer, stepper.scheduler,
                                 stepper.scaler, {"step": record.step, "trial": tid},
                                 {"study": design.name, "lr": lr, "seed": seed},
                                 own=self.task.save_state,  # the task's format when it has
                                 averaged=stepper.averaged)  # one
            ledger.add_checkpoint(tid, record.step, str(path.relative_to(self.folder)), value)
            kept.append((value, record.step, path))
            if design.better(value, best[0]):
                best[:] = [value, record.step, path]
                ledger.set_best(tid, record.step, value, str(path.relative_to(self.folder)))
            self._prune(tid, kept, record.step)

        try:
            result = train(self.task, self.train_items, cfg, val_items=self.sample,
                           on_update=on_update, on_eval=on_eval)
        except Exception as exc:  # recorded, and the study goes on
            ledger.add_steps(tid, pending)
            ledger.end_trial(tid, "failed", f"{type(exc).__name__}: {exc}"[:500],
                             pending[-1]["step"] if pending else None)
            return tid
        ledger.add_steps(tid, pending)
        last = result.steps[-1].step if result.steps else None
        if result.stop_reason:
            ledger.end_trial(tid, "diverged", result.stop_reason, last)
        else:
            ledger.end_trial(tid, "finished", "", last)
        if best[2] is not None and self.sampled:
            self._full_evaluation(tid, best[2], int(best[1]))
        return tid

    def _prune(self, tid: int, kept: list, latest: int) -> None:
        """Keep the top-N checkpoints of this trial by the metric, and the latest; remove the
        rest - only files this trial recorded, inside this trial's folder."""
        design = self.design
        ranked = sorted(kept, key=lambda k: k[0], reverse=design.mode == "max")
        keep = {k[1] for k in ranked[: design.top_n]} | {latest}
        mine = self.folder / "trials" / str(tid)
        for entry in list(kept):
            value, step, path = entry
            if step not in keep and path.parent == mine:
                shutil.rmtree(path)
                self.ledger.drop_checkpoint(tid, step)
                kept.remove(entry)

    def _save_predictions(self, model: torch.nn.Module, folder: Path, step: int) -> None:
        """Predictions for a fixed selection of validation examples, for later reading: the
        argmax at every target position (teacher forcing; regression: the output values), in one
        forward pass."""
        items = self.val_items[: self.design.prediction_examples]
        if not items:
            return
        batch = collate_items(self.task, items).to(resolve_device(self.design.device)).tensors
        labels = self.task.targets(batch["labels"])
        with eval_mode(model):
            predicted = self.task.predicted(self.task.forward(model, batch), labels)
        rows = []
        for b, it in enumerate(items):
            keep = contributes(labels[b])
            rows.append({"step": step, "example": it.id,
                         "target": self.task.decode(labels[b][keep].reshape(-1).tolist()),
                         "prediction": self.task.decode(predicted[b][keep].reshape(-1)
                                                        .tolist())})
        path = folder / "predictions.jsonl"  # appended whole: a full disk truncates no line
        before = path.read_bytes() if path.exists() else b""
        replace_file(path, before + "".join(json.dumps(r) + "\n" for r in rows).encode(),
                     "predictions")

    def _full_evaluation(self, tid: int, path: Path, step: int) -> None:
        """The best checkpoint of a trial evaluated on the whole validation set."""
        model = self.task.build_model()
        ckpt.load_checkpoint(path, model, restore_rng=False, own=self.task.restore_state)
        device = resolve_device(self.design.device)
        record = evaluate(self.task, model.to(device), self.val_items, self.design.eval_batch,
                          device, step)
        self.ledger.add_eval(tid, step, "full-best", record.loss, record.metrics,
                             record.per_class)

    # --- reading the study --------------------------------------------------------------
    def trial_table(self) -> pd.DataFrame:
        trials = self.ledger.frame("trials")
        params = pd.DataFrame([trial_params(p, f"trial {tid} in {self.ledger.path}")
                               for tid, p in zip(trials.id, trials.params, strict=True)],
                              index=trials.index, columns=["lr", "seed"])
        table = pd.concat([trials[["id"]], params, trials.drop(columns=["id", "params"])],
                          axis=1)
        return table[["id", "lr", "seed", "status", "stop_reason", "stop_step", "best_step",
                      "best_metric", "best_checkpoint", "repeats", "repro"]]

    def evals(self) -> pd.DataFrame:
        return self.ledger.frame("evals")

    def curves(self) -> pd.DataFrame:
        return self.ledger.frame("steps")

    def best(self) -> dict | None:
        """The study's best checkpoint, chosen after all trials by the planned metric."""
        trials = self.trial_table().dropna(subset=["best_metric"])
        if trials.empty:
            return None
        row = trials.sort_values("best_metric", ascending=self.design.mode == "min",
                                 kind="stable").iloc[0]
        return row.to_dict()

    def chance(self) -> Chance:
        """The validation loss of a constant prediction on the evaluated examples (`chance`)."""
        if not hasattr(self, "_chance"):
            self._chance = chance_loss(self.task, self.sample, self.design.eval_batch,
                                  resolve_device(self.design.device))
        return self._chance

    def supported(self) -> dict[str, Any]:
        """`support.findings` for this study: its best validation loss against chance, its
        validation curves (the planned metric per trial and evaluation) for the ranking."""
        evals = self.evals()
        evals = evals[evals.scope != "full-best"]  # the examples chance is measured on
        best_loss = float(evals.loss.min()) if len(evals) else None
        metric = self.design.metric
        value = evals.loss if metric == "loss" else evals.metrics.map(
            lambda text: json.loads(text).get(metric, math.nan))
        curves = pd.DataFrame({"trial": evals.trial, "step": evals.step,
                               "value": value.astype(float)}).dropna()
        # the schedule's largest factor per trial: the share of its rate it ever ran at
        reached = self.curves().dropna(subset=["scheduled"]).groupby("trial").scheduled.max()
        return findings(self.trial_table(), self.design, self.chance(), best_loss, curves,
                        self.range_test, reached.to_dict())

    def lr_summary(self) -> pd.DataFrame:
        """Per learning rate: every seed's best metric, and their mean; the spread (std, min,
        max) only when a learning rate has two or more seeds with a value - one seed has no
        spread, and none is shown."""
        return lr_summary(self.trial_table())

    def study_table(self) -> pd.DataFrame:
        """The spreadsheet view: one row for the study."""
        best = self.best() or {}
        return pd.DataFrame([{
            "study": self.design.name, "config": shown(self.folder / DESIGN),
            "notes": self.design.notes,
            "trials": len(self.trial_table()), "metric": self.design.metric,
            "best_value": best.get("best_metric"), "best_trial": best.get("id"),
            "best_checkpoint": best.get("best_checkpoint"), "repro": best.get("repro")}])

    def periodicity(self) -> pd.DataFrame:
        """The periodicity check on every trial's validation curve (one pass = a period)."""
        per_pass = math.ceil(len(self.train_items) / self.design.shape.examples_per_update)
        evals = self.evals()
        rows = []
        for tid, rows_ in evals[evals.scope != "full-best"].groupby("trial"):
            rows.append({"trial": tid, **periodicity(rows_.step.tolist(), rows_.loss.tolist(),
                                                     per_pass)})
        return pd.DataFrame(rows)


def lr_summary(trials: pd.DataFrame) -> pd.DataFrame:
    """`Study.lr_summary` from a trial table (id, lr, seed, status, best_metric)."""
    summary = trials.groupby("lr").agg(
        trials=("id", "count"), seeds=("seed", lambda s: sorted(s.tolist())),
        statuses=("status", lambda s: ", ".join(sorted(set(s)))),
        seeds_with_value=("best_metric", "count"), best_mean=("best_metric", "mean"),
        best_std=("best_metric", "std"), best_min=("best_metric", "min"),
        best_max=("best_metric", "max")).reset_index()
    if not (summary.seeds_with_value >= 2).any():  # one seed each: a mean of one value, no spread
        summary = summary.drop(columns=["best_std", "best_min", "best_max"])
    return summary


def lr_figure(study: Study, save: Path | None = None):
    """`plots.lr_summary` for this study: mean +/- std bars only from two or more seeds; with
    one seed each, the dots alone, and the title says so."""
    from .. import plots

    return plots.lr_summary(study.lr_summary(), study.trial_table(), study.design.metric,
                            save=save)


def run(params: StudyParams | Mapping[str, Any], out_dir: Path, progress: bool = False) -> Study:
    """Notebook 06 from its parameters: without `lrs`, the range test (`range_*`) and its grid;
    the design written to `out_dir`/study before any trial, then every trial run (a study
    folder that already holds them is resumed, never overwritten)."""
    params = STUDY.check(params)
    design = design_from_params(params)
    sweep = range_test.RangeSettings(params.range_min_lr, params.range_max_lr,
                                     params.range_updates, seed=design.seeds[0],
                                     device=design.device)
    study = Study(out_dir / "study", design, sweep=sweep)
    study.run_all(progress=progress)
    return study


def save(study: Study, out_dir: Path) -> str:
    """The study's tables and `summary.json`. The verdict fails when a trial failed (raised),
    a validation curve looks periodic, or every trial diverged (nothing was learned to compare:
    the range is wrong, often a typo in the task's lr); one diverged trial is a result, not a
    failure; so does "no rate learns" (the best validation loss within `chance.MARGIN` of
    chance). `findings` goes into the figures: a best lr at the edge of the grid or a best
    trial still improving at its last update are warnings (the result is provisional), never
    a failure; the range test's suggestion and sentence too, when it chose the grid."""
    from ...storage.runs import save_table, write_summary

    trials = study.trial_table()
    period = study.periodicity()
    save_table(study.study_table(), out_dir, "study_table")
    save_table(trials, out_dir, "trials")
    save_table(study.lr_summary(), out_dir, "lr_summary")
    save_table(period, out_dir, "periodicity")
    periodic = bool(period.get("periodic", pd.Series(dtype=bool)).fillna(False).any())
    best = study.best() or {}
    found = study.supported()
    tested = study.range_test
    # every metric of the best trial on the whole validation split (a reward model's accuracy
    # and margin of chosen over rejected beside its loss)
    full = study.evals().query("scope == 'full-best' and trial == @best.get('id')")
    figures = {"best_metrics": {k: round(float(v), 4) for k, v in json.loads(
                   full.metrics.iloc[-1]).items()} if len(full) else None,
               "trials": len(trials), "statuses": trials.status.value_counts().to_dict(),
               "best_trial": best.get("id"), "best_lr": best.get("lr"),
               "best_metric": best.get("best_metric"), "metric": study.design.metric,
               "best_checkpoint": best.get("best_checkpoint"), "periodic_curve": periodic,
               "control_lr": study.design.lrs[0],
               "control_remains_best": best.get("lr") == study.design.lrs[0],
               "suggested_lr": tested and tested.suggestion,
               "range_test": tested and tested.said,
               **{k: found[k] for k in ("seeds", "lrs", "extended", "extra_trials",
                                        "best_at_edge", "still_improving", "closing",
                                        "rate_ignored", "schedule_reached", "warnings",
                                        "conclusive", "no_rate_learns", "chance_loss",
                                        "supported_lr", "finding")}}
    all_diverged = bool(len(trials)) and bool((trials.status == "diverged").all())
    verdict = "fail" if (trials.status == "failed").any() or periodic or all_diverged \
        or found["no_rate_learns"] else "pass"
    write_summary(out_dir, verdict, figures, study=study.design.name)
    return verdict
