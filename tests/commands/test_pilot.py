"""The pilot's own runs (papermill, smoke sizes), kept to what no unit test shows: the report
of a run and what `workbook export` reads of it, options refused before anything runs; its
error rows (a dead kernel, a notebook that raises and keeps what it found) are
test_pilot_limits.py's.
Each notebook's verdicts are tests/notebooks' (its module's `run`/`save`); the committed
notebooks run under nbval; time limits and kills are test_pilot_limits.py's."""

import json
from pathlib import Path

import pytest

from workbook import WorkbookError
from workbook.commands.cli import main
from workbook.commands.export_plan import read_pilot
from workbook.commands.pilot import run_pilot, select

from ..conftest import GENERATION


def summary(run, stem):
    return json.loads((run / stem / "summary.json").read_text())


def test_pilot_never_reuses_a_run_folder(tmp_path):
    (tmp_path / "old.txt").write_text("keep me")
    with pytest.raises(WorkbookError, match="already holds a run"):
        run_pilot(GENERATION, out=str(tmp_path), smoke=True)
    assert (tmp_path / "old.txt").read_text() == "keep me"


def test_bad_task_and_bad_selection_fail_before_anything_runs(tmp_path):
    with pytest.raises(WorkbookError, match="cannot be imported"):
        run_pilot("nope_module:task", out=str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()
    with pytest.raises(WorkbookError, match="unknown notebooks"):
        select("01,10")
    assert main(["pilot", "--task", "nope_module:task", "--out", str(tmp_path / "r2")]) == 2
    with pytest.raises(WorkbookError, match="did you mean 'device_memory_gib'"):
        run_pilot(GENERATION, out=str(tmp_path / "r3"), params={"device_memory_gb": 24})
    assert main(["pilot", "-p", "updates='many'", "--only", "02", "--out",
                 str(tmp_path / "r4")]) == 2


def test_the_readme_own_task_runs_through_the_pilot_with_the_report(tmp_path):
    """The README's own task (a plain Dataset) through 03 and 08: every verdict passes, 03's
    gates and prediction, 08's priced plan, and the report with its tables and figures, never a
    NaN; what `workbook export` reads of the run, papermill's record included (its 01 passes in
    tests/notebooks/test_inspection.py's test_clean_samples_raise_no_flag; 04's and 07's checks
    on plain tasks are tests/notebooks' own)."""
    import re

    run, index = run_pilot("tests.own_task:task", out=str(tmp_path / "run"), smoke=True,
                           only="03,08", progress=False)
    assert index.verdict.tolist() == ["pass"] * len(index), index.error.tolist()
    gates = summary(run, "03_phase_gates")["figures"]
    assert gates["gates"] == 9 and gates["failed"] == []
    assert gates["prediction_max_abs_error_pct"] < 2.0
    assert gates["plan_peak_bytes"] > 0 and gates["overheads"] == "assumed"
    assert (run / "03_phase_gates" / "gates.csv").exists()
    plan = summary(run, "08_rental_plan")["figures"]
    assert plan["chosen"] == "control" and plan["rows"] == 18  # 3 candidates x 6 GPUs
    assert plan["catalog"]["offers"] > 0 and plan["recommended_offer"], "priced from a catalog"
    report = (run / "report.html").read_text()
    for part in ('href="03_phase_gates.html"', "Selection sheet", "A100-80GB", "Rental decision",
                 "update (first)", "Cheapest GPU that fits", "data:image/png;base64,",
                 "Offers across providers", "catalog of ", "Gate table", "Rent an L4",
                 "not applicable: "):
        assert part in report, part
    assert (run / "03_phase_gates.html").exists(), "the executed notebook opens in a browser"
    assert (run / "08_rental_plan.ipynb").exists(), "each executed notebook is kept"
    assert [r["verdict"] for r in json.loads((run / "index.json").read_text())["notebooks"]] \
        == ["pass"] * 2
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", report)
    assert not re.search(r"\bnan\b", text, re.IGNORECASE), "no NaN anywhere on the page"
    # --out outside the repository (under /tmp): what the run exports shows its paths relative
    # to the run folder, as a reader of it can open them, never this machine's folders
    for page in [*run.glob("*.html"), *run.rglob("*.md"), *run.rglob("*.csv")]:
        shown = page.read_text()
        assert f"{run}/" not in shown and f"{run.resolve()}/" not in shown, page
        assert f"{Path.home()}/" not in shown, page
    gates_page = (run / "03_phase_gates.html").read_text()
    assert "writing to 03_phase_gates" in gates_page and '"03_phase_gates"' in gates_page
    # what `workbook export` sends of it (MLflow and TensorBoard read the same plan; the
    # writers are tests/commands/test_export.py's): each notebook's parameters, start and end
    # from papermill's record, its executed notebook, HTML, tables and figures
    pilot = read_pilot(run)
    assert not pilot.still_running and pilot.missing == [
        "not run in this pilot: 01_inspect_examples, 02_overfit, 04_batch_accounting, "
        "05_memory_variants, 06_lr_study, 07_resume_reload, 09_data_parallel"], pilot.missing
    entries = {e.key: e for e in pilot.entries}
    for stem, files in (("03_phase_gates", {"gates.csv", "gates.png"}),
                        ("08_rental_plan", {"selection.csv", "conclusion.md"})):
        entry = entries[stem]
        assert entry.params["task"] == "tests.own_task:task", entry.params
        assert entry.start_ms < entry.end_ms, (entry.start_ms, entry.end_ms)
        assert {f"{stem}.ipynb", f"{stem}.html", "summary.json", *files} <= set(entry.files)
    assert entries["08_rental_plan"].params["train_limit"] == "50", "the smoke size ran"


@pytest.mark.slow  # nbval runs 04 and 05 on the generation sample; test_variants.py too
def test_pilot_smoke_accounting_and_variants(tmp_path):
    # the classification sample's variants are covered by tests/notebooks/test_variants.py
    run, index = run_pilot(GENERATION, out=str(tmp_path / "run"), smoke=True, only="04,05",
                           progress=False)
    assert index.verdict.tolist() == ["pass", "pass"], index.error.tolist()
    acc = summary(run, "04_batch_accounting")["figures"]
    assert acc["worked_example_updates"] == 200 and acc["examples_per_update"] == 16
    assert acc["reconciled"] and acc["normalisation_ok"] and acc["wrong_normalisation_caught"]
    var = summary(run, "05_memory_variants")["figures"]
    assert var["not_applicable"] == ["fp16+scaler"] and var["measured"] == 7
    assert var["changes_experiment"] == ["max_length=20"]


@pytest.mark.slow  # tests/notebooks/test_study.py: statuses, the diverged trial, the ledger
def test_pilot_smoke_lr_study(tmp_path):
    # the classification sample's study is covered by tests/notebooks/test_study.py
    run, index = run_pilot(GENERATION, out=str(tmp_path / "run"), smoke=True, only="06",
                           progress=False, params={"lrs": [1e-2, 50.0], "extra_trials": 0})
    # (1e-3 learns nothing in 20 updates of 4 examples: "no rate learns", not 5% below chance)
    assert index.verdict.tolist() == ["pass"], index.error.tolist()
    fig = summary(run, "06_lr_study")["figures"]
    assert fig["trials"] == 2 and fig["statuses"] == {"finished": 1, "diverged": 1}
    assert fig["best_lr"] == 1e-2 and fig["best_checkpoint"].startswith("trials/1/")
    assert (run / "06_lr_study" / "study" / "ledger.sqlite").exists()


def test_pilot_options_are_not_notebook_parameters(tmp_path):
    with pytest.raises(WorkbookError, match="use --task instead of -p task"):
        run_pilot(GENERATION, out=str(tmp_path / "r"), params={"task": "x:y"})
    with pytest.raises(WorkbookError, match="names no notebook"):
        select(",")
    with pytest.raises(WorkbookError, match="the selected notebooks: no parameter 'lrr'"):
        run_pilot(GENERATION, out=str(tmp_path / "r"), only="02", params={"lrr": 1.0})
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # 35 s; test_predict sizes examples.transformer_lm (fake modes, fused path)
def test_a_plain_transformer_encoder_task_passes_the_sizing_notebooks(tmp_path):
    """A clean nn.TransformerEncoder task once crashed 03, 05 and 08 (fake modes, a planned
    length beyond its 128 positions, a sheet without costs): a false alarm."""
    run, index = run_pilot("examples.transformer_lm:task", out=str(tmp_path / "run"),
                           smoke=True, only="03,08", progress=False)
    assert index.verdict.tolist() == ["pass"] * 2, index.error.tolist()
    assert summary(run, "03_phase_gates")["figures"]["plan"].startswith("mb4 x acc2 len128")


@pytest.mark.slow  # the 05 part of the guard above (the planned length beyond 128 positions)
def test_a_plain_transformer_encoder_task_passes_the_memory_variants(tmp_path):
    run, index = run_pilot("examples.transformer_lm:task", out=str(tmp_path / "run"),
                           smoke=True, only="05", progress=False)
    assert index.verdict.tolist() == ["pass"], index.error.tolist()


def test_03_judges_the_plan_against_the_gpu_08_rents():
    from workbook.commands.pilot import rental_memory

    assert rental_memory({"rental_gpu": "L4"}) == {"device_memory_gib": 24.0}
    assert rental_memory({"rental_gpu": "X", "gpus": {"X": 12}}) == {"device_memory_gib": 12.0}
    assert rental_memory({"rental_gpu": "L4", "device_memory_gib": 16.0}) == {}  # given: kept
    assert rental_memory({"rental_gpu": "B300"}) == {}  # unknown: 08 names it
    assert rental_memory({}) == {}
