"""Notebook 08: from measurements to a rental. The selection sheet (one row per candidate
configuration and GPU), the software-stack check, and a 3/7/30-day plan. It plans; it predicts
neither duration nor quality - every figure says whether it was measured or assumed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ...contract.data import prepare
from ...contract.task import Task
from ...training import campaign as models
from ...training.loop import UpdateShape
from ...training.predict import Overheads, Plan
from ..parameters import RentalParams
from ..registry import RENTAL
from . import launch_files
from .candidates import Candidate, candidates_from, same_update, sharded_default
from .conclusions import conclusion, study_result
from .offers import offers_table, resume_seconds
from .plans import (
    cheapest,
    choose,
    not_sized,
    pack,
    plain_count,
    planned_variants,
    priced_gpus,
)
from .prices import Catalog, Spot, read_catalog
from .sheet import GIB, Assumptions, flops, gpu, selection_sheet
from .speeds import SpeedBook, calibrate, generation_scale, read_speeds
from .stack import sharded_row, stack_check, task_imports


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
    catalog: Catalog | None = None
    speeds: SpeedBook | None = None
    calibration: str = ""  # what notebook 03's measurement did to the speeds, in words
    offers: pd.DataFrame = field(default_factory=pd.DataFrame)  # the spread across providers
    launches: list[launch_files.Launch] = field(default_factory=list)  # the plans that launch
    not_launched: dict[str, str] = field(default_factory=dict)  # {plan: why no launch file}
    entry_point: str = launch_files.PLACEHOLDER  # the user's training script the files run


def run(params: RentalParams | Mapping[str, Any], out_dir: Path) -> RentalResult:
    """Notebook 08 from its parameters; the stack check reads notebook 09's verdict from the
    run folder that holds `out_dir` (it writes nothing until `save`)."""
    params = RENTAL.check(params)
    task = params.load_task()
    data = prepare(task, limits={"train": params.train_limit})
    candidates = candidates_from(params.candidates)
    rental_gpu = params.rental_gpu
    gpu(rental_gpu, params.gpus)
    overheads = Overheads(int(params.cuda_context_gib * GIB),
                          params.allocator_cache_share, False)
    catalog = read_catalog(params.price_catalog, params.gpus, params.currency)
    speeds, calibration = speed_book(params, task, data, out_dir.parent)
    step_scale, step_words = generation_scale(out_dir.parent)
    assumptions = Assumptions(params.utilisation, params.eval_every, 0,
                              params.export_minutes, overheads,
                              prices=params.gpu_price_per_hour, currency=params.currency,
                              speeds=speeds, catalog=catalog,
                              spot=Spot(params.spot_interruptions_per_day,
                                        params.spot_restart_minutes,
                                        resume_seconds(out_dir.parent)),
                              parameters=models.models(task).sized_parameters,
                              step_scale=step_scale, step_words=step_words)
    sheet = selection_sheet(task, data.train, data.validation, candidates, params.gpus,
                            params.gpu_tflops, params.updates, params.headroom,
                            assumptions)
    stand_ins: dict[str, str] = {}
    if models.declared(task) and not any(c.parallelism == "fsdp" for c in candidates):
        # a campaign model is planned sharded too, so the plans compare one GPU, data parallel
        # and FSDP; when it fits no GPU of the list alone, the variants of every candidate
        # with the same update move to the sharded one
        alone = bool(sheet.fits.any())
        extra = sharded_default(candidates[0], "a campaign model is planned sharded too"
                                if alone else "no candidate fits one GPU")
        if not alone:
            stand_ins = {c.name: extra.name for c in candidates
                         if same_update(c, candidates[0])}
        candidates = [*candidates, extra]
        more = selection_sheet(task, data.train, data.validation, [extra], params.gpus,
                               params.gpu_tflops, params.updates, params.headroom,
                               assumptions)
        attrs = sheet.attrs
        sheet = pd.concat([sheet, more], ignore_index=True)
        sheet.attrs = attrs
    stack = stack_check(params.task, params.device, candidates[0].plan.shape.precision,
                        max(c.plan.shape.replicas for c in candidates), out_dir.parent)
    sharded = [c for c in candidates if c.parallelism == "fsdp"]
    if sharded:
        stack = pd.concat([stack, pd.DataFrame([sharded_row(sharded, sheet)])],
                          ignore_index=True)
    options = cheapest(sheet, rental_gpu)
    chosen = choose(sheet, rental_gpu)
    study = study_result(out_dir.parent, task.lr)
    variants = planned_variants(params.variants, sheet, stand_ins, study, task.lr)
    # priced on the GPU the decision recommends, and on the one planned on when it differs
    plans = pd.concat([pack(variants, sheet, name, days, params.reserve_share, role)
                       for name, role in priced_gpus(chosen, options, rental_gpu)
                       for days in (3, 7, 30)], ignore_index=True)
    offers = offers_table(catalog, options, sheet, assumptions.spot, params.eval_every)
    basis = {"catalog": catalog.described(), "typed": sorted(params.gpu_price_per_hour),
             "speeds": speeds.described() if speeds else
             f"an assumed utilisation of {params.utilisation:g}",
             "calibration": calibration, "generation": step_words}
    shared = {"task": params.task, "task_options": params.task_options,
              "updates": params.updates, "eval_every": params.eval_every,
              # a checkpoint at each evaluation, as the sheet's spot costs assume
              "checkpoint_every": params.eval_every, "seed": params.seed,
              "task_lr": task.lr, "parameters": assumptions.parameters}
    launches, not_launched = launch_files.launches(
        sheet, plans, chosen, options, study, shared,
        launch_files.packages_of(task_imports(params.task.split(":")[0])), out_dir.parent)
    return RentalResult(task, rental_gpu, candidates, sheet, stack, plans, options, chosen,
                        conclusion(out_dir.parent, chosen, rental_gpu, plans, stack, options,
                                   not_sized(sheet), sheet.attrs.get("models"), study, basis),
                        study, catalog, speeds, calibration, offers, launches, not_launched,
                        params.entry_point)


def speed_book(params: RentalParams, task: Task, data, run_dir: Path
               ) -> tuple[SpeedBook | None, str]:
    """The speed references `speeds` names ("references": the shipped table, "utilisation":
    none - the single assumed share - or a CSV path), calibrated by notebook 03's step time
    when it ran in `run_dir` on a GPU of the list."""
    if params.speeds == "utilisation":
        return None, "speeds = 'utilisation': every row at the assumed share"
    book = read_speeds(None if params.speeds == "references" else params.speeds,
                       params.gpus)

    def count(micro_batch: int, accumulation: int, length: int, precision: str) -> float:
        shape = UpdateShape(micro_batch=micro_batch, accumulation=accumulation,
                            precision=precision)
        counted = flops(task, data.train, data.validation,
                        Candidate("03", Plan(shape, length)))
        return counted["train_micro_batch"] * accumulation

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return book, calibrate(book, run_dir, count, params.gpus, params.gpu_tflops,
                           not models.declared(task), device)


def priced_figures(result: RentalResult) -> dict[str, Any]:
    """What the plans are priced and timed on, for summary.json: the catalog (date, offers,
    providers), the offer of the recommended GPU, how many sheet rows rest on each kind of
    speed (measured, reference, interpolated, extrapolated, assumed) and 03's calibration."""
    catalog, options, chosen = result.catalog, result.options, result.chosen
    best = options.set_index("candidate").loc[chosen["candidate"]] if chosen else None
    return {"catalog": None if catalog is None else {
                "date": catalog.date.isoformat(), "dated_by": catalog.dated_by,
                "path": catalog.path, "offers": len(catalog.offers),
                "providers": catalog.providers},
            "recommended_offer": None if best is None else best.get("cheapest_offer"),
            "recommended_spot_offer": None if best is None else best.get("cheapest_spot_offer"),
            "speed_from": {str(k): int(v) for k, v in
                           result.sheet.speed_from.value_counts().items()}
            if "speed_from" in result.sheet else {},
            "calibration": result.calibration}


def save(result: RentalResult, out_dir: Path) -> str:
    """Notebook 08's tables, `conclusion.md` and `summary.json`. The verdict fails when no
    candidate fits the GPU to rent (there is nothing to plan with), and `not_sized` names the
    candidates the prediction could not size. `planned_lr` and `study` give the learning rate
    planned on and 06's state, `plans_priced_on` the GPUs priced ({gpu: recommended / planned
    on}) and `scheduled` the variants scheduled per days on the first of them."""
    from ...storage.files import write_text
    from ...storage.runs import save_table, write_summary

    sheet, plans, options, stack, chosen = (result.sheet, result.plans, result.options,
                                            result.stack, result.chosen)
    write_text(out_dir / "conclusion.md", result.conclusion)
    for table, name in ((sheet, "selection"), (plans, "plan"), (options, "cheapest"),
                        (stack, "stack"), (result.offers, "offers")):
        save_table(table, out_dir, name)
    launched = launch_files.write(out_dir, result.launches, result.not_launched,
                                  result.entry_point)
    verdict = "pass" if chosen is not None else "fail"
    first = plans[plans.priced_on == plans.priced_on.iloc[0]] if len(plans) else plans
    study = result.study or {}
    write_summary(out_dir, verdict, {
        "rental_gpu": result.rental_gpu, "chosen": chosen and chosen["candidate"],
        "recommended_gpu": options.set_index("candidate").cheapest_gpu.get(chosen["candidate"])
        if chosen else None,
        "recommended_gpus": plain_count(options.set_index("candidate").cheapest_gpus.get(
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
                      first.groupby("days").scheduled.sum().items()},
        **priced_figures(result), "launch": launch_files.words(launched)},
        task=result.task.name)
    return verdict
