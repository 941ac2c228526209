"""Notebook 08: from measurements to a rental. The selection sheet (one row per candidate
configuration and GPU), the software-stack check, and a 3/7/30-day plan. It plans; it predicts
neither duration nor quality - every figure says whether it was measured or assumed."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from .errors import WorkbookError
from .loop import TrainConfig, build_stepper, check_precision, resolve_device
from .predict import Overheads, Plan, fit_table, plan_batches, predict
from .task import Task

GIB = 2**30


@dataclass
class Candidate:
    """One configuration to rent for."""

    name: str
    micro_batch: int
    accumulation: int
    length: int | None = None
    precision: str = "bf16"
    activation_checkpointing: bool = False
    replicas: int = 1  # data-parallel replicas, one GPU each
    eval_batch: int | None = None
    expected: str = ""  # the result this configuration is meant to produce

    def plan(self) -> Plan:
        return Plan(self.micro_batch, self.accumulation, self.length, self.eval_batch, None,
                    self.precision, self.activation_checkpointing)

    @property
    def strategy(self) -> str:
        return "single device" if self.replicas == 1 else f"data parallel x{self.replicas}"


def check_gpus(gpus: dict, tflops: dict) -> None:
    """Every GPU has a memory size and a peak throughput that are positive numbers."""
    problems = []
    for name, gib in gpus.items():
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib <= 0:
            problems.append(f"memory of {name!r} is {gib!r}, not a positive number of GiB")
        if name not in tflops:
            problems.append(f"no peak TFLOP/s for {name!r}")
    for name, value in tflops.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            problems.append(f"peak TFLOP/s of {name!r} is {value!r}, not a positive number")
    if problems:
        raise WorkbookError("GPU list: " + "; ".join(problems),
                            "give gpus as {name: GiB} and gpu_tflops as {name: TFLOP/s}")


def gpu(name: str, gpus: dict) -> float:
    if name not in gpus:
        raise WorkbookError(f"unknown GPU {name!r}", f"use one of {sorted(gpus)} or add it to "
                            "the gpus parameter with its memory")
    return gpus[name]


def flops(task: Task, train: list, val: list, cand: Candidate) -> dict[str, int]:
    """FLOPs of one training micro-batch (forward + backward) and of one evaluation example,
    counted by torch.utils.flop_counter on fake tensors (nothing is allocated)."""
    batch, _, eval_batch = plan_batches(task, train, val, cand.plan())
    cfg = TrainConfig(micro_batch=cand.micro_batch, accumulation=cand.accumulation,
                      precision="fp32", activation_checkpointing=cand.activation_checkpointing)
    with FakeTensorMode() as fake:
        stepper = build_stepper(task, cfg)
        fb = {k: fake.from_tensor(v) for k, v in batch.tensors.items()}
        fe = {k: fake.from_tensor(v) for k, v in eval_batch.tensors.items()}
        with FlopCounterMode(display=False) as counter:
            _, loss, _ = stepper.forward_loss(type(batch)(batch.ids, fb))
            loss.backward()
        train_flops = counter.get_total_flops()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            task.forward(stepper.model, fe)
        eval_flops = counter.get_total_flops() / len(eval_batch)
    return {"train_micro_batch": int(train_flops), "eval_example": int(eval_flops)}


@dataclass
class Assumptions:
    """What the sheet does not measure here, stated once."""

    utilisation: float = 0.35  # share of the GPU's peak the training reaches (MFU)
    eval_every: int = 50
    eval_examples: int = 0  # validation examples per evaluation (0: the task's set)
    export_minutes: float = 5.0  # saving and exporting a final checkpoint
    overheads: Overheads = field(default_factory=lambda: Overheads(GIB, 0.1, False))
    ddp_bucket_share: float = 1.0  # data parallel keeps gradient buckets ~ the gradients


def selection_sheet(task: Task, train: list, val: list, candidates: list[Candidate],
                    gpus: dict, tflops: dict, updates: int, headroom: float,
                    a: Assumptions) -> pd.DataFrame:
    """One row per candidate x GPU: memory needed (predicted) and whether it fits, FLOPs per
    update (counted) and time per update (assumed utilisation), and the budget's hours."""
    check_gpus(gpus, tflops)
    rows = []
    eval_examples = a.eval_examples or len(val)
    for cand in candidates:
        try:
            predicted = predict(task, train, val, cand.plan())
            counted = flops(task, train, val, cand)
        except WorkbookError as exc:  # e.g. checkpointing a model without blocks: a row
            rows += [{"candidate": cand.name, "gpu": name, "gpu_memory_gib": gib,
                      "precision": cand.precision, "micro_batch": cand.micro_batch,
                      "accumulation": cand.accumulation, "strategy": cand.strategy,
                      "fits": False, "note": f"not applicable: {exc.problem}",
                      "expected": cand.expected} for name, gib in gpus.items()]
            continue
        peak = predicted.loc[predicted.predicted_peak_bytes.idxmax()]
        ddp = 0
        if cand.replicas > 1:
            ddp = int(peak.parameter_bytes * a.ddp_bucket_share)
        update_flops = counted["train_micro_batch"] * cand.accumulation  # per replica
        for name, gib in gpus.items():
            fit = fit_table(predicted.assign(predicted_peak_bytes=predicted.predicted_peak_bytes
                                             + ddp), gib, headroom, a.overheads)
            rate = tflops[name] * 1e12 * a.utilisation
            update_s = update_flops / rate
            eval_s = counted["eval_example"] * eval_examples / rate / cand.replicas
            hours = (updates * update_s + math.ceil(updates / a.eval_every) * eval_s +
                     a.export_minutes * 60) / 3600
            rows.append({
                "candidate": cand.name, "gpu": name, "gpu_memory_gib": gib,
                "precision": cand.precision, "micro_batch": cand.micro_batch,
                "accumulation": cand.accumulation,
                "activation_checkpointing": cand.activation_checkpointing,
                "strategy": cand.strategy, "max_length": cand.length,
                "examples_per_update": cand.micro_batch * cand.accumulation * cand.replicas,
                "peak_phase": peak.phase,
                "predicted_peak_gib": round((peak.predicted_peak_bytes + ddp) / GIB, 3),
                "required_gib": round(fit.required_bytes.max() / GIB, 3),
                "fits": bool(fit.fits.all()),
                "headroom_gib": round(gib - fit.required_bytes.max() / GIB, 2),
                "flops_per_update": update_flops, "time_per_update_s": update_s,
                "budget_hours": round(hours, 4), "note": "", "expected": cand.expected})
    sheet = pd.DataFrame(rows)
    sheet.attrs["sources"] = {
        "predicted_peak_gib": "predicted on fake tensors (notebook 03's prediction)",
        "required_gib": f"prediction x (1 + {a.overheads.cache_share:.0%} allocator cache) + "
                        f"{a.overheads.context_bytes / GIB:.2f} GiB context, x (1 + "
                        f"{headroom:.0%} headroom); overheads "
                        f"{'measured' if a.overheads.measured else 'assumed'}",
        "flops_per_update": "counted with torch.utils.flop_counter",
        "time_per_update_s": f"assumed: vendor peak TFLOP/s x {a.utilisation:.0%} utilisation",
        "budget_hours": f"{updates} updates + evaluation every {a.eval_every} on "
                        f"{eval_examples} examples + {a.export_minutes} min export (assumed)"}
    return sheet


def stack_check(task_path: str, device: str, precision: str) -> pd.DataFrame:
    """The software stack verified here - Python, torch, CUDA, the precision, and every package
    the task's module imports - and what must still be verified on the rental."""
    dev = resolve_device(device)
    rows = [{"item": "python", "here": sys.version.split()[0], "verified": True,
             "on the rental": "the same minor version"},
            {"item": "torch", "here": torch.__version__, "verified": True,
             "on the rental": "the same version, in a CUDA build"},
            {"item": "CUDA", "here": torch.version.cuda if torch.cuda.is_available()
             else "none (CPU)", "verified": torch.cuda.is_available(),
             "on the rental": "driver and runtime that match the torch build"}]
    try:
        check_precision(precision, dev)
        ok, note = True, f"{precision} runs on {dev}"
    except WorkbookError as exc:
        ok, note = False, exc.problem
    rows.append({"item": f"precision {precision}", "here": note, "verified": ok,
                 "on the rental": {"bf16": "bf16 support (Ampere or newer)",
                                   "fp16": "the GradScaler path on the GPU"}.get(precision,
                                                                                 "-")})
    for module, dist, version in task_imports(task_path.split(":")[0]):
        rows.append({"item": f"import {module}", "here": f"{dist} {version}" if dist else
                     "not an installed distribution", "verified": version is not None,
                     "on the rental": "install the same version" if dist else
                     "ship the module with the code"})
    return pd.DataFrame(rows)


def task_imports(module_name: str) -> list[tuple[str, str | None, str | None]]:
    """Top-level modules the task's module imports (read from its source, not run), with the
    installed distribution and version behind each; the standard library is left out."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return []
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    dists = importlib.metadata.packages_distributions()
    out = []
    for name in sorted(names - set(sys.stdlib_module_names) - {"__future__"}):
        dist = (dists.get(name) or [None])[0]
        out.append((name, dist, importlib.metadata.version(dist) if dist else None))
    return out


def pack(variants: list[dict], sheet: pd.DataFrame, gpu_name: str, days: int,
         reserve_share: float) -> pd.DataFrame:
    """Variants by priority into `days` of one rental, keeping `reserve_share` of the time for
    evaluation, export and the unexpected. What does not fit is listed, not dropped."""
    usable = days * 24 * (1 - reserve_share)
    rows, clock = [], 0.0
    for v in sorted(variants, key=lambda v: v["priority"]):
        match = sheet[(sheet.candidate == v["candidate"]) & (sheet.gpu == gpu_name)]
        if match.empty:
            raise WorkbookError(f"variant {v['name']!r} names candidate {v['candidate']!r}, "
                                "which the selection sheet does not have",
                                f"use one of {sorted(set(sheet.candidate))}")
        row = match.iloc[0]
        hours = row.budget_hours * v.get("repeats", 1)
        fits = bool(row.fits) and clock + hours <= usable
        rows.append({"days": days, "priority": v["priority"], "variant": v["name"],
                     "candidate": v["candidate"], "gpu": gpu_name, "hours": round(hours, 3),
                     "start_hour": round(clock, 3) if fits else None,
                     "end_hour": round(clock + hours, 3) if fits else None,
                     "scheduled": fits,
                     "why_not": "" if fits else ("does not fit the GPU's memory"
                                                 if not row.fits else
                                                 f"needs {hours:.1f} h, {usable - clock:.1f} h "
                                                 "left")})
        if fits:
            clock += hours
    return pd.DataFrame(rows)


def candidates_from(specs: list[dict]) -> list[Candidate]:
    """Candidates from the notebook's list of dicts; an unknown key is named."""
    fields = set(Candidate.__dataclass_fields__)
    out = []
    for spec in specs:
        unknown = set(spec) - fields
        if unknown or "name" not in spec:
            raise WorkbookError(f"candidate {spec.get('name', spec)!r}: unknown keys "
                                f"{sorted(unknown)}" if unknown else f"candidate {spec} has "
                                "no name", f"use the keys {sorted(fields)}")
        out.append(Candidate(**spec))
    return out


def choose(sheet: pd.DataFrame, rental_gpu: str) -> dict | None:
    """The first candidate (in the order given) that fits the rental GPU."""
    fitting = sheet[(sheet.gpu == rental_gpu) & sheet.fits]
    return fitting.iloc[0].to_dict() if len(fitting) else None


def conclusion(run_dir, chosen: dict | None, rental_gpu: str, plans: pd.DataFrame,
               stack: pd.DataFrame) -> str:
    """The campaign's conclusion in words that can be re-read later, from the measurements of
    the other notebooks of this run where they exist."""
    import json
    from pathlib import Path

    def summary(stem):
        path = Path(run_dir) / stem / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None

    lines = ["# Rental decision", ""]
    if chosen is None:
        lines.append(f"No candidate fits the {rental_gpu}: do not rent it for this plan. "
                     "See the selection sheet for a larger GPU or a cheaper configuration.")
    else:
        lines.append(f"Rent a **{rental_gpu}** for candidate **{chosen['candidate']}** "
                     f"({chosen['strategy']}, {chosen['precision']}, micro-batch "
                     f"{chosen['micro_batch']} x accumulation {chosen['accumulation']}): "
                     f"{chosen['required_gib']:.2f} GiB needed with headroom, "
                     f"{chosen['headroom_gib']:.2f} GiB left. Expected: "
                     f"{chosen['expected'] or 'not stated'}.")
    study = summary("06_lr_study")
    if study:
        fig = study["figures"]
        lrs = fig.get("best_lr")
        lines.append("")
        lines.append(f"Learning-rate study: best {fig['metric']} {fig['best_metric']} at lr "
                     f"{lrs} (trial {fig['best_trial']}), statuses {fig['statuses']}. "
                     + ("The control remains the best choice: no variant beat it."
                        if fig.get("control_remains_best") else
                        f"A variant beat the control (lr {fig.get('control_lr')})."))
    for stem, label in (("01_inspect_examples", "inspection"), ("02_overfit", "overfit"),
                        ("03_phase_gates", "phase gates"), ("04_batch_accounting",
                                                            "batch accounting"),
                        ("05_memory_variants", "memory variants"),
                        ("07_resume_reload", "resume and reload")):
        s = summary(stem)
        if s:
            lines.append(f"- {label}: {s['verdict']}")
    for days, plan in plans.groupby("days"):
        left = plan[~plan.scheduled]
        lines.append(f"- {days}-day plan: {int(plan.scheduled.sum())} of {len(plan)} variants "
                     f"scheduled" + (f"; not fitting: {', '.join(left.variant)}" if len(left)
                                     else ""))
    todo = stack[~stack.verified]
    lines += ["", "Still to verify on the rental before adopting it: " +
              (", ".join(todo.item) if len(todo) else "nothing beyond the versions listed"),
              "", "This sheet plans; it predicts neither duration nor quality. Times rest on "
              "an assumed utilisation; memory on a fake-tensor prediction plus stated "
              "overheads."]
    return "\n".join(lines) + "\n"
