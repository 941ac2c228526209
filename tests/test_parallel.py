"""Notebook 09: the loop on two processes under torchrun, the multi-host rules, and the planted
multi-process bugs each failing the rule meant to name it."""

import dataclasses
import json
import subprocess
import time

import pytest

from workbook import WorkbookError
from workbook.loop import UpdateShape
from workbook.parallel import CAUGHT_BY, RULES, check_devices, launch, reduce_sums
from workbook.pilot import run_pilot
from workbook.replica import FAULTS, ReplicaSpec, _artifact, shard, update_groups

from .conftest import CLASSIFICATION, GENERATION


def summary(run):
    return json.loads((run / "09_data_parallel" / "summary.json").read_text())


def test_pilot_smoke_09_passes_and_lists_every_rule(tmp_path):
    run, index = run_pilot(GENERATION, out=str(tmp_path / "run"), smoke=True, only="09",
                           progress=False)
    assert index.verdict.tolist() == ["pass"], index.error.tolist()
    figures, rules = summary(run)["figures"], summary(run)["rules"]
    assert set(rules) == set(RULES)
    assert rules["batch-norm statistics synchronised"] == "not applicable"  # no batch norm
    assert {v for k, v in rules.items() if k != "batch-norm statistics synchronised"} == {"pass"}
    assert max(figures["gradient_max_relative_deviation"].values()) < 1e-4
    report = (run / "report.html").read_text()
    assert "Multi-host rules" in report and "only rank 0 writes" in report
    assert report.count(">not applicable<") == 1, "a verdict the CSV round trip must keep"


def test_each_planted_multi_process_bug_fails_its_rule(tmp_path):
    """The classification sample with batch norm, so every planted bug applies."""
    run, index = run_pilot(CLASSIFICATION, out=str(tmp_path / "run"), smoke=True, only="09",
                           task_options={"batch_norm": "batch"},
                           params={"demonstrate_faults": True}, progress=False)
    assert index.verdict.tolist() == ["pass"], index.error.tolist()
    figures, rules = summary(run)["figures"], summary(run)["rules"]
    assert rules["batch-norm statistics synchronised"] == "pass"
    assert rules["resume in new processes is exact"] == "pass"
    assert figures["faults_caught"] == {FAULTS[f]: True for f in FAULTS}
    rows = json.loads((run / "09_data_parallel" / "planted_faults.json").read_text())
    assert {r["planted bug"]: r["rule"] for r in rows} == {FAULTS[f]: CAUGHT_BY[f]
                                                           for f in FAULTS}


def test_shards_are_disjoint_cover_every_example_and_keep_ranks_in_step():
    spec = ReplicaSpec("t", shape=UpdateShape(2, 2, replicas=2))
    for n in (32, 13, 9):  # whole updates, a partial last update, a rank with fewer examples
        groups = update_groups(n, spec, epoch=0, world=3)
        seen = []
        for group in groups:
            plans = [shard(group, r, 3, 2) for r in range(3)]
            assert len({len(b) + fill for b, fill in plans}) == 1, "same micro-steps per rank"
            seen += [i for b, _ in plans for mb in b for i in mb]
        assert sorted(seen) == list(range(n))
    assert update_groups(13, spec, 0, 3) != update_groups(13, spec, 1, 3), "set_epoch"
    fixed = ReplicaSpec("t", shape=UpdateShape(2, 2, replicas=2), fault="fixed_order")
    assert update_groups(13, fixed, 0, 3) == update_groups(13, fixed, 1, 3)
    same = [shard(list(range(8)), r, 2, 2, "same_order")[0] for r in range(2)]
    assert same[0] == same[1]


def test_written_paths_are_named_by_their_artifact():
    assert _artifact(".ckpt-000005.partial-4242/model.safetensors") == "ckpt-000005"
    assert _artifact(".result.json.x1y2z3.tmp") == "result.json"
    assert _artifact("weights.safetensors") == "weights.safetensors"


def test_evaluation_sums_add_over_ranks():
    ranks = [{"(loss)": [10.0, 4.0], "accuracy": [3.0, 4.0]},
             {"(loss)": [2.0, 1.0], "accuracy": [0.0, 1.0]}]
    assert reduce_sums(ranks) == {"(loss)": [12.0, 5.0], "accuracy": [3.0, 5.0]}


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(WorkbookError, match="2 or more"):
        check_devices("cpu", 1)
    with pytest.raises(WorkbookError, match="'cpu' \\(gloo\\) or 'cuda'"):
        check_devices("tpu", 2)
    with pytest.raises(WorkbookError, match="unknown replica settings"):
        ReplicaSpec.from_dict({"task": GENERATION, "replica": 2})
    with pytest.raises(WorkbookError, match="unknown planted fault"):
        ReplicaSpec.from_dict({"task": GENERATION, "fault": "nope"})
    with pytest.raises(WorkbookError, match=r"unknown replica settings \['micro_batch'\]"):
        ReplicaSpec.from_dict({"task": GENERATION, "micro_batch": 2})  # the shape is one field
    with pytest.raises(WorkbookError, match=r"unknown update-shape fields \['world'\]"):
        ReplicaSpec.from_dict({"task": GENERATION, "shape": {"micro_batch": 2, "world": 2}})
    spec = ReplicaSpec(GENERATION, shape=UpdateShape(4, 1, replicas=3))
    assert ReplicaSpec.from_dict(dataclasses.asdict(spec)) == spec
    from workbook.replica import main as replica_main

    for bad, message in (("{task: x}", "--spec is not JSON"), ("[1, 2]", "an object with"),
                         ('{"updates": 3}', "with a 'task' path")):
        with pytest.raises(WorkbookError, match=message):
            replica_main(bad, "unused", None)


def test_a_worker_error_comes_back_with_its_message(tmp_path):
    spec = ReplicaSpec(GENERATION, check_examples=15, updates=2)
    with pytest.raises(WorkbookError, match="check_examples=15 must be a multiple of 2 x 2"):
        launch(spec, tmp_path / "run")
    assert "check_examples=15" in (tmp_path / "run" / "launch-error.log").read_text()
    with pytest.raises(WorkbookError, match="already holds a run"):
        launch(spec, tmp_path / "run")  # the failed launch's folder is kept, not reused


def test_a_stuck_launch_is_killed_with_every_worker(tmp_path):
    spec = ReplicaSpec("tests.stuck_task:hung_rank", updates=2)
    start = time.monotonic()
    with pytest.raises(WorkbookError, match="did not finish within 10 s"):
        launch(spec, tmp_path / "run", timeout=10)
    assert time.monotonic() - start < 45
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True)
    assert not left.stdout.strip(), "a worker outlived the launch"


def test_processes_sharing_one_gpu_use_gloo_and_say_so(monkeypatch):
    import torch

    from workbook.replica import backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert backend("cuda", 2) == "gloo"
    line = check_devices("cuda", 2)
    assert "share 1 GPU" in line and "gloo" in line and "NCCL itself is not exercised" in line
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert backend("cuda", 2) == "nccl" and "NCCL" in check_devices("cuda", 2)
    assert backend("cpu", 2) == "gloo"
