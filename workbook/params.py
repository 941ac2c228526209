"""Notebook parameters: papermill silently ignores unknown names, so each notebook checks its
own namespace here and fails with a clear message on a typo or a wrong type."""

from __future__ import annotations

import ast
import difflib
from typing import Any

from .errors import WorkbookError

COMMON = {
    "task": "workbook.samples.generation:task",  # package.module:attribute of the task
    "task_options": {},  # keyword arguments for a task factory
    "out_dir": "",  # where this notebook writes (empty: a new folder under runs/)
    "device": "cpu",  # "cpu", "cuda" or "auto"
    "seed": 0,
}

NOTEBOOKS: dict[str, dict[str, Any]] = {
    "01_inspect_examples": {**COMMON, "show_examples": 4, "probe_size": 8},
    "02_overfit": {**COMMON, "examples": 8, "updates": 150, "lr": 3e-3,
                   "loss_threshold": 0.05, "init_tolerance": 0.5},
    "03_phase_gates": {**COMMON, "micro_batch": 2, "accumulation": 8, "eval_batch": 16,
                       "length": 0, "precision": "fp32", "activation_checkpointing": False,
                       "lr": 1e-3,
                       "device_memory_gib": 0.0, "headroom": 0.2, "input_bound_threshold": 0.3,
                       "train_limit": 0, "plan_micro_batch": 16, "plan_accumulation": 2,
                       "plan_length": 1024, "plan_eval_batch": 32, "plan_precision": "bf16",
                       "plan_activation_checkpointing": False, "cuda_context_gib": 1.0,
                       "allocator_cache_share": 0.1},
    "04_batch_accounting": {**COMMON, "micro_batch": 2, "accumulation": 8, "replicas": 1,
                            "drop_partial": False, "hold": "epochs", "budget": 1.0,
                            "reconcile_updates": 30, "reconcile_examples": 45,
                            "check_examples": 16,
                            "partial_examples": 13, "tolerance": 1e-4},
    "05_memory_variants": {**COMMON, "micro_batch": 4, "accumulation": 4, "eval_batch": 16,
                           "length": 0, "short_length": 20, "updates": 20, "lr": 1e-3,
                           "train_limit": 0, "val_limit": 64, "plan_micro_batch": 16,
                           "plan_accumulation": 2, "plan_length": 1024, "plan_eval_batch": 32},
    "06_lr_study": {**COMMON, "study_name": "lr-comparison", "lrs": [1e-4, 5e-5, 2e-4],
                    "seeds": [0], "updates": 200, "micro_batch": 2, "accumulation": 8,
                    "eval_every": 50, "eval_batch": 32, "eval_sample": 0, "metric": "loss",
                    "top_n": 2, "divergence_multiple": 3.0, "prediction_examples": 4,
                    "notes": "none"},
    "07_resume_reload": {**COMMON, "micro_batch": 2, "accumulation": 8, "lr": 1e-3,
                         "updates": 10, "train_limit": 64, "mid_step": 6, "boundary_step": 0,
                         "tolerance": 0.0, "demonstrate_faults": True, "controls": 8},
    "08_rental_plan": {**COMMON, "gpus": {"L4": 24, "A100-40GB": 40, "L40S": 48,
                                          "A100-80GB": 80, "H200": 141},
                       "gpu_tflops": {"L4": 121, "A100-40GB": 312, "L40S": 362,
                                      "A100-80GB": 312, "H200": 989},
                       "utilisation": 0.35, "rental_gpu": "A100-80GB",
                       "candidates": [
                           {"name": "control", "micro_batch": 16, "accumulation": 2,
                            "length": 1024, "precision": "bf16",
                            "expected": "the study's control at campaign scale"},
                           {"name": "checkpointed", "micro_batch": 32, "accumulation": 1,
                            "length": 1024, "precision": "bf16",
                            "activation_checkpointing": True,
                            "expected": "same effective batch, fewer passes per update"},
                           {"name": "2 replicas", "micro_batch": 16, "accumulation": 1,
                            "length": 1024, "precision": "bf16", "replicas": 2,
                            "expected": "same effective batch on two GPUs"}],
                       "updates": 20000, "eval_every": 500, "export_minutes": 5.0,
                       "headroom": 0.2, "cuda_context_gib": 1.0, "allocator_cache_share": 0.1,
                       "variants": [
                           {"name": "control", "priority": 1, "candidate": "control",
                            "repeats": 3},
                           {"name": "best study lr", "priority": 2, "candidate": "control",
                            "repeats": 3},
                           {"name": "checkpointed", "priority": 3,
                            "candidate": "checkpointed", "repeats": 1}],
                       "reserve_share": 0.2, "train_limit": 200},
}

# Names IPython itself puts in a notebook's namespace.
_IPYTHON = {"In", "Out", "get_ipython", "exit", "quit", "open"}
_LITERALS = (str, int, float, bool, list, dict, tuple, type(None))


def _literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def parameter_names(history: list[str]) -> set[str]:
    """Names assigned by the executed cells that hold nothing but `name = literal` lines: the
    notebook's parameters cell and the cell papermill injects."""
    names: set[str] = set()
    for source in history:
        try:
            body = ast.parse(source).body
        except SyntaxError:
            continue
        if body and all(isinstance(n, ast.Assign) and len(n.targets) == 1 and
                        isinstance(n.targets[0], ast.Name) and _literal(n.value) for n in body):
            names |= {n.targets[0].id for n in body}
    return names


def check(namespace: dict[str, Any], notebook: str) -> dict[str, Any]:
    """Return the notebook's parameters from `namespace`, after checking names and types.
    In a kernel the parameters are read from the executed parameter cells (so re-running the
    check after later cells is fine); elsewhere every literal-valued global counts."""
    if notebook not in NOTEBOOKS:
        raise WorkbookError(f"unknown notebook {notebook!r}", f"use one of {sorted(NOTEBOOKS)}")
    spec = NOTEBOOKS[notebook]
    history = namespace.get("In")
    if isinstance(history, list):
        given = {k: namespace[k] for k in parameter_names(history) if k in namespace}
    else:
        given = {k: v for k, v in namespace.items()
                 if not k.startswith("_") and k not in _IPYTHON and isinstance(v, _LITERALS)}
    return validate(given, notebook, spec)


def validate(given: dict[str, Any], notebook: str,
             spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check parameter names and types against a notebook's defaults; fill in the rest."""
    spec = spec if spec is not None else NOTEBOOKS[notebook]
    problems = []
    for name in sorted(set(given) - set(spec)):
        close = difflib.get_close_matches(name, spec, n=1)
        problems.append(f"unknown parameter {name!r}"
                        + (f" (did you mean {close[0]!r}?)" if close else ""))
    for name, value in given.items():
        if name not in spec:
            continue
        want = type(spec[name])
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            problems.append(f"parameter {name!r} must be {want.__name__}, got "
                            f"{type(value).__name__} {value!r}")
    if problems:
        raise WorkbookError(f"notebook {notebook}: " + "; ".join(problems),
                            f"use only these parameters: {', '.join(sorted(spec))}")
    return {**spec, **{k: v for k, v in given.items()}}
