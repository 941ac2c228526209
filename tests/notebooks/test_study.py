"""Notebook 06's study: every trial keeps its row, the plan is fixed, checkpoints stay in their
trial, and a killed trial is marked interrupted."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from workbook import UpdateShape, WorkbookError, evaluate
from workbook.notebooks.study import Study, StudyDesign, periodicity
from workbook.storage.ledger import Ledger

from ..conftest import CLASSIFICATION, GENERATION


def plan(**kw):
    base = dict(name="lr", task=CLASSIFICATION, lrs=[1e-3], seeds=[0], updates=20,
                shape=UpdateShape(2, 2), eval_every=5, eval_batch=8, metric="accuracy")
    return StudyDesign(**{**base, **kw})


def test_divergence_is_recorded_and_the_study_goes_on(tmp_path):
    study = Study(tmp_path / "s", plan(lrs=[1e-3, 10.0, 2e-3]))
    ids = study.run_all()
    table = study.trial_table().set_index("id")
    assert table.status.tolist() == ["finished", "diverged", "finished"]
    diverged = table.loc[ids[1]]
    assert "above 3 x" in diverged.stop_reason or "above 1000 x" in diverged.stop_reason
    assert diverged.stop_step >= 1
    assert len(study.curves().query(f"trial == {ids[1]}")) == diverged.stop_step
    assert study.best()["id"] in (ids[0], ids[2])


def test_a_study_whose_every_trial_diverged_fails_and_says_why(tmp_path):
    from workbook.notebooks.study import save

    study = Study(tmp_path / "s", plan(lrs=[1e3], updates=6))
    study.run_all()
    assert save(study, tmp_path) == "fail"
    finding = json.loads((tmp_path / "summary.json").read_text())["figures"]["finding"]
    assert finding.startswith("every learning rate tried diverged (1000)")
    # 20 updates at 1e-2 learn (6 at 1e-3 stay within 5% of chance: "no rate learns")
    mixed = Study(tmp_path / "m", plan(lrs=[1e-2, 1e3], updates=20, eval_every=10))
    mixed.run_all()
    (tmp_path / "mixed").mkdir()
    assert save(mixed, tmp_path / "mixed") == "pass"  # one diverged trial is a result


def test_an_interrupted_trial_is_run_again_by_run_all_and_its_row_is_kept(tmp_path):
    import sqlite3

    study = Study(tmp_path / "s", plan(lrs=[1e-3, 2e-3], updates=4, eval_every=2))
    first = study.run_trial(1e-3, 0)
    study.ledger.close()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with sqlite3.connect(tmp_path / "s" / "ledger.sqlite") as db:  # its process was killed
        db.execute("INSERT INTO trials (study, params, status, repro, pid, started) VALUES "
                   "('lr', ?, 'running', 'r', ?, 0)", (json.dumps({"lr": 2e-3, "seed": 0}),
                                                       dead.pid))
    reopened = Study(tmp_path / "s", task=CLASSIFICATION)
    killed = int(reopened.trial_table().id.max())
    (again,) = reopened.run_all()  # was []: the interrupted trial counted as done
    table = reopened.trial_table().set_index("id")
    assert table.loc[killed, "status"] == "interrupted", "the interrupted row is kept"
    assert table.loc[again, "status"] == "finished" and table.loc[again, "repeats"] == killed
    assert reopened.run_all() == [] and table.loc[first, "status"] == "finished"


def test_a_rerun_gets_a_new_id_and_a_link(tmp_path):
    study = Study(tmp_path / "s", plan(lrs=[10.0]))
    (first,) = study.run_all()
    again = study.run_trial(10.0, seed=1, repeats=first)
    table = study.trial_table().set_index("id")
    assert again != first and table.loc[again, "repeats"] == first
    assert table.loc[first, "status"] == "diverged", "the failure is not replaced"
    with pytest.raises(WorkbookError, match="trial 99 does not exist"):
        study.run_trial(1e-3, 0, repeats=99)


def test_the_plan_is_written_first_and_cannot_change(tmp_path):
    Study(tmp_path / "s", plan())
    assert json.loads((tmp_path / "s" / "design.json").read_text())["lrs"] == [1e-3]
    with pytest.raises(WorkbookError, match="cannot change .*'lrs'"):
        Study(tmp_path / "s", plan(lrs=[1e-3, 2e-3]))
    assert Study(tmp_path / "s", task=CLASSIFICATION).design.lrs == [1e-3]
    with pytest.raises(WorkbookError, match="records the task .*classification"):
        Study(tmp_path / "s")  # reopening needs the task named by the user


def test_a_design_written_before_the_shape_was_one_field_reopens(tmp_path):
    from workbook.storage.runs import seal_file

    design = plan(shape=UpdateShape(4, 2))
    Study(tmp_path / "s", design)
    path = tmp_path / "s" / "design.json"
    stored = json.loads(path.read_text())
    flat = {**{k: v for k, v in stored.items() if k != "shape"}, **stored["shape"]}
    path.write_text(json.dumps(flat))
    seal_file(path)
    assert Study(tmp_path / "s", design).design == design
    path.write_text(json.dumps([flat]))
    seal_file(path)
    with pytest.raises(WorkbookError, match="is not a JSON object"):
        Study(tmp_path / "s", task=CLASSIFICATION)


@pytest.mark.parametrize("change, words", [
    ({"lrs": [1e-3, -1.0]}, r"study design: field 'lrs\[1\]' should be greater than 0 "
     r"\(got -1.0\)"),
    ({"seeds": [], "top_n": 0}, r"field 'seeds' should have at least 1 item .*; field 'top_n' "
     r"should be greater than or equal to 1 \(got 0\)"),
    ({"metric": 3, "notes": None}, r"field 'metric' should be a valid string \(got 3\); field "
     r"'notes' should be a valid string \(got None\)"),
    ({"eval_every": 50, "eval_batch": 1}, "eval_every 50 must be between 1 and the budget of "
     "20 updates; eval_batch 1 is below the micro-batch"),
    ({"eval_every": 50}, "eval_every 50 must be between 1 and the budget of 20"),
    ({"metric": "f1"}, "metric 'f1' is not produced by the task"),
    ({"eval_batch": 1}, "below the micro-batch"),
])
def test_bad_plans_are_refused_before_anything_is_written(change, words, tmp_path):
    with pytest.raises(WorkbookError, match=words):
        Study(tmp_path / "s", plan(**change))
    assert not (tmp_path / "s" / "design.json").exists()


def test_evaluation_metric_is_identical_for_any_eval_batch(cls_task, cls_items):
    torch.manual_seed(0)
    model = cls_task.build_model()
    items = cls_items["validation"][:23]  # 23 = partial last batch for 4, 5, 8, 16
    records = [evaluate(cls_task, model, items, b, torch.device("cpu")) for b in (1, 4, 5, 16)]
    for r in records[1:]:
        assert r.loss == pytest.approx(records[0].loss, rel=1e-6)
        assert r.metrics == records[0].metrics and r.per_class == records[0].per_class
        assert r.targets == 23


def test_top_n_keeps_the_best_and_the_last_and_touches_only_its_own_files(tmp_path):
    study = Study(tmp_path / "s", plan(lrs=[1e-3, 2e-3], top_n=1))
    neighbour = tmp_path / "s" / "trials" / "2" / "step-000005"
    neighbour.mkdir(parents=True)  # a file of another trial, there before trial 1 runs
    (neighbour / "note.txt").write_text("not yours")
    (first,) = [study.run_trial(1e-3, 0)]
    assert (neighbour / "note.txt").read_text() == "not yours"
    rows = study.ledger.frame("checkpoints", first)
    kept = rows[rows.kept == 1]
    best = study.trial_table().set_index("id").loc[first]
    assert set(kept.step) == {int(best.best_step), 20}
    on_disk = {p.name for p in (tmp_path / "s" / "trials" / str(first)).glob("step-*")}
    assert on_disk == {f"step-{s:06d}" for s in kept.step}
    assert len(rows) == 4, "every checkpoint keeps its ledger row, removed or not"


def test_eval_sample_skew_and_full_evaluation_of_the_best(tmp_path):
    study = Study(tmp_path / "s", plan(eval_sample=40))
    (tid,) = study.run_all()
    assert {"mean length", "share of recall"} <= set(study.skew.property)
    scopes = study.evals().query(f"trial == {tid}").scope.tolist()
    assert scopes.count("sample") == 4 and scopes[-1] == "full-best"
    full = study.evals().query("scope == 'full-best'").iloc[0]
    assert json.loads(full.per_class)["recall"][1] == sum(
        1 for r in study.raw["validation"] if r["label"] == "recall")
    predictions = (tmp_path / "s" / "trials" / str(tid) / "predictions.jsonl").read_text()
    assert len(predictions.splitlines()) == 4 * 4  # 4 examples at each of 4 evaluations


def test_periodicity_detector():
    steps = list(range(10, 410, 10))
    period = [0.0, 0.3, 0.1, -0.2, 0.05] * 8  # repeats every 5 evaluations = 50 updates
    values = [2.0 - 0.002 * s + p for s, p in zip(steps, period, strict=True)]
    assert periodicity(steps, values, 50)["periodic"]
    smooth = [2.0 - 0.002 * s for s in steps]
    noisy = [v + 0.01 * ((i * 7919) % 13 - 6) / 6 for i, v in enumerate(smooth)]
    assert not periodicity(steps, noisy, 50)["periodic"]
    assert not periodicity(steps[:4], values[:4], 50)["tested"]


def test_killing_a_trial_leaves_finished_rows_and_marks_it_interrupted(tmp_path):
    study = Study(tmp_path / "s", plan(task=GENERATION, metric="loss", updates=120,
                                       eval_every=5, eval_sample=8, shape=UpdateShape(2, 1),
                                       prediction_examples=1))
    finished = study.run_trial(1e-3, 0)
    study.ledger.close()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "workbook", "trial", "--study",
                             str(tmp_path / "s"), "--task", GENERATION, "--lr", "2e-3"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ledger = Ledger(tmp_path / "s" / "ledger.sqlite")
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until the second trial has written checkpoints
        rows = ledger.frame("checkpoints")
        if len(rows[rows.trial != finished]) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    ledger.close()
    reopened = Study(tmp_path / "s", task=GENERATION)
    table = reopened.trial_table().set_index("id")
    assert table.loc[finished, "status"] == "finished"
    killed = table.index[table.index != finished][0]
    assert table.loc[killed, "status"] == "interrupted"
    assert not list((tmp_path / "s" / "trials").glob("*/.*partial*"))
    best = table.loc[killed, "best_checkpoint"]
    assert best and (tmp_path / "s" / best / "manifest.json").exists()
    from workbook.training.checkpoint import verify

    verify(tmp_path / "s" / best)  # the best recorded checkpoint is complete
    assert len(reopened.curves().query(f"trial == {finished}")) == 120


# --- what the study supports: warnings and spreads, on planted trial tables ----------------
def _trials(rows):
    """A trial table as `Study.trial_table` gives it, from (lr, seed, best_metric, best_step)
    rows: every trial finished at update 20 (evaluations every 5)."""
    import pandas as pd

    return pd.DataFrame([{"id": i + 1, "lr": lr, "seed": seed, "status": "finished",
                          "stop_step": 20, "best_step": step, "best_metric": metric}
                         for i, (lr, seed, metric, step) in enumerate(rows)])


GRID = [1e-4, 5e-5, 2e-4]  # the control first


@pytest.mark.parametrize("best_lr, edge, words", [
    (2e-4, "upward", "the best lr 0.0002 is the largest tried (5e-05, 0.0001, 0.0002): a "
                     "larger one may be better - extend the range upward"),
    (5e-5, "downward", "the best lr 5e-05 is the smallest tried (5e-05, 0.0001, 0.0002): a "
                       "smaller one may be better - extend the range downward"),
])
def test_a_best_lr_at_the_edge_of_the_grid_is_a_warning(best_lr, edge, words):
    from workbook.notebooks.study import findings

    losses = {lr: 2.0 if lr == best_lr else 3.0 for lr in GRID}
    found = findings(_trials([(lr, 0, losses[lr], 10) for lr in GRID]),
                     plan(lrs=GRID, metric="loss"))
    assert found["best_lr"] == best_lr and found["best_at_edge"] == edge
    assert found["warnings"] == [words] and not found["conclusive"]
    assert f"provisional - {words}" in found["finding"]
    assert found["supported_lr"] == best_lr, "still the rate to plan on, for now"


def test_a_best_lr_inside_the_grid_and_done_improving_warns_of_nothing():
    from workbook.notebooks.study import findings

    losses = {1e-4: 2.0, 5e-5: 3.0, 2e-4: 2.5}  # the control wins, in the middle of the grid
    found = findings(_trials([(lr, 0, losses[lr], 10) for lr in GRID]),
                     plan(lrs=GRID, metric="loss"))
    assert found["warnings"] == [] and found["conclusive"] and found["best_at_edge"] == ""
    assert found["still_improving"] == [] and found["control_remains_best"]
    assert found["finding"].startswith("the control (lr 0.0001) remains the best choice")
    assert "provisional" not in found["finding"] and "extend" not in found["finding"]


def test_a_best_trial_still_improving_at_its_last_update_is_a_warning():
    from workbook.notebooks.study import findings

    design = plan(lrs=GRID, metric="loss")
    middle = {1e-4: 2.0, 5e-5: 3.0, 2e-4: 2.5}
    improving = findings(_trials([(lr, 0, middle[lr], 20) for lr in GRID]), design)
    assert improving["still_improving"] == [1, 2, 3]
    assert improving["warnings"] == ["every trial (3 of 3) was still improving at its last "
                                     "update (20 of 20): the budget is too short to call a "
                                     "winner - lengthen it"]
    best_only = findings(_trials([(lr, 0, middle[lr], 20 if lr == 1e-4 else 10)
                                  for lr in GRID]), design)
    assert best_only["warnings"][0].startswith("the best trial (1) was still improving")
    others = findings(_trials([(lr, 0, middle[lr], 10 if lr == 1e-4 else 20)
                               for lr in GRID]), design)
    assert others["warnings"] == [] and others["conclusive"], "only the best one's trend counts"
    one_eval = findings(_trials([(lr, 0, middle[lr], 20) for lr in GRID]),
                        plan(lrs=GRID, metric="loss", eval_every=20))
    assert one_eval["warnings"] == [], "a single evaluation shows no trend"


def test_one_seed_has_no_spread_and_two_seeds_have_one():
    import matplotlib

    matplotlib.use("Agg")
    from types import SimpleNamespace

    from workbook.notebooks.study import findings, lr_figure, lr_summary

    middle = {1e-4: 2.0, 5e-5: 3.0, 2e-4: 2.5}
    one = _trials([(lr, 0, middle[lr], 10) for lr in GRID])
    summary = lr_summary(one)
    assert not {"best_std", "best_min", "best_max"} & set(summary.columns)
    assert summary.seeds_with_value.tolist() == [1, 1, 1]
    found = findings(one, plan(lrs=GRID, metric="loss"))
    assert "on one seed, so no spread" in found["finding"] and found["seeds"] == 1
    two = _trials([(lr, s, middle[lr] + 0.1 * s, 10) for lr in GRID for s in (0, 1)])
    spread = lr_summary(two).set_index("lr")
    assert spread.loc[1e-4, "best_std"] == pytest.approx(0.0707, abs=1e-4)
    assert "on 2 seeds" in findings(two, plan(lrs=GRID, seeds=[0, 1], metric="loss"))["finding"]

    def legend(trials, seeds):
        fake = SimpleNamespace(lr_summary=lambda: lr_summary(trials), trial_table=lambda: trials,
                               design=plan(lrs=GRID, seeds=seeds, metric="loss"))
        fig = lr_figure(fake)
        ax = fig.axes[0]
        return [t.get_text() for t in ax.get_legend().get_texts()], ax.get_title()

    labels, title = legend(one, [0])
    assert "mean +/- std" not in labels and "each seed" in labels and "one seed" in title
    labels, title = legend(two, [0, 1])
    assert "mean +/- std" in labels and "one seed" not in title


def test_the_design_carries_every_parameter_of_06_that_it_declares():
    """A parameter of the notebook that the design also declares reaches it (extra_trials did
    not: the study never extended its grid from the notebook or the pilot)."""
    from dataclasses import fields

    from workbook.commands import params
    from workbook.notebooks.study import design_from_params

    given = params.of("06_lr_study", extra_trials=3, eval_sample=7, top_n=3, seeds=[1, 2])
    design = design_from_params(given)
    shared = {f.name for f in fields(StudyDesign)} & set(given.names()) - {"task"}
    assert {"extra_trials", "eval_sample", "top_n", "seeds"} <= shared
    assert {n: getattr(design, n) for n in shared} == {n: getattr(given, n) for n in shared}


def test_a_trials_command_holds_from_one_folder_in_a_pilot_outside_the_checkout(
        tmp_path, monkeypatch):
    """In a pilot run under /tmp (`RUN_ENV` set), report paths read relative to the run folder,
    but a trial's repro command keeps its study folder whole: the interpreter's path and the
    study's must hold from the one folder the command is pasted in."""
    import shlex

    from workbook.storage.runs import RUN_ENV

    design = StudyDesign(name="s", task="tests.own_task:task", lrs=[1e-3], updates=4,
                         shape=UpdateShape(4, 1), eval_every=2, eval_batch=8,
                         prediction_examples=0)
    study = Study(tmp_path / "06_lr_study" / "study", design)
    study.ledger.close()
    monkeypatch.setenv(RUN_ENV, str(tmp_path))
    words = shlex.split(study.repro(1e-3, 0))
    assert words[words.index("--study") + 1] == str(tmp_path / "06_lr_study" / "study")
