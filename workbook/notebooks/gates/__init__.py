"""Notebook 03: every phase of the campaign passes a gate - one row each with its inputs, memory
counters, time, verdict and the remediation when it fails."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch

from ...base.errors import WorkbookError
from ...contract import fine_tuning
from ...contract.data import Item, collate_items, prepare
from ...contract.outputs import eval_mode
from ...contract.task import Task
from ...storage.records import to_frame
from ...training import campaign
from ...training import checkpoint as ckpt
from ...training.deviation import max_difference
from ...training.devices import resolve_device
from ...training.evaluation import evaluate
from ...training.loop import HeldBehaviour, build_stepper, train
from ...training.memory import GIB, MemoryReading, measure, rebased, state_tensors, storage_bytes
from ...training.predict import (
    Overheads,
    Plan,
    compare,
    fit_table,
    longest_accepted,
    predicted_or_reason,
    rule_of_thumb,
    sized_batches,
    summary_figures,
)
from ...training.workload import Workload, targets_of
from .. import registry
from ..parameters import GatesParams
from .diagnosis import companion_causes, first_nonfinite_module
from .plan import GatesResult
from .settings import (
    INPUT_BOUND_CAUSES,
    INPUT_TIMED_UPDATES,
    PHASES,
    REMEDIATION,
    GateReport,
    GateRow,
    GateSettings,
    encode_seconds,
    input_bound,
)
from .update import BeforeUpdate, later_update_check, timed_update, update_check


@dataclass(frozen=True)
class Gate:
    """One row of the gates: `work(run, context)` is what is measured, `check(run, context,
    result)` judges it as (verdict, detail), or (verdict, detail, remediation) where the check
    found the cause and its fix. `prepare(run)` makes the context before the
    measurement (a snapshot to compare with), `finish(run)` tidies after it; `blocked(run)` says
    why the gate cannot run (None: it can). A chained gate's memory is read from what the
    previous phase left; `training` gates are also the memory variants' phases."""

    phase: str
    work: Callable[["GateRun", Any], Any]
    check: Callable[["GateRun", Any, Any], tuple[str, ...]]
    prepare: Callable[["GateRun"], Any] = lambda run: None
    finish: Callable[["GateRun"], None] = lambda run: None
    blocked: Callable[["GateRun"], str | None] = lambda run: None
    chained: bool = True
    training: bool = True


class GateRun:
    """The gates of one model and optimizer, in the order of `GATES`, measuring each."""

    def __init__(self, task: Task, settings: GateSettings, train_items: list[Item],
                 val_items: list[Item], out_dir: Path,
                 save: Callable[..., Path] = ckpt.save_checkpoint,
                 load: Callable[..., dict] = ckpt.load_checkpoint):
        self.task, self.out_dir = task, Path(out_dir)
        self.settings = replace(settings, grad_clip=task.grad_clip)  # the task's clipping
        self.train_items, self.val_items = train_items, val_items
        self.encode_s = 0.0  # median seconds to encode one raw example
        self.save, self.load = save, load
        self.device = resolve_device(settings.device)
        self.rows: list[GateRow] = []
        self.live = 0  # CPU: bytes alive in the workload between phases (start of next phase)
        self.pipeline = pd.DataFrame()  # the timed updates the data gate judges
        self.work: Workload | None = None  # built by the forward gate
        self.checkpoint = self.out_dir / "gate-checkpoint"
        self.rng_at_save: dict | None = None
        self.finite_loss = False  # set by the forward gate
        self.generation: tuple[float, float] | None = None  # seconds in the later update

    def row(self, phase: str, **kw: Any) -> GateRow:
        seq = self.task.main_input(self.batch.tensors).shape[-1]
        shape = self.settings.shape
        return GateRow(phase, shape.micro_batch, int(seq), self.settings.eval_batch,
                       shape.precision,
                       str(self.device), remediation=REMEDIATION[phase], **kw)

    def phase(self, gate: Gate) -> GateRow:
        """Measure the gate's work and judge it; an exception (OOM included) fails the row."""
        why = gate.blocked(self)
        if why:
            row = self.row(gate.phase, verdict="fail", detail=f"not run: {why}")
            self.rows.append(row)
            return row
        row = self.row(gate.phase)
        start = time.perf_counter()
        holder = None
        try:
            context = gate.prepare(self)
            with measure(self.device) as holder:
                result = gate.work(self, context)
            row.verdict, row.detail, *remedy = gate.check(self, context, result)
            # a passing row has nothing to remedy (its detail may say why all is well)
            row.remediation = "" if row.verdict == "pass" else \
                remedy[0] if remedy else row.remediation
        except Exception as exc:
            oom = isinstance(exc, torch.OutOfMemoryError)
            row.verdict = "fail"
            row.detail = ("out of memory: " if oom else f"{type(exc).__name__}: ") + \
                str(exc).strip().splitlines()[0][:300]
        reading: MemoryReading | None = holder.reading if holder is not None else None
        row.time_s = time.perf_counter() - start
        if reading is not None:
            if reading.counter == "cpu-profiler":  # relative to the workload alive at the start
                reading = rebased(reading, self.live if gate.chained else 0)
                if gate.chained:
                    self.live = reading.allocated_bytes
            for key, value in asdict(reading).items():
                setattr(row, key, value)
        gate.finish(self)
        self.fit(row)
        self.rows.append(row)
        return row

    def fit(self, row: GateRow) -> None:
        """With a stated device memory, a phase whose peak plus headroom does not fit fails."""
        limit = self.settings.device_memory_gib * GIB
        peak = row.peak_reserved_bytes or row.peak_allocated_bytes
        if not limit or peak is None or row.verdict == "fail":
            return
        need = peak * (1 + self.settings.headroom)
        if need > limit:
            row.verdict = "fail"
            row.detail += (f"; needs {need / GIB:.2f} GiB with {self.settings.headroom:.0%} "
                           f"headroom, the device has {self.settings.device_memory_gib} GiB")
            row.remediation = ("lower the micro-batch (raise accumulation), activation "
                               "checkpointing, mixed precision - see notebook 05")

    def build_workload(self) -> None:
        """Model, optimizer and the sized batches on the device: what every training gate
        runs on (unmeasured, before the forward gate)."""
        stepper = build_stepper(self.task, self.settings.train_config())
        batches = [b.to(self.device) for b in (self.batch, *self.group, self.eval_batch)]
        self.work = Workload(stepper, batches[0], batches[1:-1], batches[-1],
                             targets_of(self.task, self.batch),
                             sum(targets_of(self.task, b) for b in self.group))
        self.live = storage_bytes(state_tensors(stepper.model, stepper.optimizer,
                                                self.work.tensors()))

    def input_pipeline(self) -> pd.DataFrame:
        """Time a few real updates: per update, the wait for data against the whole update. The
        loader encodes the raw examples on every pass, as a campaign's Dataset does in
        `__getitem__`, so the wait includes it; `encode_s` is the part spent encoding (the
        median per example, timed on its own, times the examples)."""
        columns = ["step", "examples", "encode_s", "data_s", "time_s", "data_share"]
        try:
            updates = max(self.settings.input_updates, INPUT_TIMED_UPDATES)
            steps = to_frame(train(self.task, self.train_items,
                                   self.settings.train_config(updates)).steps)
        except Exception:  # the forward gate reports what is wrong with the training step
            return pd.DataFrame(columns=columns)
        self.encode_s = encode_seconds(self.task, [it.raw for it in self.train_items
                                                   if it.raw is not None])
        steps = steps.assign(encode_s=steps.examples * self.encode_s)
        return steps.assign(data_share=steps.data_s / steps.time_s)[columns]

    def run(self, training_only: bool = False) -> GateReport:
        """All gates; or, with `training_only`, just the training phases and validation."""
        self.batch_items = sorted(self.train_items, key=lambda it: self.task.length(it.tensors),
                                  reverse=True)[: self.settings.shape.micro_batch]
        self.batch, self.group, self.eval_batch = sized_batches(
            self.task, self.train_items, self.val_items, self.settings.plan())
        if not training_only:
            self.pipeline = self.input_pipeline()
        for gate in GATES:
            if gate.training or not training_only:
                self.phase(gate)
        return GateReport(self.rows, self.pipeline, train_items=self.train_items,
                          val_items=self.val_items)


# --- the gates, in order: work and check of each ---------------------------------------------
def _data_work(run: GateRun, _) -> Any:
    return collate_items(run.task, run.batch_items).to(run.device)


def _data_check(run: GateRun, _, batch) -> tuple[str, str]:
    problems, t, task = [], batch.tensors, run.task
    ids, labels = task.main_input(t), t.get("labels")
    if labels is None:
        return "fail", "the batch has no 'labels'"
    for key, value in t.items():
        if value.shape[0] != len(batch):
            problems.append(f"{key} has batch dimension {value.shape[0]}, not {len(batch)}")
    if "input_ids" in t and ids.is_floating_point():
        problems.append(f"input_ids are {ids.dtype}, not integer ids")
    regression = task.target_kind.float_targets
    if labels.is_floating_point() != regression:
        problems.append(f"labels are {labels.dtype}, not " + (
            "float targets (regression)" if regression else "class/token ids"))
    mask = t.get("attention_mask")
    if mask is not None and ids is not None and mask.shape != ids.shape:
        problems.append(f"attention_mask {tuple(mask.shape)} != input_ids {tuple(ids.shape)}")
    if labels.dim() > 1 and not regression and ids is not None and labels.shape != ids.shape:
        problems.append(f"labels {tuple(labels.shape)} != input_ids {tuple(ids.shape)}")
    if task.target_count(labels) == 0:
        problems.append("no contributing targets in the batch")
    longest = max(task.length(it.tensors) for it in run.train_items)
    longest_val = max(task.length(it.tensors) for it in run.val_items)
    bound, waited = input_bound(run.pipeline, run.settings, run.encode_s)
    detail = (f"dtypes {', '.join(f'{k}:{str(v.dtype)[6:]}' for k, v in t.items())}; "
              f"longest input {longest} (train), {longest_val} (validation); {waited}")
    if problems:
        return "fail", "; ".join(problems)
    if bound:
        return "warn", detail + "; usual causes: " + "; ".join(INPUT_BOUND_CAUSES)
    return "pass", detail


INIT_TARGETS = 32  # fewer targets than this in the micro-batch: the initial loss is judged on
INIT_EXAMPLES = 64  # this many training examples instead


def _forward_check(run: GateRun, _, __) -> tuple[str, str]:
    state, model = run.work.state, run.work.stepper.model
    logits, count = state["logits"], int(state["count"])
    loss = float(state["loss_sum"].detach()) / max(count, 1)
    micro = run.settings.shape.micro_batch
    if logits.shape[0] != micro:
        return "fail", f"logits batch dimension {logits.shape[0]} != {micro}"
    if not math.isfinite(loss):
        where = first_nonfinite_module(model, lambda: run.task.forward(model,
                                                                        run.batch.tensors))
        return "fail", (f"loss is {loss} (NaN/inf produced in forward"
                        + (f", first by module '{where}')" if where else ")"))
    outputs, labels = logits.shape[-1], run.batch.tensors["labels"]
    detail = f"logits {tuple(logits.shape)}, loss {loss:.4f} over {count} targets"
    phases = getattr(model, "phases_said", None)  # a forward made of phases (GRPO's)
    if callable(phases) and phases():
        detail += f"; {phases()}"
    sample = run.train_items[:INIT_EXAMPLES]
    if count < INIT_TARGETS:
        # a few targets' mean loss is noise (a regression MLP with batch norm on 2 rows missed
        # the 50% band 41% of the time): judge the untrained model over more examples
        with HeldBehaviour(model):  # every mode flag as it was after: the gates after judge them
            record = evaluate(run.task, model, sample, run.settings.eval_batch, run.device)
        labels = torch.cat([it.tensors["labels"].reshape(-1) for it in sample]) \
            if run.task.target_kind.float_targets else labels
        loss, count = record.loss, record.targets
        detail += f"; {loss:.4f} over {count} targets of {len(sample)} examples (eval mode)"

    def measured() -> float:
        with HeldBehaviour(model):
            return evaluate(run.task, model, sample, run.settings.eval_batch, run.device).loss
    start = fine_tuning.initial_loss(run.task, model, outputs, labels, measured)
    if start.expected is None:
        return "pass", detail + f"; initial loss {start.rule}"
    if fine_tuning.adapted(model):  # the adapted model over the same examples as its base
        loss = measured()
        detail += f"; {loss:.4f} over {len(sample)} examples (eval mode)"
    expected = start.expected
    detail += f", expected ~{start.rule} = {expected:.4f}"
    if abs(loss - expected) > (start.tolerance or run.settings.init_tolerance) * expected:
        return "fail", detail + " - " + (fine_tuning.NOT_IDENTITY if start.tolerance
                                         else "far from the untrained value")
    return "pass", detail


def _no_model(run: GateRun) -> str | None:
    return "the model and optimizer were not built (see forward + loss)" if run.work is None \
        else None


def _note_loss(run: GateRun) -> None:
    """After the forward gate: whether it left a finite loss for the gates that need one."""
    loss = run.work.state.get("loss_sum") if run.work is not None else None
    run.finite_loss = loss is not None and bool(torch.isfinite(loss.detach()))


def _no_finite_loss(run: GateRun) -> str | None:
    return None if run.finite_loss else "forward + loss gave no finite loss"


def _backward_check(run: GateRun, _, __) -> tuple[str, str]:
    named = [(n, p) for n, p in run.work.stepper.model.named_parameters() if p.requires_grad]
    missing = [n for n, p in named if p.grad is None]
    bad = [n for n, p in named if p.grad is not None and not torch.isfinite(p.grad).all()]
    if bad:
        return "fail", f"non-finite gradients in {bad[:5]}"
    if missing:
        return "fail", f"{len(missing)} trainable parameters got no gradient: {missing[:5]}"
    return "pass", (f"{len(named)} trainable tensors, all with finite gradients; loss "
                    f"normalised by {run.work.targets} targets")


def _modes(run: GateRun) -> dict[str, bool]:
    """Every module's training flag before any evaluation."""
    return {n: m.training for n, m in run.work.stepper.model.named_modules()}


def _validation_check(run: GateRun, modes: dict[str, bool], _) -> tuple[str, str]:
    task, model, probe = run.task, run.work.stepper.model, run.val_items[:4]
    problems, padded = [], []

    def logits(items):
        batch = collate_items(task, items).to(run.device).tensors
        padded.append(int(task.main_input(batch).shape[-1]))
        return task.forward(model, batch)
    with eval_mode(model):
        first, second = logits(probe[:2]), logits(probe[:2])
        other = logits(probe[:1] + probe[2:])  # the same example, other companions
    if not torch.equal(first, second):
        problems.append("two passes on the same input disagree: dropout (or another random "
                        "layer) still active in eval mode")
    if first.dim() > 2:  # the real positions of example 0, on the padding side
        n = min(first.shape[1], other.shape[1])
        side = task.side(collate_items(task, probe[:2]).tensors)
        mine, theirs = task.real_part(first[0], n, side), task.real_part(other[0], n, side)
    else:
        mine, theirs = first[0], other[0]
    if not torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5):
        problems.append("an example's output depends on its batch companions: " +
                        "; or ".join(companion_causes(task, model, (padded[0], padded[2]))))
    seen: list = []
    grads_before = [p.grad for p in model.parameters()]
    evaluate(task, model, run.val_items, run.settings.eval_batch, run.device,
             precision=run.settings.shape.precision, seen=seen)
    behaves = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._NormBase)
    stuck = sorted((not isinstance(m, behaves), n) for n, m in model.named_modules()
                   if m.training != modes[n])  # dropout and batch-norm named first
    stuck = [n for _, n in stuck]
    if stuck:
        problems.append(
            f"after evaluation {len(stuck)} module(s) stayed in eval mode while the model went "
            f"back to training ({', '.join(stuck[:3])}{', ...' if len(stuck) > 3 else ''}): "
            "dropout and batch-norm keep their evaluation behaviour for the rest of training - "
            "a `train()` override that does not call `super().train(mode)`, or code that "
            "switches submodules itself, does this")
    if any(p.grad is not g for p, g in zip(model.parameters(), grads_before, strict=True)):
        problems.append("evaluation created or changed gradients")
    counts = pd.Series([str(i) for i in seen]).value_counts()
    wanted = {str(it.id) for it in run.val_items}
    if set(counts.index) != wanted or (counts != 1).any():
        problems.append(f"validation predicted {len(seen)} times for {len(wanted)} examples "
                        f"(missing {len(wanted - set(counts.index))}, repeated "
                        f"{int((counts > 1).sum())})")
    longest = max(task.length(it.tensors) for it in run.val_items)
    detail = (f"eval batch {run.settings.eval_batch}, longest eval length {longest}; "
              f"{len(run.val_items)} examples each predicted once")
    return ("fail", "; ".join(problems)) if problems else ("pass", detail)


def _save_work(run: GateRun, _) -> Path:
    stepper = run.work.stepper
    shape = run.settings.shape
    counters = {"step": 2, "examples": shape.micro_batch * (1 + shape.accumulation)}
    run.rng_at_save = ckpt.rng_state()
    return run.save(run.checkpoint, stepper.model, stepper.optimizer, stepper.scheduler,
                    stepper.scaler, counters, {"task": run.task.name}, own=run.task.save_state)


def _export_work(run: GateRun, _) -> Path:
    from safetensors.torch import save_model

    export = run.out_dir / "export.safetensors"
    if export.exists():
        raise WorkbookError(f"{export} exists", "export into a new run folder")
    save_model(run.work.stepper.model, str(export))
    return export


def _resume_work(run: GateRun, _) -> tuple[Any, dict]:
    fresh = build_stepper(run.task, run.settings.train_config())
    info = run.load(run.checkpoint, fresh.model, fresh.optimizer, fresh.scheduler,
                    fresh.scaler, own=run.task.restore_state)
    return fresh, info


def _resume_check(run: GateRun, _, result) -> tuple[str, str]:
    fresh, info = result
    stepper = run.work.stepper
    tied, restored = ckpt.tied_groups(stepper.model), ckpt.tied_groups(fresh.model)
    if tied != restored:
        untied = [" = ".join(g) for g in tied if g not in restored]
        return "fail", (f"tied weights {', '.join(untied)} are separate tensors after loading: "
                        "the restore replaced a shared parameter instead of copying into it "
                        "(load_state_dict/safetensors load_model keep the tie)")
    problems = []
    for (n, a), b in zip(stepper.model.state_dict().items(), fresh.model.state_dict().values(),
                         strict=True):
        if not torch.equal(a, b):
            problems.append(f"weight {n} differs after loading")
    sa, sb = stepper.optimizer.state_dict(), fresh.optimizer.state_dict()
    for key, state in sa["state"].items():
        other = sb["state"].get(key, {})
        for name, value in state.items():
            if not (isinstance(value, torch.Tensor) and name in other and
                    torch.equal(value, other[name])):
                problems.append(f"optimizer state {key}.{name} not restored")
                break
    if info["counters"].get("step") != 2:
        problems.append(f"counters {info['counters']} not restored")
    # the next update, from the same random state, must match the uninterrupted run
    for each in (stepper, fresh):
        ckpt.set_rng_state(run.rng_at_save)
        each.accumulate(run.work.group)
        each.step()
    diff = max_difference(dict(stepper.model.named_parameters()),
                          dict(fresh.model.named_parameters()))
    if diff > run.settings.resume_tolerance:
        problems.append(f"the next update differs from the uninterrupted run by {diff:.3g} "
                        f"(allowed {run.settings.resume_tolerance:g})")
    if problems:
        return "fail", "; ".join(problems[:4])
    return "pass", f"state and counters restored; next update max |diff| = {diff:g}"


def _no_checkpoint(run: GateRun) -> str | None:
    return _no_model(run) or (None if run.checkpoint.exists() else "no checkpoint was saved")


GATES = (
    Gate("data", _data_work, _data_check, chained=False, training=False),
    Gate("forward + loss", lambda run, _: run.work.forward(), _forward_check,
         prepare=GateRun.build_workload, finish=_note_loss),
    Gate("backward", lambda run, _: run.work.backward(), _backward_check,
         blocked=_no_finite_loss),
    Gate("update (first)", lambda run, _: run.work.update_first(), partial(update_check, 1),
         prepare=lambda run: BeforeUpdate.of(run.work.stepper), blocked=_no_finite_loss),
    Gate("update (later)", timed_update, later_update_check,
         prepare=lambda run: BeforeUpdate.of(run.work.stepper), blocked=_no_finite_loss),
    Gate("validation", lambda run, _: run.work.validation(), _validation_check, prepare=_modes,
         finish=lambda run: run.work.state.pop("eval_logits", None), blocked=_no_model),
    Gate("checkpoint save", _save_work, lambda run, _, path: (
        "pass", f"{ckpt.checkpoint_bytes(path) / 2**20:.2f} MiB in {path.name}/ (weights, "
        "optimizer, rng)"), blocked=_no_model, chained=False, training=False),
    Gate("export", _export_work, lambda run, _, path: (
        "pass", f"{path.stat().st_size / 2**20:.2f} MiB weights only"), blocked=_no_model,
         chained=False, training=False),
    Gate("resume", _resume_work, _resume_check, blocked=_no_checkpoint, chained=False,
         training=False),
)
assert tuple(g.phase for g in GATES) == PHASES


def run_gates(task: Task, settings: GateSettings, out_dir: str | Path,
              train_limit: int | None = None, **hooks: Any) -> GateReport:
    """Load the task's splits and pass every phase through its gate."""
    data = prepare(task, limits={"train": train_limit or 0})
    run = GateRun(task, settings, data.train, data.validation, Path(out_dir), **hooks)
    report = run.run()
    table = report.table()
    report.figures = {"gates": len(table), "failed": table.phase[table.verdict == "fail"]
                      .tolist(), "warned": table.phase[table.verdict == "warn"].tolist(),
                      "peak_allocated_bytes": int(table.peak_allocated_bytes.max()),
                      "peak_phase": table.phase[table.peak_allocated_bytes.idxmax()]}
    if run.generation:  # generation's measured share of a step: 08 prices the campaign with it
        spent, whole = run.generation
        report.figures.update(generation_s=round(spent, 4), update_s=round(whole, 4),
                              generation_share=round(min(spent / whole, 1.0), 4))
    return report


def display_table(report: GateReport) -> pd.DataFrame:
    """The gate table for people: MiB instead of bytes, the columns that do not vary."""
    t = report.table()
    out = t[["phase", "micro_batch", "seq_len", "eval_batch", "precision", "device"]].copy()
    for col in ("baseline_bytes", "peak_allocated_bytes", "peak_reserved_bytes"):
        out[col.replace("_bytes", "_mib")] = (t[col].astype(float) / 2**20).round(3)
    out["verdict"] = t.verdict
    return out


def show_gates(report: GateReport) -> None:
    """Notebook 03's full gate table for people, in two parts that fit beside JupyterLab's file
    browser at 1280 px (one table of ten columns was cut at the right, its long detail squeezed
    into rows 280 px tall): what each gate measured - memory in MiB, time in ms, headers in
    words, no empty column - then its verdict and what it checked, the detail given the width."""
    from IPython.display import display

    from ...base.frontend import human

    t = report.table()
    for columns in (["phase", "counter", "baseline_bytes", "peak_allocated_bytes",
                     "peak_reserved_bytes", "rss_peak_bytes", "time_s"],
                    ["phase", "verdict", "detail"]):
        display(human(t[columns]).set_index("phase").rename_axis(None))


def measure_gates(params: GatesParams | Mapping[str, Any], out_dir: Path
                  ) -> tuple[Task, GateSettings, GateReport]:
    """Notebook 03's gates from its parameters, before any prediction: the task, the settings
    and the gate report (its exports are written into `out_dir`)."""
    p = registry.GATES.check(params)
    task = p.load_task()
    settings = GateSettings(p.shape(), eval_batch=p.eval_batch, length=p.length,
                            device=p.device, lr=p.lr, seed=p.seed,
                            device_memory_gib=p.device_memory_gib, headroom=p.headroom,
                            input_bound_threshold=p.input_bound_threshold)
    return task, settings, run_gates(task, settings, out_dir, train_limit=p.train_limit or None)


def run(params: GatesParams | Mapping[str, Any], out_dir: Path) -> GatesResult:
    """Notebook 03 from its parameters: the gates (`measure_gates`), the prediction at the same
    settings, and the rental plan's prediction and fit."""
    params = registry.GATES.check(params)
    task, settings, report = measure_gates(params, out_dir)
    device = resolve_device(params.device)

    def predicted(plan: Plan, judged_here: bool = False) -> pd.DataFrame:
        # the plan sizes the campaign model (when the task declares one); the pilot-size
        # prediction is of the model measured here, the twin
        return predicted_or_reason(task, report.train_items, report.val_items, plan,
                                   device=str(device), cpu_exact=judged_here,
                                   campaign=not judged_here)

    plan = Plan(params.shape("plan_"), params.plan_length or longest_accepted(task),
                params.plan_eval_batch)
    planned = predicted(plan)
    overheads = Overheads.of(device, report.table(), params.cuda_context_gib,
                             params.allocator_cache_share)
    # the pilot-size prediction is judged against the gates measured here, on this device
    check = compare(predicted(settings.plan(), judged_here=True), report.table())
    return GatesResult(task, settings, report, check, plan, planned,
                       overheads, fit_table(planned, settings.device_memory_gib,
                                            settings.headroom, overheads),
                       rule_of_thumb(task, planned, campaign=True),
                       planned.attrs.get("refused"))


def save(result: GatesResult, out_dir: Path) -> str:
    """Write the gate table, the input-pipeline timings, the plan's fit and `summary.json` of
    notebook 03; the verdict."""
    from ...storage.runs import save_table, write_summary

    report = result.report
    save_table(report.table(), out_dir, "gates")
    save_table(report.pipeline, out_dir, "input_pipeline")
    save_table(result.fit, out_dir, "plan_fit")
    figures = {**report.figures,
               **summary_figures(result.check, result.plan, result.planned, result.fit),
               "plan_fits": result.fits,
               "plan_unpredicted": result.unpredicted,
               "plan_needs_sharding": result.needs_sharding,
               **({"plan_refused": result.plan_refused} if result.plan_refused else {}),
               "device_memory_gib": result.settings.device_memory_gib or None,
               "models": campaign.models(result.task).lines(),
               "ran_at": f"{result.settings.plan().label()} on {report.table().device.iloc[0]}",
               "overheads": "measured" if result.overheads.measured else "assumed"}
    write_summary(out_dir, result.verdict, figures, task=result.task.name)
    return result.verdict
