"""Notebook 08's launch files: the SkyPilot YAML loads with SkyPilot's own parser (offline,
when the `launch` extra is installed), the torchrun script passes `bash -n` and carries every
checked setting, a multi-node FSDP plan asks for whole nodes, and a plan the pilot could not
verify gets no file and says why."""

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import yaml

from workbook.commands import params
from workbook.notebooks import rental
from workbook.notebooks.rental import launch_files

CHECKED = {"MICRO_BATCH": "micro_batch", "ACCUMULATION": "accumulation",
           "PRECISION": "precision", "ACTIVATION_CHECKPOINTING": "activation_checkpointing",
           "LEARNING_RATE": "learning_rate", "CHECKPOINT_EVERY": "checkpoint_every",
           "RESUME_FROM": "resume_from"}


def _passed(run_dir, stem, figures=None):
    (run_dir / stem).mkdir(parents=True, exist_ok=True)
    (run_dir / stem / "summary.json").write_text(json.dumps({"verdict": "pass",
                                                              "figures": figures or {}}))


LAUNCH_PYTHON = Path(__file__).resolve().parents[2] / ".venv-launch" / "bin" / "python"
SKY_READ = """import json, sys
import sky
for path in sys.argv[1:]:
    task = sky.Task.from_yaml(path)
    print(json.dumps({"num_nodes": task.num_nodes, "envs": dict(task.envs),
                      "accelerators": [r.accelerators for r in task.resources],
                      "use_spot": [r.use_spot for r in task.resources]}))
"""


def _sky_tasks(*paths):
    """The tasks SkyPilot's own parser reads from `paths` (`sky.Task.from_yaml`, offline), in
    the venv `make install` gives it (.venv-launch: skypilot pins a click the hf extra
    refuses); one process for all (importing sky takes seconds)."""
    if not LAUNCH_PYTHON.exists():
        pytest.skip("no .venv-launch with skypilot: `make install` creates it")
    done = subprocess.run([str(LAUNCH_PYTHON), "-c", SKY_READ, *map(str, paths)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"SkyPilot refused one of {paths}:\n{done.stderr[-2000:]}"
    read = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(read) == len(paths), done.stdout[-2000:]
    return [SimpleNamespace(**json.loads(line)) for line in read]


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """08 on the built-in sample, after a study and a resume that passed; its folder and
    result. Without the sample's campaign model: its FSDP sizing (test_rental.py's) would
    take most of this test's time and adds no launch file here."""
    run = tmp_path_factory.mktemp("run")
    out = run / "08_rental_plan"
    out.mkdir()
    _passed(run, "07_resume_reload")  # a verified resume: spot too
    _passed(run, "06_lr_study", {"supported_lr": 3e-4, "best_lr": 3e-4, "control_lr": 1e-4,
                                 "conclusive": True, "seeds": 1, "trials": 3})
    p = params.of("08_rental_plan", small=True, train_limit=20,
                  task_options={"campaign_layers": 0},
                  gpus={"L4": 24, "A100-80GB": 80}, gpu_tflops={"L4": 121, "A100-80GB": 312},
                  candidates=[{"name": "control", "micro_batch": 16, "accumulation": 2}],
                  variants=[{"name": "control", "priority": 1, "candidate": "control",
                             "repeats": 3, "lr": "study"}])
    result = rental.run(p, out)
    assert rental.save(result, out) == "pass"
    return out, result


def test_the_sample_plan_launches_with_every_checked_setting(sample):
    out, result = sample
    index = json.loads((out / "launch" / "index.json").read_text())
    assert index["entry_point_is_placeholder"] and not index["not_written"]
    names = [plan["name"] for plan in index["plans"]]
    assert names[0] == "recommended" and len(names) == 1 + len(
        result.plans.drop_duplicates(["variant", "gpu"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["figures"]["launch"].startswith(f"written for {len(names)} plans")
    for plan in index["plans"]:
        files = {k: out / v for k, v in plan["files"].items()}
        assert set(files) == {"sky", "sky_spot", "torchrun", "settings"}, files
        settings = json.loads(files["settings"].read_text())
        script = files["torchrun"].read_text()
        assert subprocess.run(["bash", "-n", str(files["torchrun"])],
                              capture_output=True).returncode == 0, script
        for env, key in CHECKED.items():
            value = launch_files.shown(settings[key])
            assert value and f"export {env}={value}" in script, (env, script)
        assert "train.py is a placeholder" in script
        assert f"--nproc_per_node={settings['gpus']}" in script
        for kind, spot in (("sky", False), ("sky_spot", True)):
            task = yaml.safe_load(files[kind].read_text())
            assert task["resources"]["use_spot"] is spot
            assert task["resources"]["accelerators"] == f"{plan['gpu']}:{plan['gpus']}"
            assert {k: task["envs"][k] for k in CHECKED} == \
                {k: launch_files.shown(settings[v]) for k, v in CHECKED.items()}
            assert "SKYPILOT_NODE_RANK" in task["run"] and "torch==" in task["setup"]
    recommended = json.loads((out / "launch/recommended/settings.json").read_text())
    assert recommended["learning_rate"] == 3e-4 and recommended["learning_rate_from"] == \
        "06's study"


def test_the_sample_plan_loads_with_skypilots_parser(sample):
    out, _ = sample
    paths = sorted((out / "launch").glob("*/sky*.yaml"))
    assert len(paths) >= 4
    # SkyPilot's parser; nothing contacts a cloud
    for path, task in zip(paths, _sky_tasks(*paths), strict=True):
        assert task.num_nodes == 1 and task.envs["PRECISION"] == "bf16", path


def _fsdp_sheet(fits=True):
    return pd.DataFrame([{
        "candidate": "sharded", "gpu": "A100-40GB", "fits": fits, "gpus": 16, "nodes": 2,
        "strategy": "FSDP2 full sharding x16 (2 nodes of 8)", "precision": "bf16",
        "micro_batch": 1, "accumulation": 2, "activation_checkpointing": True,
        "examples_per_update": 32, "max_length": 4096, "required_gib": 37.5,
        "budget_hours": 30.0, "spot_cost": None}])


def _launches(run_dir, sheet):
    plans = pd.DataFrame([{"variant": "control", "candidate": "sharded", "gpu": "A100-40GB",
                           "lr": 1e-4, "lr_from": "06's control"}])
    options = pd.DataFrame([{"candidate": "sharded", "cheapest_gpu": "A100-40GB"}])
    return launch_files.launches(
        sheet, plans, {"candidate": "sharded"}, options, {"lr": 2e-4},
        {"updates": 100, "eval_every": 10, "checkpoint_every": 10, "seed": 0,
         "parameters": 7_000_000_000}, ["torch==2.6.0"], run_dir)


def test_a_multi_node_fsdp_plan_asks_for_whole_nodes_and_no_spot_without_a_resume(tmp_path):
    plans, refused = _launches(tmp_path, _fsdp_sheet())
    assert not refused and [p.name for p in plans] == ["recommended", "control-A100-40GB"]
    index = launch_files.write(tmp_path, plans, refused, "src/train.py")
    first = index["plans"][0]
    assert set(first["files"]) == {"sky", "torchrun", "settings"}, "07 did not run: no spot"
    task = yaml.safe_load((tmp_path / first["files"]["sky"]).read_text())
    assert task["num_nodes"] == 2 and task["resources"]["accelerators"] == "A100:8", \
        "SkyPilot's name for the 40 GB A100, per node"
    assert task["resources"]["disk_size"] >= 3 * 16 * 7 + 100
    assert task["envs"]["LEARNING_RATE"] == "0.0002" and task["envs"]["ENTRY_POINT"] == \
        "src/train.py"
    script = (tmp_path / first["files"]["torchrun"]).read_text()
    assert "--nnodes=2 --nproc_per_node=8" in script and "placeholder" not in script
    sky_task, = _sky_tasks(tmp_path / first["files"]["sky"])
    assert sky_task.num_nodes == 2


def test_a_plan_the_pilot_could_not_verify_writes_no_launch_file_and_says_why(tmp_path):
    (tmp_path / "02_overfit").mkdir()
    (tmp_path / "02_overfit" / "summary.json").write_text(json.dumps(
        {"verdict": "error", "error": "RuntimeError: planted"}))
    plans, refused = _launches(tmp_path, _fsdp_sheet())
    assert plans == [] and "notebook 02 (overfit) ended with error" in refused["every plan"]
    index = launch_files.write(tmp_path, plans, refused, launch_files.PLACEHOLDER)
    assert [p.name for p in (tmp_path / "launch").iterdir()] == ["index.json"]
    assert "not written, notebook 02" in launch_files.words(index)
    # the clean twin passes; a plan that does not fit its GPU is refused alone
    shutil.rmtree(tmp_path / "02_overfit")
    plans, refused = _launches(tmp_path, _fsdp_sheet(fits=False))
    assert plans == [] and refused == {
        "recommended": "candidate sharded does not fit the A100-40GB",
        "control-A100-40GB": "candidate sharded does not fit the A100-40GB"}
