"""Every notebook's verdict is computed by its module's `save` (not in a cell): each fails on
the part it guards, with everything else clean."""

import json

import pandas as pd

from workbook import accounting, parallel, rental, resume
from workbook.accounting import BatchAccount


class Named:
    name = "t"


def summary(folder):
    return json.loads((folder / "summary.json").read_text())


def test_04_fails_when_the_tasks_own_step_depends_on_the_split(tmp_path):
    account = BatchAccount(2, 2, 1, 16)
    reconciled = pd.DataFrame({"counter": ["updates"], "match": [True]})

    def check(own_ok):
        return pd.DataFrame({
            "normalisation": ["targets of the whole update (loop)"] * 2
            + ["per micro-batch mean (wrong)"] * 2 + ["the task's train_step"] * 2,
            "max_relative_deviation": [0.0, 1e-7, 0.0, 0.3, 0.0, 1e-7 if own_ok else 0.2],
            "within_tolerance": [True, True, True, False, True, own_ok]})

    for own_ok, expected in ((True, "pass"), (False, "fail")):
        out = tmp_path / expected
        out.mkdir()
        assert accounting.save(out, Named, account, pd.DataFrame(), reconciled, check(own_ok),
                               account) == expected
        figures = summary(out)["figures"]
        assert figures["own_train_step_ok"] is own_ok and figures["wrong_normalisation_caught"]
    out = tmp_path / "counters"
    out.mkdir()
    assert accounting.save(out, Named, account, pd.DataFrame(), reconciled.assign(match=False),
                           check(True), account) == "fail"


def test_07_fails_when_tampered_code_ran(tmp_path):
    cases = pd.DataFrame({"case": ["mid-epoch"], "resumed_after": [5], "exact": [True],
                          "max_param_diff": [0.0], "examples_differ_from": [None],
                          "error": [""], "continued_to_the_end": [True]})
    for ran, expected in ((False, "pass"), (True, "fail")):
        out = tmp_path / expected
        out.mkdir()
        tamper = pd.DataFrame({"refused": [True], "code ran": [ran]})
        assert resume.save(out, Named, cases, tamper, {"identical": True}) == expected
    out = tmp_path / "inexact"
    out.mkdir()
    assert resume.save(out, Named, cases.assign(exact=False),
                       pd.DataFrame({"refused": [True], "code ran": [False]}),
                       {"identical": True}) == "fail"


def test_08_fails_when_nothing_fits(tmp_path):
    sheet = pd.DataFrame({"fits": [False]})
    plans = pd.DataFrame({"days": [3], "scheduled": [1]})
    options = pd.DataFrame({"candidate": ["a"], "cheapest_gpu": ["L4"]})
    assert rental.save(tmp_path, Named, "L4", sheet, plans, options, pd.DataFrame(),
                       None) == "fail"
    assert summary(tmp_path)["figures"]["chosen"] is None


def test_09_fails_when_a_rule_misses_its_planted_bug(tmp_path):
    rules = pd.DataFrame({"rule": ["shards disjoint"], "verdict": ["pass"]})
    phases = pd.DataFrame({"phase": ["all-reduce"], "median_s": [0.01]})
    result = {"gradient_check": [{"case": "2 x 8", "max_relative_deviation": 1e-8}]}
    for caught, expected in ((True, "pass"), (False, "fail")):
        out = tmp_path / expected
        out.mkdir()
        faults = pd.DataFrame({"planted bug": ["every rank writes"], "caught": [caught]})
        assert parallel.save(out, Named, 2, result, rules, pd.DataFrame(), phases,
                             pd.DataFrame(), faults) == expected
