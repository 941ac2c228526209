"""Notebook 08's selection sheet: one row per candidate and GPU, with the memory predicted, the
FLOPs counted and the time and cost from stated assumptions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from ...base.errors import WorkbookError, reason
from ...contract.task import Task
from ...training import campaign as models
from ...training import sharding
from ...training.fake_phases import fake_model
from ...training.loop import TrainConfig, build_stepper
from ...training.memory import GIB
from ...training.predict import Overheads, fit_table, longest_accepted, predict, sized_batches
from ...training.workload import TRAINING_PHASES
from .candidates import Candidate
from .prices import Catalog, Spot, price_columns


def check_gpus(gpus: dict, tflops: dict, prices: dict | None = None,
               partial: bool = False) -> None:
    """Every GPU has a memory size and a peak throughput that are positive numbers (and a
    price, when prices are given; only the GPUs priced when `partial`: a catalog prices the
    rest)."""
    problems = []
    for name in gpus:
        if prices and not (isinstance(prices.get(name), (int, float)) and prices[name] >= 0) \
                and (not partial or name in prices):
            problems.append(f"no price per hour for {name!r} (got {prices.get(name)!r})")
    for name in set(prices or {}) - set(gpus):
        problems.append(f"a price for {name!r}, which is not one of the gpus")
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
                            "gpu_price_per_hour as {name: price} for the same names (or {} "
                            "to price every GPU from the catalog)")


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
    cfg = TrainConfig(replace(cand.plan.shape, precision="fp32"), device="cpu")
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

    utilisation: float = 0.35  # share of the GPU's peak the training reaches (MFU), unless...
    eval_every: int = 50
    eval_examples: int = 0  # validation examples per evaluation (0: the task's set)
    export_minutes: float = 5.0  # saving and exporting a final checkpoint
    overheads: Overheads = field(default_factory=lambda: Overheads(GIB, 0.1, False))
    ddp_bucket_share: float = 1.0  # data parallel keeps gradient buckets ~ the gradients
    prices: dict = field(default_factory=dict)  # typed per GPU-hour: win over the catalog
    currency: str = "USD"
    catalog: Catalog | None = None  # GPU offers, on-demand and spot (prices)
    spot: Spot | None = None
    parameters: int = 0  # of the model the rental trains, for the speed references
    speeds: Any = None  # ...a SpeedBook (speeds) gives it per GPU, size and strategy
    min_update_s: float = 0.005  # no update is faster: kernel launches of even a tiny model
    step_scale: float = 1.0  # an update's time over its training part: 1 / (1 - generation's
    step_words: str = ""  # share) where 03 measured one (speeds.generation_scale), and why


def selection_sheet(task: Task, train: list, val: list, candidates: list[Candidate],
                    gpus: dict, tflops: dict, updates: int, headroom: float,
                    a: Assumptions) -> pd.DataFrame:
    """One row per candidate x GPU: memory needed (predicted) and whether it fits, FLOPs per
    update (counted) and time per update (assumed utilisation), and the budget's hours. A
    candidate the prediction cannot size has rows without memory whose `note` says why."""
    check_gpus(gpus, tflops, a.prices, partial=a.catalog is not None)
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
                                        a, name),
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
                              "(workbook.sharding)",
        "required_gib": f"prediction x (1 + {a.overheads.cache_share:.0%} allocator cache) + "
                        f"{a.overheads.context_bytes / GIB:.2f} GiB context, x (1 + "
                        f"{headroom:.0%} headroom); overheads "
                        f"{'measured' if a.overheads.measured else 'assumed'}",
        "flops_per_update": "counted with torch.utils.flop_counter",
        "time_per_update_s": (f"{a.speeds.described()}: the MFU of each row (`mfu`, its range "
                              "`mfu_low`-`mfu_high`; `speed_from` says measured, reference, "
                              "interpolated or extrapolated, `speed_source` from what)"
                              if a.speeds is not None else
                              f"assumed: vendor peak TFLOP/s x {a.utilisation:.0%} utilisation")
                             + f" x vendor peak TFLOP/s, never below {a.min_update_s * 1000:.0f}"
                             " ms (launch overhead; `time_floored` marks the rows held at "
                             "that floor)" + (f"; {a.step_words} (not the rows measured on "
                                              "their GPU: 03's update holds it)"
                                              if a.step_words else ""),
        "cost": price_words(a),
        "budget_hours_low": "the budget's hours at the references' highest MFU, "
                            "`budget_hours_high` at their lowest (`cost_low`, `cost_high`)",
        "budget_hours": f"{updates} updates + evaluation every {a.eval_every} on "
                        f"{eval_examples} examples + {a.export_minutes} min export (assumed)"}
    return sheet


def price_words(a: Assumptions) -> str:
    """Where the sheet's prices come from, in words."""
    typed = f"typed prices per GPU-hour for {', '.join(sorted(a.prices))} (they win); " \
        if a.prices else ""
    if a.catalog is None:
        return (f"{typed}in {a.currency} x budget hours x GPUs (replicas, or the FSDP world)"
                if a.prices else "no prices given: no costs")
    spot = f"; `spot_cost` at the cheapest spot offer with {a.spot.words()}" if a.spot else ""
    return (f"{typed}{a.catalog.described()}: the cheapest whole-instance offer for the row's "
            f"GPUs in {a.currency} (`offer`; `paid_gpus` counts the idle GPUs of a larger "
            f"instance) x budget hours{spot}")


# the training phases decide a fit; a validation row the prediction cannot size (the fused
# inference kernel of nn.TransformerEncoderLayer) is named in the note and left out
DECIDING = TRAINING_PHASES[:-1]


NUMBERS = ("predicted_peak_gib", "required_gib", "headroom_gib", "flops_per_update",
           "time_per_update_s", "budget_hours", "budget_hours_low", "budget_hours_high",
           "gpu_hours", "price_per_hour", "cost", "cost_low", "cost_high",
           "spot_price_per_hour", "spot_cost")


def predicted_phases(task: Task, train: list, val: list,
                     cand: Candidate) -> tuple[pd.DataFrame | None, str]:
    """The predicted phases a candidate's fit rests on, and a note on what was not predicted;
    None when a training phase has no prediction (the candidate cannot be sized)."""
    try:
        predicted = predict(task, train, val, cand.plan, campaign=True)
    except Exception as exc:  # never a crash of the notebook: the row says what happened
        return None, not_sized_because(exc, "the prediction")
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


def not_sized_because(exc: Exception, what: str) -> str:
    """Why `what` sized nothing, for a row's note: "not applicable" for a configuration it
    refused, "not predicted" for an operation fake tensors cannot run or any other failure."""
    if not isinstance(exc, WorkbookError):
        return f"not predicted: {what} raised {type(exc).__name__}: {reason(exc)}"
    word = "not predicted" if exc.problem.startswith("predicting") else "not applicable"
    return f"{word}: {exc.problem}"


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
                 eval_examples: int, a: Assumptions, gpu: str = "",
                 gpus: int | None = None, accumulation: int | None = None) -> dict:
    """The speed, time and cost part of a sheet row on `gpus` GPUs (default: the plan's
    replicas) of the `gpu` (peak `tflops` each), every GPU making `accumulation` micro-batches
    per update (default: the plan's): the MFU from `a.speeds` (else `a.utilisation`, assumed)
    with its range, the budget's hours at the MFU and at the range's ends (`budget_hours_low`
    at the highest MFU), and the prices (`prices.price_columns`). Empty times without a
    FLOP count."""
    count = gpus or cand.plan.shape.replicas
    speed = a.speeds.estimate(gpu, a.parameters, cand.parallelism) if a.speeds is not None \
        else None
    mfu, low, high = (speed.mfu, speed.low, speed.high) if speed else (a.utilisation,) * 3
    out = {"mfu": mfu, "mfu_low": low, "mfu_high": high,
           "speed_from": speed.basis if speed else "assumed",
           "speed_source": speed.words if speed else
           f"assumed: utilisation {a.utilisation:g} of the peak for every row"}
    if counted is None:
        out.update(flops_per_update=None, time_per_update_s=None, time_floored=False,
                   budget_hours=None, budget_hours_low=None, budget_hours_high=None,
                   gpu_hours=None)
        hours = (None, None, None)
        update_s = None
    else:
        update_flops = counted["train_micro_batch"] * (accumulation or
                                                       cand.plan.shape.accumulation)
        # generation's measured share of a step on top, unless 03 timed the whole step there
        scale = 1.0 if speed and speed.basis == "measured" else a.step_scale

        def budget(share: float) -> tuple[float, float]:
            rate = tflops * 1e12 * share
            # every GPU works in parallel; generation's share on top of the floored training
            each = max(update_flops / rate, a.min_update_s) * scale
            eval_s = counted["eval_example"] * eval_examples / rate / count
            return each, (updates * each + math.ceil(updates / a.eval_every) * eval_s +
                          a.export_minutes * 60) / 3600

        update_s, mid = budget(mfu)
        hours = (round(mid, 4), round(budget(high)[1], 4), round(budget(low)[1], 4))
        out.update(flops_per_update=update_flops, time_per_update_s=update_s,
                   time_floored=update_s == a.min_update_s * scale, budget_hours=hours[0],
                   budget_hours_low=hours[1], budget_hours_high=hours[2],
                   gpu_hours=round(mid * count, 4))
    interval = (update_s or 0) * a.eval_every  # a checkpoint at each evaluation
    return {**out, **price_columns(gpu, count, hours, a.prices, a.catalog, a.spot, interval)}


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
        except Exception as exc:
            run, note = None, not_sized_because(exc, "the sharded prediction")
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
                                    eval_examples, a, name, chosen, acc),
                     "currency": a.currency, "note": note, "expected": cand.expected})
    return rows
