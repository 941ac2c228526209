"""benchmarks/gpu_check.py stays runnable between GPU loans: its CPU half runs every section's
code, it refuses clearly without a GPU, and --prepare knows what the GPU image lacks. The first
two call its `main` in the test's process (a new interpreter would only import torch again);
--prepare runs it as the command it is."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_half_runs_every_section(gpu_check, tmp_path, capsys, monkeypatch):
    import pandas as pd

    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its sibling scripts, as when it is run
    kept = [x for name in ("display.width", "display.max_colwidth")  # main() sets both
            for x in (name, pd.get_option(name))]
    with pd.option_context(*kept):
        code = gpu_check.main(["--cpu-half", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    lines = out.splitlines()
    for section in ("env", "counter", "oom", "prediction", "speed"):
        assert any(line.startswith(f"[{section}] ok") for line in lines), section
    figures = dict(line.split(": ", 1) for line in lines if line.startswith("cpu_half_"))
    for name in ("counter_vs_allocator_pct", "prediction_max_abs_error_pct", "oom_recorded",
                 "speed_vs_catalog", "pilot_verdicts", "resume_exact"):
        assert f"cpu_half_{name}" in figures, name
    assert float(figures["cpu_half_prediction_max_abs_error_pct"]) < 5  # CPU: fake is exact
    assert (tmp_path / "prediction.csv").is_file() and (tmp_path / "figures.json").is_file()


def test_without_a_gpu_it_refuses_in_one_line(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().out.strip().splitlines() == [
        "error: no CUDA GPU is visible; fix: run it on a GPU machine (after --prepare's "
        "install line), or --cpu-half to exercise its code on the CPU"]


def test_prepare_carries_what_the_image_lacks_and_nothing_it_has():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    done = subprocess.run([sys.executable, str(SCRIPT), "--prepare", "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    carried = {item.split("==")[0] for item in done.stdout.split(": ", 1)[1].split(", ")}
    assert {"papermill", "nbclient", "ipykernel", "nbval", "pydantic", "trl"} <= carried
    assert not carried & {"torch", "transformers", "peft", "pandas", "numpy", "jinja2"}
