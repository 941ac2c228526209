import ast
import json
from pathlib import Path

import pytest

from workbook import WorkbookError
from workbook.params import NOTEBOOKS, check, validate

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"


def test_typo_gets_a_suggestion():
    with pytest.raises(WorkbookError, match="unknown parameter 'updatse' .*did you mean 'updates'"):
        validate({"updatse": 3}, "02_overfit")


def test_wrong_type_is_named():
    with pytest.raises(WorkbookError, match="'examples' must be int, got str"):
        validate({"examples": "8"}, "02_overfit")
    with pytest.raises(WorkbookError, match="'examples' must be int, got bool"):
        validate({"examples": True}, "02_overfit")


def test_int_is_accepted_for_float_and_defaults_fill_in():
    params = validate({"lr": 1}, "02_overfit")
    assert params["lr"] == 1 and params["updates"] == NOTEBOOKS["02_overfit"]["updates"]


def test_check_reads_a_notebook_namespace_and_skips_ipython_names():
    namespace = {"Out": {}, "_": None, "task": "a:b", "examples": 3, "json": json}
    assert check(namespace, "02_overfit")["examples"] == 3
    with pytest.raises(WorkbookError, match="unknown parameter 'exampels'"):
        check({**namespace, "exampels": 3}, "02_overfit")


def test_in_a_kernel_only_the_parameter_cells_count():
    history = ["", 'task = "a:b"\nexamples = 3  # comment', "# Parameters\nexampels = 4\n",
               "import workbook as wb\np = wb.params.check(globals(), '02_overfit')",
               "n = len(items)\nratio = 0.5"]
    namespace = {"In": history, "task": "a:b", "examples": 3, "exampels": 4, "ratio": 0.5,
                 "n": 7}
    with pytest.raises(WorkbookError, match="unknown parameter 'exampels'"):
        check(namespace, "02_overfit")
    history[2] = "# Parameters\nexamples = 4\n"
    namespace["examples"] = 4
    assert check(namespace, "02_overfit")["examples"] == 4, "later literals do not count"


@pytest.mark.parametrize("stem", sorted(NOTEBOOKS))
def test_notebook_parameters_cell_matches_the_spec(stem):
    nb = json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    tree = ast.parse("".join(cell["source"]))
    values = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body}
    assert values == NOTEBOOKS[stem], "parameters cell and workbook.params disagree"


def test_committed_notebooks_match_their_source(tmp_path):
    """tools/build_notebooks.py is the notebooks' source; committed copies carry outputs."""
    import subprocess
    import sys

    subprocess.run([sys.executable, str(NOTEBOOK_DIR.parent / "tools" / "build_notebooks.py"),
                    str(tmp_path)], check=True)
    for built in sorted(tmp_path.glob("*.ipynb")):
        fresh = json.loads(built.read_text())
        committed = json.loads((NOTEBOOK_DIR / built.name).read_text())
        assert [("".join(c["source"]), c["cell_type"]) for c in fresh["cells"]] == \
            [("".join(c["source"]), c["cell_type"]) for c in committed["cells"]], built.name


@pytest.mark.parametrize("stem", sorted(NOTEBOOKS))
def test_committed_notebooks_carry_their_outputs(stem):
    """Committed notebooks read as documentation: every code cell executed, no stored error."""
    nb = json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in cells), "execute the notebook"
    assert not any(o.get("output_type") == "error" for c in cells for o in c["outputs"])
    assert any(c["outputs"] for c in cells)
