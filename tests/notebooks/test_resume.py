"""Notebook 07: bit-exact resume in a new process, planted resume bugs, safe loading, the
kill-during-save test and the archive round trip."""

import os
import random
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from workbook import TrainConfig, UpdateShape, WorkbookError, load_task
from workbook.notebooks.resume import (
    check_cases,
    compare,
    latest_checkpoint,
    recipe,
    run_recipe,
    tamper_checks,
)
from workbook.notebooks.resume.archive import reload_archive, write_archive
from workbook.training.checkpoint import load_checkpoint, save_checkpoint, verify

from ..conftest import CLASSIFICATION, GENERATION


def spec_for(task, **options):
    cfg = TrainConfig(UpdateShape(2, 8), lr=1e-3)
    return recipe(task, options, cfg, train_limit=48)  # 3 updates per pass


def test_bit_exact_resume_in_a_new_process_mid_pass_and_at_the_boundary(tmp_path):
    # the classification sample's dropout makes the random states matter; the generation
    # sample's resumes in new processes are 07's own, under nbval
    cases, details = check_cases(spec_for(CLASSIFICATION), 7, 4, 3, tmp_path)
    assert cases.exact.all() and cases.continued_to_the_end.all(), cases
    assert (cases.max_param_diff == 0).all() and (cases.max_loss_diff == 0).all()
    boundary = details["epoch boundary"]
    assert boundary.step.tolist() == [4, 5, 6, 7], "the run continues into the next pass"
    assert [r["epoch"] for r in details["reference"]] == [0, 0, 0, 1, 1, 1, 2]


@pytest.mark.parametrize("fault", ["optimizer", "sampler", "rng"])
def test_planted_resume_bugs_are_caught(fault, tmp_path):
    spec = spec_for(CLASSIFICATION)  # dropout 0.1: the random states matter
    reference, weights = run_recipe(spec, 6, tmp_path, checkpoint_at=(4,))
    resumed, w = run_recipe(spec, 6, start_from=tmp_path / "ckpt-000004", faults=(fault,))
    _, verdict = compare(reference, resumed, weights, w)
    assert not verdict["exact"]
    assert verdict["same_examples"] == (fault != "sampler")


def test_resume_refuses_a_checkpoint_of_another_task(tmp_path):
    run_recipe(spec_for(CLASSIFICATION), 2, tmp_path, checkpoint_at=(1,))
    with pytest.raises(WorkbookError, match="written by task 'sample-classification'"):
        run_recipe(spec_for(GENERATION), 3, start_from=tmp_path / "ckpt-000001")


def test_missing_and_truncated_checkpoints_are_refused(tmp_path):
    with pytest.raises(WorkbookError, match="is not a checkpoint"):
        verify(tmp_path / "nothing")
    model = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path / "c", model, torch.optim.AdamW(model.parameters()))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WorkbookError, match="does not match its manifest"):
        load_checkpoint(path, torch.nn.Linear(3, 2))
    with pytest.raises(WorkbookError, match="already exists"):
        save_checkpoint(path, model)


def test_tampered_and_malicious_checkpoints_are_refused_and_no_code_runs(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path / "c", model, torch.optim.AdamW(model.parameters()))
    table = tamper_checks(path, tmp_path).set_index("case")
    assert table.refused.all()
    assert "needs arbitrary code" in table.message.iloc[1]
    assert not (tmp_path / "payload-ran").exists()


def test_random_states_survive_weights_only_loading(tmp_path):
    import numpy as np

    model = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path / "c", model)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    load_checkpoint(path, model)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


SAVER = """
import sys, torch
from pathlib import Path
from workbook.training.checkpoint import save_checkpoint
from workbook.training.loop import UpdateShape
model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
opt = torch.optim.AdamW(model.parameters())
step = int(sys.argv[2])
while True:
    step += 1
    save_checkpoint(Path(sys.argv[1]) / f"ckpt-{step:06d}", model, opt, counters={"step": step})
"""


@pytest.mark.slow  # a soak: six kills at random points; `make test-all` runs it
def test_a_kill_at_random_points_during_saving_never_breaks_the_latest(tmp_path):
    rng = random.Random(0)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    step = 0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path), str(step)],
                                env=env)
        deadline = time.time() + 60
        while time.time() < deadline and not (tmp_path / f"ckpt-{step + 1:06d}").exists():
            time.sleep(0.01)  # until this process has saved once
        time.sleep(rng.random() * 0.3)  # then a kill anywhere in the following saves
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        latest = latest_checkpoint(tmp_path)
        verify(latest)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
        info = load_checkpoint(latest, model, torch.optim.AdamW(model.parameters()))
        step = info["counters"]["step"]
    assert step > 0


def test_archive_round_trip(tmp_path):
    """Written, then reloaded identical - in this process: the reload in a new process
    (`workbook reload`) is nbval's 07 on this sample and test_commands.py's
    test_a_task_that_prints_while_loading_still_reloads_identical_in_a_new_process."""
    task = load_task(GENERATION)
    torch.manual_seed(0)
    model = task.build_model()
    path = write_archive(tmp_path / "archive", GENERATION, {}, model, {"lr": 1e-3},
                         pd.DataFrame({"step": [1], "loss": [5.0]}), ["make pilot"], 4)
    for name in ("model.safetensors", "config.json", "revision.json", "environment.json",
                 "metrics.csv", "procedure.md", "control_outputs.safetensors", "manifest.json"):
        assert (path / name).exists(), name
    reloaded = reload_archive(path, GENERATION)
    assert reloaded["identical"] and reloaded["max_abs_diff"] == 0, reloaded
    with pytest.raises(WorkbookError, match="already exists"):
        write_archive(path, GENERATION, {}, model, {}, pd.DataFrame(), [])


def test_an_archive_of_other_weights_does_not_reproduce(tmp_path):
    task = load_task(GENERATION)
    model = task.build_model()
    path = write_archive(tmp_path / "a", GENERATION, {}, model, {}, pd.DataFrame({"x": [1]}),
                         [], 2)
    from safetensors.torch import save_model

    torch.manual_seed(123)
    other = task.build_model()
    save_model(other, str(path / "model.safetensors"))
    with pytest.raises(WorkbookError, match="does not match its manifest"):
        reload_archive(path, GENERATION)
