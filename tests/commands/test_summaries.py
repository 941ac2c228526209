"""A notebook's summary.json, read by one reader (`storage.runs.read_summary`) wherever it is
read - the pilot's index row and its error record, the report, the export, the notebooks'
`summary_of` and verdict line - each caller keeping its own rule for a summary that is missing
or cannot be read."""

import json
import os
from pathlib import Path

import pytest

from workbook.commands import export_plan, pilot, report
from workbook.notebooks import registry
from workbook.storage import runs

STEM = registry.OVERFIT.stem
GOOD = {"verdict": "fail", "figures": {"final_loss": 1.5}, "task": "t"}


def _folder(run: Path, case: str) -> Path:
    """The notebook's folder in `run` with its summary.json good, missing, cut short, of a
    verdict no notebook writes, or a link to a good one."""
    folder = run / STEM
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "summary.json"
    if case == "good":
        path.write_text(json.dumps(GOOD))
    elif case == "corrupt":
        path.write_text('{"verdict": "pa')
    elif case == "other":
        path.write_text(json.dumps({"verdict": "great", "figures": {}}))
    elif case == "link":
        (run / "elsewhere.json").write_text(json.dumps(GOOD))
        os.symlink(run / "elsewhere.json", path)
    return folder


def test_the_one_reader_gives_the_summary_none_or_an_error_naming_the_file(tmp_path):
    assert runs.read_summary(_folder(tmp_path / "good", "good")) == GOOD
    assert runs.read_summary(_folder(tmp_path / "missing", "missing")) is None
    for case, words in (("corrupt", "is not valid JSON"), ("other", "field 'verdict'"),
                        ("link", "is a symbolic link")):
        with pytest.raises(runs.WorkbookError, match=words) as caught:
            runs.read_summary(_folder(tmp_path / case, case))
        assert "summary.json" in caught.value.problem and caught.value.fix


def _executed(run: Path, case: str, monkeypatch) -> dict:
    """The pilot's index row for a notebook papermill ran, that left its summary as `case`."""
    import papermill

    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: _folder(run, case))
    return pilot.execute(STEM, run, {}, "workbook", 60)


@pytest.mark.parametrize("case", ["good", "missing", "corrupt", "other", "link"])
def test_each_caller_keeps_its_rule_for_a_missing_or_unreadable_summary(case, tmp_path,
                                                                        monkeypatch):
    run = tmp_path / "run"
    row = _executed(run, case, monkeypatch)
    folder = run / STEM
    said = ["what an earlier notebook missed"]  # the export's list, over every notebook
    entry = export_plan._notebook(run, export_plan.IndexRow(notebook=STEM, verdict="fail"),
                                  said)
    missing = said[1:]
    if case == "good":
        assert (row["verdict"], row["error"]) == ("fail", "")
        assert report._summary(folder) == registry.summary_of(run, STEM) == GOOD
        assert registry.verdict_line(folder).startswith("verdict: fail - ")
        assert missing == [] and entry.metrics["final_loss"] == 1.5
    else:  # the pilot: an error row naming the file; the report: nothing to show
        assert row["verdict"] == "error" and "summary.json" in row["error"]
        assert report._summary(folder) is None
        assert registry.verdict_line(folder) == "verdict: unknown - no summary.json was written"
        assert "final_loss" not in entry.metrics
    if case == "missing":
        assert "the notebook finished without writing it" in row["error"]
        assert registry.summary_of(run, STEM) is None
        assert missing == [f"{STEM}: no summary.json: no key figures"]
    elif case != "good":  # the notebooks: read as unreadable, never as a pass
        assert registry.summary_of(run, STEM) == {
            "verdict": "unreadable", "error": f"{STEM}/summary.json cannot be read"}
        assert missing == [f"{STEM}: its summary.json is not a plain file: not exported"] \
            if case == "link" else \
            missing[0].startswith(f"{STEM}: its summary.json cannot be read (")
    # a notebook that failed keeps what its summary holds, with the error
    pilot._record_error(folder, "boom")
    recorded = json.loads((folder / "summary.json").read_text())
    kept = GOOD if case == "good" else {
        "verdict": "error", "figures": {}, **({"found": []} if case == "missing" else {})}
    assert recorded == {**kept, "error": "boom"}


def test_every_caller_reads_through_the_one_reader(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _folder(run, "good")
    read = []
    original = runs.read_summary
    monkeypatch.setattr(runs, "read_summary", lambda folder: read.append(Path(folder).name)
                        or original(folder))
    callers = [lambda: pilot.execute(STEM, run, {}, "workbook", 60),
               lambda: report._summary(run / STEM),
               lambda: registry.summary_of(run, STEM),
               lambda: registry.verdict_line(run / STEM),
               lambda: export_plan._notebook(run, export_plan.IndexRow(notebook=STEM,
                                                                       verdict="pass"), []),
               lambda: pilot._record_error(run / STEM, "boom")]
    import papermill

    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: None)
    for call in callers:
        read.clear()
        call()
        assert read and set(read) == {STEM}
