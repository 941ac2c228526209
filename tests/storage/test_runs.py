import html
import json

import pytest

from workbook import WorkbookError
from workbook.storage.runs import claim_dir, new_run_dir, notebook_dir, write_summary


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
    monkeypatch.setattr("workbook.storage.runs.RUNS_ROOT", tmp_path)
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

    from workbook.storage.artifacts import write_file
    from workbook.storage.runs import save_table

    missing = tmp_path / "not-made"
    with pytest.raises(WorkbookError, match="create the folder .*not-made first") as info:
        save_table(pd.DataFrame({"a": [1]}), missing, "rows")
    assert "disk space" not in info.value.fix
    with pytest.raises(WorkbookError, match="create the folder .*not-made first"):
        write_file(missing / "x.bin", lambda tmp: tmp.write_bytes(b"x"), "weights")
    assert not tmp_path.joinpath("not-made").exists()


def test_a_claimed_folder_cannot_be_claimed_again_even_before_anything_is_in_it(tmp_path):
    claim_dir(tmp_path / "run")  # the other pilot has not written anything yet
    with pytest.raises(WorkbookError, match="already holds a run"):
        claim_dir(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    claim_dir(tmp_path / "empty")  # an empty existing folder is taken once
    with pytest.raises(WorkbookError, match="already holds a run"):
        claim_dir(tmp_path / "empty")


def test_of_many_processes_given_one_folder_at_once_one_gets_it(tmp_path):
    import threading

    start, won, refused = threading.Barrier(8), [], []

    def claim():
        start.wait()
        try:
            won.append(claim_dir(tmp_path / "run"))
        except WorkbookError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7
    assert all("already holds a run" in e.problem for e in refused)


@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_get_the_umask_mode_whatever_the_temporary_had(umask, expected, tmp_path):
    import os
    import stat

    from workbook.storage.files import write_json, write_text

    before = os.umask(umask)
    try:
        write_json(tmp_path / "a.json", {"x": 1})  # through a temporary file made 0600
        write_text(tmp_path / "b.txt", "new", overwrite=False)
    finally:
        os.umask(before)
    for name in ("a.json", "b.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == expected, name


def test_an_output_written_as_new_is_never_overwritten_and_leaves_nothing(tmp_path):
    from workbook.storage.files import write_text

    write_text(tmp_path / "r.json", "first", overwrite=False)
    with pytest.raises(WorkbookError, match="r.json already exists"):
        write_text(tmp_path / "r.json", "second", overwrite=False)
    assert (tmp_path / "r.json").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    write_text(tmp_path / "r.json", "replaced")  # the default replaces: index.json, summaries
    assert (tmp_path / "r.json").read_text() == "replaced"


def test_the_pilot_keeps_space_for_its_index_and_gives_it_back_when_the_disk_fills(tmp_path):
    from workbook.commands.pilot import RESERVE, RESERVE_BYTES, _Reserve

    space = _Reserve(tmp_path)
    reserve = tmp_path / RESERVE
    assert reserve.stat().st_blocks * 512 >= RESERVE_BYTES, "allocated on the disk"
    space.check("")  # a notebook that passed on a roomy disk: the space stays kept
    assert reserve.exists() and not space.low
    space.check("WorkbookError: cannot write checkpoint x: No space left on device")
    assert not reserve.exists() and space.low, "given back for the index and the report"
    calls = []

    def index():
        calls.append(1)
        if len(calls) == 1:
            raise WorkbookError("cannot write file index.json: No space left on device", "")
    space = _Reserve(tmp_path)
    space.write(index)  # refused once, written after the space is given back
    assert len(calls) == 2 and not reserve.exists() and space.low


def test_an_executed_notebook_save_the_disk_refuses_keeps_the_last_complete_one(
        tmp_path, monkeypatch):
    import errno
    import os

    from workbook.commands.pilot import _atomic, _AtomicIO

    path = tmp_path / ".01.partial.ipynb"
    target = _atomic(path)
    assert target.startswith("workbook-atomic://")
    _AtomicIO().write('{"cells": []}', target)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(WorkbookError, match="No space left on device") as info:
        _AtomicIO().write('{"cells": [1]}', target)
    assert "free space on" in info.value.fix
    assert path.read_text() == '{"cells": []}', "the last complete save stays"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name], "no temporary file"


def test_an_output_folder_under_a_regular_file_is_named_as_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(WorkbookError, match="notes.txt is a file, not a folder"):
        claim_dir(tmp_path / "notes.txt" / "run" / "deeper")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_what_a_killed_run_left_half_written_is_swept_and_a_live_ones_is_kept(tmp_path):
    import os
    import subprocess
    import sys

    from workbook.storage.runs import CLAIM, sweep_runs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed, live = tmp_path / "20261202-000000-killed", tmp_path / "20261202-000001-live"
    for run, pid in ((killed, dead.pid), (live, os.getpid())):
        (run / "02_overfit").mkdir(parents=True)
        (run / CLAIM).write_text(json.dumps({"pid": pid}))
        (run / ".02_overfit.partial.ipynb").write_text("{}")
        (run / "02_overfit" / f".steps.csv.partial-{pid}-x1").mkdir()
        (run / "02_overfit" / "steps.csv").write_text("step\n1\n")
    (tmp_path / "not-a-run").mkdir()  # no claim: never touched
    (tmp_path / "not-a-run" / f".x.partial-{dead.pid}-y").write_text("theirs")
    removed = sweep_runs(tmp_path)
    assert sorted(p.name for p in removed) == [".02_overfit.partial.ipynb",
                                              f".steps.csv.partial-{dead.pid}-x1"]
    assert (killed / "02_overfit" / "steps.csv").exists(), "finished files stay"
    assert (live / ".02_overfit.partial.ipynb").exists()
    assert (live / "02_overfit" / f".steps.csv.partial-{os.getpid()}-x1").exists()
    assert (tmp_path / "not-a-run" / f".x.partial-{dead.pid}-y").exists()


def test_a_childs_error_is_said_without_its_progress_bars():
    from workbook.base.errors import child_error

    stderr = ("Map:   0%|          | 0/483 [00:00<?, ? examples/s]\rMap: 100%|##########| "
              "483/483 [00:00<00:00, 9155.45 examples/s]\n\x1b[31mwarning: slow\x1b[0m\n"
              "error: from_hf: the checkpoint holds no optimizer.pt, scheduler.pt\n"
              "  -> fix: save with save_only_model=False\n")
    said = child_error(stderr)
    assert said == ("error: from_hf: the checkpoint holds no optimizer.pt, scheduler.pt\n"
                    "-> fix: save with save_only_model=False")
    assert child_error("Traceback (most recent call last):\n  boom\nValueError: x\n") == \
        "Traceback (most recent call last):\nboom\nValueError: x"


def test_a_path_is_shown_relative_to_the_pilots_run_folder_and_never_with_the_home_folder(
        tmp_path, monkeypatch):
    """Inside the working folder or the checkout a path is relative to the working folder (the
    committed notebooks' outputs); a pilot run elsewhere (--out under /tmp) shows its paths
    relative to its run folder, what a reader of its report can open; the home folder is `~`."""
    from workbook.storage.runs import CHECKOUT, RUN_ENV, shown, shown_in

    run, home = tmp_path / "run", tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(RUN_ENV, raising=False)
    study = run / "06_lr_study" / "study"
    assert shown(study) == str(study)  # no pilot, no home: as given (a notebook run alone)
    monkeypatch.setenv(RUN_ENV, str(run))
    assert shown(study) == "06_lr_study/study" and shown(run) == "."
    # a command's paths all hold from the one working folder it is pasted in
    assert shown(study, in_run=False) == str(study)
    assert shown(home / "runs" / "x", in_run=False) == "~/runs/x"
    assert shown(tmp_path / "run2" / "x") == str(tmp_path / "run2" / "x")  # not in the run
    assert shown(home / ".venv" / "bin" / "python") == "~/.venv/bin/python"
    assert shown(CHECKOUT / "notebooks") == "notebooks"  # the working folder's rule first
    page = (f'out_dir = "{run}/01_inspect_examples"; writing to {run}/01_inspect_examples; '
            f"{home}/.venv/bin/python; {tmp_path}/run2/x")
    assert shown_in(page, run) == ('out_dir = "01_inspect_examples"; writing to '
                                   f"01_inspect_examples; ~/.venv/bin/python; {tmp_path}/run2/x")
    odd = tmp_path / "a&b's run"  # as an HTML page holds it: escaped
    assert shown_in(f"<td>{html.escape(str(odd))}/x.csv</td>", odd) == "<td>x.csv</td>"
