"""The commands (`python -m workbook trial|resume|reload|ddp`): everything they are given is
checked before any work, a failure exits non-zero, nothing is written over, results come back
in a file (never stdout, which the task's prints share), and every command they suggest is
quoted for the shell."""

import argparse
import contextlib
import io
import json
import os
import stat
import subprocess

import pandas as pd
import pytest
import torch

from workbook import TrainConfig, UpdateShape, WorkbookError
from workbook.commands.cli import SEED_MAX, main
from workbook.notebooks.parallel.process import claim_launch
from workbook.storage.ledger import Ledger
from workbook.storage.runs import CLAIM, claim_dir

OWN = "tests.own_task:task"
NOISY = "tests.noisy_task:task"


@pytest.fixture
def umask_022():
    before = os.umask(0o022)
    yield
    os.umask(before)


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def pasted_runs_nothing(line: str, marker) -> bool:
    """Paste `line` after `:` (bash still expands its arguments, `$(...)` included)."""
    subprocess.run(["bash", "-c", f": {line}"], capture_output=True, timeout=30)
    return not marker.exists()


# --- reload ------------------------------------------------------------------------------------
def archive_of(task_path, folder):
    from workbook import load_task
    from workbook.notebooks.resume.archive import write_archive

    torch.manual_seed(0)
    model = load_task(task_path).build_model()
    return write_archive(folder, task_path, {}, model, {"lr": 1e-3},
                         pd.DataFrame({"step": [1], "loss": [0.5]}), ["make pilot"], 4)


def test_a_task_that_prints_while_loading_still_reloads_identical_in_a_new_process(
        tmp_path, umask_022):
    from workbook.notebooks.resume.archive import reload_in_new_process

    path = archive_of(NOISY, tmp_path / "archive")
    assert {f.name: mode(f) for f in path.iterdir()} == {
        f.name: 0o644 for f in path.iterdir()}, "safetensors were written 0600"
    reloaded = reload_in_new_process(path, NOISY)  # prints a forged result and non-UTF-8 bytes
    assert reloaded["identical"] is True and reloaded["max_abs_diff"] == 0, reloaded
    assert "error" not in reloaded


def test_a_failed_reload_hands_back_its_error_in_the_result_file(tmp_path):
    path = archive_of(OWN, tmp_path / "archive")
    code, _, err = cli("reload", "--archive", path, "--task", NOISY,
                       "--result", tmp_path / "r.json")
    outcome = json.loads((tmp_path / "r.json").read_text())
    assert code == 2 == outcome["exit_code"] and outcome["result"] is None
    assert "records the task 'tests.own_task:task'" in outcome["error"]["problem"] in err
    code, out, _ = cli("reload", "--archive", path, "--task", OWN, "--result", tmp_path / "ok")
    outcome = json.loads((tmp_path / "ok").read_text())
    assert code == 0 and outcome["result"]["identical"] is True and outcome["error"] is None
    assert json.loads(out) == outcome["result"], "people still read it on stdout"


def test_the_parent_reads_the_error_a_child_handed_back_or_its_stderr():
    from workbook.storage.processes import outcome_error

    done = subprocess.CompletedProcess([], 2, "", "Traceback ...\nValueError: x")
    handed = {"exit_code": 2, "result": None, "error": {"problem": "bad", "fix": "mend it"}}
    assert outcome_error(handed, done, "the reload") == "bad\n  -> fix: mend it"
    assert outcome_error(None, done, "the reload").endswith("ValueError: x")
    silent = subprocess.CompletedProcess([], -9, "", "")
    assert outcome_error(None, silent, "the reload") == \
        "the reload exited with code -9 and handed back no result"


@pytest.mark.parametrize("content", ["not json", "[1]", '{"exit_code": "0"}'])
def test_a_result_file_not_in_the_format_is_no_result(content, tmp_path):
    from workbook.storage.processes import read_result

    (tmp_path / "r.json").write_text(content)
    assert read_result(tmp_path / "r.json") is None
    assert read_result(tmp_path / "missing.json") is None


def test_a_result_file_that_exists_or_has_no_folder_is_refused_before_any_work(tmp_path):
    (tmp_path / "r.json").write_text("mine")
    code, _, err = cli("reload", "--archive", tmp_path / "no-archive", "--task", OWN,
                       "--result", tmp_path / "r.json")
    assert code == 2 and "--result: " in err and "already exists" in err
    assert "is not a archive" not in err, "refused before the archive is even read"
    assert (tmp_path / "r.json").read_text() == "mine"
    code, _, err = cli("reload", "--archive", tmp_path, "--task", OWN,
                       "--result", tmp_path / "nowhere" / "r.json")
    assert code == 2 and "does not exist" in err and not (tmp_path / "nowhere").exists()


# --- trial -------------------------------------------------------------------------------------
@pytest.fixture
def study(tmp_path):
    from workbook.notebooks.study import Study, StudyDesign

    design = StudyDesign(name="s", task=OWN, lrs=[1e-3], updates=4, shape=UpdateShape(4, 1),
                         eval_every=2, eval_batch=8, metric="accuracy", prediction_examples=1)
    Study(tmp_path / "study", design).ledger.close()
    return tmp_path / "study"


def trials(folder) -> pd.DataFrame:
    ledger = Ledger(folder / "ledger.sqlite")
    try:
        return ledger.frame("trials")
    finally:
        ledger.close()


@pytest.mark.parametrize("seed, lr, words", [
    (SEED_MAX + 1, "1e-3", "--seed 4294967296 is outside 0..4294967295"),
    (-1, "1e-3", "--seed -1 is outside 0..4294967295"),
    (0, "nan", "--lr nan is not a positive finite number"),
    (0, "0", "--lr 0.0 is not a positive finite number"),
])
def test_a_trial_with_a_bad_seed_or_lr_is_refused_before_any_work(seed, lr, words, study):
    code, _, err = cli("trial", "--study", study, "--task", OWN, "--lr", lr, "--seed", seed)
    assert code == 2 and words in err and "-> fix: give" in err
    assert trials(study).empty and not (study / "trials").exists()


def test_a_trial_exits_0_when_it_ran_and_1_when_it_failed(study, monkeypatch):
    code, out, _ = cli("trial", "--study", study, "--task", OWN, "--lr", "1e-3",
                       "--seed", SEED_MAX, "--result", study / "first.json")
    assert code == 0 and out.strip() == "trial 1: finished"
    handed = json.loads((study / "first.json").read_text())["result"]
    assert handed == {"trial": 1, "status": "finished", "stop_reason": "", "stop_step": 4}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("workbook.notebooks.study.train", full_disk)
    code, _, err = cli("trial", "--study", study, "--task", OWN, "--lr", "1e-3",
                       "--result", study / "second.json")
    assert code == 1
    assert "error: trial 2 failed: OSError: [Errno 28] No space left on device" in err
    assert "run it again as a new trial: " in err and "--repeats 2" in err
    outcome = json.loads((study / "second.json").read_text())
    assert outcome["exit_code"] == 1 and outcome["result"]["status"] == "failed"
    assert trials(study).status.tolist() == ["finished", "failed"], "the failure keeps its row"


# --- resume ------------------------------------------------------------------------------------
@pytest.fixture
def checkpoint(tmp_path):
    from workbook.notebooks.resume import recipe, run_recipe

    spec = recipe(OWN, {}, TrainConfig(UpdateShape(4, 2), lr=1e-3), 64)
    run_recipe(spec, 2, tmp_path, checkpoint_at=(1,))
    return tmp_path / "ckpt-000001"


def test_resume_writes_new_files_only_with_the_umask_mode(checkpoint, tmp_path, umask_022):
    out = tmp_path / "resumed"
    code, _, err = cli("resume", "--checkpoint", checkpoint, "--to", 2, "--out", out,
                       "--task", OWN, "--result", tmp_path / "r.json")
    assert code == 0, err
    weights, records = out.with_suffix(".safetensors"), out.with_suffix(".json")
    assert mode(weights) == mode(records) == mode(tmp_path / "r.json") == 0o644
    assert json.loads((tmp_path / "r.json").read_text())["result"]["updates"] == 1
    before = records.read_text()
    code, _, err = cli("resume", "--checkpoint", checkpoint, "--to", 2, "--out", out,
                       "--task", OWN)
    assert code == 2 and f"--out: {out.with_suffix('.json')} already exists" in err
    assert records.read_text() == before
    assert not [p.name for p in tmp_path.iterdir() if "partial" in p.name or ".tmp" in p.name]


def test_resume_refuses_an_existing_output_before_any_work(checkpoint, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the resume ran")

    monkeypatch.setattr("workbook.notebooks.resume.run_recipe", never)
    out = tmp_path / "resumed"
    out.with_suffix(".safetensors").write_bytes(b"theirs")
    code, _, err = cli("resume", "--checkpoint", checkpoint, "--to", 2, "--out", out,
                       "--task", OWN)
    assert code == 2 and "already exists" in err and "-> fix: give --out a new name" in err
    assert out.with_suffix(".safetensors").read_bytes() == b"theirs"
    assert not out.with_suffix(".json").exists()
    code, _, err = cli("resume", "--checkpoint", checkpoint, "--to", 2, "--out",
                       tmp_path / "no-such" / "r", "--task", OWN)
    assert code == 2 and "the folder" in err and "does not exist" in err
    (tmp_path / "notes.txt").write_text("mine")  # --out under a regular file: named as one
    code, _, err = cli("resume", "--checkpoint", checkpoint, "--to", 2, "--out",
                       tmp_path / "notes.txt" / "r", "--task", OWN)
    assert code == 2 and f"{tmp_path / 'notes.txt'} is a file, not a folder" in err
    assert "does not exist" not in err and (tmp_path / "notes.txt").read_text() == "mine"


# --- ddp ---------------------------------------------------------------------------------------
def test_ddp_outside_torchrun_says_how_to_start_it_and_the_command_is_quoted(
        tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    marker = tmp_path / "pwned"
    spec = json.dumps({"task": f"x$(touch {marker}):task"})
    code, _, err = cli("ddp", "--spec", spec, "--out", tmp_path / "launch")
    assert code == 2 and "KeyError" not in err
    assert "workbook ddp is started by torchrun (notebook 09 does that)" in err
    line = err.split("-> fix: run the notebook (09_data_parallel), or ", 1)[1].strip()
    assert line.startswith("torchrun --standalone --nproc_per_node=2 -m workbook ddp --spec '")
    assert pasted_runs_nothing(line, marker)
    assert not (tmp_path / "launch").exists()


def ddp_args(out) -> argparse.Namespace:
    return argparse.Namespace(spec="{}", out=str(out), resume_from=None, then=[])


def test_rank_0_claims_the_launch_folder_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    made = claim_dir(tmp_path / "launch")  # what notebook 09's launch does first
    claim_launch(ddp_args(made))
    with pytest.raises(WorkbookError, match="already holds a run"):
        claim_launch(ddp_args(made))  # a second torchrun given the same --out
    claim_launch(ddp_args(tmp_path / "by-hand"))  # a new folder, as by hand
    monkeypatch.setenv("RANK", "1")
    claim_launch(ddp_args(made))  # only rank 0 claims
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "result.json").write_text("{}")
    monkeypatch.setenv("RANK", "0")
    code, _, err = cli("ddp", "--spec", "{}", "--out", tmp_path / "old")
    assert code == 2 and "already holds a run" in err
    assert (tmp_path / "old" / "result.json").read_text() == "{}"
    assert sorted(p.name for p in made.iterdir()) == sorted([CLAIM, ".workbook-launch"])


@pytest.mark.parametrize("words", [["pilot", "--option", "no-value"], ["pilot", "-p", "lr"],
                                   ["pilot", "--timeout", "soon"]])
def test_a_refused_argument_names_its_fix(words, capsys):
    with pytest.raises(SystemExit) as caught:
        main(words)
    assert caught.value.code == 2 and "(give " in capsys.readouterr().err
