"""Notebook 09's launches: one torchrun launch of the loop on N processes under a time limit,
its command line (here and, by hand, on the rental) and the collective backend it uses."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ...base.errors import WorkbookError
from ...storage.artifacts import read_json
from ...storage.files import write_text
from ...storage.processes import fresh_process
from ...storage.runs import claim_dir
from ...storage.runs import shown as shown_path
from ...training.devices import resolve_device
from ...training.ranks import backend
from ...training.replica import RESULT, ReplicaSpec

LAUNCH_TIMEOUT = 600  # seconds for one launch (a few updates on every rank)


def launch(spec: ReplicaSpec, folder: Path, resume_from: Path | None = None,
           timeout: float = LAUNCH_TIMEOUT) -> dict[str, Any]:
    """Run `spec` on its shape's replicas, one process each, with torchrun into the new
    `folder` and return what rank 0 gathered. A stuck launch is killed with every worker after
    `timeout` seconds."""
    return launch_in_turn([(spec, folder)], resume_from, timeout)[0]


def launch_in_turn(runs: list[tuple[ReplicaSpec, Path]], resume_from: Path | None = None,
                   timeout: float = LAUNCH_TIMEOUT) -> list[dict[str, Any]]:
    """`launch` of each (spec, new folder) in turn in the same processes of one torchrun launch
    (the first resuming `resume_from`): what rank 0 gathered for each. The processes start,
    import and join the process group once for all (most of a short launch's time on the CPU),
    so the runs share their replicas, device and collective timeout; `timeout` is the whole
    launch's."""
    replicas = runs[0][0].shape.replicas
    if not isinstance(replicas, int) or replicas < 2:
        raise WorkbookError(f"replicas must be 2 or more, got {replicas!r}",
                            "data parallelism needs at least two processes")
    if len({(s.shape.replicas, s.device, s.collective_timeout_s) for s, _ in runs}) > 1:
        raise WorkbookError("runs launched in turn differ in replicas, device or collective "
                            "timeout", "launch such runs separately")
    for _, folder in runs:
        claim_dir(folder)  # a launch never writes over an earlier one
    (spec, folder), later = runs[0], runs[1:]
    cmd = command(spec, folder, resume_from, later)
    # torchrun's own log folder: a fresh /tmp/torchelastic_* per launch, never removed, unless
    # named; the workers' output comes back through the pipes, so it holds nothing to keep
    with tempfile.TemporaryDirectory(prefix="workbook-torchrun-") as logs:
        done = fresh_process(cmd["args"], timeout, f"the {replicas}-process launch",
                             launcher=[*cmd["launcher"], f"--log-dir={logs}"])
    if done.returncode:  # the log goes with the first run that wrote no result
        failed = next((f for _, f in runs if not (f / RESULT).exists()), runs[-1][1])
        log = write_text(failed / "launch-error.log", done.stdout + done.stderr)
        errors = re.findall(r"error: (.*(?:\n  -> fix: .*)?)", done.stderr)
        raised = re.findall(r"^\[rank\d+\]: \w*(?:Error|Exception)\b.*$", done.stderr, re.M)
        shown = errors[-1] if errors else "; ".join(dict.fromkeys(raised)) or \
            done.stderr.strip()[-800:]
        raise WorkbookError(f"the {replicas}-process launch failed (exit {done.returncode}): "
                            f"{shown}", f"every rank's output is in {shown_path(log)}")
    return [read_json(f / RESULT, "the launch's result") for _, f in runs]


def command(spec: ReplicaSpec, folder: Path, resume_from: Path | None = None,
            later: Sequence[tuple[ReplicaSpec, Path]] = ()) -> dict[str, list[str]]:
    """The torchrun command line of a launch: `python LAUNCHER -m workbook ARGS` (with
    `--then SPEC OUT` for each run after the first in the same processes)."""
    launcher = ["-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={spec.shape.replicas}", "--max_restarts=0"]
    args = ["ddp", "--spec", json.dumps(asdict(spec)), "--out", str(folder)]
    if resume_from is not None:
        args += ["--resume-from", str(resume_from)]
    for then, out in later:
        args += ["--then", json.dumps(asdict(then)), str(out)]
    return {"launcher": launcher, "args": args}


def rented_spec(spec: ReplicaSpec, gpus: int = 8) -> ReplicaSpec:
    """The launch to run by hand on the rented machine before the campaign: the same rules at
    the rental's scale - one process per GPU, bf16, 100 updates over the whole training and
    validation splits, a checkpoint at update 50 - not the pilot's 10 fp32 updates on 32
    examples."""
    return replace(spec, device="cuda", shape=replace(spec.shape, replicas=gpus,
                                                      precision="bf16"),
                   updates=100, train_limit=0, validation_limit=0, checkpoint_at=50)


def shell_command(spec: ReplicaSpec, out: str = "runs/ddp") -> str:
    """The command to run the same launch by hand, e.g. on a rented multi-GPU machine."""
    import shlex

    cmd = command(spec, Path(out))
    return "torchrun " + shlex.join([*cmd["launcher"][2:], "-m", "workbook", *cmd["args"]])


def check_devices(device: str, replicas: int) -> str:
    """Check the settings and say which collective backend carries them: gloo on the CPU, NCCL
    with one GPU per process, gloo on CUDA tensors when processes must share GPUs (NCCL refuses
    two ranks on one GPU). Returns a line for the reader."""
    if device not in ("cpu", "cuda"):
        raise WorkbookError(f"device {device!r} is not one notebook 09 runs on",
                            "use 'cpu' (gloo) or 'cuda' (NCCL, one GPU per process)")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 2:
        raise WorkbookError(f"replicas must be an integer of 2 or more, got {replicas!r}",
                            "data parallelism needs at least two processes")
    if device == "cuda":
        resolve_device(device)  # no GPU at all: the clear error, not a launch that fails
    chosen = backend(device, replicas)
    if device == "cpu":
        return f"{replicas} processes on the CPU, collectives over gloo"
    if chosen == "nccl":
        return f"{replicas} processes, one GPU each, collectives over NCCL"
    return (f"{replicas} processes share {torch.cuda.device_count()} GPU(s): NCCL needs one GPU "
            "per process, so gloo carries the collectives on CUDA tensors (the FSDP2 launches "
            "run on the CPU: FSDP2 over gloo on shared CUDA tensors crashes). The rules are the "
            "same; NCCL itself is not exercised - run with one GPU per process to check it")
