"""The archive at the end of a campaign: weights, configuration, code revision, environment,
raw metrics, procedure, and the outputs on a fixed set of control inputs - so that a fresh
process can reload it and check that it reproduces them."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model

from ...base.errors import WorkbookError
from ...contract import fine_tuning
from ...contract.data import Item, collate_items, prepare
from ...contract.outputs import eval_mode
from ...contract.task import Task, load_recorded_task, load_task
from ...storage import schemas
from ...storage.artifacts import read_json, verify, write_folder
from ...storage.files import read_plain
from ...storage.processes import fresh_result, outcome_error, task_args
from ...training import checkpoint as ckpt
from ...training.checkpoint import WEIGHTS, load_weights
from ...training.loop import seed_everything

CONFIG = "config.json"
CONTROL_OUTPUTS = "control_outputs.safetensors"


def code_revision(root: Path | None = None) -> dict:
    """The git commit of the code and whether the tree had uncommitted changes."""
    root = root or Path(__file__).resolve().parents[3]  # the checkout
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


CONTROL_SEED = 0  # the random streams an encode draws from while the control inputs are made


def control_items(task: Task, n: int) -> list[Item]:
    """The control inputs: the first n validation examples (fixed by the split rule), encoded
    from seeded random streams (an encode with random augmentation gives the same inputs in
    every process); this process's random state is left as it was."""
    state = ckpt.rng_state()
    try:
        seed_everything(CONTROL_SEED)
        return prepare(task, ("validation",), {"validation": n}).validation
    finally:
        ckpt.set_rng_state(state)


def control_outputs(task: Task, model: torch.nn.Module, items: list[Item]) -> torch.Tensor:
    """The model's outputs on the control inputs, in eval mode (the mode is restored)."""
    device = next(model.parameters()).device
    with eval_mode(model):
        return task.forward(model, collate_items(task, items).to(device).tensors).float().cpu()


def write_archive(path: str | Path, task_path: str, task_options: dict, model: torch.nn.Module,
                  config: dict, metrics: pd.DataFrame, procedure: list[str],
                  controls: int = 8) -> Path:
    """Write the archive folder atomically (never over an existing one)."""
    task = load_task(task_path, **task_options)
    items = control_items(task, controls)
    outputs = control_outputs(task, model, items)

    def fill(tmp: Path) -> None:
        # a fine-tune's archive holds its adapters, reloaded onto the base the task loads
        if fine_tuning.saves_adapters(model):
            save_file(fine_tuning.adapter_state(model), str(tmp / fine_tuning.ADAPTERS))
        else:
            save_model(model, str(tmp / WEIGHTS))
        save_file({"logits": outputs.contiguous()}, str(tmp / CONTROL_OUTPUTS))
        files = {
            CONFIG: {"task": task_path, "task_options": task_options, "train": config,
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

    return write_folder(path, fill, "archive")


def reload_archive(path: str | Path, task: str | None, task_options: dict | None = None) -> dict:
    """Verify the manifest, rebuild the model of the task the caller names (it must be the one
    the archive records; nothing recorded is imported), load the weights (safetensors: no code
    runs) and re-run the control inputs."""
    path = Path(path)
    verify(path, "archive")
    fix = "the archive is damaged or was edited; use an intact copy"
    config = read_json(path / CONFIG, "archive configuration")
    schemas.check(schemas.ArchiveConfig, config, path / CONFIG, "archive configuration", fix)
    revision = read_json(path / "revision.json", "code revision")
    schemas.check(schemas.Revision, revision, path / "revision.json", "code revision", fix)
    loaded = load_recorded_task(config, task, task_options, f"archive {path}")
    model = loaded.build_model()
    if (path / fine_tuning.ADAPTERS).exists():
        fine_tuning.load_adapters(model, path / fine_tuning.ADAPTERS)
    else:
        load_weights(model, path / WEIGHTS, "archive")
    ids = read_json_list(path / "control_inputs.json")
    items = control_items(loaded, len(ids))
    if [str(it.id) for it in items] != ids:
        raise WorkbookError("the control inputs are no longer the same examples",
                            "reload with the data the archive was made from")
    try:
        tensors = load_file(str(path / CONTROL_OUTPUTS))
    except (SafetensorError, OSError) as exc:
        raise WorkbookError(f"{path / CONTROL_OUTPUTS} cannot be read ({exc})",
                            "the archive is damaged; use an intact copy") from None
    fresh = control_outputs(loaded, model, items)
    if set(tensors) != {"logits"}:
        raise WorkbookError(f"{path / CONTROL_OUTPUTS} holds the tensors {sorted(tensors)[:5]}, "
                            "not the one 'logits' the workbook writes", fix)
    stored = tensors["logits"]
    why = schemas.tensor_mismatch("its tensor 'logits'", (stored.dtype, stored.shape), fresh,
                                  "the fresh outputs'")
    if why:
        raise WorkbookError(f"{path / CONTROL_OUTPUTS} does not hold the control outputs of "
                            f"this model on {len(ids)} inputs: {why}", fix)
    diff = float((stored - fresh).abs().max()) if stored.numel() else 0.0
    return {"identical": bool(torch.equal(stored, fresh)), "max_abs_diff": diff,
            "control_inputs": len(ids), "revision": revision}


def read_json_list(path: Path) -> list[str]:
    """The control inputs' example ids (a list of strings), parsed bounded and checked."""
    fix = "use an intact archive"
    data = schemas.parse_json(read_plain(path, "control inputs", fix), path, "control inputs",
                              fix)
    schemas.check(schemas.ControlInputs, {"ids": data}, path, "list of control inputs", fix)
    return data


def reload_in_new_process(path: str | Path, task: str, task_options: dict | None = None,
                          timeout: float = 600) -> dict:
    """`python -m workbook reload --archive PATH --task TASK` in a fresh process: the result it
    hands back in a file (whatever the task prints), or `identical: False` with the error when
    it failed."""
    outcome, done = fresh_result(["reload", "--archive", str(path),
                                  *task_args(task, task_options)], timeout, "the reload")
    result = (outcome or {}).get("result")
    if isinstance(result, dict) and isinstance(result.get("identical"), bool):
        return result
    return {"identical": False, "error": outcome_error(outcome, done, "the reload")}
