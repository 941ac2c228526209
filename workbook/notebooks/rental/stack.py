"""Notebook 08's software-stack check: what this machine verified (Python, torch, CUDA, the
precision, notebook 09's rules, the task's imports) and what the rental must still verify."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pandas as pd
import torch

from ...base.errors import WorkbookError
from ...storage.artifacts import read_json
from ...training.loop import check_precision, resolve_device
from ..registry import GATES, PARALLEL, RENTAL
from .candidates import Candidate


def stack_check(task_path: str, device: str, precision: str, replicas: int = 1,
                run_dir: str | Path | None = None) -> pd.DataFrame:
    """The software stack verified here - Python, torch, CUDA, the precision, data parallelism
    when a candidate uses replicas (notebook 09's verdict, when it ran in `run_dir`), and every
    package the task's module imports - and what must still be verified on the rental
    (`notebook`: the one that verifies it there)."""
    dev = resolve_device(device)
    rows = [{"item": "python", "here": sys.version.split()[0], "verified": True,
             "on the rental": "the same minor version", "notebook": RENTAL.stem},
            {"item": "torch", "here": torch.__version__, "verified": True,
             "on the rental": "the same version, in a CUDA build", "notebook": RENTAL.stem},
            {"item": "CUDA", "here": torch.version.cuda if torch.cuda.is_available()
             else "none (CPU)", "verified": torch.cuda.is_available(),
             "on the rental": "driver and runtime that match the torch build",
             "notebook": GATES.stem}]
    try:
        check_precision(precision, dev)
        ok, note = True, f"{precision} runs on {dev}"
    except WorkbookError as exc:
        ok, note = False, exc.problem
    rows.append({"item": f"precision {precision}", "here": note, "verified": ok,
                 "on the rental": {"bf16": "bf16 support (Ampere or newer)",
                                   "fp16": "the GradScaler path on the GPU"}.get(precision,
                                                                                 "-"),
                 "notebook": GATES.stem})
    if replicas > 1:
        rows.append(data_parallel_row(replicas, run_dir))
    for module, dist, version in task_imports(task_path.split(":")[0]):
        rows.append({"item": f"import {module}", "here": f"{dist} {version}" if dist else
                     "not an installed distribution", "verified": version is not None,
                     "on the rental": "install the same version" if dist else
                     "ship the module with the code", "notebook": RENTAL.stem})
    return pd.DataFrame(rows)


def data_parallel_row(replicas: int, run_dir: str | Path | None) -> dict[str, object]:
    """What notebook 09 verified of data parallelism (torchrun + DDP), read from its summary."""
    path = Path(run_dir) / PARALLEL.stem / "summary.json" if run_dir else None
    summary = read_json(path, "notebook 09's summary") if path and path.exists() else None
    if summary is None:
        here, ok = ("not run yet: notebook 09 checks the multi-host rules (the pilot runs it "
                    "after this one; the report shows its verdict)"), False
    else:
        rules = summary.get("rules") or {}
        failing = [r for r, v in rules.items() if v == "fail"]
        ok = summary.get("verdict") == "pass"
        here = (f"notebook 09: {len(rules)} rules, " + (f"failing: {', '.join(failing)}"
                                                        if failing else "none failing") +
                f" ({summary.get('figures', {}).get('replicas')} CPU processes, gloo)")
    return {"item": f"data parallel x{replicas} (torchrun + DDP)", "here": here, "verified": ok,
            "on the rental": "NCCL, SyncBatchNorm and the interconnect: run notebook 09 there "
                             f"with --device cuda -p replicas={replicas}",
            "notebook": PARALLEL.stem}


def sharded_row(candidates: list[Candidate], sheet: pd.DataFrame) -> dict[str, object]:
    """What this machine verified of FSDP2 full sharding: the per-GPU prediction only."""
    worlds = sorted({int(w) for w in sheet[sheet.candidate.isin([c.name for c in candidates])]
                     .gpus.dropna()})
    return {"item": "FSDP2 full sharding (fully_shard) x" + "/".join(map(str, worlds or ["N"])),
            "here": "sized on fake tensors over a fake process group (nothing run sharded "
                    "here; notebook 09 runs the loop under FSDP2 on CPU processes)",
            "verified": False,
            "on the rental": "NCCL over the GPUs and nodes, a torch.distributed.checkpoint save "
                             "by every rank and an exact resume from it, and the per-GPU peak "
                             "(torch.cuda.max_memory_allocated) against the sheet",
            "notebook": PARALLEL.stem}


def task_imports(module_name: str) -> list[tuple[str, str | None, str | None]]:
    """Top-level modules the task's module imports (read from its source, not run), with the
    installed distribution and version behind each; the standard library is left out."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return []
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    dists = importlib.metadata.packages_distributions()
    out = []
    for name in sorted(names - set(sys.stdlib_module_names) - {"__future__"}):
        dist = (dists.get(name) or [None])[0]
        out.append((name, dist, importlib.metadata.version(dist) if dist else None))
    return out


def unverified(stack: pd.DataFrame) -> list[str]:
    """What the stack check could not verify here, in words."""
    words = []
    for _, row in stack[~stack.verified].iterrows():
        item, here, todo = row["item"], row["here"], row["on the rental"]
        if item == "CUDA":
            words.append("CUDA memory counters and timing were not measured: no GPU was "
                         "present (run notebooks 03 and 05 with device='cuda' on the rental)")
        elif item.startswith("precision"):
            words.append(f"{item} could not run here ({here}): check {todo} on the rental")
        elif item.startswith("import"):
            words.append(f"`{item[7:]}` is {here}: {todo}")
        else:
            words.append(f"{item}: {todo}")
    return words
