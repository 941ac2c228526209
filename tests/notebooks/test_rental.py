"""Notebook 08: the selection sheet's arithmetic, bad GPU input, packing, and candidates the
prediction cannot size (rows with the reason and a plain decision, never a crash)."""

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from workbook import WorkbookError
from workbook.base.frontend import readable
from workbook.commands import params
from workbook.contract.data import prepare
from workbook.notebooks import rental
from workbook.notebooks.registry import GATES, RENTAL
from workbook.notebooks.rental import sheet as rental_sheet
from workbook.notebooks.rental.candidates import Candidate, candidates_from, sharded_default
from workbook.notebooks.rental.conclusions import conclusion, plan_lines, study_result
from workbook.notebooks.rental.plans import (
    cheapest,
    choose,
    pack,
    planned_variants,
    priced_gpus,
)
from workbook.notebooks.rental.sheet import Assumptions, check_gpus, gpu, selection_sheet
from workbook.notebooks.rental.speeds import generation_scale
from workbook.notebooks.rental.stack import stack_check
from workbook.training import predict as predict_module
from workbook.training.loop import UpdateShape
from workbook.training.predict import Overheads, Plan
from workbook.training.workload import TRAINING_PHASES

from ..conftest import GENERATION

GIB = 2**30


def test_sheet_arithmetic_on_a_hand_checked_example(gen_task, gen_items):
    cand = Candidate("c", Plan(UpdateShape(4, 3, precision="fp32"), length=64))
    a = Assumptions(utilisation=0.5, eval_every=10, eval_examples=20, export_minutes=6.0,
                    overheads=Overheads(GIB, 0.5, False), min_update_s=0.0)
    sheet = selection_sheet(gen_task, gen_items["train"][:50], gen_items["validation"][:20],
                            [cand], {"toy": 1.0, "big": 80}, {"toy": 2.0, "big": 100.0},
                            updates=100, headroom=0.25, a=a).set_index("gpu")
    row = sheet.loc["toy"]
    peak = row.predicted_peak_gib * GIB
    assert row.required_gib == pytest.approx((peak * 1.5 + GIB) * 1.25 / GIB, abs=1e-3)
    assert not row.fits and sheet.loc["big", "fits"]  # 1 GiB context alone fills the toy
    # time per update = flops of one micro-batch x accumulation / (2e12 x 0.5)
    assert row.time_per_update_s == pytest.approx(row.flops_per_update / 1e12)
    assert sheet.loc["big", "time_per_update_s"] == pytest.approx(row.flops_per_update / 5e13)
    assert row.examples_per_update == 12 and row.strategy == "single device"
    assert row.flops_per_update % 3 == 0
    # the budget: 100 updates + 10 evaluations + 6 minutes of export
    assert row.budget_hours > 100 * row.time_per_update_s / 3600 + 0.1 - 1e-4


def test_data_parallel_adds_gradient_buckets_and_divides_nothing_per_gpu(gen_task, gen_items):
    one = Candidate("one", Plan(UpdateShape(4, 2, precision="fp32"), length=64))
    two = Candidate("two", Plan(UpdateShape(4, 2, precision="fp32", replicas=2), length=64))
    sheet = selection_sheet(gen_task, gen_items["train"][:30], gen_items["validation"][:8],
                            [one, two], {"g": 80}, {"g": 100}, 10, 0.2,
                            Assumptions()).set_index("candidate")
    assert sheet.loc["two", "examples_per_update"] == 2 * sheet.loc["one", "examples_per_update"]
    assert sheet.loc["two", "predicted_peak_gib"] > sheet.loc["one", "predicted_peak_gib"]
    assert sheet.loc["two", "time_per_update_s"] == sheet.loc["one", "time_per_update_s"]


@pytest.mark.parametrize("gpus, tflops, words", [
    ({"A100": "eighty"}, {"A100": 312}, "not a positive number of GiB"),
    ({"A100": 80}, {}, "no peak TFLOP/s"),
    ({"A100": 80}, {"A100": -1}, "not a positive number"),
])
def test_bad_gpu_figures_are_named(gpus, tflops, words):
    with pytest.raises(WorkbookError, match=words):
        check_gpus(gpus, tflops)


def specs(**given):
    """08's candidates and variants as its parameter model checks them, then as Candidates."""
    return candidates_from(RENTAL.check(given).candidates)


@pytest.mark.parametrize("given, words", [
    ({"candidates": [{"name": "x", "micro": 4, "accumulation": 1}]},
     r"'candidates\[0\].micro' is not a key of its record \(keys: name, micro_batch,"),
    ({"candidates": [{"micro_batch": 4}]}, r"'candidates\[0\].name' is missing"),
    ({"candidates": []}, "'candidates' of 08_rental_plan is \\[\\]; it must be a non-empty list"),
    ({"candidates": [{"name": "x", "micro_batch": 0}]},
     r"'candidates\[0\].micro_batch' of 08_rental_plan is 0; it must be >= 1"),
    ({"candidates": [{"name": "x", "micro_batch": "4", "precision": "fp8"}]},
     r"'candidates\[0\].micro_batch' must be int, got str '4'; parameter "
     r"'candidates\[0\].precision' must be 'fp32', 'bf16' or 'fp16', got str 'fp8'"),
    ({"candidates": [{"name": "x", "offload_optimizer": 1}]},
     r"'candidates\[0\].offload_optimizer' must be bool, got int 1"),
    ({"candidates": [{"name": "x", "gpus_per_node": 0}]},
     r"'candidates\[0\].gpus_per_node' .* >= 1"),
])
def test_bad_candidates_are_named_by_the_parameter_model(given, words):
    with pytest.raises(WorkbookError, match=words):
        specs(**given)


def test_unknown_gpu_and_a_clean_candidate():
    with pytest.raises(WorkbookError, match="unknown GPU 'A1000'"):
        gpu("A1000", {"A100": 80})
    (cand,) = specs(candidates=[{"name": "x", "micro_batch": 4, "length": 64}],
                    variants=[{"name": "v", "priority": 1, "candidate": "x"}])
    assert (cand.plan.shape, cand.plan.length) == (UpdateShape(4, 1, "bf16"), 64)


def test_packing_keeps_what_does_not_fit_on_the_list():
    sheet = pd.DataFrame([{"candidate": "a", "gpu": "g", "fits": True, "budget_hours": 10.0},
                          {"candidate": "big", "gpu": "g", "fits": False, "budget_hours": 1.0}])
    variants = [{"name": "first", "priority": 1, "candidate": "a", "repeats": 3},
                {"name": "second", "priority": 2, "candidate": "a", "repeats": 5},
                {"name": "oversize", "priority": 3, "candidate": "big"}]
    plan = pack(variants, sheet, "g", days=3, reserve_share=0.25)  # 54 usable hours
    assert plan.scheduled.tolist() == [True, False, False]
    assert plan.end_hour[0] == 30 and "24.0 h of the 54 usable hours left" in plan.why_not[1]
    assert "does not fit the GPU's memory" in plan.why_not[2]
    assert pack(variants, sheet, "g", 30, 0.25).scheduled.tolist() == [True, True, False]


def test_stack_check_lists_the_task_imports():
    table = stack_check(GENERATION, "cpu", "bf16").set_index("item")
    assert table.loc["import torch", "verified"]
    fp16 = stack_check(GENERATION, "cpu", "fp16").set_index("item")
    assert not fp16.loc["precision fp16", "verified"]


def _priced_sheet(gen_task, gen_items, prices):
    cands = [Candidate("control", Plan(UpdateShape(4, 2, precision="fp32"), length=64)),
             Candidate("wide", Plan(UpdateShape(4, 2, precision="fp32", replicas=2), length=64))]
    return selection_sheet(gen_task, gen_items["train"][:30], gen_items["validation"][:8],
                           cands, {"toy": 1.0, "small": 24, "big": 80},
                           {"toy": 10, "small": 100, "big": 400}, 1000, 0.2,
                           Assumptions(prices=prices, currency="EUR", min_update_s=0.005))


@pytest.fixture(scope="module")
def priced(gen_task, gen_items):
    """The priced sheet the cost and conclusion tests read (each reads a copy)."""
    return _priced_sheet(gen_task, gen_items, {"toy": 0.1, "small": 1.0, "big": 3.0})


def test_costs_the_cheapest_fitting_gpu_and_the_time_floor(gen_task, gen_items, priced):
    sheet = priced.copy()
    assert sheet.time_floored.all() and (sheet.time_per_update_s == 0.005).all(), \
        "a tiny model's update is never faster than the launch floor"
    row = sheet.set_index(["candidate", "gpu"]).loc[("wide", "big")]
    assert row.cost == pytest.approx(round(row.budget_hours * 2 * 3.0, 2))
    options = cheapest(sheet, "big").set_index("candidate")
    assert options.loc["control", "cheapest_gpu"] == "small", "toy does not fit; small is cheaper"
    assert re.search(r"costs \d+\.\dx less than big", options.loc["control", "why"])
    assert cheapest(sheet, "toy").set_index("candidate").loc["control", "why"].startswith(
        "toy lacks memory")
    with pytest.raises(WorkbookError, match="no price per hour for 'big'"):
        _priced_sheet(gen_task, gen_items, {"toy": 0.1, "small": 1.0})


def test_the_conclusion_names_the_cheapest_gpu_and_the_study_in_words(priced, tmp_path):
    import json

    sheet = priced.copy()
    (tmp_path / "06_lr_study").mkdir()
    (tmp_path / "06_lr_study" / "summary.json").write_text(json.dumps({
        "verdict": "pass", "figures": {"metric": "loss", "best_metric": 2.953021240234375,
                                       "best_lr": 2e-4, "best_trial": 3, "control_lr": 1e-4,
                                       "control_remains_best": False, "trials": 3,
                                       "statuses": {"finished": 2, "diverged": 1}}}))
    (tmp_path / "01_inspect_examples").mkdir()
    (tmp_path / "01_inspect_examples" / "summary.json").write_text(json.dumps({"verdict": "pass"}))
    (tmp_path / "04_batch_accounting").mkdir()
    (tmp_path / "04_batch_accounting" / "summary.json").write_text(json.dumps({
        "verdict": "error", "error": "AttributeError: no attribute 'x'", "figures": {}}))
    (tmp_path / "07_resume_reload").mkdir()
    (tmp_path / "07_resume_reload" / "summary.json").write_text("[1, 2")  # cut short
    variants = [{"name": "control", "priority": 1, "candidate": "control", "repeats": 2},
                {"name": "huge", "priority": 2, "candidate": "wide", "repeats": 10**6}]
    plans = pd.concat([pack(variants, sheet, "big", d, 0.2) for d in (3, 7)])
    stack = pd.DataFrame([{"item": "CUDA", "here": "none (CPU)", "verified": False,
                           "on the rental": "driver"}])
    text = conclusion(tmp_path, choose(sheet, "big"), "big", plans, stack,
                      cheapest(sheet, "big"))
    # 04 ended with an error: the decision leads with it and says "Rent" nowhere
    assert text.split("\n")[2].startswith("**Do not rent yet**: notebook 04 (batch "
                                           "accounting) ended with error: AttributeError")
    assert not re.search(r"\bRent\b", text)
    assert "Once it passes, the plan is a small for candidate **control**" in text
    assert "You planned on the big (EUR" in text
    assert "best validation loss 2.953 at lr 0.0002 (trial 3); lr 0.0002 beat the control " \
        "(lr 0.0001)" in text and "2 finished, 1 diverged" in text
    assert "{" not in text and "2.953021" not in text
    assert "Other notebooks of this run: inspection pass, batch accounting error " \
        "(AttributeError: no attribute 'x'), resume and reload unreadable " \
        "(07_resume_reload/summary.json cannot be read)." in text  # never read as passes
    assert "no GPU was present" in text and "1 of 2 variants scheduled" in text
    assert not plans.why_not.isin(["", None]).any() and plans.why_not.notna().all()
    assert "needs" in plans.set_index("variant").loc["huge", "why_not"].iloc[0]


def test_a_candidate_that_does_not_apply_says_why_in_the_plan():
    sheet = pd.DataFrame([{"candidate": "checkpointed", "gpu": "g", "fits": False,
                           "budget_hours": None, "cost": None,
                           "note": "not applicable: the model has no blocks to checkpoint"}])
    plan = pack([{"name": "v", "priority": 1, "candidate": "checkpointed"}], sheet, "g", 3, 0.2)
    assert plan.why_not[0] == "not applicable: the model has no blocks to checkpoint"


def _every_phase_unpredicted(monkeypatch, phases=TRAINING_PHASES, why="planted: the real run "
                             "that checks the prediction failed"):
    """The prediction marks `phases` "not predicted", as 03 does for a model it cannot size."""
    monkeypatch.setattr(predict_module, "calibration_limits",
                        lambda *args, **kwargs: dict.fromkeys(phases, why))


def test_no_candidate_sized_gives_rows_with_the_reason_and_a_plain_decision(monkeypatch,
                                                                            tmp_path):
    _every_phase_unpredicted(monkeypatch)
    out = tmp_path / "08_rental_plan"
    out.mkdir()
    p = params.of("08_rental_plan", small=True, train_limit=20,
                  task_options={"campaign_layers": 0}, candidates=[
        {"name": "control", "micro_batch": 2, "length": 64, "precision": "fp32"}],
        variants=[{"name": "control", "priority": 1, "candidate": "control"}])
    result = rental.run(p, out)  # crashed: "ValueError: Encountered all NA values"
    sheet = result.sheet
    assert not sheet.fits.any() and sheet.predicted_peak_gib.isna().all()
    assert sheet.note.str.startswith("not predicted (forward + loss, backward, update "
                                     "(first), update (later), validation): planted").all()
    assert sheet.flops_per_update.notna().all(), "the FLOPs and hours do not need the memory"
    assert "**No candidate could be sized**" in result.conclusion
    assert "No candidate fits any GPU" not in result.conclusion, "not sized is not too big"
    assert result.options.why.str.startswith("not predicted").all()
    assert result.plans.why_not.str.startswith("not predicted").all()
    readable(sheet)
    assert rental.save(result, out) == "fail"
    assert json.loads((out / "summary.json").read_text())["figures"]["not_sized"] == ["control"]


def test_a_model_whose_kernels_hide_memory_is_not_sized_on_the_one_phase_predicted(tmp_path):
    from examples.module_families import family_task

    task = family_task("lstm")  # the CPU's LSTM workspace: 4 of 5 phases "not predicted"
    data = prepare(task, limits={"train": 30})
    cand = Candidate("c", Plan(UpdateShape(4, 1, precision="fp32")))
    sheet = selection_sheet(task, data.train, data.validation, [cand], {"g": 80}, {"g": 100},
                            10, 0.2, Assumptions())
    assert not sheet.fits.any(), "a fit read from `update (first)` alone would be a guess"
    assert "fake tensors do not see (suspects: LSTM)" in sheet.note[0]


def test_validation_alone_not_predicted_still_sizes_on_the_training_phases(monkeypatch,
                                                                           gen_task, gen_items):
    _every_phase_unpredicted(monkeypatch, ["validation"], "planted: the fused kernel")
    cand = Candidate("c", Plan(UpdateShape(2, 1, precision="fp32"), length=64))
    sheet = selection_sheet(gen_task, gen_items["train"][:20], gen_items["validation"][:8],
                            [cand], {"toy": 1.0, "big": 80}, {"toy": 10, "big": 100}, 10, 0.2,
                            Assumptions()).set_index("gpu")
    assert sheet.loc["big", "fits"] and not sheet.loc["toy", "fits"]
    assert sheet.loc["big", "peak_phase"] != "validation"
    assert sheet.loc["big", "note"] == ("not predicted (validation): planted: the fused kernel; "
                                        "the fit rests on the training phases")
    plan = pack([{"name": "v", "priority": 1, "candidate": "c"}], sheet.reset_index(), "toy",
                3, 0.2)
    assert plan.why_not[0] == "does not fit the GPU's memory", "sized: the note is not why"


def test_a_prediction_or_flop_count_that_raises_is_a_row_not_a_crash(monkeypatch, gen_task,
                                                                      gen_items):
    def boom(*args, **kwargs):
        raise RuntimeError("planted crash\nsecond line")

    cand = Candidate("c", Plan(UpdateShape(2, 1, precision="fp32"), length=64))
    args = (gen_task, gen_items["train"][:20], gen_items["validation"][:8], [cand],
            {"toy": 1.0, "big": 80}, {"toy": 10, "big": 100}, 10, 0.2,
            Assumptions(prices={"toy": 0.1, "big": 1.0}))
    monkeypatch.setattr(rental_sheet, "flops", boom)
    sheet = selection_sheet(*args)
    assert sheet.set_index("gpu").loc["big", "fits"] and sheet.budget_hours.isna().all()
    assert sheet.note[0] == "FLOPs not counted, so no time or cost: RuntimeError: planted crash"
    options = cheapest(sheet, "big")
    assert options.cheapest_gpu[0] == "big" and "no time or cost to compare" in options.why[0]
    readable(sheet)  # a FLOP column without any count divides (None / 1e9 did not)
    assert "time not known" in conclusion(Path("/nonexistent"), choose(sheet, "big"), "big",
                                          pack([], sheet, "big", 3, 0.2), pd.DataFrame(
                                              columns=["item", "verified"]), options)
    monkeypatch.setattr(rental_sheet, "predict", boom)
    sheet = selection_sheet(*args)
    assert sheet.note.str.startswith("not predicted: the prediction raised RuntimeError: "
                                     "planted crash").all()


def test_the_cheapest_is_by_cost_even_when_another_candidate_has_none():
    def row(cand, gpu, hours, cost, fits=True):
        return {"candidate": cand, "gpu": gpu, "fits": fits, "gpu_hours": hours,
                "budget_hours": hours, "cost": cost, "price_per_hour": None if cost is None
                else cost / hours, "headroom_gib": 10.0, "required_gib": 1.0,
                "currency": "USD", "predicted_peak_gib": None if cost is None else 0.5,
                "note": "not applicable: planted" if cost is None else ""}
    sheet = pd.DataFrame([row("a", "fast", 1.0, 4.0), row("a", "slow", 3.0, 1.5),
                          row("b", "fast", None, None, False), row("b", "slow", None, None,
                                                                   False)])
    options = cheapest(sheet, "fast").set_index("candidate")
    assert options.loc["a", "cheapest_gpu"] == "slow", "by cost, not by hours"
    assert options.loc["b", "why"] == "not applicable: planted"


@pytest.mark.parametrize("variants, words", [
    ({"name": "x"}, "'variants' must be list, got dict"),
    ([{"name": "x", "candidate": "control"}], r"'variants\[0\].priority' is missing"),
    ([{"name": "x", "priority": 1, "candidate": "control", "repeat": 2}],
     r"'variants\[0\].repeat' is not a key of its record \(keys: name, priority, candidate, "
     r"repeats, lr\)"),
    ([{"name": "x", "priority": 1, "candidate": "contrl"}],
     "variant 'x' names candidate 'contrl', which is not in the candidates"),
    ([{"name": "x", "priority": 1, "candidate": "control", "repeats": 0}],
     r"'variants\[0\].repeats' of 08_rental_plan is 0; it must be >= 1"),
    ([{"name": "x", "priority": "high", "candidate": "control"}],
     r"'variants\[0\].priority' must be float, got str 'high'"),
    ([{"name": "x", "priority": True, "candidate": "control"}],
     r"'variants\[0\].priority' must be float, got bool True"),
    ([{"name": "x", "priority": 1, "candidate": "control", "lr": "best"}],
     r"'variants\[0\].lr' of 08_rental_plan is 'best'; it must be a number of 0 or more"),
    ([{"name": "x", "priority": 1, "candidate": "control", "lr": -1e-3}],
     r"'variants\[0\].lr' of 08_rental_plan is -0.001"),
])
def test_bad_variants_are_named_before_anything_is_sized(variants, words):
    with pytest.raises(WorkbookError, match=words):
        specs(candidates=[{"name": "control", "micro_batch": 2}], variants=variants)


def test_whole_number_priorities_and_rates_are_numbers():
    variants = [{"name": "a", "priority": 2, "candidate": "c", "lr": 1},
                {"name": "b", "priority": 0.5, "candidate": "c", "repeats": 2, "lr": "study"}]
    checked = RENTAL.check({"candidates": [{"name": "c"}], "variants": variants})
    assert checked.variants == variants, "kept as given"


def test_no_variants_leave_empty_plans_that_say_so():
    sheet = pd.DataFrame([{"candidate": "a", "gpu": "g", "fits": True, "budget_hours": 1.0}])
    plans = pd.concat([pack([], sheet, "g", d, 0.2) for d in (3, 7, 30)], ignore_index=True)
    assert plans.empty and "why_not" in plans
    specs(candidates=[{"name": "a", "micro_batch": 2}], variants=[])
    options = pd.DataFrame([{"candidate": "a", "cheapest_gpu": "g", "currency": "USD",
                             "cheapest_cost": None, "why": "g is the cheapest GPU that fits"}])
    text = conclusion(Path("/nonexistent"), None, "g", plans,
                      pd.DataFrame(columns=["item", "verified"]), options)
    assert "- no variants given: nothing to plan into 3, 7 or 30 days" in text



def _sheet_with_fsdp(gen_task, gen_items, gpus):
    single = Candidate("single", Plan(UpdateShape(1, 8, precision="fp32"), length=64,
                                      eval_batch=4))
    sharded = Candidate("sharded", single.plan, "same update sharded", "fsdp")
    a = Assumptions(utilisation=0.5, eval_every=10, eval_examples=8, export_minutes=6.0,
                    overheads=Overheads(0, 0.0, False), min_update_s=0.0,
                    prices={g: 2.0 if g == "small" else 3.0 for g in gpus})
    return selection_sheet(gen_task, gen_items["train"][:40], gen_items["validation"][:8],
                           [single, sharded], gpus, dict.fromkeys(gpus, 100.0), updates=100,
                           headroom=0.0, a=a)


def test_fsdp_is_picked_when_the_model_fits_no_single_gpu_and_single_when_it_fits(
        gen_task, gen_items):
    plan = Plan(UpdateShape(1, 8, precision="fp32"), length=64, eval_batch=4)
    one = predict_module.predict(gen_task, gen_items["train"][:40],
                                 gen_items["validation"][:8], plan).predicted_peak_bytes.max()
    # a GPU just below the single device's peak: single does not fit, fsdp over some N does
    gpus = {"big": 1.0, "small": 0.97 * one / GIB}
    sheet = _sheet_with_fsdp(gen_task, gen_items, gpus)
    rows = sheet.set_index(["candidate", "gpu"])
    assert rows.loc[("single", "big"), "fits"] and not rows.loc[("single", "small"), "fits"]
    small = rows.loc[("sharded", "small")]
    assert small.fits and small.gpus in (2, 4, 8) and small.strategy.startswith("FSDP2")
    assert small.examples_per_update == 8 and small.micro_batch * small.accumulation * \
        small.gpus == 8, "every world trains the same update"
    # cost arithmetic: hours x GPUs x price; each GPU makes its share of the update
    assert small.gpu_hours == pytest.approx(small.budget_hours * small.gpus, abs=1e-3)
    assert small.cost == pytest.approx(small.budget_hours * small.gpus * 2.0, abs=0.02)
    single = rows.loc[("single", "small")]
    assert small.time_per_update_s == pytest.approx(single.time_per_update_s / small.gpus,
                                                    rel=0.02)
    assert small.budget_hours >= 0.1, "6 minutes of export"
    options = cheapest(sheet, "small")
    chosen = choose(sheet, "small")
    assert chosen["candidate"] == "sharded"
    text = conclusion(Path("/nonexistent"), chosen, "small", pd.DataFrame(columns=["days"]),
                      pd.DataFrame(columns=["item", "here", "verified", "on the rental"]),
                      options, {}, ["model: 0.01 M parameters"])
    assert f"**Rent {int(small.gpus)} x small** for candidate **sharded** (FSDP2 full " \
           f"sharding x{int(small.gpus)}" in text and "GiB needed with headroom per GPU" in text
    assert "USD" in text and "Sized for: model" in text


@pytest.mark.parametrize("spec, words", [
    ({"strategy": "fsdp", "world": 1}, r"world' of 08_rental_plan is 1; it must be in \[2, 64\]"),
    ({"strategy": "fsdp", "world": 65}, r"world' of 08_rental_plan is 65; it must be in \[2, 64\]"),
    ({"strategy": "fsdp", "replicas": 2}, "every GPU of the world is a data-parallel rank"),
    ({"strategy": "zero"}, "strategy' must be '', 'single', 'ddp' or 'fsdp', got str 'zero'"),
    ({"offload_optimizer": True}, "belong to strategy fsdp"),
    ({"strategy": "ddp"}, "ddp needs replicas of 2 or more"),
    ({"strategy": "single", "replicas": 2, "world": 2},
     "strategy single with replicas=2 \\(that is ddp\\); world and offload_optimizer belong"),
])
def test_bad_strategies_are_named(spec, words):
    with pytest.raises(WorkbookError, match=words):
        specs(candidates=[{"name": "c", **spec}], variants=[])
    for clean in ({"strategy": "fsdp", "world": 2, "offload_optimizer": True},
                  {"strategy": "ddp", "replicas": 2}, {"replicas": 2}, {}):
        specs(candidates=[{"name": "c", **clean}], variants=[])


def test_the_sharded_default_keeps_the_first_candidates_update():
    first = specs(candidates=[{"name": "control", "micro_batch": 16, "accumulation": 2}],
                  variants=[])[0]
    extra = sharded_default(first)
    shape = extra.plan.shape
    assert extra.parallelism == "fsdp" and extra.world is None and shape.activation_checkpointing
    assert shape.micro_batch * shape.accumulation == 32 and shape.micro_batch == 2


# --- a decision that cannot contradict itself (planted sheets and summaries) ---------------
def _sheet_row(cand, gpu, price, fits=True, hours=0.1, floored=True, gpus=1,
               strategy="single device"):
    update_s = 0.005 if floored else 0.05
    return {"candidate": cand, "gpu": gpu, "gpu_memory_gib": 80, "precision": "bf16",
            "micro_batch": 16, "accumulation": 2, "strategy": strategy, "gpus": gpus,
            "fits": fits, "predicted_peak_gib": 1.0, "required_gib": 1.4,
            "headroom_gib": 20.0, "time_per_update_s": update_s, "time_floored": floored,
            "budget_hours": hours, "gpu_hours": hours * gpus, "price_per_hour": price,
            "cost": round(hours * gpus * price, 2), "currency": "USD", "note": "",
            "expected": "the rate the study supports, at campaign scale"}


def _sheet(floored=True, hours=0.1):
    # "cheap" costs less per hour; "planned" is the GPU planned on
    return pd.DataFrame([_sheet_row("control", "cheap", 0.8, floored=floored, hours=hours),
                         _sheet_row("control", "planned", 2.2, floored=floored,
                                    hours=hours if floored else hours / 2)])


VARIANTS = [{"name": "control", "priority": 1, "candidate": "control", "repeats": 3,
             "lr": "control"},
            {"name": "best study lr", "priority": 2, "candidate": "control", "repeats": 3,
             "lr": "study"}]
NO_STACK = pd.DataFrame(columns=["item", "here", "verified", "on the rental"])


def _study(run_dir, warnings=(), best_lr=2e-4):
    (run_dir / "06_lr_study").mkdir(parents=True, exist_ok=True)
    (run_dir / "06_lr_study" / "summary.json").write_text(json.dumps({
        "verdict": "pass", "figures": {
            "metric": "loss", "best_metric": 2.95, "best_lr": best_lr, "best_trial": 3,
            "control_lr": 1e-4, "control_remains_best": best_lr == 1e-4, "trials": 3,
            "statuses": {"finished": 3}, "seeds": 1, "warnings": list(warnings),
            "conclusive": not warnings, "supported_lr": best_lr}}))


def _decide(run_dir, sheet, rental_gpu, variants=VARIANTS):
    options, chosen = cheapest(sheet, rental_gpu), choose(sheet, rental_gpu)
    study = study_result(run_dir)
    planned = planned_variants(variants, sheet, {}, study)
    plans = pd.concat([pack(planned, sheet, g, d, 0.2, role)
                       for g, role in priced_gpus(chosen, options, rental_gpu)
                       for d in (3, 7, 30)], ignore_index=True)
    return plans, conclusion(run_dir, chosen, rental_gpu, plans, NO_STACK, options,
                             study=study)


def test_plans_are_priced_on_the_recommended_gpu_and_on_the_planned_one_saying_which(
        tmp_path):
    _study(tmp_path)
    plans, text = _decide(tmp_path, _sheet(), "planned")
    assert "**Rent a cheap** for candidate **control**" in text
    assert set(zip(plans.gpu, plans.priced_on, strict=True)) == {("cheap", "recommended"),
                                                                  ("planned", "planned on")}
    cheap = plans[plans.gpu == "cheap"]
    assert cheap.cost.tolist() == [0.24, 0.24] * 3, "priced at the recommended GPU's price"
    assert "plans on the cheap (recommended):" in text
    assert "plans on the planned (the GPU you planned on):" in text
    assert text.index("on the cheap (recommended)") < text.index("on the planned (the GPU")
    # the clean twin: planned on the GPU the decision recommends - one set of plans
    plans, text = _decide(tmp_path, _sheet(), "cheap")
    assert set(zip(plans.gpu, plans.priced_on, strict=True)) == {
        ("cheap", "recommended and planned on")}
    assert "on the cheap (recommended; the GPU you planned on)" in text
    assert "on the planned" not in text and len(plans) == 6


def test_a_budget_that_fits_in_hours_says_so_and_a_long_one_does_not(tmp_path):
    plans, text = _decide(tmp_path, _sheet(hours=0.1), "cheap")
    assert "- 3, 7 and 30-day plans on the cheap (recommended; the GPU you planned on): all " \
        "the same - every variant (control x3, best study lr x3) fits in 3 days: 0.6 h, " \
        "USD 0.48 in all. The whole budget takes 0.6 h (36 minutes), under an hour: rent by " \
        "the hour, not by the day." in text
    big = pd.concat([_sheet(), pd.DataFrame([_sheet_row("big", "cheap", 0.8, fits=False)])])
    _, text = _decide(tmp_path, big, "cheap", [*VARIANTS, {"name": "big", "priority": 3,
                                                           "candidate": "big"}])
    assert "fit in 3 days: 0.6 h, USD 0.48 in all; not scheduled in any: big (does not fit " \
        "the GPU's memory). The whole budget takes 0.6 h (36 minutes), under an hour" in text
    plans, text = _decide(tmp_path, _sheet(hours=10.0), "cheap")  # 60 h of 57.6 usable
    assert "rent by the hour" not in text and "all the same" not in text
    assert "- 3-day plan on the cheap (recommended; the GPU you planned on): 1 of 2 variants " \
        "scheduled" in text and "- 7-day plan" in text and "- 30-day plan" in text


def test_when_every_time_is_floored_the_cheapest_gpu_is_by_price_alone(tmp_path):
    _, text = _decide(tmp_path, _sheet(floored=True), "planned")
    assert "cheap fits with 20.0 GiB to spare and costs 2.8x less than planned for this " \
        "budget; by price alone: every GPU's time per update is the 5 ms launch floor" in text
    assert "cannot tell the GPUs' speeds apart" in text
    _, text = _decide(tmp_path, _sheet(floored=False), "planned")  # a real speed difference
    assert "by price alone" not in text and "launch floor" not in text
    assert "costs 1.4x less than planned for this budget." in text


def test_the_decision_plans_the_rate_the_study_supports_and_carries_its_warnings(tmp_path):
    edge = ("the best lr 0.0002 is the largest tried (5e-05, 0.0001, 0.0002): a larger one "
            "may be better - extend the range upward")
    _study(tmp_path, [edge])
    plans, text = _decide(tmp_path, _sheet(), "cheap")
    assert f"**Learning rate: 0.0002 for now**, the best of notebook 06's study, which beat " \
        f"the control (lr 0.0001) on one seed - provisional: {edge}." in text
    assert "one seed (no spread)" in text and "1 warning: see the learning rate above" in text
    assert text.count("extend the range upward") == 1
    rows = plans[plans.days == 3].set_index("variant")
    assert rows.loc["best study lr", "lr"] == 2e-4 and rows.loc["control", "lr"] == 1e-4
    assert rows.loc["best study lr", "lr_from"] == "06's best, provisional"
    assert "best study lr at lr 0.0002 x3" in text and "control at lr 0.0001 x3" in text
    # the clean twin: the best inside the grid, nothing to warn of
    _study(tmp_path, [])
    plans, text = _decide(tmp_path, _sheet(), "cheap")
    assert "**Learning rate: 0.0002**, the best of notebook 06's study, which beat the control" \
        in text and "provisional" not in text and "extend the range" not in text
    assert plans.set_index("variant").lr_from.loc["best study lr"].iloc[0] == "06's best"
    _study(tmp_path, [], best_lr=1e-4)
    _, text = _decide(tmp_path, _sheet(), "cheap")
    assert "**Learning rate: 0.0001**, the control: notebook 06's study found no better rate" \
        in text


def test_without_the_study_the_decision_says_no_rate_was_chosen(tmp_path):
    plans, text = _decide(tmp_path, _sheet(), "cheap")
    assert "**Learning rate: not chosen by a study** - notebook 06 did not run in this run " \
        "folder: run it before the campaign." in text
    assert "Learning-rate study:" not in text
    assert plans.lr.isna().all() and (plans.lr_from == "none: 06 did not run").all()
    (tmp_path / "06_lr_study").mkdir()
    (tmp_path / "06_lr_study" / "summary.json").write_text(json.dumps({
        "verdict": "fail", "figures": {"metric": "loss", "best_metric": None, "best_lr": None,
                                       "control_lr": 1e-4, "trials": 1,
                                       "statuses": {"diverged": 1},
                                       "finding": "every learning rate tried diverged (1000)"}}))
    _, text = _decide(tmp_path, _sheet(), "cheap")
    assert "**Learning rate: not chosen** - notebook 06's study is inconclusive: every " \
        "learning rate tried diverged (1000)." in text


def test_variants_of_a_candidate_that_fits_no_single_gpu_are_planned_sharded():
    sheet = pd.DataFrame([
        _sheet_row("control", "g", 2.0, fits=False),
        _sheet_row("other", "g", 2.0, fits=False),
        _sheet_row("sharded", "g", 2.0, gpus=4, strategy="FSDP2 full sharding x4")])
    variants = [{"name": "control", "priority": 1, "candidate": "control"},
                {"name": "other", "priority": 2, "candidate": "other"}]
    planned = planned_variants(variants, sheet, {"control": "sharded"},
                               study_result("/nonexistent"))
    plan = pack(planned, sheet, "g", 3, 0.2, "recommended").set_index("variant")
    assert plan.loc["control", "candidate"] == "sharded" and plan.loc["control", "scheduled"]
    assert plan.loc["control", "gpus"] == 4 and plan.loc["control", "strategy"].startswith(
        "FSDP2")
    assert plan.loc["control", "planned_as"] == ("candidate control fits no single GPU: its "
                                                 "update sharded (candidate sharded)")
    assert not plan.loc["other", "scheduled"] and plan.loc["other", "planned_as"] == "", \
        "no sharded candidate trains its update"
    lines = plan_lines(pd.concat([pack(planned, sheet, "g", d, 0.2, "recommended")
                                  for d in (3, 7, 30)]), "g", "USD")
    assert lines[-1] == ("- control: its candidate fits no single GPU, so it is planned on "
                         "candidate sharded, the same update sharded.")
    # the clean twin: a candidate that fits one GPU keeps its own plan
    fits = sheet.assign(fits=True)
    planned = planned_variants(variants, fits, {"control": "sharded"}, {})
    assert [v["candidate"] for v in planned] == ["control", "other"]


def test_a_failed_inspection_leads_the_decision_with_its_first_flag_and_fix(tmp_path):
    """01 failed: the decision's first line names it with the flag's own fix, and the plan
    that follows never says 'Rent'; the clean twin (01 passed) rents as before."""
    _study(tmp_path)
    folder = tmp_path / "01_inspect_examples"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({
        "verdict": "fail", "figures": {}, "flags": ["loss on padding"]}))
    (folder / "flags.json").write_text(json.dumps([{
        "check": "loss on padding", "count": 3, "message": "3 padding positions carry targets",
        "fix": "set labels to -100 on padding in collate", "examples": []}]))
    _, text = _decide(tmp_path, _sheet(), "planned")
    assert text.split("\n")[2] == (
        "**Do not rent yet**: notebook 01 (inspection) failed: 1 flag raised: loss on padding "
        "- fix: set labels to -100 on padding in collate. Fix it and run the pilot again; the "
        "plan below is what it would be once every notebook passes.")
    assert not re.search(r"\bRent\b", text)
    (folder / "summary.json").write_text(json.dumps({"verdict": "pass", "figures": {}}))
    _, text = _decide(tmp_path, _sheet(), "planned")
    assert "Do not rent" not in text and "**Rent a cheap** for candidate **control**" in text


def test_measured_speed_of_a_small_model_on_a_large_gpu_is_not_zero():
    """An H200 timed the sample twin at 8e-6 of its peak; rounded to 4 decimals that was an MFU
    of 0 and 08 died dividing by it."""
    import pandas as pd

    from workbook.notebooks.rental.speeds import measured_speed

    gates = pd.DataFrame({"device": ["cuda:0"]})
    pipeline = pd.DataFrame({"time_s": [0.004, 0.0041, 0.0039]})
    speed, why = measured_speed(gates, pipeline, "H200", 3.2e7, 989.0, True)
    assert why == "" and speed.mfu > 0 and abs(speed.mfu - 8.09e-6) < 1e-7
    none, why = measured_speed(gates, pipeline, "H200", 0.0, 989.0, True)
    assert none is None and "not calibrated" in why


def _gates_summary(run_dir: Path, **figures) -> Path:
    folder = run_dir / GATES.stem
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"verdict": "pass", "figures": figures}))
    return run_dir


def test_generation_share_measured_by_03_scales_every_time_per_update(tmp_path, gen_task,
                                                                       gen_items):
    scale, words = generation_scale(_gates_summary(tmp_path / "grpo", generation_share=0.8))
    assert scale == pytest.approx(5.0) and "80% (03, on the CPU)" in words and "x 5" in words
    assert generation_scale(_gates_summary(tmp_path / "sft", peak_phase="backward")) == (1.0, "")
    assert generation_scale(tmp_path / "no-03") == (1.0, "")
    held, why = generation_scale(_gates_summary(tmp_path / "all", generation_share=1.0))
    assert held == pytest.approx(20.0) and "03 measured 100%, held at 95%" in why
    with pytest.raises(WorkbookError, match="generation_share -0.2 .* is not a share"):
        generation_scale(_gates_summary(tmp_path / "bad", generation_share=-0.2))
    cand = Candidate("c", Plan(UpdateShape(4, 3, precision="fp32"), length=64))

    def sheet(**step):
        a = Assumptions(utilisation=0.5, eval_every=1000, export_minutes=0.0,
                        min_update_s=0.0, prices={"toy": 1e6}, **step)
        return selection_sheet(gen_task, gen_items["train"][:20], gen_items["validation"][:4],
                               [cand], {"toy": 80}, {"toy": 2.0}, updates=100, headroom=0.25,
                               a=a)
    plain, scaled = sheet(), sheet(step_scale=scale, step_words=words)
    assert scaled.time_per_update_s[0] == pytest.approx(5 * plain.time_per_update_s[0])
    assert scaled.cost[0] / plain.cost[0] == pytest.approx(
        scaled.budget_hours[0] / plain.budget_hours[0], rel=1e-2)
    assert scaled.cost[0] > 4 * plain.cost[0]
    assert words in scaled.attrs["sources"]["time_per_update_s"]
    assert "generation" not in plain.attrs["sources"]["time_per_update_s"]
