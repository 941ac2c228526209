"""Notebook 06 without a grid: the range test on the task's own update places it, the study
extends it at an edge within its budget, and a task whose loss cannot fall gets "no rate
learns" (tests/study_tasks.py: a linear rule, random labels, the rule under plain SGD)."""

import json
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from workbook.base.errors import WorkbookError
from workbook.notebooks.study import Study, StudyDesign, range_test, save
from workbook.notebooks.study.chance import Chance
from workbook.notebooks.study.support import beyond, findings, next_trials
from workbook.training.loop import UpdateShape

SWEEP = range_test.RangeSettings(updates=40)


def design(task: str, **kw) -> StudyDesign:
    base = dict(name="lr", task=f"tests.study_tasks:{task}", lrs=[], seeds=[0], updates=40,
                shape=UpdateShape(8, 1), eval_every=10, eval_batch=64, metric="loss",
                extra_trials=2)
    return StudyDesign(**{**base, **kw})


@pytest.mark.twin
def test_the_range_test_suggests_near_the_best_rate_and_the_study_brackets_it(tmp_path):
    # measured on this task (AdamW, 40 updates of 8): lr 0.026 -> 0.36, 0.077 -> 0.28,
    # 0.23 -> 1.15, 0.69 diverged: the known good rate is near 0.077
    study = Study(tmp_path / "s", design("separable"), sweep=SWEEP)
    test = study.range_test
    assert 0.077 <= test.suggestion <= 0.077 * 9, test.said
    assert study.design.lrs == test.grid
    assert study.design.lrs[0] == pytest.approx(test.suggestion / 3, rel=0.05)
    study.run_all()
    found = study.supported()
    assert not found["no_rate_learns"] and found["best_at_edge"] == "", found["finding"]
    assert 0.077 / 3 <= found["supported_lr"] <= 0.077 * 3 and found["extended"] == []
    curve = pd.read_csv(tmp_path / "s" / "range_test.csv")
    assert list(curve.columns) == ["update", "lr", "loss", "smoothed"] and len(curve) >= 20
    stored = json.loads((tmp_path / "s" / "range_test.json").read_text())
    assert stored["suggestion"] == test.suggestion and stored["grid"] == study.design.lrs
    reopened = Study(tmp_path / "s", design("separable"))  # reuses it: no new sweep
    assert reopened.design.lrs == study.design.lrs and reopened.run_all() == []
    (tmp_path / "s" / "range_test.json").write_text(json.dumps({**stored, "suggestion": 9.0}))
    with pytest.raises(WorkbookError, match="does not match its curve"):
        range_test.load(tmp_path / "s")


@pytest.mark.planted
def test_labels_that_ignore_their_inputs_get_no_rate_learns(tmp_path):
    study = Study(tmp_path / "s", design("shuffled"), sweep=SWEEP)
    study.run_all()
    found = study.supported()
    assert found["no_rate_learns"] and found["supported_lr"] is None, found["finding"]
    assert found["finding"].startswith("no rate learns: at no rate tried")
    assert found["extended"] == [], "no extra trial is spent on noise"
    assert save(study, tmp_path) == "fail"
    figures = json.loads((tmp_path / "summary.json").read_text())["figures"]
    assert figures["no_rate_learns"] and figures["chance_loss"] == pytest.approx(1.386, abs=0.05)


@pytest.mark.planted
def test_a_good_rate_far_above_the_default_gets_a_bracketed_study(tmp_path):
    # plain SGD: its good rate is near 0.5, where 1e-3 (or 1e-4, the old control) learns little
    study = Study(tmp_path / "s", design("sgd"), sweep=SWEEP)
    assert study.range_test.suggestion >= 0.3, study.range_test.said
    study.run_all()
    found = study.supported()
    assert found["best_at_edge"] == "" and found["supported_lr"] >= 0.1, found["finding"]
    assert min(found["lrs"]) < found["supported_lr"] < max(found["lrs"])


def test_a_flat_sweep_suggests_nothing_and_a_falling_one_its_steepest_rate():
    settings = range_test.RangeSettings(updates=40, beta=0.0)
    lrs = settings.rates()
    flat = pd.DataFrame({"update": range(1, 41), "lr": lrs, "loss": [1.4, 1.38] * 20})
    flat["smoothed"] = flat.loss
    nothing = range_test.read_curve(settings, flat, "")
    assert nothing.suggestion is None and "did not fall by 5%" in nothing.said
    falling = [2.0 if lr < 1e-3 else 1.0 if lr > 1e-1 else 2.0 - (lr / 1e-3) ** 0.5 / 10
               for lr in lrs]
    curve = flat.assign(loss=falling, smoothed=falling)
    found = range_test.read_curve(settings, curve, "")
    assert 1e-2 < found.suggestion < 1.1e-1 and found.grid[0] == pytest.approx(
        found.suggestion / 3, rel=0.05)
    with pytest.raises(WorkbookError, match="range_min_lr 1 must be positive and below"):
        range_test.RangeSettings(min_lr=1.0, max_lr=0.1).check()


def test_a_bad_sweep_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(WorkbookError, match="range_updates 3 is too few"):
        Study(tmp_path / "s", design("separable"), sweep=range_test.RangeSettings(updates=3))
    assert not (tmp_path / "s").exists()


def _table(rows):
    return pd.DataFrame([{"id": i + 1, "lr": lr, "seed": 0, "status": "finished",
                          "stop_step": 20, "best_step": 10, "best_metric": metric}
                         for i, (lr, metric) in enumerate(rows)])


def test_an_edge_extends_the_grid_within_its_budget_and_says_when_it_ran_out():
    plan = design("separable", lrs=[1e-3, 5e-4, 2e-3], extra_trials=2)
    rows = [(1e-3, 2.0), (5e-4, 2.5), (2e-3, 1.5)]
    found = findings(_table(rows), plan)
    assert found["best_at_edge"] == "upward"
    assert next_trials(_table(rows), plan, found) == [{"lr": 4e-3, "seed": 0}]
    rows += [(4e-3, 1.2)]
    found = findings(_table(rows), plan)
    assert next_trials(_table(rows), plan, found) == [{"lr": 8e-3, "seed": 0}]
    rows += [(8e-3, 1.1)]
    found = findings(_table(rows), plan)
    assert next_trials(_table(rows), plan, found) == [], "the budget of 2 is spent"
    assert found["extended"] == [4e-3, 8e-3] and not found["conclusive"]
    assert "extended its grid by itself to 0.004, 0.008 (2 of its 2 extra trials)" in \
        found["finding"]
    assert "the study's budget of 2 extra trials ran out" in found["finding"]
    assert beyond([1e-3], "downward") == 3.3e-4 and beyond([1e-2, 50.0], "downward") == 1e-3
    inside = findings(_table(rows + [(1.6e-2, 3.0)]), plan)
    assert inside["best_at_edge"] == "" and "ran out" not in inside["finding"]
    noise = findings(_table(rows), plan, Chance(1.15, "chance"), best_loss=1.1)
    assert noise["no_rate_learns"] and next_trials(_table(rows), plan, noise) == []
    assert Chance(1.0, "").learned(0.94) and not Chance(1.0, "").learned(0.96)
    assert Chance(None, "not measured").learned(5.0)


def test_the_tasks_own_rate_is_the_control_when_the_suggestion_is_far_from_it(tmp_path):
    """A short sweep can read a batch memorised at a large rate as the steepest fall (a reward
    model under LoRA fell to 0.13 at lr 3.8 in one update, then nothing learned at 0.42-3.8):
    the rate the user's script declares stays the control the suggested rates must beat."""
    settings = range_test.RangeSettings(updates=40)
    test = range_test.RangeTest(settings, pd.DataFrame(), "", 3.8, "suggested 3.8",
                                [1.3, 0.42, 3.8])
    range_test.with_own_rate(test, 1e-4)
    assert test.grid == [1e-4, 1.3, 3.8] and "own lr 0.0001 is none of them" in test.said
    near = range_test.RangeTest(settings, pd.DataFrame(), "", 3.8, "", [1.3, 0.42, 3.8])
    range_test.with_own_rate(near, 1.0)  # within 1.5x of 1.3: the grid already holds it
    range_test.with_own_rate(near, None)
    assert near.grid == [1.3, 0.42, 3.8]


@pytest.mark.twin
def test_a_loss_still_falling_toward_chance_is_too_short_a_budget_not_no_rate_learns():
    """A language model in a smoke budget: its validation loss fell from 6.7 to 3.22 and was
    still falling at its last update, 3% above its targets' unigram entropy (3.115): the
    budget was too short to tell, not 'no rate learns'; one whose loss never moved is."""
    d = design("separable", lrs=[0.005], eval_every=10, updates=20)
    table = pd.DataFrame([{"id": 1, "lr": 0.005, "seed": 0, "status": "finished",
                           "stop_step": 20, "best_step": 20, "best_metric": 3.22}])
    chance = Chance(3.115, "the validation loss of a constant prediction", untrained=6.7)
    falling = findings(table, d, chance, 3.22)
    assert not falling["no_rate_learns"] and "lengthen the budget" in " ".join(
        falling["warnings"]) and not falling["conclusive"]
    flat = findings(table, d, Chance(3.115, "a constant prediction", untrained=3.25), 3.22)
    assert flat["no_rate_learns"] and flat["supported_lr"] is None
    # examples/hf_trainer.py in a 20-update smoke study: 6.0 -> 5.24, chance 3.04, the best
    # trial no longer improving: not yet at a constant prediction's loss, so too short to tell
    done = table.assign(best_step=10, best_metric=5.24)
    short = findings(done, d, Chance(3.04, "a constant prediction", untrained=6.0), 5.24)
    assert not short["no_rate_learns"] and "no trial reached even a constant prediction's " \
        "loss - lengthen the budget" in " ".join(short["warnings"]), short["finding"]


@pytest.mark.planted
def test_an_optimizer_that_sets_its_own_step_leaves_no_rate_to_choose(tmp_path):
    """One update from the same start at lr 1e-5 and 0.1 moves the weights alike: the study
    runs one trial (learning is still read against chance) and supports no rate."""
    study = Study(tmp_path / "s", design("own_step"), sweep=SWEEP)
    assert study.range_test.rate_ignored.startswith("the task's optimizer sets its own step")
    assert study.design.lrs == [1e-3] and "(1.00x for a 10,000x rate)" in study.range_test.said
    study.run_all()
    found = study.supported()
    assert found["rate_ignored"] and found["supported_lr"] is None and not found["conclusive"]
    assert found["finding"].startswith("no rate to choose: the task's optimizer sets its own")
    assert range_test.load(tmp_path / "s").rate_ignored == study.range_test.rate_ignored


@pytest.mark.twin
def test_a_flat_sweep_under_a_slow_starting_optimizer_spans_decades_around_its_default(
        tmp_path):
    """Adadelta (pytorch/examples' mnist) shows no fall in a short sweep; the study then tries
    five rates a decade apart around Adadelta's own default, 1, and brackets the one that
    learns - the sweep's flat curve was its shortness, which the finding says."""
    adadelta = range_test.RangeTest(SWEEP, pd.DataFrame({"lr": [1e-3] * 3}), "", None, "flat",
                                    optimizer="Adadelta", optimizer_lr=1.0)
    grid, said = range_test.fallback_grid(SimpleNamespace(lr=None), adadelta)
    assert grid == [1.0, 0.01, 0.1, 10.0, 100.0] and "Adadelta's default lr (1)" in said
    assert range_test.class_default(torch.optim.Adam([torch.zeros(1, requires_grad=True)])) \
        == 1e-3
    rows = [(1.0, 2.2), (0.01, 2.3), (0.1, 2.3), (10.0, 1.5), (100.0, 2.4)]
    found = findings(_table(rows), design("separable", lrs=grid), swept=adadelta)
    assert found["best_lr"] == 10.0 and found["best_at_edge"] == ""
    assert "the range test saw no fall over its 3 updates, yet lr 10 learned" in \
        found["finding"]


def _curves(values: dict[float, list[float]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A trial table and validation curves (evaluations every 50 of 200 updates)."""
    table = pd.DataFrame([{"id": i + 1, "lr": lr, "seed": 0, "status": "finished",
                           "stop_step": 200, "best_step": 200, "best_metric": min(v)}
                          for i, (lr, v) in enumerate(values.items())])
    curves = pd.DataFrame([{"trial": i + 1, "step": 50 * (k + 1), "value": value}
                           for i, v in enumerate(values.values()) for k, value in enumerate(v)])
    return table, curves


@pytest.mark.planted
def test_a_smaller_rate_closing_on_the_best_keeps_the_study_provisional():
    """Short-horizon bias: the larger rate leads, but the smaller one's loss went from 2x to
    1.2x the best's in the last 50 updates - at that pace it passes near update 218."""
    plan = design("separable", lrs=[0.01, 0.003, 0.03], updates=200, eval_every=50)
    table, curves = _curves({0.01: [2.0, 1.0, 0.5, 0.25], 0.003: [2.8, 2.0, 1.0, 0.3],
                             0.03: [2.1, 1.5, 1.4, 1.4]})
    found = findings(table, plan, curves=curves)
    assert found["closing"] == [0.003] and not found["conclusive"], found["finding"]
    assert "lr 0.003 closes on the best (lr 0.01): its validation loss went from 2.00x the " \
        "best's to 1.20x over the last 50 updates; at that pace it passes the best near " \
        "update 218 - lengthen the budget to tell" in found["finding"]
    shifted = {0.01: [2.0, 1.0, 0.5, 0.25], 0.003: [2.8, 2.0, 1.0, 0.5],
               0.03: [2.1, 1.5, 1.4, 1.4]}  # the twin: the smaller rate trails at 2x, steady
    held = findings(*_curves(shifted)[:1], plan, curves=_curves(shifted)[1])
    assert held["conclusive"] and held["closing"] == [] and "the ranking held" in \
        held["finding"], held["finding"]
    assert not findings(table, plan)["conclusive"], "without curves: still improving warns"


@pytest.mark.planted
def test_a_warmup_longer_than_the_study_is_named_not_read_as_a_rate_or_as_no_learning(
        tmp_path):
    """The task's own schedule warms up over 5,000 updates; 06's trials run 40: every trial ran
    at under 1% of its rate (read from the optimizer at every update), so no rate is supported,
    the grid is not extended toward ever larger rates, and the labels are not blamed."""
    study = Study(tmp_path / "s", design("long_warmup"), sweep=SWEEP)
    study.run_all()
    found = study.supported()
    assert found["schedule_reached"] < 0.01 and found["supported_lr"] is None, found["finding"]
    assert found["finding"].startswith("the rates were not reached: the task's own schedule")
    assert not found["no_rate_learns"] and found["extended"] == []
    twin = findings(_table([(1e-3, 2.0), (5e-4, 2.5), (2e-3, 2.2)]),
                    design("separable", lrs=[1e-3, 5e-4, 2e-3]), reached={1: 1.0})
    assert twin["supported_lr"] == 1e-3 and twin["schedule_reached"] == 1.0
