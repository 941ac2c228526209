import json
from pathlib import Path

import pytest

from workbook import WorkbookError
from workbook.params import check, defaults, smoke, stems, validate

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"


def test_typo_gets_a_suggestion():
    with pytest.raises(WorkbookError, match="no parameter 'updatse' .*did you mean 'updates'"):
        validate({"updatse": 3}, "02_overfit")


def test_wrong_type_is_named():
    with pytest.raises(WorkbookError, match="'examples' must be int, got str"):
        validate({"examples": "8"}, "02_overfit")
    with pytest.raises(WorkbookError, match="'examples' must be int, got bool"):
        validate({"examples": True}, "02_overfit")


def test_int_is_accepted_for_float_and_defaults_fill_in():
    params = validate({"lr": 1}, "02_overfit")
    assert params["lr"] == 1 and params["updates"] == defaults("02_overfit")["updates"]


def test_check_reads_a_notebook_namespace_and_skips_ipython_names():
    namespace = {"Out": {}, "_": None, "task": "a:b", "examples": 3, "lr": 1e-3, "json": json}
    assert check(namespace, "02_overfit")["examples"] == 3
    with pytest.raises(WorkbookError, match="no parameter 'exampels'"):
        check({**namespace, "exampels": 3}, "02_overfit")


def test_in_a_kernel_only_the_parameter_cells_count():
    history = ["", 'task = "a:b"\nexamples = 3  # comment\nlr = 0.001',
               "# Parameters\nexampels = 4\n",
               "import workbook as wb\np = wb.params.check(globals(), '02_overfit')",
               "n = len(items)\nratio = 0.5"]
    namespace = {"In": history, "task": "a:b", "examples": 3, "lr": 1e-3, "exampels": 4,
                 "ratio": 0.5, "n": 7}
    with pytest.raises(WorkbookError, match="no parameter 'exampels'"):
        check(namespace, "02_overfit")
    history[2] = "# Parameters\nexamples = 4\n"
    namespace["examples"] = 4
    assert check(namespace, "02_overfit")["examples"] == 4, "later literals do not count"


def test_defaults_are_read_from_the_parameters_cell(tmp_path, monkeypatch):
    """The parameters cell is the only table of defaults: editing it changes what is validated."""
    import shutil

    import workbook.params as params

    shutil.copy(NOTEBOOK_DIR / "02_overfit.ipynb", tmp_path / "02_overfit.ipynb")
    monkeypatch.setattr(params, "NOTEBOOK_DIR", tmp_path)
    assert params.stems() == ["02_overfit"] and defaults("02_overfit")["updates"] == 150
    nb = json.loads((tmp_path / "02_overfit.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    cell["source"] = "".join(cell["source"]).replace("updates = 150", "updates = 7\nwidth = 3")
    (tmp_path / "02_overfit.ipynb").write_text(json.dumps(nb))
    assert defaults("02_overfit")["updates"] == 7
    assert validate({"width": 4}, "02_overfit")["width"] == 4
    cell["source"] += "\nderived = updates * 2"
    (tmp_path / "02_overfit.ipynb").write_text(json.dumps(nb))
    with pytest.raises(WorkbookError, match="not `name = literal`"):
        defaults("02_overfit")


def test_unknown_notebook_is_named():
    with pytest.raises(WorkbookError, match="unknown notebook '99_nope'"):
        defaults("99_nope")


@pytest.mark.parametrize("stem", stems())
def test_smoke_sizes_are_known_parameters_of_the_right_type(stem):
    values = smoke(stem)
    assert set(values) <= set(defaults(stem))


def test_a_smoke_file_with_a_typo_is_refused(tmp_path, monkeypatch):
    import workbook.params as params

    (tmp_path / "02_overfit.yaml").write_text("updatse: 3\n")
    monkeypatch.setattr(params, "SMOKE_DIR", tmp_path)
    with pytest.raises(WorkbookError, match="did you mean 'updates'"):
        smoke("02_overfit")


@pytest.mark.parametrize("stem", stems())
def test_committed_notebooks_carry_their_outputs(stem):
    """Committed notebooks read as documentation: every code cell executed, no stored error."""
    nb = json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in cells), "execute the notebook"
    assert not any(o.get("output_type") == "error" for c in cells for o in c["outputs"])
    assert any(c["outputs"] for c in cells)


def test_a_parameter_of_other_notebooks_names_them():
    with pytest.raises(WorkbookError, match=r"no parameter 'lr' \(it belongs to 02_overfit, "
                       r"03_phase_gates.*\)(.|\n)*fix: select the notebooks that take it"):
        validate({"lr": 0.1}, "the selected notebooks", defaults("01_inspect_examples"))
