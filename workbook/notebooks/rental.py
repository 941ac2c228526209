"""Notebook 08: from measurements to a rental. The selection sheet (one row per candidate
configuration and GPU), the software-stack check, and a 3/7/30-day plan. It plans; it predicts
neither duration nor quality - every figure says whether it was measured or assumed."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from ..base.errors import WorkbookError, reason
from ..contract.data import prepare
from ..contract.task import Task, task_from_params
from ..storage.artifacts import read_json
from ..training import campaign as models
from ..training import sharding
from ..training.loop import UpdateShape, build_stepper, check_precision, resolve_device
from ..training.predict import (
    Overheads,
    Plan,
    fake_model,
    fit_table,
    longest_accepted,
    predict,
    sized_batches,
)
from ..training.workload import TRAINING_PHASES

GIB = 2**30


STRATEGIES = ("single", "ddp", "fsdp")


@dataclass
class Candidate:
    """One configuration to rent for: a named plan and the result it is meant to produce, and
    how it spreads over GPUs (`strategy`): "single" (one GPU), "ddp" (data parallel, one whole
    copy of the model per GPU, `plan.shape.replicas` GPUs) or "fsdp" (FSDP2 full sharding over
    `world` GPUs, 2..64, `gpus_per_node` per node; no `world`: every count of
    `sharding.WORLDS` is sized and each GPU type gets the smallest that fits). Under fsdp
    micro_batch x accumulation is the whole update, split evenly over the GPUs
    (`sharding.per_gpu_split`), so every count trains the same experiment; `offload_optimizer`
    keeps the sharded state in host memory (FSDP2 CPUOffloadPolicy)."""

    name: str
    plan: Plan
    expected: str = ""
    strategy: str = ""  # "" : "single" or "ddp" by the plan's replicas
    world: int | None = None
    gpus_per_node: int = 8
    offload_optimizer: bool = False

    @property
    def parallelism(self) -> str:
        """How the update is spread: \"single\", \"ddp\" or \"fsdp\"."""
        if self.strategy:
            return self.strategy
        return "single" if self.plan.shape.replicas == 1 else "ddp"

    def label(self, world: int | None = None) -> str:
        """The strategy in words, as the sheet's `strategy` column shows it."""
        if self.parallelism == "fsdp":
            world = world or self.world
            nodes = sharding.nodes(world, self.gpus_per_node) if world else None
            return (f"FSDP2 full sharding x{world or 'N'}" +
                    (f" ({nodes} nodes of {self.gpus_per_node})" if nodes and nodes > 1
                     else "") + (" + optimizer offload" if self.offload_optimizer else ""))
        replicas = self.plan.shape.replicas
        return "single device" if replicas == 1 else f"data parallel x{replicas}"

    def described(self, gpu: str, gib: float, world: int | None = None,
                  shape: UpdateShape | None = None) -> dict:
        """The first columns of its selection-sheet row on `gpu` (`world` GPUs, each making
        `shape`'s micro-batches, for fsdp)."""
        shape = shape or self.plan.shape
        count = world if self.parallelism == "fsdp" else shape.replicas
        return {"candidate": self.name, "gpu": gpu, "gpu_memory_gib": gib,
                "precision": shape.precision, "micro_batch": shape.micro_batch,
                "accumulation": shape.accumulation,
                "activation_checkpointing": shape.activation_checkpointing,
                "strategy": self.label(world), "gpus": count,
                "nodes": sharding.nodes(count, self.gpus_per_node) if count else None,
                "max_length": self.plan.length,
                "examples_per_update": shape.micro_batch * shape.accumulation * (count or 1)}


def check_gpus(gpus: dict, tflops: dict, prices: dict | None = None) -> None:
    """Every GPU has a memory size and a peak throughput that are positive numbers (and a
    price, when prices are given)."""
    problems = []
    for name in gpus:
        if prices and not (isinstance(prices.get(name), (int, float)) and prices[name] >= 0):
            problems.append(f"no price per hour for {name!r} (got {prices.get(name)!r})")
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
                            "give gpus as {name: GiB}, gpu_tflops as {name: TFLOP/s} and "
                            "gpu_price_per_hour as {name: price} for the same names")


def gpu(name: str, gpus: dict) -> float:
    if name not in gpus:
        raise WorkbookError(f"unknown GPU {name!r}", f"use one of {sorted(gpus)} or add it to "
                            "the gpus parameter with its memory")
    return gpus[name]


def flops(task: Task, train: list, val: list, cand: Candidate) -> dict[str, int]:
    """FLOPs of one training micro-batch (forward + backward) and of one evaluation example of
    the model the rental trains (the campaign model, when the task declares one), counted by
    torch.utils.flop_counter on fake tensors (nothing is allocated). A deep campaign model is
    counted at 2, 3 and 4 layers and extrapolated along its depth (`campaign.by_depth`: FLOPs
    add up per layer)."""
    counted, _ = models.by_depth(task, lambda t: _flops(t, train, val, cand))
    return {k: int(round(v)) for k, v in counted.items()}


def _flops(task: Task, train: list, val: list, cand: Candidate) -> dict[str, int]:
    batch, _, eval_batch = sized_batches(task, train, val, cand.plan)
    # FLOPs: no autocast, and the same count on any device (the batches stay on the CPU)
    cfg = replace(cand.plan.shape, precision="fp32").train_config(device="cpu")
    with FakeTensorMode() as fake:
        stepper = build_stepper(task, cfg, fake_model(task, cfg, fake, campaign=True))
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
    prices: dict = field(default_factory=dict)  # per GPU-hour; {} = costs not shown
    currency: str = "USD"
    min_update_s: float = 0.005  # no update is faster: kernel launches of even a tiny model


def selection_sheet(task: Task, train: list, val: list, candidates: list[Candidate],
                    gpus: dict, tflops: dict, updates: int, headroom: float,
                    a: Assumptions) -> pd.DataFrame:
    """One row per candidate x GPU: memory needed (predicted) and whether it fits, FLOPs per
    update (counted) and time per update (assumed utilisation), and the budget's hours. A
    candidate the prediction cannot size has rows without memory whose `note` says why."""
    check_gpus(gpus, tflops, a.prices)
    rows = []
    eval_examples = a.eval_examples or len(val)
    longest = longest_accepted(task)
    which = models.which(task)
    for cand in candidates:
        # no length given: the model's longest
        cand = replace(cand, plan=replace(cand.plan, length=cand.plan.length or longest))
        if cand.parallelism == "fsdp":
            rows += [{**row, "model": which} for row in sharded_rows(
                task, train, val, cand, gpus, tflops, updates, headroom, eval_examples, a)]
            continue
        predicted, note = predicted_phases(task, train, val, cand)
        counted, flops_note = counted_flops(task, train, val, cand) \
            if not note.startswith("not applicable") else (None, "")
        note = "; ".join(n for n in (note, flops_note) if n)
        for name, gib in gpus.items():
            rows.append({**cand.described(name, gib),
                         **memory_columns(predicted, cand, gib, headroom, a),
                         **time_columns(counted, cand, tflops[name], updates, eval_examples,
                                        a, a.prices.get(name)),
                         "currency": a.currency, "note": note, "expected": cand.expected,
                         "model": which})
    sheet = pd.DataFrame(rows)
    for column in NUMBERS:  # a column no candidate could fill is NaN, not None
        sheet[column] = pd.to_numeric(sheet[column])
    sheet.attrs["models"] = models.models(task).lines()
    sheet.attrs["sources"] = {
        "model": "the model every figure is for: " + "; ".join(sheet.attrs["models"]),
        "predicted_peak_gib": "predicted on fake tensors (notebook 03's prediction); fsdp rows "
                              "per GPU, over a fake process group of that many ranks "
                              "(workbook.training.sharding)",
        "required_gib": f"prediction x (1 + {a.overheads.cache_share:.0%} allocator cache) + "
                        f"{a.overheads.context_bytes / GIB:.2f} GiB context, x (1 + "
                        f"{headroom:.0%} headroom); overheads "
                        f"{'measured' if a.overheads.measured else 'assumed'}",
        "flops_per_update": "counted with torch.utils.flop_counter",
        "time_per_update_s": f"assumed: vendor peak TFLOP/s x {a.utilisation:.0%} utilisation, "
                             f"never below {a.min_update_s * 1000:.0f} ms (launch overhead; "
                             "`time_floored` marks the rows held at that floor)",
        "cost": f"assumed prices per GPU-hour in {a.currency} (edit gpu_price_per_hour) x "
                "budget hours x GPUs (replicas, or the FSDP world)",
        "budget_hours": f"{updates} updates + evaluation every {a.eval_every} on "
                        f"{eval_examples} examples + {a.export_minutes} min export (assumed)"}
    return sheet


# the training phases decide a fit; a validation row the prediction cannot size (the fused
# inference kernel of nn.TransformerEncoderLayer) is named in the note and left out
DECIDING = TRAINING_PHASES[:-1]
NUMBERS = ("predicted_peak_gib", "required_gib", "headroom_gib", "flops_per_update",
           "time_per_update_s", "budget_hours", "gpu_hours", "price_per_hour", "cost")


def predicted_phases(task: Task, train: list, val: list,
                     cand: Candidate) -> tuple[pd.DataFrame | None, str]:
    """The predicted phases a candidate's fit rests on, and a note on what was not predicted;
    None when a training phase has no prediction (the candidate cannot be sized)."""
    try:
        predicted = predict(task, train, val, cand.plan, campaign=True)
    except WorkbookError as exc:  # a refused configuration, or an op fake tensors cannot run
        word = "not predicted" if exc.problem.startswith("predicting") else "not applicable"
        return None, f"{word}: {exc.problem}"
    except Exception as exc:  # never a crash of the notebook: the row says what happened
        return None, f"not predicted: the prediction raised {type(exc).__name__}: {reason(exc)}"
    missing = predicted[predicted.predicted_peak_bytes.isna()]
    if missing.phase.isin(DECIDING).any():
        return None, "not predicted " + unpredicted(missing)
    scaled = predicted[predicted.note.fillna("").str.startswith("sized from the measured")]
    said = "; ".join(f"({r.phase}) {r.note}" for r in scaled.itertuples())
    if len(missing):
        return (predicted.dropna(subset=["predicted_peak_bytes"]),
                f"not predicted {unpredicted(missing)}; the fit rests on the training phases"
                + (f"; {said}" if said else ""))
    return predicted, said


def unpredicted(missing: pd.DataFrame) -> str:
    """'(phase, phase): reason; (phase): reason' for phases without a prediction."""
    by_reason: dict[str, list[str]] = {}
    for r in missing.itertuples():
        why = str(r.note).removeprefix("not predicted: ") if isinstance(r.note, str) and r.note \
            else "no reason given"
        by_reason.setdefault(why, []).append(r.phase)
    return "; ".join(f"({', '.join(phases)}): {why}" for why, phases in by_reason.items())


def counted_flops(task: Task, train: list, val: list,
                  cand: Candidate) -> tuple[dict[str, int] | None, str]:
    """`flops`, or None and a note when the count fails on this model."""
    try:
        return flops(task, train, val, cand), ""
    except Exception as exc:
        problem = exc.problem if isinstance(exc, WorkbookError) else \
            f"{type(exc).__name__}: {reason(exc)}"
        return None, f"FLOPs not counted, so no time or cost: {problem}"


def memory_columns(predicted: pd.DataFrame | None, cand: Candidate, gib: float,
                   headroom: float, a: Assumptions) -> dict:
    """The memory part of a sheet row on a GPU of `gib`: empty (and not fitting) when the
    candidate was not sized."""
    if predicted is None:
        return {"peak_phase": None, "predicted_peak_gib": None, "required_gib": None,
                "fits": False, "headroom_gib": None}
    peak = predicted.loc[predicted.predicted_peak_bytes.idxmax()]
    ddp = int(peak.parameter_bytes * a.ddp_bucket_share) if cand.plan.shape.replicas > 1 else 0
    fit = fit_table(predicted.assign(predicted_peak_bytes=predicted.predicted_peak_bytes + ddp),
                    gib, headroom, a.overheads)
    return {"peak_phase": peak.phase,
            "predicted_peak_gib": round((peak.predicted_peak_bytes + ddp) / GIB, 3),
            "required_gib": round(fit.required_bytes.max() / GIB, 3),
            "fits": bool(fit.fits.all()),
            "headroom_gib": round(gib - fit.required_bytes.max() / GIB, 2)}


def time_columns(counted: dict[str, int] | None, cand: Candidate, tflops: float, updates: int,
                 eval_examples: int, a: Assumptions, price: float | None,
                 gpus: int | None = None, accumulation: int | None = None) -> dict:
    """The time and cost part of a sheet row on `gpus` GPUs (default: the plan's replicas) of
    `tflops` each, every GPU making `accumulation` micro-batches per update (default: the
    plan's): empty without a FLOP count. Cost = budget hours x GPUs x price per GPU-hour."""
    if counted is None:
        return {"flops_per_update": None, "time_per_update_s": None, "time_floored": False,
                "budget_hours": None, "gpu_hours": None, "price_per_hour": price, "cost": None}
    count = gpus or cand.plan.shape.replicas
    update_flops = counted["train_micro_batch"] * (accumulation or cand.plan.shape.accumulation)
    rate = tflops * 1e12 * a.utilisation
    update_s = max(update_flops / rate, a.min_update_s)  # every GPU works in parallel
    eval_s = counted["eval_example"] * eval_examples / rate / count
    hours = (updates * update_s + math.ceil(updates / a.eval_every) * eval_s +
             a.export_minutes * 60) / 3600
    return {"flops_per_update": update_flops, "time_per_update_s": update_s,
            "time_floored": update_s == a.min_update_s,
            "budget_hours": round(hours, 4), "gpu_hours": round(hours * count, 4),
            "price_per_hour": price,
            "cost": None if price is None else round(hours * count * price, 2)}


def sharded_rows(task: Task, train: list, val: list, cand: Candidate, gpus: dict, tflops: dict,
                 updates: int, headroom: float, eval_examples: int,
                 a: Assumptions) -> list[dict]:
    """The sheet rows of an fsdp candidate: per GPU type the smallest world of the candidate's
    (its `world`, or every one of `sharding.WORLDS`) whose per-GPU peak of every phase fits
    with headroom (the largest world sized, not fitting, when none does). One fake run per
    per-GPU micro-batch size (`sharding.sharded_run`), the other worlds derived from it."""
    shape = cand.plan.shape
    worlds = [cand.world] if cand.world else list(sharding.WORLDS)
    notes: dict[int, str] = {}
    split: dict[int, tuple[int, int]] = {}
    for w in worlds:
        each = sharding.per_gpu_split(shape.micro_batch, shape.accumulation, w)
        if each is None:
            notes[w] = (f"{shape.micro_batch * shape.accumulation} examples per update do not "
                        f"split evenly over {w} GPUs")
        else:
            split[w] = each
    frames: dict[int, pd.DataFrame | None] = {}
    counted: dict[int, dict | None] = {}
    for micro in sorted({m for m, _ in split.values()}, reverse=True):
        group = [w for w, (m, _) in split.items() if m == micro]
        longest_acc = max(split[w][1] for w in group)
        plan = replace(cand.plan, shape=replace(shape, micro_batch=micro,
                                                accumulation=min(longest_acc, 2)))
        try:
            run = sharding.sharded_run(task, train, val, plan, min(group),
                                       offload_optimizer=cand.offload_optimizer, campaign=True)
            note = ""
        except WorkbookError as exc:
            run, note = None, (f"not predicted: {exc.problem}" if exc.problem.startswith(
                "predicting") else f"not applicable: {exc.problem}")
        except Exception as exc:
            run, note = None, (f"not predicted: the sharded prediction raised "
                               f"{type(exc).__name__}: {reason(exc)}")
        sized_here = run is not None and not any(p in run.limits for p in DECIDING)
        flop_count, flops_note = counted_flops(task, train, val, replace(cand, plan=plan)) \
            if sized_here else (None, "")
        for w in group:
            frame = run.at(w) if run is not None else None
            why = note
            if frame is not None:
                missing = frame[frame.predicted_peak_bytes.isna()]
                if missing.phase.isin(DECIDING + (sharding.CHECKPOINT_SAVE,)).any():
                    frame, why = None, "not predicted " + unpredicted(missing)
                elif len(missing):
                    frame = frame.dropna(subset=["predicted_peak_bytes"])
                    why = (f"not predicted {unpredicted(missing)}; the fit rests on the "
                           "training phases and the checkpoint save")
            frames[w], counted[w] = frame, flop_count
            notes[w] = "; ".join(n for n in (why, flops_note) if n)
    rows = []
    sized_worlds = [w for w in worlds if frames.get(w) is not None]
    for name, gib in gpus.items():
        chosen, memory = None, None
        for w in sized_worlds:
            memory = memory_columns(frames[w], cand, gib, headroom, a)
            chosen = w
            if memory["fits"]:
                break
        if chosen is None:  # nothing sized: the first world's reason
            chosen = next((w for w in worlds if w in split), worlds[0])
            memory = memory_columns(None, cand, gib, headroom, a)
        micro, acc = split.get(chosen, (shape.micro_batch, shape.accumulation))
        per_gpu = replace(shape, micro_batch=micro, accumulation=acc)
        skipped = [f"x{w}: {notes[w]}" for w in worlds if w not in sized_worlds and notes.get(w)]
        derived = frames.get(chosen) is not None and bool(frames[chosen].note.str.contains(
            "derived from").any())
        note = "; ".join(n for n in (
            notes.get(chosen, "") if chosen in sized_worlds else "",
            "per-GPU peaks derived from the fake run at another world size (the sharded "
            "state scaled as 1/N)" if derived else "",
            ("not sized: " + "; ".join(skipped)) if skipped and sized_worlds else
            "; ".join(skipped) if skipped else "") if n)
        rows.append({**cand.described(name, gib, chosen, per_gpu), **memory,
                     **time_columns(counted.get(chosen), cand, tflops[name], updates,
                                    eval_examples, a, a.prices.get(name), chosen, acc),
                     "currency": a.currency, "note": note, "expected": cand.expected})
    return rows


def stack_check(task_path: str, device: str, precision: str, replicas: int = 1,
                run_dir: str | Path | None = None) -> pd.DataFrame:
    """The software stack verified here - Python, torch, CUDA, the precision, data parallelism
    when a candidate uses replicas (notebook 09's verdict, when it ran in `run_dir`), and every
    package the task's module imports - and what must still be verified on the rental."""
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
    if replicas > 1:
        rows.append(data_parallel_row(replicas, run_dir))
    for module, dist, version in task_imports(task_path.split(":")[0]):
        rows.append({"item": f"import {module}", "here": f"{dist} {version}" if dist else
                     "not an installed distribution", "verified": version is not None,
                     "on the rental": "install the same version" if dist else
                     "ship the module with the code"})
    return pd.DataFrame(rows)


def data_parallel_row(replicas: int, run_dir: str | Path | None) -> dict[str, object]:
    """What notebook 09 verified of data parallelism (torchrun + DDP), read from its summary."""
    path = Path(run_dir) / "09_data_parallel" / "summary.json" if run_dir else None
    summary = read_json(path, "notebook 09's summary") if path and path.exists() else None
    if summary is None:
        here, ok = ("not run yet: notebook 09 checks the multi-host rules (the pilot runs it "
                    "after this one; the report shows its verdict)"), False
    else:
        rules = summary.get("rules") or {}
        failing = [r for r, v in rules.items() if v == "fail"]
        ok = summary.get("verdict") == "pass"
        here = (f"notebook 09: {len(rules)} rules, " + (f"failing: {', '.join(failing)}"
                                                        if failing else "none failing") +
                f" ({summary.get('figures', {}).get('replicas')} CPU processes, gloo)")
    return {"item": f"data parallel x{replicas} (torchrun + DDP)", "here": here, "verified": ok,
            "on the rental": "NCCL, SyncBatchNorm and the interconnect: run notebook 09 there "
                             f"with --device cuda -p replicas={replicas}"}


def sharded_row(candidates: list[Candidate], sheet: pd.DataFrame) -> dict[str, object]:
    """What this machine verified of FSDP2 full sharding: the per-GPU prediction only."""
    worlds = sorted({int(w) for w in sheet[sheet.candidate.isin([c.name for c in candidates])]
                     .gpus.dropna()})
    return {"item": "FSDP2 full sharding (fully_shard) x" + "/".join(map(str, worlds or ["N"])),
            "here": "sized on fake tensors over a fake process group (nothing run sharded "
                    "here; notebook 09 runs the loop under FSDP2 on CPU processes)",
            "verified": False,
            "on the rental": "NCCL over the GPUs and nodes, a torch.distributed.checkpoint save "
                             "by every rank and an exact resume from it, and the per-GPU peak "
                             "(torch.cuda.max_memory_allocated) against the sheet"}


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
        cost = row.get("cost")
        lr = v.get("lr")
        rows.append({"days": days, "priced_on": priced_on, "priority": v["priority"],
                     "variant": v["name"], "candidate": v["candidate"], "gpu": gpu_name,
                     "gpus": _plain(row.get("gpus")), "strategy": row.get("strategy"),
                     "lr": float(lr) if isinstance(lr, (int, float)) else None,
                     "lr_from": v.get("lr_from", ""), "repeats": repeats,
                     "hours": round(hours, 3), "cost": None if pd.isna(cost) else
                     round(float(cost) * repeats, 2),
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
                "strategy", "lr", "lr_from", "repeats", "hours", "cost", "start_hour",
                "end_hour", "scheduled", "why_not", "planned_as"]

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


def same_update(a: Candidate, b: Candidate) -> bool:
    """Whether two candidates train the same experiment: the same examples per update, the
    precision and the length (how they are spread over GPUs aside)."""
    sa, sb = a.plan.shape, b.plan.shape
    return (sa.examples_per_update, sa.precision, a.plan.length) == \
        (sb.examples_per_update, sb.precision, b.plan.length)


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


def check_variants(variants: Any, candidates: list[Candidate]) -> None:
    """Every variant has a name, a numeric priority and a candidate of the list (repeats, when
    given, a positive integer), before anything is sized."""
    names = [c.name for c in candidates]
    if not isinstance(variants, list):
        raise WorkbookError(f"variants must be a list, got {variants!r}",
                            'give e.g. [{"name": "control", "priority": 1, "candidate": '
                            f'{names[0]!r}, "repeats": 3}}]')
    keys = {"name", "priority", "candidate", "repeats", "lr"}
    optional = {"repeats", "lr"}
    problems = []
    for v in variants:
        if not isinstance(v, dict):
            problems.append(f"{v!r} is not a dict")
            continue
        shown = v.get("name", v)
        if set(v) - keys or keys - optional - set(v):
            problems.append(f"variant {shown!r}: unknown keys {sorted(set(v) - keys)}, missing "
                            f"{sorted(keys - optional - set(v))}")
        elif isinstance(v["priority"], bool) or not isinstance(v["priority"], (int, float)):
            problems.append(f"variant {shown!r}: priority {v['priority']!r} is not a number")
        elif v["candidate"] not in names:
            problems.append(f"variant {shown!r} names candidate {v['candidate']!r}, which is "
                            "not in the candidates")
        elif not (isinstance(r := v.get("repeats", 1), int) and not isinstance(r, bool)
                  and r > 0):
            problems.append(f"variant {shown!r}: repeats {r!r} is not a positive integer")
        elif "lr" in v and v["lr"] not in VARIANT_LRS and (
                isinstance(v["lr"], bool) or not isinstance(v["lr"], (int, float)) or
                not v["lr"] >= 0):
            problems.append(f"variant {shown!r}: lr {v['lr']!r} is not a number of 0 or more "
                            "(0: the task's own), 'control' or 'study'")
    if problems:
        raise WorkbookError("variants: " + "; ".join(problems),
                            f"give each variant name, priority (a number), candidate (one of "
                            f"{names}) and optionally repeats (a positive integer) and lr (a "
                            "number, 0 for the task's own, 'control': 06's control, or "
                            "'study': the rate 06's study supports)")


VARIANT_LRS = ("control", "study")


def _spend(row: pd.Series) -> float:
    """Unrounded cost of a sheet row (GPU-hours when no price is given)."""
    price = row.get("price_per_hour")
    return row.gpu_hours * (1.0 if price is None or pd.isna(price) else price)


def cheapest(sheet: pd.DataFrame, rental_gpu: str) -> pd.DataFrame:
    """Per candidate: the cheapest GPU that fits with headroom (by the budget's cost, or its
    hours when no prices are given), beside the GPU asked for, and why they differ."""
    rows = []
    for name, group in sheet.groupby("candidate", sort=False):
        fitting = group[group.fits]
        asked = group[group.gpu == rental_gpu].iloc[0]
        # by cost where every fitting GPU has one; a GPU without time or cost comes last
        key = "cost" if len(fitting) and fitting.cost.notna().all() else "gpu_hours"
        best = fitting.sort_values(key, kind="stable", na_position="last").iloc[0] \
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
        rows.append({"candidate": name, "cheapest_gpu": None if best is None else best.gpu,
                     "cheapest_gpus": None if best is None else best.get("gpus"),
                     "cheapest_strategy": None if best is None else best.get("strategy"),
                     "cheapest_micro_batch": None if best is None else best.get("micro_batch"),
                     "cheapest_accumulation": None if best is None else
                     best.get("accumulation"),
                     "cheapest_required_gib": None if best is None else best.required_gib,
                     "cheapest_gpu_hours": None if best is None else best.gpu_hours,
                     "cheapest_cost": None if best is None else best.cost,
                     "cheapest_hours": None if best is None else best.budget_hours,
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


STRATEGY_KEYS = {"strategy", "world", "gpus_per_node", "offload_optimizer"}


def candidates_from(specs: list[dict]) -> list[Candidate]:
    """Candidates from the notebook's list of flat dicts (name, the update shape's fields,
    length, eval_batch, expected; precision bf16 unless given; strategy "single", "ddp" or
    "fsdp" with world, gpus_per_node and offload_optimizer); an unknown key is named."""
    shape_keys = set(UpdateShape.__dataclass_fields__)
    keys = {"name", "length", "eval_batch", "expected"} | shape_keys | STRATEGY_KEYS
    if not isinstance(specs, list) or not specs:
        raise WorkbookError(f"candidates must be a non-empty list, got {specs!r}",
                            'give at least one, e.g. [{"name": "control", "micro_batch": 16, '
                            '"accumulation": 2}]')
    out = []
    for spec in specs:
        unknown = set(spec) - keys
        if unknown or "name" not in spec:
            raise WorkbookError(f"candidate {spec.get('name', spec)!r}: unknown keys "
                                f"{sorted(unknown)}" if unknown else f"candidate {spec} has "
                                "no name", f"use the keys {sorted(keys)}")
        shape = UpdateShape.from_params({"precision": "bf16",
                                         **{k: v for k, v in spec.items() if k in shape_keys}})
        cand = Candidate(spec["name"], Plan(shape, spec.get("length"), spec.get("eval_batch")),
                         spec.get("expected", ""), spec.get("strategy", ""), spec.get("world"),
                         spec.get("gpus_per_node", 8), spec.get("offload_optimizer", False))
        check_strategy(cand)
        out.append(cand)
    return out


def check_strategy(cand: Candidate) -> None:
    """A candidate's strategy and its settings agree, named when they do not."""
    problems = []
    strategy, replicas = cand.parallelism, cand.plan.shape.replicas
    if strategy not in STRATEGIES:
        problems.append(f"strategy {strategy!r} is not one of {list(STRATEGIES)}")
    elif strategy == "single" and replicas != 1:
        problems.append(f"strategy single with replicas={replicas} (that is ddp)")
    elif strategy == "ddp" and replicas < 2:
        problems.append("strategy ddp needs replicas of 2 or more")
    elif strategy == "fsdp":
        if replicas != 1:
            problems.append(f"strategy fsdp with replicas={replicas}: under FSDP every GPU of "
                            "the world is a data-parallel rank; give the GPU count as world")
        if cand.world is not None:
            try:
                sharding.check_world(cand.world)
            except WorkbookError as exc:
                problems.append(exc.problem)
    if strategy != "fsdp" and (cand.world is not None or cand.offload_optimizer):
        problems.append("world and offload_optimizer belong to strategy fsdp")
    gpn = cand.gpus_per_node
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        problems.append(f"gpus_per_node {gpn!r} is not a positive integer")
    if not isinstance(cand.offload_optimizer, bool):
        problems.append(f"offload_optimizer {cand.offload_optimizer!r} is not True or False")
    if problems:
        raise WorkbookError(f"candidate {cand.name!r}: " + "; ".join(problems),
                            'e.g. {"name": "sharded", "strategy": "fsdp", "micro_batch": 2, '
                            '"accumulation": 16, "activation_checkpointing": True} (world '
                            "2..64, or none: the smallest that fits each GPU)")


def sharded_default(first: Candidate) -> Candidate:
    """The fsdp candidate added when no candidate fits one GPU: the first candidate's update
    (the same examples per update and precision) sharded over the smallest world that fits
    each GPU, micro-batches of at most 2 per GPU (padded, as a campaign's are) and activation
    checkpointing."""
    shape = first.plan.shape
    total = shape.examples_per_update
    micro = min(2, shape.micro_batch) if total % 2 == 0 else 1
    return Candidate(
        "sharded", Plan(replace(shape, micro_batch=micro, accumulation=total // micro,
                                replicas=1, activation_checkpointing=True),
                        first.plan.length, first.plan.eval_batch, first.plan.eval_length),
        f"the update of candidate {first.name} ({total} examples) sharded over N GPUs with "
        "FSDP2 and activation checkpointing: added because no candidate fits one GPU", "fsdp")


def choose(sheet: pd.DataFrame, rental_gpu: str) -> dict | None:
    """The first candidate (in the order given) that fits the rental GPU."""
    fitting = sheet[(sheet.gpu == rental_gpu) & sheet.fits]
    return fitting.iloc[0].to_dict() if len(fitting) else None


def article(name: str) -> str:
    """'a' or 'an' before a GPU name: names read letter by letter (an L4, an A100, an H200,
    a T4) by the letter's sound, words (a small, an older) by their first vowel."""
    spelled = len(name) > 1 and name[0].isupper() and (name[1].isdigit() or name[1].isupper()
                                                        or name[1] == "-")
    if spelled:
        return "an" if name[0] in "AEFHILMNORSX" else "a"
    return "an" if name[:1].lower() in "aeiou" else "a"


def money(amount: float | None, currency: str) -> str:
    return "cost not given (no price)" if amount is None or pd.isna(amount) else \
        f"{currency} {amount:,.2f}"


def unverified(stack: pd.DataFrame) -> list[str]:
    """What the stack check could not verify here, in words."""
    words = []
    for _, row in stack[~stack.verified].iterrows():
        item, here, todo = row["item"], row["here"], row["on the rental"]
        if item == "CUDA":
            words.append("CUDA memory counters and timing were not measured: no GPU was "
                         "present (run notebooks 03 and 05 with device='cuda' on the rental)")
        elif item.startswith("precision"):
            words.append(f"{item} could not run here ({here}): check {todo} on the rental")
        elif item.startswith("import"):
            words.append(f"`{item[7:]}` is {here}: {todo}")
        else:
            words.append(f"{item}: {todo}")
    return words


def hours(value: float | None) -> str:
    return "time not known" if value is None or pd.isna(value) else f"{value:.1f} h"


def decision_unsized(unsized: dict[str, str], candidates: int, rental_gpu: str) -> str:
    """What the conclusion says of the candidates the prediction could not size: the decision
    itself when none could be, else a sentence naming them and why."""
    by_reason: dict[str, list[str]] = {}
    for name, why in unsized.items():
        by_reason.setdefault(why, []).append(name)
    reasons = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())
    if len(unsized) == candidates:
        which, one = ("the only candidate", "it") if candidates == 1 else \
            (f"any of the {candidates} candidates", "one")
        return (f"**No candidate could be sized**: the memory prediction could not size {which}, "
                f"so this sheet cannot say whether {one} fits the {rental_gpu} - do not rent on "
                "it. Size by measuring instead (notebook 03 with a candidate's plan_* settings, "
                f"on a machine that holds it). Why: {reasons}.")
    return f" Not sized, so not judged: {reasons}."


def per_gpu(required_gib: float | None, count: int) -> str:
    """', X GiB per GPU needed with headroom' for a row of several GPUs."""
    if required_gib is None or pd.isna(required_gib):
        return ""
    return f", {required_gib:.1f} GiB {'per GPU ' if count > 1 else ''}needed with headroom"


def gpu_hours(value: float | None, count: int) -> str:
    return "" if count == 1 or value is None or pd.isna(value) else \
        f" on {count} GPUs, {value:,.0f} GPU-hours"


def study_result(run_dir, task_lr: float | None = None) -> dict[str, Any]:
    """Notebook 06's result as this plan uses it, from its summary.json in the run folder.
    `state`: "ran" (a learning rate is supported; `conclusive` False when 06 warned - a best lr
    at the edge of the grid, a best trial still improving), "no result" (06 ran, no rate can be
    chosen), "error" (06 stopped, or its summary cannot be read) or "not run". `lr` is the rate
    to plan on (None without one), `control_lr` 06's control, `short` the state in a few
    words, `said` the decision's sentence on the learning rate and `study` the study's line
    (None when 06 gave no figures)."""
    path = Path(run_dir) / "06_lr_study" / "summary.json"
    out: dict[str, Any] = {"state": "not run", "lr": None, "control_lr": None,
                           "control_best": False, "conclusive": False, "warnings": [],
                           "seeds": None, "study": None, "short": "06 did not run"}
    own = f" (the task's own lr is {task_lr:g}, untested against others)" if task_lr else ""
    try:
        summary = json.loads(path.read_text()) if path.exists() else None
        if summary is not None and not isinstance(summary, dict):
            raise ValueError("not an object")
    except (ValueError, OSError):
        summary = {"verdict": "error", "error": "06_lr_study/summary.json cannot be read"}
    if summary is None:
        out["said"] = ("**Learning rate: not chosen by a study** - notebook 06 did not run in "
                       f"this run folder{own}: run it before the campaign.")
        return out
    fig = summary.get("figures") if isinstance(summary.get("figures"), dict) else {}
    if summary.get("verdict") == "error" or not fig:
        why = str(summary.get("error") or "no figures")[:120]
        out.update(state="error", short="06 stopped with an error",
                   said=f"**Learning rate: not chosen by a study** - notebook 06 stopped with "
                        f"an error ({why}){own}: fix it and run it before the campaign.")
        return out
    control = fig.get("control_lr")
    lr = fig.get("supported_lr", fig.get("best_lr"))
    warnings = [str(w) for w in fig.get("warnings") or []]
    seeds = fig.get("seeds")
    out.update(control_lr=control, warnings=warnings, seeds=seeds, study=study_line(fig))
    if lr is None:
        finding = fig.get("finding") or "no trial produced a metric"
        out.update(state="no result", short="06 found no rate",
                   said=f"**Learning rate: not chosen** - notebook 06's study is "
                        f"inconclusive: {finding}.")
        return out
    conclusive = bool(fig.get("conclusive", not warnings))
    control_best = control is not None and lr == control
    out.update(state="ran", lr=lr, control_best=control_best, conclusive=conclusive,
               short="06's result")
    why = ("the control: notebook 06's study found no better rate" if control_best else
           f"the best of notebook 06's study, which beat the control (lr {control:g})"
           if control is not None else "the best of notebook 06's study")
    one = " on one seed" if seeds == 1 else f" over {seeds} seeds" if seeds else ""
    if conclusive:
        out["said"] = f"**Learning rate: {lr:g}**, {why}{one}."
    else:
        out["said"] = (f"**Learning rate: {lr:g} for now**, {why}{one} - provisional: "
                       + "; ".join(warnings) + ". Settle it before the campaign.")
    return out


def study_line(fig: dict) -> str:
    """'Learning-rate study: ...' from 06's figures: the trials, the best value and lr, the
    verdict, the seeds, and how many warnings (the decision's learning-rate sentence, always
    written before it, says them)."""
    statuses = ", ".join(f"{n} {status}" for status, n in (fig.get("statuses") or {}).items())
    found = (f"best validation {fig['metric']} {fig['best_metric']:.3f} at lr "
             f"{fig['best_lr']:g} (trial {fig['best_trial']})"
             if fig.get("best_metric") is not None else "no trial produced a metric")
    seeds = fig.get("seeds")
    if seeds == 1:
        found += ", one seed (no spread)"
    elif seeds:
        found += f", {seeds} seeds"
    verdict = (f"the control (lr {fig['control_lr']:g}) remains the best choice"
               if fig.get("control_remains_best") else
               f"lr {fig['best_lr']:g} beat the control (lr {fig['control_lr']:g})"
               if fig.get("best_lr") is not None else "no learning rate can be chosen yet")
    warnings = fig.get("warnings") or []
    return (f"Learning-rate study: {fig.get('trials')} trials ({statuses}); {found}; "
            f"{verdict}" + (f" ({len(warnings)} warning{'s' if len(warnings) > 1 else ''}: "
                            "see the learning rate above)" if warnings else "") + ".")


def duration(hours_: float) -> str:
    """A whole plan's hours in words: under an hour, under a day, or days."""
    if hours_ < 1:
        return f"{hours_:.1f} h ({max(1, round(hours_ * 60))} minutes), under an hour"
    if hours_ < 24:
        return f"{hours_:.1f} h, under a day"
    return f"{hours_:.1f} h ({hours_ / 24:.1f} days)"


def variant_words(r) -> str:
    """'control at lr 0.0001 x3' for a plan row."""
    lr = getattr(r, "lr", None)
    return (f"{r.variant}" + (f" at lr {lr:g}" if lr is not None and not pd.isna(lr) else "")
            + (f" x{int(r.repeats)}" if r.repeats and int(r.repeats) > 1 else ""))


def plan_lines(plans: pd.DataFrame, rental_gpu: str, currency: str) -> list[str]:
    """The conclusion's 3/7/30-day lines, per GPU priced on (saying which is recommended and
    which was planned on). When the longer plans schedule nothing more (every variant fits the
    shortest, or what is left out is so for another reason than time) one line says they are
    the same, with the whole budget's hours in words ("under an hour: rent by the hour")."""
    if plans.empty:
        return ["- no variants given: nothing to plan into 3, 7 or 30 days"]
    if "priced_on" not in plans:
        plans = plans.assign(priced_on="")
    roles = {RECOMMENDED: " (recommended)", PLANNED: " (the GPU you planned on)",
             BOTH: " (recommended; the GPU you planned on)"}
    lines = []
    for (gpu_name, role), group in plans.groupby(["gpu", "priced_on"], sort=False):
        where = f"on the {gpu_name}{roles.get(role, '')}"
        by_days = dict(list(group.groupby("days")))
        shortest = by_days[min(by_days)]
        # the same in every plan, and nothing left out for want of time: one line, in hours
        same = all(plan.scheduled.tolist() == shortest.scheduled.tolist()
                   for plan in by_days.values()) and not shortest[~shortest.scheduled] \
            .why_not.astype(str).str.startswith("needs ").any()
        if len(by_days) > 1 and same:
            done, left = shortest[shortest.scheduled], shortest[~shortest.scheduled]
            total = done.hours.sum()
            cost = done.cost.sum() if done.cost.notna().all() else None
            days = sorted(by_days)
            named = ", ".join(map(str, days[:-1])) + f" and {days[-1]}"
            which = ", ".join(variant_words(r) for r in done.itertuples())
            fit = (f"every variant ({which}) fits" if left.empty else
                   f"{len(done)} of {len(shortest)} variants ({which}) fit")
            rent = ("rent by the hour, not by the day" if total < 24 else
                    f"a rental longer than {days[0]} days adds nothing")
            lines.append(
                f"- {named}-day plans {where}: " + (
                    f"all the same - {fit} in {days[0]} days: {total:.1f} h, "
                    f"{money(cost, currency)} in all" if len(done) else
                    f"none of the {len(shortest)} variants scheduled")
                + ("; not scheduled in any: " + "; ".join(f"{r.variant} ({r.why_not})"
                                                          for r in left.itertuples())
                   if len(left) else "") + "." +
                (f" The whole budget takes {duration(total)}: {rent}." if len(done) else ""))
            continue
        for days, plan in by_days.items():
            done = plan[plan.scheduled]
            left = plan[~plan.scheduled]
            cost = done.cost.sum() if done.cost.notna().all() else None
            which = ", ".join(variant_words(r) for r in done.itertuples())
            lines.append(f"- {days}-day plan {where}: {len(done)} of {len(plan)} variants "
                         "scheduled" + (f" ({which})" if len(done) else "") +
                         f", {done.hours.sum():.1f} h, {money(cost, currency)}"
                         + ("; not scheduled: " + "; ".join(f"{r.variant} ({r.why_not})"
                                                            for r in left.itertuples())
                            if len(left) else ""))
    sharded = plans[plans.planned_as.fillna("") != ""] if "planned_as" in plans else plans[:0]
    if len(sharded):
        names = list(dict.fromkeys(sharded.variant))
        many = len(names) > 1
        whose = "their candidates fit" if many else "its candidate fits"
        lines.append(f"- {', '.join(names)}: {whose} no single GPU, so "
                     f"{'they are' if many else 'it is'} planned on "
                     f"candidate {sharded.candidate.iloc[0]}, the same update sharded.")
    return lines


EARLIER_NOTEBOOKS = (("01_inspect_examples", "inspection"), ("02_overfit", "overfit"),
                     ("03_phase_gates", "phase gates"), ("04_batch_accounting",
                                                         "batch accounting"),
                     ("05_memory_variants", "memory variants"),
                     ("07_resume_reload", "resume and reload"))


def _summary(run_dir, stem: str) -> dict | None:
    path = Path(run_dir) / stem / "summary.json"
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (ValueError, OSError):
        return {"verdict": "unreadable", "error": f"{stem}/summary.json cannot be read"}


def first_failure(run_dir) -> str | None:
    """The first notebook of this run before 08 that did not pass, with why and its fix where
    the notebook wrote one (01's first flag, 03's first failed gate); None when all passed."""
    from ..storage.runs import verdict_line

    for stem, label in EARLIER_NOTEBOOKS:
        s = _summary(run_dir, stem)
        if not isinstance(s, dict) or s.get("verdict") == "pass":
            continue
        folder = Path(run_dir) / stem
        why = str(s.get("error") or "") if s.get("verdict") != "fail" else \
            verdict_line(folder).removeprefix("verdict: fail").removeprefix(" - ")
        fix = ""
        with_fix = {"01": ("flags.json", "fix"), "03": ("gates.json", "remediation")}
        if stem[:2] in with_fix:
            name, key = with_fix[stem[:2]]
            try:
                rows = json.loads((folder / name).read_text())
            except (OSError, ValueError):
                rows = []
            fixes = [r.get(key) for r in rows if isinstance(r, dict) and r.get(key) and
                     r.get("verdict", "fail") == "fail"]
            fix = str(fixes[0]) if fixes else ""
        state = "failed" if s.get("verdict") == "fail" else f"ended with {s.get('verdict')!s}"
        return (f"notebook {stem[:2]} ({label}) {state}" + (f": {why[:300]}" if why else "")
                + (f" - fix: {fix[:300]}" if fix else ""))
    return None


def conclusion(run_dir, chosen: dict | None, rental_gpu: str, plans: pd.DataFrame,
               stack: pd.DataFrame, options: pd.DataFrame,
               unsized: dict[str, str] | None = None,
               models_lines: list[str] | None = None, study: dict | None = None) -> str:
    """The campaign's conclusion in words, every figure rounded, from this notebook's sheet and
    the summaries of the other notebooks of this run where they exist (`unsized`: the
    candidates the prediction could not size, with the reason; `study`: 06's result as
    `study_result` reads it from the run folder, by default). The plans are told per GPU
    priced on, recommended or planned on (`priced_gpus`)."""
    study = study if study is not None else study_result(run_dir)
    lines = ["# Rental decision", ""]
    failure = first_failure(run_dir)
    if failure:  # no plan outweighs a check that failed: it leads, and nothing says "Rent"
        lines += [f"**Do not rent yet**: {failure}. Fix it and run the pilot again; the plan "
                  "below is what it would be once every notebook passes.", ""]
    currency = options.currency.iloc[0] if len(options) else "USD"
    unsized = unsized or {}
    if chosen is None and unsized and len(unsized) == len(options):
        lines.append(decision_unsized(unsized, len(options), rental_gpu))
    elif chosen is None:
        fits_elsewhere = options.dropna(subset=["cheapest_gpu"])
        nowhere = "No candidate that could be sized" if unsized else "No candidate"
        lines.append(f"No candidate fits the {rental_gpu}: do not rent it for this plan." + (
            " Candidates that fit another GPU: " + "; ".join(
                f"{r.candidate} on {r.cheapest_gpu} ({money(r.cheapest_cost, r.currency)})"
                for r in fits_elsewhere.itertuples()) + "." if len(fits_elsewhere) else
            f" {nowhere} fits any GPU of the list: reduce the micro-batch or the length, or "
            "turn on activation checkpointing (notebook 05).")
            + (decision_unsized(unsized, len(options), rental_gpu) if unsized else ""))
    else:
        best = options.set_index("candidate").loc[chosen["candidate"]]
        lead = "Once it passes, the plan is" if failure else "**Rent"

        def shape(strategy, micro, acc):
            return (f"{strategy}, {chosen['precision']}, micro-batch {int(micro)} x accumulation "
                f"{int(acc)}")

        if best.cheapest_gpu != rental_gpu:
            gpu_name = best.cheapest_gpu
            count = int(best.get("cheapest_gpus") or 1)
            what = f"{article(gpu_name)} {gpu_name}" if count == 1 else f"{count} x {gpu_name}"
            how = shape(best.cheapest_strategy, best.cheapest_micro_batch,
                        best.cheapest_accumulation)
            spent = hours(best.cheapest_hours) + gpu_hours(best.cheapest_gpu_hours, count)
            lines.append(f"{lead} {what}{'**' * (not failure)} for candidate "
                         f"**{chosen['candidate']}** ({how}"
                         f"{per_gpu(best.cheapest_required_gib, count)}): the cheapest GPU that "
                         "fits it with headroom, "
                         f"{money(best.cheapest_cost, currency)} for the budget "
                         f"({spent}). You planned on the {rental_gpu} "
                         f"({money(best.asked_cost, currency)}); {best.why}.")
        else:
            count = int(chosen.get("gpus") or 1)
            what = f"{article(rental_gpu)} {rental_gpu}" if count == 1 else \
                f"{count} x {rental_gpu}"
            how = shape(chosen["strategy"], chosen["micro_batch"], chosen["accumulation"])
            lines.append(f"{lead} {what}{'**' * (not failure)} for candidate "
                         f"**{chosen['candidate']}** ({how}): "
                         f"{chosen['required_gib']:.2f} GiB needed with headroom"
                         f"{' per GPU' if count > 1 else ''}, "
                         f"{chosen['headroom_gib']:.1f} GiB to spare, "
                         f"{money(chosen.get('cost'), currency)} for the budget "
                         f"({hours(chosen['budget_hours'])}"
                         f"{gpu_hours(chosen.get('gpu_hours'), count)}); {best.why}.")
        lines += ["", study["said"]]
        if models_lines:
            lines += ["", "Sized for: " + "; ".join(models_lines) + "."]
        lines += ["", f"Expected result: {chosen['expected'] or 'not stated'}."]
        if unsized:
            lines += ["", decision_unsized(unsized, len(options), rental_gpu).strip()]
    if chosen is None:
        lines += ["", study["said"]]
    if study.get("study"):
        lines += ["", study["study"]]
    verdicts = []
    for stem, label in EARLIER_NOTEBOOKS:
        s = _summary(run_dir, stem)
        if isinstance(s, dict) and s.get("verdict"):  # an error too: never read as a pass
            verdicts.append(f"{label} {s['verdict']}" + (
                f" ({str(s.get('error', ''))[:120]})" if s["verdict"] != "pass" and
                s.get("error") else ""))
    if verdicts:
        lines += ["", "Other notebooks of this run: " + ", ".join(verdicts) + "."]
    lines += ["", *plan_lines(plans, rental_gpu, currency)]
    todo = unverified(stack)
    lines += ["", "Still to verify on the rental before adopting it: " +
              ("; ".join(todo) if todo else "nothing beyond matching the versions listed") + ".",
              "", "This sheet plans; it predicts neither duration nor quality. Times rest on "
              "an assumed utilisation, costs on assumed prices, memory on a fake-tensor "
              "prediction plus stated overheads."]
    return "\n".join(lines) + "\n"


@dataclass
class RentalResult:
    """Everything notebook 08 shows: the selection sheet, the stack verified here, the 3/7/30-day
    plans, the cheapest GPU per candidate and the conclusion."""

    task: Task
    rental_gpu: str
    candidates: list[Candidate]
    sheet: pd.DataFrame
    stack: pd.DataFrame
    plans: pd.DataFrame
    options: pd.DataFrame
    chosen: dict | None  # the first candidate that fits the GPU to rent
    conclusion: str  # markdown
    study: dict = field(default_factory=dict)  # 06's result as planned on (`study_result`)


def run(params: dict[str, Any], out_dir: Path) -> RentalResult:
    """Notebook 08 from its parameters; the stack check reads notebook 09's verdict from the
    run folder that holds `out_dir` (it writes nothing until `save`)."""
    task = task_from_params(params)
    data = prepare(task, limits={"train": params["train_limit"]})
    candidates = candidates_from(params["candidates"])
    check_variants(params["variants"], candidates)
    rental_gpu = params["rental_gpu"]
    gpu(rental_gpu, params["gpus"])
    overheads = Overheads(int(params["cuda_context_gib"] * GIB),
                          params["allocator_cache_share"], False)
    assumptions = Assumptions(params["utilisation"], params["eval_every"], 0,
                              params["export_minutes"], overheads,
                              prices=params["gpu_price_per_hour"], currency=params["currency"])
    sheet = selection_sheet(task, data.train, data.validation, candidates, params["gpus"],
                            params["gpu_tflops"], params["updates"], params["headroom"],
                            assumptions)
    stand_ins: dict[str, str] = {}
    if models.declared(task) and not sheet.fits.any() and \
            not any(c.parallelism == "fsdp" for c in candidates):
        # the campaign model fits no GPU of the list alone: plan it sharded, and the variants
        # of every candidate with the same update on the sharded one
        extra = sharded_default(candidates[0])
        stand_ins = {c.name: extra.name for c in candidates if same_update(c, candidates[0])}
        candidates = [*candidates, extra]
        more = selection_sheet(task, data.train, data.validation, [extra], params["gpus"],
                               params["gpu_tflops"], params["updates"], params["headroom"],
                               assumptions)
        attrs = sheet.attrs
        sheet = pd.concat([sheet, more], ignore_index=True)
        sheet.attrs = attrs
    stack = stack_check(params["task"], params["device"], candidates[0].plan.shape.precision,
                        max(c.plan.shape.replicas for c in candidates), out_dir.parent)
    sharded = [c for c in candidates if c.parallelism == "fsdp"]
    if sharded:
        stack = pd.concat([stack, pd.DataFrame([sharded_row(sharded, sheet)])],
                          ignore_index=True)
    options = cheapest(sheet, rental_gpu)
    chosen = choose(sheet, rental_gpu)
    study = study_result(out_dir.parent, task.lr)
    variants = planned_variants(params["variants"], sheet, stand_ins, study, task.lr)
    # priced on the GPU the decision recommends, and on the one planned on when it differs
    plans = pd.concat([pack(variants, sheet, name, days, params["reserve_share"], role)
                       for name, role in priced_gpus(chosen, options, rental_gpu)
                       for days in (3, 7, 30)], ignore_index=True)
    return RentalResult(task, rental_gpu, candidates, sheet, stack, plans, options, chosen,
                        conclusion(out_dir.parent, chosen, rental_gpu, plans, stack, options,
                                   not_sized(sheet), sheet.attrs.get("models"), study),
                        study)


def _plain(value):
    """A count from a table cell as a plain int (None for a missing one), for JSON."""
    return None if value is None or pd.isna(value) else int(value)


def save(result: RentalResult, out_dir: Path) -> str:
    """Notebook 08's tables, `conclusion.md` and `summary.json`. The verdict fails when no
    candidate fits the GPU to rent (there is nothing to plan with), and `not_sized` names the
    candidates the prediction could not size. `planned_lr` and `study` give the learning rate
    planned on and 06's state, `plans_priced_on` the GPUs priced ({gpu: recommended / planned
    on}) and `scheduled` the variants scheduled per days on the first of them."""
    from ..storage.files import write_text
    from ..storage.runs import save_table, write_summary

    sheet, plans, options, stack, chosen = (result.sheet, result.plans, result.options,
                                            result.stack, result.chosen)
    write_text(out_dir / "conclusion.md", result.conclusion)
    for table, name in ((sheet, "selection"), (plans, "plan"), (options, "cheapest"),
                        (stack, "stack")):
        save_table(table, out_dir, name)
    verdict = "pass" if chosen is not None else "fail"
    first = plans[plans.priced_on == plans.priced_on.iloc[0]] if len(plans) else plans
    study = result.study or {}
    write_summary(out_dir, verdict, {
        "rental_gpu": result.rental_gpu, "chosen": chosen and chosen["candidate"],
        "recommended_gpu": options.set_index("candidate").cheapest_gpu.get(chosen["candidate"])
        if chosen else None,
        "recommended_gpus": _plain(options.set_index("candidate").cheapest_gpus.get(
            chosen["candidate"])) if chosen else None,
        "recommended_strategy": options.set_index("candidate").cheapest_strategy.get(
            chosen["candidate"]) if chosen else None,
        "sized_model": "; ".join(sheet.attrs.get("models") or []),
        "fitting_rows": int(sheet.fits.sum()), "rows": len(sheet),
        "not_sized": list(not_sized(sheet)),
        "planned_lr": study.get("lr"), "study": study.get("state", "not run"),
        "study_conclusive": bool(study.get("conclusive")),
        "plans_priced_on": {str(g): r for g, r in zip(*(
            plans.drop_duplicates(["gpu", "priced_on"])[c] for c in ("gpu", "priced_on")),
            strict=True)} if len(plans) else {},
        # the plans on the first GPU priced (the recommended one), by days
        "scheduled": {int(d): int(n) for d, n in
                      first.groupby("days").scheduled.sum().items()}},
        task=result.task.name)
    return verdict

