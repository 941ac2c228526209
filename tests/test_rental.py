"""Notebook 08: the selection sheet's arithmetic, bad GPU input, packing."""

import re

import pandas as pd
import pytest

from workbook import WorkbookError
from workbook.loop import UpdateShape
from workbook.predict import Overheads, Plan
from workbook.rental import (
    Assumptions,
    Candidate,
    candidates_from,
    cheapest,
    check_gpus,
    choose,
    conclusion,
    gpu,
    pack,
    selection_sheet,
    stack_check,
)

from .conftest import GENERATION

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


def test_unknown_gpu_and_unknown_candidate_keys():
    with pytest.raises(WorkbookError, match="unknown GPU 'A1000'"):
        gpu("A1000", {"A100": 80})
    with pytest.raises(WorkbookError, match="unknown keys \\['micro'\\]"):
        candidates_from([{"name": "x", "micro": 4, "accumulation": 1}])
    with pytest.raises(WorkbookError, match="non-empty list"):
        candidates_from([])
    with pytest.raises(WorkbookError, match="micro_batch must be a positive integer"):
        candidates_from([{"name": "x", "micro_batch": 0}])
    (cand,) = candidates_from([{"name": "x", "micro_batch": 4, "length": 64}])
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


def test_costs_the_cheapest_fitting_gpu_and_the_time_floor(gen_task, gen_items):
    sheet = _priced_sheet(gen_task, gen_items, {"toy": 0.1, "small": 1.0, "big": 3.0})
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


def test_the_conclusion_names_the_cheapest_gpu_and_the_study_in_words(gen_task, gen_items,
                                                                       tmp_path):
    import json

    sheet = _priced_sheet(gen_task, gen_items, {"toy": 0.1, "small": 1.0, "big": 3.0})
    (tmp_path / "06_lr_study").mkdir()
    (tmp_path / "06_lr_study" / "summary.json").write_text(json.dumps({
        "verdict": "pass", "figures": {"metric": "loss", "best_metric": 2.953021240234375,
                                       "best_lr": 2e-4, "best_trial": 3, "control_lr": 1e-4,
                                       "control_remains_best": False, "trials": 3,
                                       "statuses": {"finished": 2, "diverged": 1}}}))
    variants = [{"name": "control", "priority": 1, "candidate": "control", "repeats": 2},
                {"name": "huge", "priority": 2, "candidate": "wide", "repeats": 10**6}]
    plans = pd.concat([pack(variants, sheet, "big", d, 0.2) for d in (3, 7)])
    stack = pd.DataFrame([{"item": "CUDA", "here": "none (CPU)", "verified": False,
                           "on the rental": "driver"}])
    text = conclusion(tmp_path, choose(sheet, "big"), "big", plans, stack,
                      cheapest(sheet, "big"))
    assert "**Rent a small** for candidate **control**" in text
    assert "You planned on the big (EUR" in text
    assert "best validation loss 2.953 at lr 0.0002 (trial 3); lr 0.0002 beat the control " \
        "(lr 0.0001)" in text and "2 finished, 1 diverged" in text
    assert "{" not in text and "2.953021" not in text
    assert "no GPU was present" in text and "1 of 2 variants scheduled" in text
    assert not plans.why_not.isin(["", None]).any() and plans.why_not.notna().all()
    assert "needs" in plans.set_index("variant").loc["huge", "why_not"].iloc[0]


def test_a_candidate_that_does_not_apply_says_why_in_the_plan():
    sheet = pd.DataFrame([{"candidate": "checkpointed", "gpu": "g", "fits": False,
                           "budget_hours": None, "cost": None,
                           "note": "not applicable: the model has no blocks to checkpoint"}])
    plan = pack([{"name": "v", "priority": 1, "candidate": "checkpointed"}], sheet, "g", 3, 0.2)
    assert plan.why_not[0] == "not applicable: the model has no blocks to checkpoint"
