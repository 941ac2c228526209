"""The notebooks, one entry each: its stem (`NN_name`, the .ipynb, its smoke YAML and its run
folder), its title, its key figures (label per figure, most important first), how its verdict is
explained in one sentence, and the module whose `run` and `save` it calls. Every other layer
knows a notebook through this registry, never by its stem as a string (`tests/test_layers.py`).

The registry imports no notebook module (their `run` and `save` load on first use), so a
notebook's parts (08 reads 03's, 06's and 09's folders) and the commands may use it. Each
entry names its notebook's parameter model (`parameters.py`); `entry.check(given)` checks by it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..base import frontend
from ..base.errors import WorkbookError, shorten
from ..base.frontend import word
from ..storage import runs
from . import parameters as models
from .parameters import NotebookParams

# (passed, key figures, the whole summary.json) -> the verdict's reason, one sentence
Why = Callable[[bool, dict, dict], str]


@dataclass(frozen=True)
class ReportTable:
    """A table of the notebook's folder the report shows: its heading, the CSV, the columns in
    order (None: all of them); an optional one is shown only when the notebook wrote it."""

    heading: str
    file: str
    columns: tuple[str, ...] | None = None
    optional: bool = False


@dataclass(frozen=True)
class ReportNote:
    """A sentence the report shows under a heading when the summary's figure `figure` is a
    dict holding `key` (why a part of the notebook did not run)."""

    heading: str
    figure: str
    key: str


@dataclass(frozen=True)
class NotebookEntry:
    stem: str  # NN_name: notebooks/NN_name.ipynb, notebooks/smoke/NN_name.yaml, its run folder
    title: str  # the report's heading
    module: str  # its entry module (a family: its package) with `run(params, out)`, `save(...)`
    key_figures: Mapping[str, str]  # figure name -> label, most important first
    why: Why
    parameters: type[NotebookParams]  # its parameters: names, types, defaults, ranges
    report: tuple[ReportTable | ReportNote, ...] = ()  # the tables the decision rests on

    def check(self, given: Mapping | NotebookParams) -> NotebookParams:
        """`given` (this notebook's parameters, or a mapping of some of them) checked by its
        model, defaults filled in."""
        if isinstance(given, self.parameters):
            return given
        return models.check([self.parameters], given, self.stem, owners)[0]

    @property
    def code(self) -> ModuleType:
        return importlib.import_module(f"{__package__}.{self.module}")

    @property
    def run(self) -> Callable:
        return self.code.run

    @property
    def save(self) -> Callable:
        return self.code.save


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _listed(items, empty="none") -> str:
    items = list(items or [])
    return ", ".join(map(str, items)) if items else empty



def _inspection_why(ok: bool, f: dict, summary: dict) -> str:
    flags = summary.get("flags") or []
    return (f"no flag on {f.get('examples', 0):,} examples ({f.get('num_outputs')} outputs, "
            f"expected initial loss {word(f.get('expected_initial_loss'))})" if ok else
            f"{len(flags)} flag{'s' * (len(flags) != 1)} raised: {_listed(flags)}")


INSPECTION = NotebookEntry(
    "01_inspect_examples", "01 Inspect examples", "inspection", why=_inspection_why,
    parameters=models.InspectionParams,
    key_figures={
        "flags": "flags raised", "examples": "examples", "num_outputs": "output classes / tokens",
        "expected_initial_loss": "expected initial loss (ln outputs)",
        "contributing_share": "share of positions that carry a target",
        "targets_per_example_mean": "targets per example (mean)",
        "zero_target_examples": "examples without a target",
        "targets_on_padding": "targets on padding", "targets_on_prompt": "targets on the prompt",
        "groups_crossing_splits": "groups in more than one split"})


def _overfit_why(ok: bool, f: dict, summary: dict) -> str:
    if ok and f.get("conclusive") is False:
        return (f"not conclusive: give it more updates - the loss fell from "
                f"{word(f.get('initial_loss'))} to {word(f.get('final_loss'))} in "
                f"{f.get('updates_run')} updates and is still falling (bar "
                f"{word(f.get('final_loss_bar'))}); {f.get('exact_examples')} of "
                f"{f.get('examples')} examples are reproduced exactly")
    if ok and f.get("final_reward") is not None:
        return (f"the mean reward rose from {word(f.get('initial_reward'))} to "
                f"{word(f.get('final_reward'))} in {f.get('updates_run')} updates on "
                f"{f.get('examples')} prompts: the policy learns its reward")
    if ok:
        return (f"the loss fell from {word(f.get('initial_loss'))} to "
                f"{word(f.get('final_loss'))} (below {word(f.get('final_loss_bar'))}) in "
                f"{f.get('updates_run')} updates and "
                f"{f.get('exact_examples')} of {f.get('examples')} examples are reproduced "
                "exactly")
    return (f"failed: {_listed(summary.get('failed'))}"
            + (f"; {summary['diagnosis']}" if summary.get("diagnosis") else ""))


OVERFIT = NotebookEntry(
    "02_overfit", "02 Overfit a tiny subset", "overfit", why=_overfit_why,
    parameters=models.OverfitParams,
    key_figures={
        "final_loss": "final loss on the subset", "final_loss_bar": "loss to fall below",
        "exact_examples": "examples reproduced exactly", "examples": "examples memorised",
        "initial_loss": "initial loss", "expected_initial_loss": "expected initial loss",
        "initial_loss_rule": "expected initial loss from", "finite": "loss finite throughout",
        "lr_diverges": "learning rate diverges", "lr": "learning rate", "lr_from": "lr from",
        "updates_run": "updates run", "updates": "updates planned",
        "update_by": "update made by", "loss_threshold": "loss threshold",
        "pair_accuracy": "pairs whose chosen answer scores higher",
        "mean_margin": "mean score margin, chosen - rejected"})


def _gates_why(ok: bool, f: dict, summary: dict) -> str:
    failed, gates = f.get("failed") or [], f.get("gates", 0)
    head = f"{gates - len(failed)} of {gates} gates passed" + (
        f" (failed: {_listed(failed)})" if failed else "") + (
        f", {len(f['warned'])} warned ({_listed(f['warned'])})" if f.get("warned") else "")
    if f.get("plan_refused"):
        return head + f"; the plan is refused: {f['plan_refused']}"
    need = f.get("plan_required_bytes")
    fits = f.get("plan_fits")
    device = f.get("device_memory_gib")
    on = f"the {device:g} GiB rental GPU" if device else "the rental GPU"
    plan = f"; the plan {f.get('plan')} needs {_gib(need)}" if need else ""
    if plan and f.get("plan_needs_sharding"):
        update = _gib(f.get("plan_update_required_bytes"))
        plan += (f" and fits no single {device:g} GiB GPU: its first update alone needs "
                 f"{update} (weights, gradients, optimizer state), so the campaign shards "
                 "it - 08 sizes FSDP2 over several GPUs")
    elif plan and fits is not None:
        plan += f" and {'fits' if fits else 'does not fit'} {on}"
    elif f.get("plan_unpredicted"):
        plan += (f"; the plan {f.get('plan')}: {_listed(f['plan_unpredicted'])} not "
                 "predicted, its fit not judged")
    elif plan:
        plan += " (no device memory given: fit not judged)"
    return head + plan


GATES = NotebookEntry(
    "03_phase_gates", "03 Phase gates", "gates", why=_gates_why,
    parameters=models.GatesParams,
    key_figures={
        "gates": "gates run", "failed": "gates failed", "warned": "gates warned",
        "plan_fits": "plan fits the rental GPU",
        "plan_unpredicted": "plan phases not predicted",
        "plan_needs_sharding": "plan needs sharding (its update fits no one GPU)",
        "plan_update_required_bytes": "plan's first update needs (with headroom)",
        "device_memory_gib": "rental GPU memory (GiB)",
        "plan": "plan (predicted, not run)", "plan_required_bytes": "plan needs (with headroom)",
        "plan_peak_bytes": "plan peak (predicted)", "ran_at": "gates ran at",
        "peak_allocated_bytes": "peak allocated in the gates", "peak_phase": "peak phase",
        "prediction_max_abs_error_pct": "prediction error, largest (%)",
        "prediction_notes": "prediction notes", "overheads": "CUDA overheads",
        "models": "model"},
    report=(ReportTable("Gate table", "gates.csv", (
        "phase", "micro_batch", "seq_len", "precision", "peak_allocated_bytes",
        "peak_reserved_bytes", "time_s", "verdict", "detail")),))


def _accounting_why(ok: bool, f: dict, summary: dict) -> str:
    parts = [("the loop's counts match the calculator", f.get("reconciled")),
             ("the loss is normalised over the update's targets", f.get("normalisation_ok")),
             ("the wrong normalisation is caught", f.get("wrong_normalisation_caught"))]
    if ok:
        return ", ".join(p for p, _ in parts) + (
            f" (largest gradient deviation {f['max_deviation']:.1e})"
            if isinstance(f.get("max_deviation"), float) else "")
    bad = [p.replace(" match", " do not match").replace(" is ", " is not ")
           for p, good in parts if good is False]
    return "; ".join(bad + [f"finding: {x}" for x in f.get("findings") or []]) or "failed"


ACCOUNTING = NotebookEntry(
    "04_batch_accounting", "04 Batch accounting", "accounting", why=_accounting_why,
    parameters=models.AccountingParams,
    key_figures={
        "reconciled": "loop counts match the calculator",
        "normalisation_ok": "loss normalised over the update's targets",
        "wrong_normalisation_caught": "wrong normalisation caught",
        "max_deviation": "largest gradient deviation (relative)", "findings": "findings",
        "warned": "warnings", "examples_per_update": "examples per update",
        "updates_per_pass": "updates per pass",
        "worked_example_updates": "updates in the worked example",
        "own_train_step_ok": "task's own train_step agrees",
        "own_step_loss_agrees": "task's own step loss agrees",
        "own_eval_ok": "task's own evaluation agrees"})


def _variants_why(ok: bool, f: dict, summary: dict) -> str:
    text = f"{f.get('measured')} of {f.get('variants')} variants measured" + (
        f" (not applicable here: {_listed(f.get('not_applicable'))})"
        if f.get("not_applicable") else "")
    if f.get("checkpointing_memory_ratio") is not None:
        text += (f"; activation checkpointing needs {f['checkpointing_memory_ratio']:.2f} "
                 "of the control's peak memory")
    return text if ok else "a measured variant gave a non-finite loss; " + text


VARIANTS = NotebookEntry(
    "05_memory_variants", "05 Memory variants", "variants", why=_variants_why,
    parameters=models.VariantsParams,
    key_figures={
        "measured": "variants measured", "variants": "variants",
        "not_applicable": "not applicable here", "changes_experiment": "change the experiment",
        "checkpointing_memory_ratio": "checkpointing: memory (x control)",
        "checkpointing_time_ratio": "checkpointing: time (x control)"})


def _study_why(ok: bool, f: dict, summary: dict) -> str:
    statuses = f.get("statuses") or {}
    done = ", ".join(f"{n} {s}" for s, n in statuses.items())
    if not ok:
        return f"trials: {done or 'none'}" + (
            "; the periodic validation curve says the evaluation repeats itself"
            if f.get("periodic_curve") else "") + (
            f"; no rate learns: the best validation loss does not clear chance "
            f"({f.get('chance_loss'):.4g})" if f.get("no_rate_learns") else "")
    text = f"{f.get('trials')} trials ({done}); best lr {f.get('best_lr'):g} " \
        f"({f.get('metric')} {f.get('best_metric'):.4g})" \
        if f.get("best_lr") is not None else f"{f.get('trials')} trials ({done})"
    warnings = f.get("warnings") or []
    return text + (f", provisional: {len(warnings)} warning"
                   f"{'s' * (len(warnings) != 1)} (see the finding)" if warnings else "")


STUDY = NotebookEntry(
    "06_lr_study", "06 Learning-rate study", "study", why=_study_why,
    parameters=models.StudyParams,
    key_figures={
        "finding": "finding", "supported_lr": "learning rate the study supports",
        "conclusive": "conclusive", "warnings": "warnings", "best_lr": "best learning rate",
        "best_metric": "best validation value", "metric": "metric",
        "best_metrics": "best trial's validation metrics",
        "control_lr": "control learning rate", "control_remains_best": "control still best",
        "best_at_edge": "best at the grid's edge", "still_improving": "trials still improving",
        "closing": "rates closing on the best", "rate_ignored": "optimizer ignores the rate",
        "schedule_reached": "share of its rate the schedule let a trial reach",
        "suggested_lr": "range test's suggestion", "extended": "rates the study added",
        "no_rate_learns": "no rate learns", "chance_loss": "chance (validation loss)",
        "trials": "trials", "statuses": "trial statuses", "seeds": "seeds", "lrs": "rates tried",
        "best_trial": "best trial", "best_checkpoint": "best checkpoint",
        "periodic_curve": "periodic validation curve"})


def _resume_why(ok: bool, f: dict, summary: dict) -> str:
    cases = f.get("cases") or []
    exact = sum(bool(c.get("exact")) for c in cases)
    caught = f.get("faults_caught") or {}
    text = (f"{exact} of {len(cases)} resume cases exact, tampered checkpoints "
            f"{'refused' if f.get('tampering_refused') else 'NOT refused'}, the archive "
            f"{'reloads identically' if f.get('archive_identical') else 'reloads DIFFERENTLY'}")
    named = [c for c in cases if c.get("data")]
    if named:  # the data's own words: where the resumed run read from, and why
        text += f"; {named[0]['case']}: {named[0]['data']}"
    if caught:
        text += f"; {sum(bool(v) for v in caught.values())} of {len(caught)} planted " \
            "faults caught"
        missed = [k for k, v in caught.items() if v is False]
        why = {"random states not restored": "this training draws no random numbers, "
               "e.g. no dropout", "checkpoint without optimizer state": "its optimizer "
               "keeps no state, e.g. plain SGD without momentum"}
        if missed:
            reasons = "; ".join(why.get(m, "the run does not depend on it") for m in missed)
            text += (f" (not caught: {_listed(missed)} - resuming without it changed "
                     f"nothing, so {reasons})")
    return text


RESUME = NotebookEntry(
    "07_resume_reload", "07 Resume and reload", "resume", why=_resume_why,
    parameters=models.ResumeParams,
    key_figures={
        "cases": "resume cases", "archive_identical": "archive reloads identically",
        "tampering_refused": "tampered checkpoints refused",
        "faults_caught": "planted faults caught (a no: the fault changed nothing here)"})


def _rental_why(ok: bool, f: dict, summary: dict) -> str:
    if not ok:
        return "no candidate fits any GPU of the sheet"
    gpus = f.get("recommended_gpus") or 1
    return (f"candidate {f.get('chosen')} on {gpus} x {f.get('recommended_gpu')} "
            f"({f.get('recommended_strategy')}); {f.get('fitting_rows')} of {f.get('rows')} "
            "configurations fit")


RENTAL = NotebookEntry(
    "08_rental_plan", "08 Rental plan", "rental", why=_rental_why,
    parameters=models.RentalParams,
    key_figures={
        "recommended_gpu": "recommended GPU", "recommended_gpus": "GPUs",
        "recommended_strategy": "strategy", "chosen": "candidate planned",
        "planned_lr": "learning rate planned", "study": "learning-rate study",
        "study_conclusive": "study conclusive", "rental_gpu": "GPU planned on",
        "plans_priced_on": "plans priced on", "scheduled": "variants scheduled (days: runs)",
        "fitting_rows": "configurations that fit", "rows": "configurations sized",
        "not_sized": "not sized", "sized_model": "model sized",
        "recommended_offer": "offer priced on", "recommended_spot_offer": "spot offer",
        "catalog": "price catalog", "speed_from": "speeds of the sheet's rows",
        "calibration": "speed calibration"},
    report=(
        ReportTable("Cheapest GPU that fits, per candidate", "cheapest.csv"),
        ReportTable("Selection sheet", "selection.csv", (
            "candidate", "gpu", "gpu_memory_gib", "strategy", "precision", "micro_batch",
            "accumulation", "activation_checkpointing", "required_gib", "fits",
            "time_per_update_s", "time_floored", "mfu", "speed_from", "budget_hours", "offer",
            "paid_gpus", "price_per_hour", "cost", "cost_low", "cost_high", "spot_offer",
            "spot_cost", "note")),
        ReportTable("Offers across providers", "offers.csv"),
        ReportTable("3, 7 and 30-day plans", "plan.csv", (
            "days", "priority", "variant", "candidate", "gpu", "repeats", "hours", "hours_low",
            "hours_high", "cost", "cost_low", "cost_high", "spot_cost", "offer", "price_from",
            "speed_from", "scheduled", "why_not"))))


def _parallel_why(ok: bool, f: dict, summary: dict) -> str:
    rules = summary.get("rules") or {}
    failing = [r for r, v in rules.items() if v == "fail"]
    caught = f.get("faults_caught") or {}
    shown = {k: v for k, v in caught.items() if v is not None}
    text = (f"{len(rules) - len(failing)} of {len(rules)} rules hold on "
            f"{f.get('replicas')} replicas" if not failing else
            f"{len(failing)} rules fail: {_listed(failing)}")
    if shown:
        text += (f"; {sum(bool(v) for v in shown.values())} of {len(shown)} planted faults "
                 "caught")
    fsdp = f.get("fsdp") or {}
    if fsdp.get("rules"):
        bad = [r for r, v in fsdp["rules"].items() if v == "fail"]
        text += "; FSDP2: " + (f"{len(bad)} rules fail ({_listed(bad)})" if bad else
                               f"all {len(fsdp['rules'])} rules hold")
        gap = fsdp.get("memory_max_abs_error_pct")
        if gap is not None:  # shown, not judged: what the sizing misses on this machine
            text += (", per-rank memory within 2% of the prediction" if gap < 2 else
                     f", per-rank memory up to {gap:.3g}% off the prediction")
    return text


PARALLEL = NotebookEntry(
    "09_data_parallel", "09 Data parallel under torchrun", "parallel", why=_parallel_why,
    parameters=models.ParallelParams,
    key_figures={
        "rules_failing": "rules failing", "replicas": "replicas",
        "faults_caught": "planted faults caught",
        "faults_not_demonstrable": "faults not demonstrable here",
        "gradient_max_relative_deviation": "gradient deviation against one process (relative)",
        "all_reduce_median_s": "all-reduce, median", "fsdp": "FSDP2"},
    report=(
        ReportTable("Multi-host rules", "rules.csv", ("rule", "verdict", "measured",
                                                      "remediation")),
        # the FSDP2 launches ran
        ReportTable("Rules under FSDP2 sharding", "fsdp_rules.csv", (
            "rule", "verdict", "measured", "remediation"), optional=True),
        ReportTable("Planted FSDP faults", "fsdp_planted_faults.csv", optional=True),
        # FSDP2 cannot run the model as it is written
        ReportNote("Rules under FSDP2 sharding", "fsdp", "not_run")))


ENTRIES = (INSPECTION, OVERFIT, GATES, ACCOUNTING, VARIANTS, STUDY, RESUME, RENTAL, PARALLEL)


def stems() -> list[str]:
    """The notebooks' stems, in order."""
    return [e.stem for e in ENTRIES]


def owners(name: str) -> list[str]:
    """The notebooks that take the parameter `name`."""
    return [e.stem for e in ENTRIES if name in e.parameters.names()]


def entry(stem: str) -> NotebookEntry:
    """The entry of the notebook `stem` (NN_name)."""
    for e in ENTRIES:
        if e.stem == stem:
            return e
    raise WorkbookError(f"unknown notebook {stem!r}", f"use one of {stems()}")


def entry_of(folder: str | Path) -> NotebookEntry | None:
    """The entry whose notebook wrote `folder`: a pilot's `<run>/NN_name`, or a notebook's own
    `<timestamp>-NN_name[-n]`; None for another folder."""
    name = runs.notebook_of(folder)
    return next((e for e in ENTRIES if name.startswith(e.stem)), None)


def title(stem: str) -> str:
    found = entry_of(stem)
    return found.title if found else stem


def labels(stem: str) -> Mapping[str, str]:
    """A notebook's key-figure labels, most important first (none for an unknown stem)."""
    found = entry_of(stem)
    return found.key_figures if found else {}


def explain(stem: str, summary: dict) -> str:
    """Why the notebook `stem` reached the verdict of its `summary` (a summary.json), in one
    sentence; "" for a folder no notebook wrote. An error in an explanation is raised."""
    found = entry_of(stem)
    if found is None:
        return ""
    if summary.get("verdict") == "error":  # it stopped: the error is the why, not its figures
        return shorten(str(summary.get("error") or "the notebook stopped with an error"), 300)
    return found.why(summary.get("verdict") == "pass", summary.get("figures") or {}, summary)


def summary_of(run_dir: str | Path, stem: str) -> dict | None:
    """The summary.json the notebook `stem` wrote in the run folder `run_dir`
    (`runs.read_summary`: None when it wrote none), a verdict "unreadable" when it cannot be
    read (never taken for a pass)."""
    try:
        return runs.read_summary(Path(run_dir) / stem)
    except WorkbookError:
        return {"verdict": "unreadable", "error": f"{stem}/summary.json cannot be read"}


def verdict_line(out_dir: str | Path) -> str:
    """A notebook's last line: its verdict and why (`runs.verdict_line` with `explain`)."""
    return runs.verdict_line(out_dir, explain)


def key_figures(stem: str, figures: dict) -> list[tuple[str, str]]:
    """(label, value in words) of a notebook's key figures, most important first."""
    return frontend.key_figures(figures, labels(stem))


def figure_table(figures: dict, stem: str):
    """A notebook's key figures as a table of words (`frontend.figure_table`)."""
    return frontend.figure_table(figures, labels(stem))
