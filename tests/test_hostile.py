"""Hostile and careless input: every probe gets a clear message (or the right diagnosis), no
code named in a folder runs, and nothing partial is left behind."""

import pytest

from .hostile_probes import PROBES, SLOW, probe

# Probes another test of `make test` proves with more, in a process of its own each: the test
# that does. They run, as SLOW's do, in `make test-all` and `python benchmarks/hostile_inputs.py`.
ELSEWHERE = {"task_prints_while_loading": "tests/commands/test_commands.py::test_a_task_that_"
             "prints_while_loading_still_reloads_identical_in_a_new_process"}


# The probes that take more than a few seconds (a pilot, a fresh process, a lock wait) run in
# `make test-all` and `python benchmarks/hostile_inputs.py`; `make test` runs the rest, which
# covers every class of the probes.
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW or n in ELSEWHERE else n
    for n in sorted(PROBES)])
def test_hostile_input_is_handled(name, tmp_path):
    outcome = probe(name, tmp_path)
    if outcome.skipped:
        pytest.skip(outcome.skipped)
    assert outcome.handled, outcome.message
    assert not outcome.code_ran, "code named in a folder was executed"
    assert not outcome.sql_ran, "SQL planted in a ledger ran"
    assert not outcome.overwritten, "an existing output was overwritten"
    assert not outcome.left, f"left behind: {outcome.left}"


@pytest.mark.parametrize("notebook, module, given, message", [
    ("02_overfit", "overfit", {"examples": 0}, "parameter 'examples' of 02_overfit is 0"),
    ("05_memory_variants", "variants", {"short_length": 0},
     "parameter 'short_length' of 05_memory_variants is 0"),  # was a silent copy of the control
    ("09_data_parallel", "parallel", {"checkpoint_at": 10},
     "checkpoint_at 10 is not an update before the last"),  # was found after a whole launch
    ("03_phase_gates", "gates", {"precision": "fp8"},
     "field 'precision' should be .* \\(got 'fp8'\\)"),
])
def test_a_parameter_that_cannot_work_is_refused_before_any_work(notebook, module, given,
                                                                 message, tmp_path):
    """A script's own dict goes through the notebook's parameter model too."""
    import workbook
    from workbook import WorkbookError
    from workbook.commands import params

    checked = params.of(notebook, small=True)
    with pytest.raises(WorkbookError, match=message):  # a script's own dict
        getattr(workbook, module).run({**checked, **given}, tmp_path)
    assert not any(tmp_path.iterdir()), "nothing written"
    if module != "gates":  # the precision is the update shape's to judge
        with pytest.raises(WorkbookError, match=message):
            params.of(notebook, small=True, **given)


def test_each_probe_proved_elsewhere_names_a_test_of_make_test():
    from pathlib import Path

    for name, test in ELSEWHERE.items():
        path, function = test.split("::")
        source = (Path(__file__).parent.parent / path).read_text()
        assert f"def {function}(" in source, name
        head = source.split(f"def {function}(")[0].rstrip().splitlines()[-1]
        assert "slow" not in head, f"{test} is itself left to make test-all"
