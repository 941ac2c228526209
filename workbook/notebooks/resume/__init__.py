"""Notebook 07: exact resume. A run is described by a recipe (task, options, data, config); it
checkpoints its full state between updates, and a NEW process continues from a checkpoint. The
two continuations are compared update by update: loss, learning rate, the examples consumed, and
the final parameters (bit-identical on the CPU)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load_file

from ...base.errors import WorkbookError, child_error, shorten
from ...contract.data import Item, epoch_updates, prepare
from ...contract.pipeline import DataPosition, open_pipeline
from ...contract.task import Task, load_task
from ...storage import schemas
from ...storage.artifacts import copy_folder, reseal
from ...storage.processes import fresh_process, task_args, workbook_command
from ...storage.records import StepRecord
from ...storage.schemas import Index, Name, Options
from ...training import checkpoint as ckpt
from ...training.deviation import difference_by_name
from ...training.loop import (
    Position,
    Stepper,
    TrainConfig,
    UpdateShape,
    averaged_model,
    build_stepper,
    make_sampler,
    train,
)
from ..parameters import ResumeParams
from ..registry import RESUME
from .archive import reload_in_new_process, write_archive
from .position import (
    global_seed,
    pass_orders,
    position_before,
    random_data,
    repeated_pass,
    repeats,
    stated_length,
    where_from,
)
from .stream_state import probe_pipeline
from .undeclared import undeclared_state

# planted resume bugs, to show what the check catches ("carried": a task's Task.state only,
# "averaged_model": a task's Task.averaged_model only)
FAULTS = ("optimizer", "sampler", "rng", "carried", "averaged_model")
StoredConfig = schemas.derived(TrainConfig)  # TrainConfig's fields as a recipe stores them


class Recipe(schemas.Closed):
    """A recipe as `recipe` writes it: everything a new process needs to rebuild a run."""

    task: Name
    task_options: Options = {}
    train_limit: Index = 0
    config: StoredConfig


def recipe(task: str, task_options: dict, cfg: TrainConfig, train_limit: int = 0) -> dict:
    """Everything a new process needs to rebuild the run."""
    return {"task": task, "task_options": dict(task_options), "train_limit": train_limit,
            "config": asdict(cfg)}


def rebuild(spec: dict, task: Task | None = None, source: Any = "the recipe"
            ) -> tuple[Task, list[Item], TrainConfig]:
    """The task, training items and configuration of a recipe. A recipe read from a checkpoint
    comes with the `task` its user named (`load_recorded_task`); only a recipe built in this
    process may name the task to load."""
    spec = check_recipe(spec, source, "recipe" if source != "the recipe" else "")
    task = task if task is not None else load_task(spec["task"], **spec["task_options"])
    try:
        cfg = TrainConfig.from_dict(spec["config"])
        limit = spec["train_limit"]
    except (TypeError, ValueError, KeyError) as exc:
        raise WorkbookError(f"the recipe's configuration is not one this workbook wrote ({exc})",
                            "resume with the workbook version that wrote the checkpoint, or "
                            "use an intact checkpoint") from None
    items = [] if cfg.pipeline else prepare(task, ("train",), {"train": limit}).train
    return task, items, cfg


def check_recipe(spec: Any, source: Any = "the recipe", field: str = "") -> dict:
    """A recipe (read from `source`, e.g. a checkpoint's meta.json) checked against
    `Recipe` before any of it is used: a task and its options, a train_limit of 0 or
    more, and a configuration of finite, in-range values (grad_clip NaN, a string lr or a
    negative seed are refused by name). A recipe written before the shape was one field is
    read too. Returns it with its defaults filled in."""
    if isinstance(spec, dict) and isinstance(spec.get("config"), dict):
        spec = {**spec, "config": UpdateShape.nested(spec["config"])}
    return schemas.check(Recipe, spec, source, "recipe",
                         "resume with the workbook version that wrote the checkpoint, or use "
                         "an intact checkpoint", field).model_dump()


def _record(r: StepRecord) -> dict:
    return {"step": r.step, "epoch": r.epoch, "loss": r.loss, "lr": r.lr,
            "ids": [str(i) for i in r.example_ids]}


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def run_recipe(spec: dict, to_step: int, folder: Path | None = None,
               checkpoint_at: tuple = (), start_from: Path | None = None, faults: tuple = (),
               task: Task | None = None, name=checkpoint_name, loop_order: bool = False
               ) -> tuple[list[dict], dict]:
    """Train to update `to_step` (from scratch, or continuing `start_from`), checkpointing after
    the updates in `checkpoint_at` into `folder / name(step)`. Returns the per-update records
    (a resumed run's first one says how its data position came back) and the final weights."""
    task, items, cfg = rebuild(spec, task, "the recipe" if start_from is None else
                               Path(start_from) / ckpt.META)
    cfg.updates = to_step
    pipe = open_pipeline(task, cfg.seed, workers=cfg.workers, micro_batch=cfg.shape.micro_batch,
                         limit=spec["train_limit"], loop_order=loop_order) \
        if cfg.pipeline else None
    if start_from is None:
        stepper = build_stepper(task, cfg, examples=None if cfg.pipeline else len(items))
        position, first, base = Position(), 1, ckpt.tensor_record(stepper.model)
    else:
        stepper, position, first, base = restore(start_from, spec, task, cfg, faults,
                                                 len(items))
        if to_step < first:
            raise WorkbookError(f"--to {to_step} lies before the checkpoint's next update "
                                f"{first}: nothing would be resumed",
                                f"give --to {first} or later")

    def on_update(record: StepRecord, st: Stepper, after: Position) -> None:
        if record.step in checkpoint_at:
            counters = {"step": record.step, "epoch": after.epoch, "group": after.group,
                        "micro_batch_in_group": 0, "sampler_state": after.sampler_state,
                        "data": None if after.data is None else asdict(after.data)}
            ckpt.save_checkpoint(Path(folder) / name(record.step), st.model,
                                 st.optimizer, st.scheduler, st.scaler, counters,
                                 {"recipe": spec, "task_name": task.name},
                                 own=task.save_state, sampler=st.sampler, carry=st.carry,
                                 base=base, averaged=st.averaged)
        return None

    result = train(task, items, cfg, stepper=stepper, start=position, first_step=first,
                   on_update=on_update, pipeline=pipe)
    weights = final_weights(result.model, result.averaged)
    records = [_record(r) for r in result.steps]
    if pipe is not None and start_from is not None and records:
        records[0].update(resumed_by=pipe.resumes_by, skipped=pipe.skipped.examples,
                          skip_s=pipe.skipped.seconds)
    return records, weights


def final_weights(model: torch.nn.Module, averaged: torch.nn.Module | None) -> dict:
    """The weights a run ends with, compared between the uninterrupted and the resumed run:
    the model's, and its averaged model's (Task.averaged_model) under `AVERAGED`."""
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if averaged is not None:
        weights.update({AVERAGED + k: v.detach().cpu().clone()
                        for k, v in averaged.state_dict().items()})
    return weights


AVERAGED = "averaged_model:"  # the averaged model's weights among a run's final weights


def restore(path: Path, spec: dict, task: Task, cfg: TrainConfig, faults: tuple = (),
            examples: int = 0) -> tuple[Stepper, Position, int, dict]:
    """Model, optimizer, schedule, scaler, sampler (of `examples` training examples), random
    states, thread count and data position from a checkpoint, and the model's tensors as this
    process built it (the base its own checkpoints record); `faults` plants the classic
    resume bugs."""
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise WorkbookError(f"unknown planted faults {sorted(unknown)}", f"use {FAULTS}")
    ckpt.verify(path)
    meta = ckpt.load_meta(path)
    if meta.get("task_name") not in (None, task.name):
        raise WorkbookError(f"checkpoint {path} was written by task {meta['task_name']!r}, not "
                            f"{task.name!r}", "resume it with the task that wrote it")
    stepper = build_stepper(task, cfg)
    stepper.sampler = None if cfg.pipeline else make_sampler(task, examples, cfg.seed)
    if callable(getattr(stepper.sampler, "state_dict", None)):
        # off its initial state before restore_state sees it: a restore that starts the order
        # over (reseeds) then changes it and is checked, instead of passing for one that left
        # the sampler alone
        for _ in stepper.sampler:
            pass
    optimizer = None if "optimizer" in faults else stepper.optimizer
    built = ckpt.tensor_record(stepper.model)
    stepper.averaged = averaged_model(task, stepper.model)
    info = ckpt.load_checkpoint(path, stepper.model, optimizer, stepper.scheduler,
                                stepper.scaler, restore_rng="rng" not in faults,
                                own=task.restore_state, sampler=stepper.sampler,
                                carry=None if "carried" in faults else stepper.carry,
                                built=built,
                                averaged=None if "averaged_model" in faults else
                                stepper.averaged)
    torch.set_num_threads(info["meta"]["threads"])  # 1..4096: checked by load_meta
    c = info["counters"]
    schemas.check(schemas.ResumeCounters, c, Path(path) / ckpt.STATE, "checkpoint state",
                  "resume from a checkpoint of notebook 07's run", "counters")
    if cfg.pipeline and c.get("data") is None:
        raise WorkbookError(f"checkpoint {path} holds no data position of the training "
                            "pipeline", "resume from a checkpoint of this run (07 writes one)")
    data = DataPosition(**c["data"]) if cfg.pipeline else None
    if not cfg.pipeline:
        check_position(path, c, task, cfg, examples)
    position = Position(c["epoch"], c["group"], c.get("sampler_state"), data)
    if "sampler" in faults:  # the classic: the data order restarts from the pass's beginning
        position = Position(c["epoch"], 0, c.get("sampler_state"),
                            data and DataPosition(data.epoch))
    return stepper, position, int(c["step"]) + 1, built


def check_position(path: Path, counters: dict, task: Task, cfg: TrainConfig,
                   examples: int) -> None:
    """The data position a checkpoint records must lie inside a pass of this run: the next
    update of the pass at most the pass's last plus one (the end of the pass), and the step
    count the one that pass and position give. A position beyond the pass would be skipped
    silently into the next one. (A task's own sampler may change a pass's length: its position
    is its own to check.)"""
    if task.make_sampler is not None or not examples:
        return
    per_pass = len(epoch_updates(list(range(examples)), cfg.shape.micro_batch,
                                 cfg.shape.accumulation, cfg.drop_partial))
    epoch, group, step = counters["epoch"], counters["group"], counters["step"]
    fix = "resume from an intact checkpoint of this run (same task, options and configuration)"
    if group > per_pass:
        raise WorkbookError(f"checkpoint {path}: its data position (update {group} of pass "
                            f"{epoch}) lies beyond the pass, which has {per_pass} updates", fix)
    if step != epoch * per_pass + group:
        raise WorkbookError(f"checkpoint {path}: its step {step} is not the one its data "
                            f"position gives (pass {epoch}, update {group} of {per_pass}: step "
                            f"{epoch * per_pass + group})", fix)


FRESH_PROCESS_TIMEOUT = 600  # seconds for one resume in a new process (a few updates)


def resume_in_new_process(checkpoint: Path, to_step: int, out: Path, spec: dict,
                          faults: tuple = (), save_at: int = 0) -> tuple[list[dict], dict]:
    """Continue a checkpoint in a fresh Python process (`python -m workbook resume`), naming
    the recipe's task on the command line; `save_at` checkpoints it again into OUT.ckpt."""
    done = fresh_process(["resume", "--checkpoint", str(checkpoint), "--to", str(to_step),
                          "--out", str(out), *task_args(spec["task"], spec["task_options"])]
                         + [f"--fault={f}" for f in faults]
                         + ([f"--save-at={save_at}"] if save_at else []),
                         FRESH_PROCESS_TIMEOUT, "the resumed process")
    if done.returncode:
        raise WorkbookError(f"the resumed process failed: {child_error(done.stderr)}",
                            "read the error above; the checkpoint or task may be broken")
    return read_records(out.with_suffix(".json")), load_file(
        str(out.with_suffix(".safetensors")))


def read_records(path: Path) -> list[dict]:
    """The per-update records a resumed process handed back, parsed bounded and checked
    (`schemas.ResumedRecord`: steps from 1, finite non-negative learning rates)."""
    from ...storage.files import read_plain

    fix = "run the resume again into a new --out"
    data = schemas.parse_json(read_plain(path, "resumed records", fix), path,
                              "resumed records", fix)
    schemas.check(schemas.ResumedRecords, {"records": data}, path, "resumed records", fix)
    return data


def compare(reference: list[dict], resumed: list[dict], ref_weights: dict, weights: dict,
            tolerance: float = 0.0) -> tuple[pd.DataFrame, dict]:
    """Per update after the resume point: loss, learning rate and example ids against the
    uninterrupted run; then the final parameters."""
    ref = {r["step"]: r for r in reference}
    rows = [{"step": r["step"], "loss_uninterrupted": ref[r["step"]]["loss"],
             "loss_resumed": r["loss"], "loss_diff": abs(r["loss"] - ref[r["step"]]["loss"]),
             "same_lr": r["lr"] == ref[r["step"]]["lr"],
             "same_examples": r["ids"] == ref[r["step"]]["ids"]} for r in resumed]
    table = pd.DataFrame(rows)
    diffs = difference_by_name(weights, ref_weights)
    diff = max(diffs.values())
    steps_ok = bool(len(table)) and table.same_lr.all() and table.same_examples.all()
    differs = table.step[~table.same_examples] if len(table) else table.step
    verdict = {"updates_compared": len(table), "max_param_diff": diff,
               "max_loss_diff": float(table.loss_diff.max()) if len(table) else None,
               "same_examples": bool(table.same_examples.all()) if len(table) else False,
               "examples_differ_from": int(differs.iloc[0]) if len(differs) else None,
               "exact": bool(steps_ok and diff <= tolerance and
                             float(table.loss_diff.max()) <= tolerance),
               "continued_to_the_end": bool(len(table) and
                                            table.step.iloc[-1] == reference[-1]["step"])}
    averaged = [v for k, v in diffs.items() if k.startswith(AVERAGED)]
    if averaged:  # the task's averaged model, compared beside the model
        verdict["max_averaged_model_diff"] = max(averaged)
    return table, verdict


def latest_checkpoint(folder: str | Path) -> Path:
    """The newest complete checkpoint in a folder (a kill during a save leaves only a
    `.partial` folder behind, which is never a candidate)."""
    candidates = sorted(Path(folder).glob("ckpt-*"), reverse=True)
    for path in candidates:
        try:
            ckpt.verify(path)
            return path
        except WorkbookError:
            continue
    raise WorkbookError(f"no complete checkpoint in {folder}",
                        "check the folder; a run that never saved cannot resume")


def check_cases(spec: dict, updates: int, mid_step: int, boundary_step: int, folder: Path,
                tolerance: float = 0.0, twice_step: int = 0, workers: int = 0,
                task: Task | None = None) -> tuple[pd.DataFrame, dict]:
    """The uninterrupted reference run (checkpointing at the resume points), then each case
    resumed in a new process: mid-epoch (in the second pass), exactly at an epoch boundary
    (which must continue), resumed twice (the mid-epoch resume checkpoints again at
    `twice_step` and a third process continues that) and, with `workers`, a run whose
    DataLoader has that many worker processes. Each row says where the resumed data came from
    when it was not where the uninterrupted run went on (`data`)."""
    points = [("mid_step", mid_step), ("boundary_step", boundary_step)] + \
        ([("twice_step", twice_step)] if twice_step else [])
    for name, step in points:
        if not 0 < step < updates:
            raise WorkbookError(f"resume point {name}={step} must lie inside the {updates} "
                                "updates", "choose points after the first update and before "
                                "the last")
    if twice_step and twice_step <= mid_step:
        raise WorkbookError(f"twice_step {twice_step} must come after mid_step {mid_step}",
                            "give twice_step between mid_step and updates, or 0")
    task, items, cfg = rebuild(spec, task)
    order, length = pass_orders(task, items, cfg, spec["train_limit"]), stated_length(task, cfg)
    reference, weights = run_recipe(spec, updates, folder,
                                    checkpoint_at=(mid_step, boundary_step), task=task)
    rows, details = [], {"reference": reference, "weights": weights}
    probes = probe_pipeline(task, cfg, spec["train_limit"]) if cfg.pipeline else None
    again = repeated_pass(reference, order) or (probes.partial if probes else "")
    if probes is not None:  # the resumes that read elsewhere cite the same cause
        probes.partial = again

    def case(name: str, path: Path, step: int, out: str, ref: list[dict], ref_weights: dict,
             save_at: int = 0, first: tuple[int, int] | None = None, data: str = "",
             config: TrainConfig | None = None, loop_order: bool = False) -> None:
        try:
            resumed, w = (run_recipe(spec, updates, start_from=path, task=task,
                                     loop_order=True) if loop_order else
                          resume_in_new_process(path, updates, folder / out, spec,
                                                save_at=save_at))
        except WorkbookError as exc:  # e.g. the task's restore_state lost a part: a failed case
            rows.append({"case": name, "resumed_after": step, "updates_compared": 0,
                         "max_param_diff": None, "max_loss_diff": None,
                         "same_examples": False, "examples_differ_from": None, "exact": False,
                         "continued_to_the_end": False, "resumed_by": "", "skipped": None,
                         "skip_s": None, "data": data, "error": exc.problem})
            return
        table, verdict = compare(ref, resumed, ref_weights, w, tolerance)
        details[name] = table
        first_record = resumed[0] if resumed else {}
        data = data or where_from(ref, resumed, step, order if config is None else
                                  pass_orders(task, items, config, spec["train_limit"]),
                                  cfg.shape.micro_batch, first, length,
                                  probes.cause if probes and config is None else None,
                                  loop_order)
        if not data and verdict["same_examples"] and not verdict["exact"]:
            data = global_seed(task, config or cfg) or random_data(
                task, items, config or cfg, spec["train_limit"]) or carried(config or cfg)
        rows.append({"case": name, "resumed_after": step, **verdict,
                     "exact": verdict["exact"] and not data,
                     "resumed_by": first_record.get("resumed_by") or "workbook order",
                     "skipped": first_record.get("skipped"),
                     "skip_s": first_record.get("skip_s"), "data": data, "error": ""})

    found: dict[str, str] = {}

    def carried(config: TrainConfig) -> str:  # measured once per configuration
        key = repr(config)
        if key not in found:
            found[key] = undeclared_state(task, items, config, spec["train_limit"])
        return found[key]

    mid, twice = folder / checkpoint_name(mid_step), folder / "resumed-mid-epoch.ckpt"
    case("mid-epoch", mid, mid_step, "resumed-mid-epoch", reference, weights,
         save_at=twice_step)
    case("epoch boundary", folder / checkpoint_name(boundary_step), boundary_step,
         f"resumed-{boundary_step}", reference, weights)
    if twice_step:
        case("resumed twice", twice, twice_step, "resumed-twice", reference, weights,
             first=position_before(reference, mid_step + 1))
    if cfg.pipeline:  # load_state_dict, then set_epoch at the next pass, then iterate
        case("restored as a training loop does", mid, mid_step, "resumed-loop-order",
             reference, weights, loop_order=True)
    if again:
        rows.append({"case": "a new pass after a pass cut short", "resumed_after": None,
                     "exact": False, "continued_to_the_end": True, "data": again, "error": "",
                     "resumed_by": "", "updates_compared": 0})
    if workers:
        wspec = {**spec, "config": {**spec["config"], "workers": workers}}
        wfolder = folder / f"workers-{workers}"
        wref, wweights = run_recipe(wspec, updates, wfolder, checkpoint_at=(mid_step,),
                                    task=task)
        details["workers reference"] = wref
        case(f"{workers} DataLoader workers", wfolder / checkpoint_name(mid_step), mid_step,
             "resumed-workers", wref, wweights, data=repeats(wref, workers),
             config=TrainConfig.from_dict(wspec["config"]))
    return pd.DataFrame(rows), details


def planted_faults(spec: dict, updates: int, step: int, folder: Path, reference: list[dict],
                   ref_weights: dict, tolerance: float = 0.0) -> pd.DataFrame:
    """Resume with each classic bug planted and say whether the comparison catches it."""
    rows = []
    state = ckpt.load_state(folder / checkpoint_name(step))
    for fault in [f for f in FAULTS if f not in ("carried", "averaged_model") or
                  state.get(f) is not None]:
        name = {"optimizer": "checkpoint without optimizer state",
                "sampler": "sampler restarted on resume",
                "rng": "random states not restored",
                "carried": "carried state (Task.state) not restored",
                "averaged_model": "averaged model (Task.averaged_model) not restored"}[fault]
        try:
            resumed, w = run_recipe(spec, updates, start_from=folder / checkpoint_name(step),
                                    faults=(fault,))
        except WorkbookError as exc:  # the restore refused: caught, loudly
            rows.append({"planted bug": name, "caught": True, "max_loss_diff": None,
                         "same_examples": None, "refused": exc.problem})
            continue
        _, verdict = compare(reference, resumed, ref_weights, w, tolerance)
        rows.append({"planted bug": name, "caught": not verdict["exact"],
                     "max_loss_diff": verdict["max_loss_diff"],
                     "same_examples": verdict["same_examples"], "refused": ""})
    return pd.DataFrame(rows)


def tamper_checks(checkpoint: Path, folder: Path) -> pd.DataFrame:
    """A changed file and a pickle that would run code: both must be refused, and the code must
    not run."""
    import pickle

    rows = []
    data = bytearray((checkpoint / ckpt.STATE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    # each copy is made whole in a temporary folder and renamed (a full disk leaves none)
    changed = copy_folder(checkpoint, folder / "tampered", {ckpt.STATE: bytes(data)},
                          "tampered copy")
    rows.append(_refused("a byte changed in state.pt", changed))
    marker = folder / "payload-ran"
    evil = copy_folder(checkpoint, folder / "malicious", {
        ckpt.STATE: pickle.dumps(_Payload(str(marker)), protocol=2)}, "malicious copy")
    reseal(evil)  # a forger can fix the manifest
    rows.append({**_refused("a pickle that runs code (manifest forged)", evil),
                 "code ran": marker.exists()})
    return pd.DataFrame(rows)


class _Payload:
    """Unpickling this would create a file: the demonstration of arbitrary code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _refused(what: str, path: Path) -> dict:
    try:
        ckpt.load_state(path)
    except WorkbookError as exc:  # the message without this run's folder, to read and compare
        return {"case": what, "refused": True,
                "message": shorten(exc.problem.replace(str(path.parent) + "/", ""), 200)}
    return {"case": what, "refused": False, "message": "loaded!"}


@dataclass
class ResumeCases:
    """Notebook 07's resume cases: the recipe, its uninterrupted run and each case resumed in a
    new process, compared update by update."""

    task: Task
    spec: dict  # the recipe
    examples: int  # training examples in one pass
    updates_per_pass: int
    mid_step: int
    boundary_step: int
    cases: pd.DataFrame
    details: dict  # per case: the update-by-update comparison; the reference run


@dataclass
class ResumeResult(ResumeCases):
    """Everything notebook 07 shows: the resume cases, the planted bugs, the tampered
    checkpoints and the archive reloaded in a new process."""

    faults: pd.DataFrame | None
    tamper: pd.DataFrame
    archive: Path
    reloaded: dict


def resume_cases(params: ResumeParams | Mapping[str, Any], out_dir: Path) -> ResumeCases:
    """Notebook 07's resume cases from its parameters (`check_cases`), before its planted
    faults, tampered copies and archive; the checkpoints and resumed runs go into `out_dir`."""
    params = RESUME.check(params)
    shape = params.shape()
    cfg = TrainConfig(shape, lr=params.lr, seed=params.seed, device=params.device)
    cfg.pipeline = bool(params.use_pipeline) and params.load_task().train_pipeline \
        is not None
    spec = recipe(params.task, params.task_options, cfg, params.train_limit)
    task, items, _ = rebuild(spec)
    examples = len(pass_orders(task, items, cfg, params.train_limit)(0)) if cfg.pipeline \
        else len(items)
    per_pass = (examples // shape.examples_per_update if cfg.drop_partial else
                math.ceil(examples / shape.examples_per_update))
    mid, boundary, updates = params.mid_step, params.boundary_step or per_pass, params.updates
    twice = params.twice_step or (mid + updates) // 2
    cases, details = check_cases(spec, updates, mid, boundary, out_dir, params.tolerance,
                                 twice if mid < twice < updates else 0, params.workers, task)
    return ResumeCases(task, spec, examples, per_pass, mid, boundary, cases, details)


def run(params: ResumeParams | Mapping[str, Any], out_dir: Path) -> ResumeResult:
    """Notebook 07 from its parameters: checkpoints, resumed runs, the tampered copies and the
    archive are written into `out_dir`."""
    params = RESUME.check(params)
    found = resume_cases(params, out_dir)
    task, spec, mid, details = found.task, found.spec, found.mid_step, found.details
    faults = (planted_faults(spec, params.updates, mid, out_dir, details["reference"],
                             details["weights"], params.tolerance)
              if params.demonstrate_faults else None)
    tamper = tamper_checks(out_dir / checkpoint_name(mid), out_dir)
    model = task.build_model()
    model.load_state_dict({k: v for k, v in details["weights"].items()
                           if not k.startswith(AVERAGED)})  # the model is what is archived
    archive = write_archive(out_dir / "archive", params.task, params.task_options, model,
                            spec["config"],
                            pd.DataFrame(details["reference"]).drop(columns=["ids"]),
                            [workbook_command(["pilot", *task_args(params.task,
                                                                   params.task_options),
                                               "--only", "07"])],
                            params.controls)
    reloaded = reload_in_new_process(archive, params.task, params.task_options)
    return ResumeResult(**vars(found), faults=faults, tamper=tamper, archive=archive,
                        reloaded=reloaded)


def save(result: ResumeResult, out_dir: Path) -> str:
    """Notebook 07's tables and `summary.json`. The verdict passes when every resume case is
    exact and ran to the end, the archive reproduced its control outputs in a new process, and
    every tampered file was refused without running its code."""
    from ...storage.runs import save_table, write_summary

    cases, tamper, reloaded, faults = result.cases, result.tamper, result.reloaded, result.faults
    ok = bool(cases.exact.all() and cases.continued_to_the_end.all() and reloaded["identical"]
              and tamper.refused.all() and not tamper["code ran"].fillna(False).any())
    save_table(cases, out_dir, "resume_cases")
    save_table(tamper, out_dir, "tamper")
    if faults is not None:
        save_table(faults, out_dir, "planted_faults")
    verdict = "pass" if ok else "fail"
    write_summary(out_dir, verdict, {
        "cases": [{k: None if isinstance(v, float) and math.isnan(v) else v
                   for k, v in row.items()} for row in cases.reindex(columns=[
                       "case", "resumed_after", "exact", "max_param_diff",
                       "examples_differ_from", "resumed_by", "skipped", "data",
                       "error"]).to_dict("records")],
        "archive_identical": reloaded["identical"],
        "tampering_refused": bool(tamper.refused.all()),
        "faults_caught": None if faults is None else
        faults.set_index("planted bug").caught.to_dict()}, task=result.task.name)
    return verdict

