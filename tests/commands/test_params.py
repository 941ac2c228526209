import ast
import json
from pathlib import Path

import pytest

from workbook import WorkbookError
from workbook.commands.params import check, defaults, smoke, stems, validate
from workbook.notebooks.registry import entry

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"


def checked(given: dict, stem: str):
    """`given` checked by the notebook's parameter model."""
    return entry(stem).check(given)


def test_typo_gets_a_suggestion():
    with pytest.raises(WorkbookError, match="no parameter 'updatse' .*did you mean 'updates'"):
        checked({"updatse": 3}, "02_overfit")


def test_a_typo_in_a_parameter_papermill_injects_stops_the_setup_cell(tmp_path):
    """`papermill -p updatse 3` on the committed 02: papermill's own injected cell
    (`parameterize_notebook`), then the notebook's code cells up to its setup cell, run in
    order in one namespace as a kernel runs them (`In` their sources): the setup cell names the
    typo before anything is written; its twin, `updates`, is read. That a raising cell stops a
    notebook under papermill in a kernel is test_pilot_limits.py's (08's error row)."""
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    def setup_cell(given: dict) -> dict:
        nb = parameterize_notebook(load_notebook_node(str(NOTEBOOK_DIR / "02_overfit.ipynb")),
                                   given, kernel_name="workbook", language="python")
        namespace = {"In": [""]}
        for cell in [c for c in nb.cells if c.cell_type == "code"]:
            namespace["In"].append(cell.source)
            exec(cell.source, namespace)
            if "wb.params.check(globals()" in cell.source:
                return namespace
        raise AssertionError("02 has no setup cell")

    out = tmp_path / "o"
    with pytest.raises(WorkbookError, match="no parameter 'updatse' .*did you mean 'updates'"):
        setup_cell({"updatse": 3, "out_dir": str(out)})
    assert not out.exists()
    assert setup_cell({"updates": 3, "out_dir": str(out)})["p"]["updates"] == 3


def test_wrong_type_is_named():
    with pytest.raises(WorkbookError, match="'examples' must be int, got str"):
        checked({"examples": "8"}, "02_overfit")
    with pytest.raises(WorkbookError, match="'examples' must be int, got bool"):
        checked({"examples": True}, "02_overfit")


@pytest.mark.parametrize("written, value", [("false", False), ("False", False), (0, False),
                                            ("true", True), ("on", True), (1, True),
                                            (False, False)])
def test_a_yes_no_parameter_takes_what_a_command_line_writes(written, value):
    assert checked({"fsdp": written}, "09_data_parallel").fsdp is value


@pytest.mark.parametrize("written", ["maybe", 2, 0.0])
def test_a_yes_no_parameter_refuses_what_is_neither(written):
    with pytest.raises(WorkbookError, match="'fsdp' must be bool"):
        checked({"fsdp": written}, "09_data_parallel")


def test_int_is_accepted_for_float_and_defaults_fill_in():
    params = checked({"lr": 1}, "02_overfit")
    assert params.lr == 1 and params.updates == defaults("02_overfit")["updates"] == 150


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


def parameters_cell(path: Path) -> dict:
    """The `name = literal` assignments of a notebook's cell tagged `parameters`, in order."""
    cells = json.loads(path.read_text())["cells"]
    cell = next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
    values = {}
    for node in ast.parse("".join(cell["source"])).body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1, \
            f"{path.name}: parameters cell line {node.lineno} is not `name = literal`"
        values[node.targets[0].id] = ast.literal_eval(node.value)
    return values


def cell_differs(path: Path, stem: str) -> list[str]:
    """Where a notebook's parameters cell and its model's defaults differ: names, order,
    values (with their types: 1 is not 1.0)."""
    cell, model = parameters_cell(path), defaults(stem)
    if list(cell) != list(model):
        return [f"names: the cell has {list(cell)}, the model {list(model)}"]
    return [f"{k}: the cell has {cell[k]!r}, the model {model[k]!r}" for k in cell
            if repr(cell[k]) != repr(model[k])]


@pytest.mark.parametrize("stem", stems())
def test_each_notebooks_parameters_cell_is_its_models_defaults(stem):
    """The model is the one source of the defaults; the cell papermill overrides (committed
    with its outputs) spells the same names, in the same order, with the same literals."""
    assert cell_differs(NOTEBOOK_DIR / f"{stem}.ipynb", stem) == []


def test_a_cell_that_drifts_from_its_model_is_named(tmp_path):
    nb = json.loads((NOTEBOOK_DIR / "02_overfit.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    source = "".join(cell["source"])
    for changed, found in ((source.replace("updates = 150", "updates = 7"), "updates: the cell"),
                           (source.replace("lr = 0.0", "lr = 0"), "lr: the cell has 0,"),
                           (source + "\nwidth = 3", "names: the cell has")):
        cell["source"] = changed
        (tmp_path / "02_overfit.ipynb").write_text(json.dumps(nb))
        assert found in cell_differs(tmp_path / "02_overfit.ipynb", "02_overfit")[0]


def test_unknown_notebook_is_named():
    with pytest.raises(WorkbookError, match="unknown notebook '99_nope'"):
        defaults("99_nope")
    with pytest.raises(WorkbookError, match="unknown notebook '99_nope'"):
        smoke("99_nope")


@pytest.mark.parametrize("stem", stems())
def test_smoke_sizes_are_known_parameters_of_the_right_type(stem):
    values = smoke(stem)
    assert set(values) <= set(defaults(stem))


def test_a_smoke_file_with_a_typo_is_refused(tmp_path, monkeypatch):
    import workbook.commands.params as params

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
    with pytest.raises(WorkbookError, match=r"the selected notebooks: no parameter 'lr' \(it "
                       r"belongs to 02_overfit, 03_phase_gates.*\)(.|\n)*fix: select the "
                       "notebooks that take it"):
        validate({"lr": 0.1}, ["01_inspect_examples"])


# --- ranges ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stem", stems())
def test_every_notebooks_defaults_and_smoke_values_are_in_range(stem):
    assert dict(checked(defaults(stem), stem)) == defaults(stem)
    assert dict(checked(smoke(stem), stem)) == {**defaults(stem), **smoke(stem)}


@pytest.mark.parametrize(("stem", "bad", "good", "match"), [
    ("04_batch_accounting", {"budget": 1e999}, {"budget": 1e9},
     r"'budget' of 04_batch_accounting is inf; it must be a finite number"),
    ("04_batch_accounting", {"budget": float("nan")}, {"budget": 2.5}, r"'budget' .* is nan"),
    ("08_rental_plan", {"utilisation": 0}, {"utilisation": 1},
     r"parameter 'utilisation' of 08_rental_plan is 0; it must be in \(0, 1\] \(the share of "
     r"peak FLOP/s the training reaches\)"),
    ("01_inspect_examples", {"probe_size": -3}, {"probe_size": 1},
     r"'probe_size' of 01_inspect_examples is -3; it must be >= 1"),
    ("02_overfit", {"examples": 0}, {"examples": 100000},
     r"'examples' of 02_overfit is 0; it must be >= 1"),
    ("02_overfit", {"updates": -1}, {"updates": 1}, r"'updates' .* is -1; it must be >= 1"),
    ("02_overfit", {"lr": -1e-3}, {"lr": 0.0}, r"'lr' .* it must be >= 0 \(0: the task's own"),
    ("03_phase_gates", {"headroom": 1.0}, {"headroom": 0.0}, r"'headroom' .* in \[0, 1\)"),
    ("03_phase_gates", {"device_memory_gib": -24}, {"device_memory_gib": 0},
     r"'device_memory_gib' .* >= 0 \(GiB of the rental GPU; 0: not given\)"),
    ("03_phase_gates", {"length": -1}, {"length": 0}, r"'length' .* >= 0"),
    ("03_phase_gates", {"plan_micro_batch": 0}, {"plan_micro_batch": 1},
     r"'plan_micro_batch' .* >= 1"),
    ("04_batch_accounting", {"reconcile_examples": 0}, {"reconcile_examples": 1},
     r"'reconcile_examples' .* >= 1"),
    ("04_batch_accounting", {"replicas": 0}, {"replicas": 1}, r"'replicas' .* >= 1"),
    ("06_lr_study", {"seeds": []}, {"seeds": [0, 1]}, r"'seeds' .* a non-empty list"),
    ("06_lr_study", {"seeds": [0, -1]}, {"seeds": [2**32 - 1]}, r"'seeds\[1\]' .* is -1"),
    ("06_lr_study", {"lrs": [1e-3, 0.0]}, {"lrs": []}, r"'lrs\[1\]' .* is 0.0; it must be > 0"),
    ("06_lr_study", {"divergence_multiple": 1.0}, {"divergence_multiple": 1.5},
     r"'divergence_multiple' .* > 1"),
    ("07_resume_reload", {"mid_step": 0}, {"mid_step": 1}, r"'mid_step' .* >= 1"),
    ("07_resume_reload", {"boundary_step": -1}, {"boundary_step": 0}, r"'boundary_step' .* >= 0"),
    ("08_rental_plan", {"gpus": {"L4": float("inf")}}, {"gpus": {"L4": 24}},
     r"\"gpus\['L4'\]\" of 08_rental_plan is inf"),
    ("08_rental_plan", {"candidates": [{"name": "c", "micro_batch": 0}]},
     {"candidates": [{"name": "control", "micro_batch": 1}, {"name": "checkpointed"}]},
     r"'candidates\[0\].micro_batch' of 08_rental_plan is 0; it must be >= 1"),
    ("08_rental_plan", {"variants": [{"name": "v", "priority": 1, "candidate": "control",
                                  "repeats": 0}]},
     {"variants": [{"name": "v", "priority": 1, "candidate": "control", "repeats": 1}]},
     r"'variants\[0\].repeats' .* >= 1"),
    ("08_rental_plan", {"reserve_share": 1.0}, {"reserve_share": 0.0}, r"'reserve_share'"),
    ("02_overfit", {"task_options": {"dropout": float("nan")}}, {"task_options": {"dropout": 0.1}},
     r"'task_options.dropout' of 02_overfit is nan"),
    ("02_overfit", {"examples": 2**64}, {"examples": 2**62}, r"'examples' .* a 64-bit integer"),
])
def test_a_value_out_of_range_is_refused_and_its_clean_twin_passes(stem, bad, good, match):
    with pytest.raises(WorkbookError, match=match) as caught:
        checked(bad, stem)
    assert "fix: give it a value in its range" in str(caught.value)
    assert checked(good, stem)[next(iter(good))] == next(iter(good.values()))


def test_task_options_keep_their_own_names():
    """task_options are the task's keyword arguments: only finiteness applies to them."""
    assert checked({"task_options": {"updates": -1}}, "02_overfit").task_options


def test_every_problem_is_named_at_once_and_the_pilot_union_is_checked():
    with pytest.raises(WorkbookError, match=r"'updates' of the selected notebooks is 0(.|\n)*"
                       r"'utilisation' of the selected notebooks is 0(.|\n)*each a value"):
        validate({"updates": 0, "utilisation": 0}, ["02_overfit", "08_rental_plan"])
    validate({"updates": 3, "utilisation": 1}, ["02_overfit", "08_rental_plan"])


def test_a_smoke_file_out_of_range_is_refused(tmp_path, monkeypatch):
    import workbook.commands.params as params

    (tmp_path / "02_overfit.yaml").write_text("updates: 0\n")
    monkeypatch.setattr(params, "SMOKE_DIR", tmp_path)
    with pytest.raises(WorkbookError, match="'updates' of 02_overfit.yaml for notebook "
                       "02_overfit is 0"):
        smoke("02_overfit")


def test_a_namespace_out_of_range_stops_the_notebook():
    with pytest.raises(WorkbookError, match="'examples' of 02_overfit is -2"):
        check({"task": "a:b", "examples": -2, "lr": 1e-3}, "02_overfit")


@pytest.mark.parametrize(("text", "value"), [
    ("8", 8), ("-3", -3), ("1e-3", 1e-3), ("[0, 1]", [0, 1]), ('{"max_length": 64}',
                                                               {"max_length": 64}),
    ("cuda", "cuda"), ("workbook.samples.generation:task", "workbook.samples.generation:task"),
    ("it's", "it's"), ("{[1]: 2}", "{[1]: 2}"), ("-" * 20 + "1", "-" * 20 + "1"),
    ("[" * 19 + "]" * 19, [[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]),
])
def test_parse_literal_reads_literals_and_keeps_other_text(text, value):
    from workbook.commands.params import parse_literal

    assert parse_literal(text) == value


@pytest.mark.parametrize(("text", "match"), [
    ("-" * 100_000 + "1", "longer than 10000 characters"),
    ("-" * 5_000 + "1", "nests brackets or signs deeper than 20"),
    ("-" * 21 + "1", "deeper than 20"),
    ("[" * 30 + "]" * 30, "deeper than 20"),
    ("[" * 100_000, "longer than"),
])
def test_parse_literal_bounds_length_and_nesting(text, match):
    import argparse

    from workbook.commands.params import parse_literal

    with pytest.raises(WorkbookError, match=match) as caught:
        parse_literal(text)
    assert isinstance(caught.value, argparse.ArgumentTypeError), "argparse reports it cleanly"
    assert len(str(caught.value)) < 300, "the value is shown shortened"


def test_parse_literal_as_an_argparse_type_gives_a_usage_error(capsys):
    import argparse

    from workbook.commands.params import parse_literal

    parser = argparse.ArgumentParser(prog="t")
    parser.add_argument("-p", type=parse_literal)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["-p", "[" * 5000 + "1"])
    assert exited.value.code == 2 and "deeper than 20" in capsys.readouterr().err


def test_a_value_inside_a_list_or_dict_of_the_wrong_type_is_named():
    with pytest.raises(WorkbookError, match=r"parameter \"gpus\['L4'\]\" must be float, got str"):
        checked({"gpus": {"L4": "24"}}, "08_rental_plan")
    with pytest.raises(WorkbookError, match=r"parameter 'lrs\[1\]' must be float, got str"):
        checked({"lrs": [1e-3, "2e-3"]}, "06_lr_study")
    assert checked({"lrs": [1e-3, 2]}, "06_lr_study").lrs == [1e-3, 2]
    assert checked({"gpus": {"L4": 24}}, "08_rental_plan").gpus == {"L4": 24}, "an int kept"


def test_a_rule_across_parameters_is_checked_with_them():
    with pytest.raises(WorkbookError, match="checkpoint_at 10 is not an update before the last "
                       r"\(updates=10\)(.|\n)*fix: give checkpoint_at between 1 and 9"):
        checked({"checkpoint_at": 10}, "09_data_parallel")
    assert checked({"checkpoint_at": 9}, "09_data_parallel").checkpoint_at == 9


def test_a_cell_reads_the_checked_parameters_by_name():
    """Notebook cells spell `p["out_dir"]`; `lr_from` is where lr came from, not a parameter."""
    p = checked({"lr": 1e-3}, "02_overfit").model_copy(update={"lr_from": "parameter"})
    assert p["out_dir"] == p.out_dir == "" and dict(p) == {**defaults("02_overfit"), "lr": 1e-3}
    with pytest.raises(KeyError):
        p["lr_from"]
    with pytest.raises(WorkbookError, match="no parameter 'lr_from'"):
        checked({"lr_from": "task"}, "02_overfit")


def test_a_wrong_type_alone_is_told_the_type_not_the_names():
    with pytest.raises(WorkbookError, match="fix: give each a value of the type named"):
        checked({"examples": "8"}, "02_overfit")
