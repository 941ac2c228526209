import json

import pytest

from workbook import WorkbookError
from workbook.runs import claim_dir, new_run_dir, notebook_dir, write_summary


def test_existing_run_is_never_reused(tmp_path):
    run = claim_dir(tmp_path / "run")
    (run / "summary.json").write_text("{}")
    with pytest.raises(WorkbookError, match="already holds a run"):
        claim_dir(run)
    assert (run / "summary.json").read_text() == "{}"


def test_empty_existing_folder_may_be_claimed(tmp_path):
    assert claim_dir(tmp_path) == tmp_path


def test_new_run_dirs_are_unique(tmp_path):
    made = {new_run_dir("x y", root=tmp_path) for _ in range(3)}
    assert len(made) == 3 and all(" " not in p.name for p in made)


def test_notebook_dir_without_out_dir_makes_a_new_folder(tmp_path, monkeypatch):
    monkeypatch.setattr("workbook.runs.RUNS_ROOT", tmp_path)
    assert notebook_dir("", "01_x").parent == tmp_path


def test_summary_is_json_with_verdict_and_safe_numbers(tmp_path):
    write_summary(tmp_path, "pass", {"loss": float("nan"), "n": 3})
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data == {"verdict": "pass", "figures": {"loss": "nan", "n": 3}}
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError):
        write_summary(tmp_path, "ok", {})


def test_a_write_into_a_missing_folder_names_that_cause_not_the_disk(tmp_path):
    import pandas as pd

    from workbook.artifacts import write_file
    from workbook.runs import save_table

    missing = tmp_path / "not-made"
    with pytest.raises(WorkbookError, match="create the folder .*not-made first") as info:
        save_table(pd.DataFrame({"a": [1]}), missing, "rows")
    assert "disk space" not in info.value.fix
    with pytest.raises(WorkbookError, match="create the folder .*not-made first"):
        write_file(missing / "x.bin", lambda tmp: tmp.write_bytes(b"x"), "weights")
    assert not tmp_path.joinpath("not-made").exists()
