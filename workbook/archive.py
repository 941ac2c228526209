"""The archive at the end of a campaign: weights, configuration, code revision, environment,
raw metrics, procedure, and the outputs on a fixed set of control inputs - so that a fresh
process can reload it and check that it reproduces them."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from .checkpoint import MANIFEST, _sha256, verify
from .data import Item, collate_items, encode_examples, load_examples, split_examples
from .errors import WorkbookError
from .runs import fresh_process
from .task import Task, load_task


def code_revision(root: Path | None = None) -> dict:
    """The git commit of the code and whether the tree had uncommitted changes."""
    root = root or Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True, timeout=60).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=root, timeout=60,
                                    capture_output=True, text=True, check=True).stdout.strip())
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None, "note": "not a git checkout"}


def environment(device: torch.device) -> dict:
    return {"torch": torch.__version__, "python": sys.version.split()[0],
            "platform": platform.platform(), "device": str(device),
            "cuda": torch.version.cuda if torch.cuda.is_available() else None,
            "threads": torch.get_num_threads()}


def control_items(task: Task, n: int) -> list[Item]:
    """The control inputs: the first n validation examples (fixed by the split rule)."""
    rows = split_examples(task, load_examples(task))["validation"][:n]
    return encode_examples(task, rows)


@torch.no_grad()
def control_outputs(task: Task, model: torch.nn.Module, items: list[Item]) -> torch.Tensor:
    model.eval()
    device = next(model.parameters()).device
    return task.forward(model, collate_items(task, items).to(device).tensors).float().cpu()


def write_archive(path: str | Path, task_path: str, task_options: dict, model: torch.nn.Module,
                  config: dict, metrics: pd.DataFrame, procedure: list[str],
                  controls: int = 8) -> Path:
    """Write the archive folder atomically (never over an existing one)."""
    path = Path(path)
    if path.exists():
        raise WorkbookError(f"archive {path} already exists", "archive into a new folder")
    task = load_task(task_path, **task_options)
    items = control_items(task, controls)
    outputs = control_outputs(task, model, items)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        save_model(model, str(tmp / "model.safetensors"))
        save_file({"logits": outputs.contiguous()}, str(tmp / "control_outputs.safetensors"))
        files = {
            "config.json": {"task": task_path, "task_options": task_options, "train": config,
                            "task_name": task.name},
            "revision.json": code_revision(),
            "environment.json": environment(next(model.parameters()).device),
            "control_inputs.json": [str(it.id) for it in items],
        }
        for name, data in files.items():
            (tmp / name).write_text(json.dumps(data, indent=1, default=str))
        metrics.to_csv(tmp / "metrics.csv", index=False)
        (tmp / "procedure.md").write_text("# Procedure\n\n" + "".join(
            f"    {line}\n" for line in procedure))
        (tmp / MANIFEST).write_text(json.dumps({f.name: _sha256(f) for f in
                                                sorted(tmp.iterdir())}, indent=1))
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def reload_archive(path: str | Path) -> dict:
    """Verify the manifest, rebuild the model from the archived configuration, load the
    weights (safetensors: no code runs) and re-run the control inputs."""
    path = Path(path)
    verify(path)
    config = json.loads((path / "config.json").read_text())
    task = load_task(config["task"], **config["task_options"])
    model = task.build_model()
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise WorkbookError(f"archive {path} does not fit the task's model",
                            "reload it with the task and options it was archived with")
    ids = json.loads((path / "control_inputs.json").read_text())
    items = [it for it in control_items(task, len(ids))]
    if [str(it.id) for it in items] != ids:
        raise WorkbookError("the control inputs are no longer the same examples",
                            "reload with the data the archive was made from")
    stored = load_file(str(path / "control_outputs.safetensors"))["logits"]
    fresh = control_outputs(task, model, items)
    diff = float((stored - fresh).abs().max())
    return {"identical": bool(torch.equal(stored, fresh)), "max_abs_diff": diff,
            "control_inputs": len(ids), "revision": json.loads(
                (path / "revision.json").read_text())}


def reload_in_new_process(path: str | Path, timeout: float = 600) -> dict:
    """`python -m workbook reload --archive PATH` in a fresh process: its result, or
    `identical: False` with the error when it failed."""
    done = fresh_process(["reload", "--archive", str(path)], timeout, "the reload")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"identical": False, "error": done.stderr.strip()[-600:]}
