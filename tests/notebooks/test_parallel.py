"""Notebook 09: the loop on two processes under torchrun, the multi-host rules, and the planted
multi-process bugs each failing the rule meant to name it."""

import dataclasses
import json
import subprocess
import tempfile
import time
from itertools import zip_longest
from pathlib import Path

import pandas as pd
import pytest
import torch

from workbook import WorkbookError, load_task
from workbook.commands.pilot import run_pilot
from workbook.contract.data import load_examples, prepare, split_examples
from workbook.notebooks import parallel
from workbook.notebooks.parallel import faults as parallel_faults
from workbook.notebooks.parallel import rank_rules as parallel_rules
from workbook.notebooks.parallel.faults import (
    CAUGHT_BY,
    NOT_DEMONSTRABLE,
    demonstration,
    planted_faults,
)
from workbook.notebooks.parallel.launches import check_devices, launch, launch_in_turn
from workbook.notebooks.parallel.rank_rules import RULES
from workbook.storage.artifacts import read_json
from workbook.training.loop import UpdateShape
from workbook.training.replica import (
    FAULTS,
    RESULT,
    ReplicaSpec,
    _artifact,
    check_items,
    example_targets,
    rank_evaluation,
    shard,
    update_groups,
)

from ..conftest import CLASSIFICATION, GENERATION


def summary(run):
    return json.loads((run / "09_data_parallel" / "summary.json").read_text())


@pytest.mark.slow  # nbval runs 09 (every rule, FSDP too) on the generation sample
def test_pilot_smoke_09_passes_and_lists_every_rule(tmp_path):
    # the FSDP launches are left out here (35 s): nbval runs 09 with them on the generation
    # sample, test_conventions on a tied, shifted model, and test_fsdp's slow tests plant both
    # faults; this run checks the data-parallel rules and that fsdp=false is honoured
    run, index = run_pilot(GENERATION, out=str(tmp_path / "run"), smoke=True, only="09",
                           progress=False, params={"fsdp": False})
    assert index.verdict.tolist() == ["pass"], index.error.tolist()
    figures, rules = summary(run)["figures"], summary(run)["rules"]
    assert set(rules) == set(RULES)
    assert rules["batch-norm statistics synchronised"] == "not applicable"  # no batch norm
    assert {v for k, v in rules.items() if k != "batch-norm statistics synchronised"} == {"pass"}
    assert max(figures["gradient_max_relative_deviation"].values()) < 1e-4
    assert not figures.get("fsdp") and not (run / "09_data_parallel" / "fsdp").exists()
    report = (run / "report.html").read_text()
    assert "Multi-host rules" in report and "only rank 0 writes" in report
    assert "Rules under FSDP2 sharding" not in report
    assert report.count(">not applicable<") == 1, "a verdict the CSV round trip must keep"


@pytest.mark.slow  # 74 s; nbval's 09 plants every fault that applies to the generation sample
def test_each_planted_multi_process_bug_fails_its_rule(tmp_path):
    """The classification sample with batch norm, so every planted bug applies. The notebook's
    own calls (`run`, `save`) without a kernel: the pilot's path is the smoke test's."""
    from workbook.commands import params

    p = params.of("09_data_parallel", small=True, task=CLASSIFICATION,
                  task_options={"batch_norm": "batch"}, demonstrate_faults=True)
    out = tmp_path / "09_data_parallel"
    assert parallel.save(parallel.run(p, out), out) == "pass"
    figures, rules = summary(tmp_path)["figures"], summary(tmp_path)["rules"]
    assert rules["batch-norm statistics synchronised"] == "pass"
    assert rules["resume in new processes is exact"] == "pass"
    assert figures["faults_caught"] == {FAULTS[f]: True for f in FAULTS}
    assert figures["faults_not_demonstrable"] == {}
    rows = json.loads((out / "planted_faults.json").read_text())
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


def test_the_write_audit_sees_what_this_process_wrote_under_its_folder_only(tmp_path):
    """The one audit of both launches (DDP names artifacts, FSDP a folder's final files)."""
    from workbook.training.ranks import WriteAudit

    (tmp_path / "out").mkdir()
    (tmp_path / "read.txt").write_text("x")
    audit = WriteAudit(tmp_path / "out")
    (tmp_path / "out" / "ckpt").mkdir()
    (tmp_path / "out" / "ckpt" / "a.distcp.tmp").write_text("x")
    (tmp_path / "out" / "ckpt" / "a.distcp.tmp").rename(tmp_path / "out" / "ckpt" / "a.distcp")
    (tmp_path / "read.txt").read_text()
    (tmp_path / "elsewhere.txt").write_text("x")
    assert audit.paths == {"ckpt", "ckpt/a.distcp.tmp", "ckpt/a.distcp"}
    assert audit.under("ckpt") == ["a.distcp"]
    assert {_artifact(p) for p in audit.paths} == {"ckpt"}


@pytest.mark.twin
def test_a_hand_written_tasks_metrics_are_means_over_rows_whatever_its_step_carries(
        gen_task, gen_items):
    """How a metric is reduced over ranks is declared on the task (`Task.framework`, which the
    adapters fill): a hand-written task declares none, so each of its metrics is a mean over
    rows, and an attribute set on its eval_step declares nothing."""
    def own_eval(model, batch):
        weight = batch.get("example_weight")
        rows = float(weight.sum()) if weight is not None else float(len(batch["labels"]))
        return {"seen": (rows, rows)}  # 1 over rows; 2 if the two ranks' values were added

    own_eval.metric_reductions = {"seen": "sum"}  # a fact passed on the side: never read
    task = dataclasses.replace(gen_task, eval_step=own_eval)
    model = task.build_model()
    ranks = [rank_evaluation(task, model, gen_items["validation"][r::2], 4, torch.device("cpu"))
             for r in range(2)]
    assert [r["reductions"] for r in ranks] == [{}, {}]
    assert parallel_rules.reduced_values({"ranks": ranks, "single": None})["seen"] == 1.0


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(WorkbookError, match="2 or more"):
        check_devices("cpu", 1)
    with pytest.raises(WorkbookError, match="'cpu' \\(gloo\\) or 'cuda'"):
        check_devices("tpu", 2)
    with pytest.raises(WorkbookError, match="field 'replica' is not a field of the replica "
                       "settings"):
        ReplicaSpec.from_dict({"task": GENERATION, "replica": 2})
    with pytest.raises(WorkbookError, match="field 'task' is missing"):
        ReplicaSpec.from_dict({"updates": 2})
    with pytest.raises(WorkbookError, match="unknown planted fault"):
        ReplicaSpec.from_dict({"task": GENERATION, "fault": "nope"})
    with pytest.raises(WorkbookError, match="field 'micro_batch' is not a field of the replica"):
        ReplicaSpec.from_dict({"task": GENERATION, "micro_batch": 2})  # the shape is one field
    with pytest.raises(WorkbookError, match="field 'shape.world' is not a field of the replica"):
        ReplicaSpec.from_dict({"task": GENERATION, "shape": {"micro_batch": 2, "world": 2}})
    spec = ReplicaSpec(GENERATION, shape=UpdateShape(4, 1, replicas=3))
    assert ReplicaSpec.from_dict(dataclasses.asdict(spec)) == spec
    from workbook.training.replica import main as replica_main
    from workbook.training.replica import read_spec

    with pytest.raises(WorkbookError, match="--spec is not JSON"):
        read_spec("{task: x}")
    for bad, message in (("[1, 2]", "replica settings should be a valid dictionary"),
                         ('{"updates": 3}', "field 'task' is missing")):
        with pytest.raises(WorkbookError, match=message):
            replica_main(read_spec(bad), "unused", None)


def test_runs_in_turn_name_the_one_that_failed(tmp_path, monkeypatch):
    """09's resume and planted faults run in turn in one launch (`--then`): the error's log goes
    to the first run without a result, the runs before it keep theirs. A real launch whose
    last run fails is `in_turn`'s (test_a_worker_error_comes_back_with_its_message); here, a
    run between others, torchrun is replaced by what it leaves."""
    from workbook.notebooks.parallel import launches

    runs = [(ReplicaSpec(GENERATION, fault=fault), tmp_path / name) for fault, name in (
        ("", "resumed"), ("rank_seed", "fault-rank_seed"), ("same_order", "fault-same_order"))]

    def torchrun(args, timeout, what, launcher):
        assert args.count("--then") == 2 and args[args.index("--then") + 2] == str(runs[1][1])
        (runs[0][1] / "result.json").write_text("{}")  # the first run finished
        return subprocess.CompletedProcess(args, 1, "", "error: the second run failed")

    monkeypatch.setattr(launches, "fresh_process", torchrun)
    with pytest.raises(WorkbookError, match="launch failed \\(exit 1\\): the second run failed"):
        launch_in_turn(runs)
    assert [(folder / "launch-error.log").exists() for _, folder in runs] == [False, True, False]
    with pytest.raises(WorkbookError, match="differ in replicas, device or collective timeout"):
        launch_in_turn([runs[0], (ReplicaSpec(GENERATION, shape=UpdateShape(2, 2, replicas=3)),
                                  tmp_path / "three")])


@pytest.fixture(scope="module")
def in_turn(tmp_path_factory):
    """Three tests' runs in one launch, in turn as 09's planted faults run (one start of the
    processes): a task whose optimizer reaches into the model by position, then the per-rank
    mean planted on data whose default check examples hold equal targets, then a run whose
    workers raise (the launch fails; the runs before it keep their results)."""
    folder = tmp_path_factory.mktemp("in_turn")
    data = equal_shares_data(folder / "equal.jsonl")
    task, items = _task_and_items(data)
    spec = ReplicaSpec(GENERATION, {"data_file": data}, updates=2)
    demos = parallel_faults.demonstrations(spec, items, None, ("rank_mean_loss",), task)
    careful = ReplicaSpec("tests.careful_task:task", {"head_lr_groups": True},
                          UpdateShape(2, 2, replicas=2), updates=2, validation_limit=8)
    failing = (ReplicaSpec(GENERATION, check_examples=15, updates=2), folder / "failing")
    runs = [(careful, folder / "careful"), *parallel_faults.planted_runs(demos, folder), failing]
    before = torchrun_temp_folders()
    with pytest.raises(WorkbookError) as failed:
        launch_in_turn(runs)
    careful_run, *planted = [read_json(out / RESULT, "a result") for _, out in runs[:-1]]
    table = parallel_faults.fault_table(demos, planted, ("rank_mean_loss",), task)
    return {"careful": careful_run, "logs_left": torchrun_temp_folders() - before,
            "task": task, "items": items, "faults": table, "failed": failed.value,
            "failing": failing}


def test_a_worker_error_comes_back_with_its_message(in_turn):
    """The last run of the launch raises in its workers: the error's message comes back, its
    log goes to that run's folder (the runs before it keep theirs, read above), and the folder
    is kept, not reused."""
    spec, folder = in_turn["failing"]
    assert "check_examples=15 must be a multiple of 2 x 2" in in_turn["failed"].problem
    assert "check_examples=15" in (folder / "launch-error.log").read_text()
    assert [p.name for p in folder.parent.glob("*/launch-error.log")] == ["launch-error.log"]
    with pytest.raises(WorkbookError, match="already holds a run"):
        launch(spec, folder)


def test_build_optimizer_gets_the_module_02_07_get_not_the_ddp_wrapper(in_turn):
    """A task whose optimizer reaches into the model by position (a head at its own rate):
    the DistributedDataParallel wrapper has no `[-1]`, so handing it over failed every rank."""
    result = in_turn["careful"]
    assert [[r["step"] for r in rank["records"]] for rank in result["ranks"]] == [[1, 2]] * 2
    assert not in_turn["logs_left"], "torchrun left its log folder behind"


def torchrun_temp_folders() -> set[Path]:
    """torchrun's default log folders in the temp folder (one per launch, never removed; the
    launch's own `workbook-torchrun-*` goes with it, and another test's may be live now)."""
    return set(Path(tempfile.gettempdir()).glob("torchelastic_*"))


def test_a_stuck_launch_is_killed_with_every_worker(tmp_path):
    """A limit short of the launch (the hung rank never loads its data) stops torchrun and both
    workers, seen alive during the launch: a worker's SIGTERM kills it wherever it is (no
    handler), so the limit need only come after the workers start, not at their hang (8 s; on
    a machine so busy that they had not both started by then, once more at 30 s)."""
    import threading

    import psutil

    spec = ReplicaSpec("tests.stuck_task:hung_rank", updates=2)
    before = torchrun_temp_folders()

    def killed_launch(limit: int, run: Path) -> dict:
        workers, launched = {}, threading.Event()

        def watch():  # the workers (`workbook ddp --out RUN`, not torchrun's) while it runs
            while not launched.is_set():
                for proc in psutil.process_iter(["cmdline"]):
                    line = proc.info["cmdline"] or []
                    if str(run) in line and "torch.distributed.run" not in line:
                        workers.setdefault(proc.pid, proc)
                launched.wait(0.5)

        watcher = threading.Thread(target=watch)
        watcher.start()
        start = time.monotonic()
        try:
            with pytest.raises(WorkbookError, match=f"did not finish within {limit} s"):
                launch(spec, run, timeout=limit)
        finally:
            launched.set()
            watcher.join()
        assert time.monotonic() - start < limit + 32
        _, alive = psutil.wait_procs(list(workers.values()), timeout=5)
        assert not alive, "a worker outlived the launch"
        return workers

    workers = killed_launch(8, tmp_path / "run")
    if len(workers) < 2:
        workers = killed_launch(30, tmp_path / "run-30")
    assert len(workers) == 2, "the limit came before both workers started: raise it"
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert not left.stdout.strip(), "a process of the launch outlived it"
    assert torchrun_temp_folders() <= before, "the killed launch left its log folder behind"


def test_processes_sharing_one_gpu_use_gloo_and_say_so(monkeypatch):
    import torch

    from workbook.training.ranks import backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert backend("cuda", 2) == "gloo"
    line = check_devices("cuda", 2)
    assert "share 1 GPU" in line and "gloo" in line and "NCCL itself is not exercised" in line
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert backend("cuda", 2) == "nccl" and "NCCL" in check_devices("cuda", 2)
    assert backend("cpu", 2) == "gloo"


# --- planted faults on data that can show them -----------------------------------------------
def equal_shares_data(path):
    """The generation sample's own examples, reordered so that the gradient check's default
    partial case - the first 15 training examples, example i on rank i % 2 - gives both ranks
    56 targets (8 x 7 and 14 + 10 + 10 + 7 + 5 + 5 + 5): a per-rank mean cannot show there."""
    task = load_task(GENERATION)
    examples = load_examples(task)
    by_count = {}
    for ex in split_examples(task, examples)["train"]:
        by_count.setdefault(task.target_count(task.encode(ex)["labels"]), []).append(ex)
    rank0, rank1 = by_count[7][:8], [by_count[c].pop() for c in (14, 10, 10, 7, 5, 5, 5)]
    first = [ex for pair in zip_longest(rank0, rank1) for ex in pair if ex is not None]
    ids = {ex["id"] for ex in first}
    rows = first + [ex for ex in examples if ex["id"] not in ids]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def identical_data(path, n=80):
    """One example repeated under n ids and conversations: every share has the same mean."""
    rows = [{"conversation": f"conv{i}", "id": f"same-{i}", "instruction": "repeat: fosadu",
             "response": "fosadu fosadu"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _task_and_items(data_file, limit=32):
    task = load_task(GENERATION, data_file=data_file)
    return task, prepare(task, ("train",), {"train": limit}).train


def _partial_shares(task, items, world=2):
    return [sum(example_targets(task, it) for it in items[r::world]) for r in range(world)]


def test_a_per_rank_mean_is_caught_where_the_default_examples_hold_equal_targets(in_turn):
    """The user's case: the first 15 examples give each rank the same targets, so the check
    picks others (the same 16, two swapped across ranks) and the planted bug is caught."""
    task, items = in_turn["task"], in_turn["items"]
    assert _partial_shares(task, items[:15]) == [56, 56], "the default would hide the bug"
    chosen = check_items(task, items, 16, 2)
    assert len(set(_partial_shares(task, chosen[:15]))) == 2
    assert {it.id for it in chosen} == {it.id for it in items[:16]}
    table = in_turn["faults"]
    assert table.caught.tolist() == [True] and table.verdict.tolist() == ["fail"], table.measured
    assert "targets per rank [56, 56]" not in table.measured[0]


def test_a_fault_no_data_of_the_task_can_show_is_not_demonstrable_and_fails_nothing(tmp_path):
    """Identical examples: every share has the same mean gradient, so a per-rank mean gives
    the right gradient whatever is chosen; a model initialised without randomness cannot show
    a seed per rank; batch-norm statistics that agree over ranks cannot show whose were saved.
    Each says why, no launch runs, and the verdict still passes."""
    task, items = _task_and_items(identical_data(tmp_path / "same.jsonl"))
    spec = ReplicaSpec(GENERATION, {"data_file": str(tmp_path / "same.jsonl")})

    def fixed_init():
        model = task.build_model()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.01)
        return model
    fixed = dataclasses.replace(task, build_model=fixed_init)
    agreeing = {"batch_norm_final": {"layers": 1, "ranks_differed_by": 0.0,
                                     "rank0_vs_rank_mean": 0.0}}
    faults = pd.concat([planted_faults(spec, items, tmp_path, None, ("rank_mean_loss",), task),
                        planted_faults(spec, items, tmp_path, None, ("rank_seed",), fixed),
                        planted_faults(spec, items, tmp_path, agreeing, ("bn_rank0",), task)],
                       ignore_index=True)
    assert faults.verdict.tolist() == ["not demonstrable"] * 3
    assert faults.caught.tolist() == [None] * 3
    assert all(m.startswith(NOT_DEMONSTRABLE) for m in faults.measured)
    assert "same mean gradient per target" in faults.measured[0]
    assert "bit-identical parameters" in faults.measured[1]
    assert not list(tmp_path.glob("fault-*")), "nothing was launched"
    clean = pd.DataFrame({"rule": list(RULES), "verdict": "pass"})
    assert parallel.outcome(clean, faults) == "pass"
    missed = pd.concat([faults, pd.DataFrame([{"planted bug": "x", "caught": False}])])
    assert parallel.outcome(clean, missed) == "fail", "a missed bug still fails"


def test_order_and_writer_demonstrations_pick_settings_that_show_their_fault():
    """10 updates of 8 examples over 3,500 training examples never reach a second pass: the
    order bug is planted on the most examples that still let every rank read one (72); a run
    without a checkpoint gets one, so a second writer shows."""
    items = list(range(3500))  # demonstration only counts them
    spec = ReplicaSpec(GENERATION, shape=UpdateShape(2, 2, replicas=2), updates=10,
                       train_limit=0, checkpoint_at=0)
    demo = demonstration("fixed_order", spec, items)
    assert not demo.why and demo.spec.train_limit == len(demo.items) == 72
    assert demo.spec.check_examples == 16 and demo.spec.fault == "fixed_order"
    assert all(1 in p for p in parallel_faults._passes_read(72, demo.spec, 2))
    assert not all(1 in p for p in parallel_faults._passes_read(73, demo.spec, 2))
    assert demonstration("fixed_order", spec, items[:40]).spec.train_limit == 0, "kept"
    short = ReplicaSpec(GENERATION, shape=UpdateShape(1, 1, replicas=2), updates=2)
    assert "raise updates" in demonstration("fixed_order", short, items).why
    assert demonstration("all_ranks_write", spec, items).spec.checkpoint_at == 1


def test_overlapping_shards_fail_before_the_first_pass_ends():
    def result(ids_per_rank):
        return {"ranks": [{"records": [{"epoch": 0, "ids": ids}]} for ids in ids_per_rank],
                "first_step": 1, "train_ids": [str(i) for i in range(100)],
                "spec": {"drop_partial": False}}
    same = parallel_rules._shard_rows(result([["1", "2"], ["1", "2"]]))[0]
    assert same["verdict"] == "fail" and "coverage not checked" in same["measured"]
    apart = parallel_rules._shard_rows(result([["1", "2"], ["3", "4"]]))[0]
    assert apart["verdict"] == "not applicable"


def test_the_rented_command_runs_the_rules_at_the_rentals_scale_and_parses_back():
    import json
    import shlex

    from workbook.notebooks.parallel.launches import rented_spec, shell_command
    from workbook.training.replica import ReplicaSpec

    line = shell_command(rented_spec(ReplicaSpec("workbook.samples.generation:task")))
    words = shlex.split(line)
    spec = ReplicaSpec.from_dict(json.loads(words[words.index("--spec") + 1]))
    assert "--nproc_per_node=8" in words and spec.device == "cuda"
    assert (spec.shape.precision, spec.shape.replicas, spec.updates) == ("bf16", 8, 100)
    assert (spec.train_limit, spec.validation_limit, spec.checkpoint_at) == (0, 0, 50)
