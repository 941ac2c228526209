"""Every notebook's verdict is computed by its module's `save` (not in a cell): each fails on
the part it guards, with everything else clean."""

import json

import pandas as pd

from workbook.notebooks import accounting, parallel, rental, resume
from workbook.notebooks.accounting import BatchAccount
from workbook.training.loop import UpdateShape


class Named:
    name = "t"


def summary(folder):
    return json.loads((folder / "summary.json").read_text())


def test_04_fails_when_the_tasks_own_step_depends_on_the_split(tmp_path):
    account = BatchAccount(UpdateShape(2, 2, replicas=1), examples=16)
    reconciled = pd.DataFrame({"counter": ["updates"], "match": [True]})

    def check(own_ok):
        return pd.DataFrame({
            "normalisation": ["targets of the whole update (loop)"] * 2
            + ["per micro-batch mean (wrong)"] * 2 + ["the task's train_step"] * 2,
            "micro_batch x accumulation": ["8 x 1", "1 x 8"] * 3,
            "max_relative_deviation": [0.0, 1e-7, 0.0, 0.3, 0.0, 1e-7 if own_ok else 0.2],
            "within_tolerance": [True, True, True, False, True, own_ok]})

    def result(reconciled, check):
        return accounting.AccountingResult(Named, 16, 1.0, account, {}, pd.DataFrame(), account,
                                           reconciled, check, pd.DataFrame())

    for own_ok, expected in ((True, "pass"), (False, "fail")):
        out = tmp_path / expected
        out.mkdir()
        assert accounting.save(result(reconciled, check(own_ok)), out) == expected
        figures = summary(out)["figures"]
        assert figures["own_train_step_ok"] is own_ok and figures["wrong_normalisation_caught"]
        assert bool(figures["findings"]) is not own_ok  # the split dependence, in words
    out = tmp_path / "counters"
    out.mkdir()
    assert accounting.save(result(reconciled.assign(match=False), check(True)), out) == "fail"


def test_07_fails_when_tampered_code_ran(tmp_path):
    def result(cases, tamper):
        return resume.ResumeResult(Named, {}, 16, 2, 5, 8, cases, {}, None, tamper,
                                   tmp_path / "archive", {"identical": True})

    cases = pd.DataFrame({"case": ["mid-epoch"], "resumed_after": [5], "exact": [True],
                          "max_param_diff": [0.0], "examples_differ_from": [None],
                          "error": [""], "continued_to_the_end": [True]})
    for ran, expected in ((False, "pass"), (True, "fail")):
        out = tmp_path / expected
        out.mkdir()
        tamper = pd.DataFrame({"refused": [True], "code ran": [ran]})
        assert resume.save(result(cases, tamper), out) == expected
    out = tmp_path / "inexact"
    out.mkdir()
    assert resume.save(result(cases.assign(exact=False),
                              pd.DataFrame({"refused": [True], "code ran": [False]})),
                       out) == "fail"


def test_08_fails_when_nothing_fits(tmp_path):
    sheet = pd.DataFrame({"fits": [False]})
    plans = pd.DataFrame({"days": [3], "scheduled": [1], "gpu": ["L4"],
                          "priced_on": ["recommended"]})
    options = pd.DataFrame({"candidate": ["a"], "cheapest_gpu": ["L4"]})
    result = rental.RentalResult(Named, "L4", [], sheet, pd.DataFrame(), plans, options, None,
                                 "nothing fits")
    assert rental.save(result, tmp_path) == "fail"
    assert (tmp_path / "conclusion.md").read_text() == "nothing fits"
    assert summary(tmp_path)["figures"]["chosen"] is None


def test_09_fails_when_a_rule_misses_its_planted_bug(tmp_path):
    rules = pd.DataFrame({"rule": ["shards disjoint"], "verdict": ["pass"]})
    phases = pd.DataFrame({"phase": ["all-reduce"], "median_s": [0.01]})
    launch = {"gradient_check": [{"case": "2 x 8", "max_relative_deviation": 1e-8}]}
    spec = parallel.ReplicaSpec("t")
    for caught, expected in ((True, "pass"), (False, "fail")):
        out = tmp_path / expected
        out.mkdir()
        faults = pd.DataFrame({"planted bug": ["every rank writes"], "caught": [caught]})
        result = parallel.ParallelResult(Named, "", spec, None, launch, rules, pd.DataFrame(),
                                         pd.DataFrame(), phases, {}, pd.DataFrame(), faults, "")
        assert parallel.save(result, out) == expected


def test_a_notebook_runs_from_a_script_with_the_notebooks_parameters(tmp_path):
    """`params.of` + the module's `run` + `save`: what the notebook's cells call, without a
    kernel; the parameters are checked as the notebook checks them."""
    import pytest

    from workbook.base.errors import WorkbookError
    from workbook.commands import params

    p = params.of("04_batch_accounting", small=True, task="examples.regression:task",
                  micro_batch=4)
    assert p["reconcile_updates"] == params.smoke("04_batch_accounting")["reconcile_updates"]
    result = accounting.run(p, tmp_path)
    assert result.account.shape == UpdateShape(4, 8) and result.reconciled.match.all()
    assert accounting.save(result, tmp_path) == "pass" == summary(tmp_path)["verdict"]
    with pytest.raises(WorkbookError, match="did you mean 'micro_batch'"):
        params.of("04_batch_accounting", micro_bach=4)


def test_a_bad_update_shape_is_refused_before_any_notebook_runs(tmp_path):
    """A shape read from parameters is checked where it is read: a micro-batch of 0 was a
    RuntimeError from inside collate (03, 05), a ZeroDivisionError (07), or a study of failed
    trials (06)."""
    import pytest

    from workbook.base.errors import WorkbookError
    from workbook.commands import params
    from workbook.notebooks import gates, study, variants

    for notebook, module in (("03_phase_gates", gates), ("05_memory_variants", variants),
                             ("06_lr_study", study), ("07_resume_reload", resume)):
        with pytest.raises(WorkbookError, match=f"parameter 'micro_batch' of {notebook} is 0"):
            params.of(notebook, small=True, micro_batch=0)
        given = {**params.of(notebook, small=True), "micro_batch": 0}  # a script's own dict
        with pytest.raises(WorkbookError, match=f"parameter 'micro_batch' of {notebook} is 0"):
            module.run(given, tmp_path / notebook)
        assert not (tmp_path / notebook).exists(), "refused before anything is written"
