"""The pilot command: execute the notebooks in order with papermill into a new run folder."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

from .errors import WorkbookError
from .params import NOTEBOOKS, validate
from .runs import claim_dir, new_run_dir, write_json
from .task import load_task

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
KERNEL = "workbook"

# Small sizes for CI and a first look (`--smoke`); they override the notebooks' defaults.
SMOKE: dict[str, dict[str, Any]] = {
    "01_inspect_examples": {"show_examples": 2, "probe_size": 4},
    "02_overfit": {"examples": 4, "updates": 80},
    "03_phase_gates": {"accumulation": 2, "eval_batch": 8, "train_limit": 300,
                       "plan_micro_batch": 4, "plan_length": 256},
    "04_batch_accounting": {"reconcile_updates": 8, "reconcile_examples": 21,
                            "check_examples": 8, "partial_examples": 5},
    "05_memory_variants": {"updates": 3, "train_limit": 200, "val_limit": 16,
                           "plan_micro_batch": 4, "plan_length": 128, "plan_eval_batch": 8},
    "06_lr_study": {"updates": 20, "eval_every": 10, "eval_sample": 32, "accumulation": 2,
                    "eval_batch": 16, "prediction_examples": 2},
    "07_resume_reload": {"train_limit": 32, "accumulation": 4, "updates": 8, "mid_step": 5,
                         "controls": 4},
    "08_rental_plan": {"updates": 2000, "train_limit": 50},
}


def ensure_kernel() -> str:
    """Register this interpreter as the `workbook` Jupyter kernel when it is not yet known."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
        if Path(spec.argv[0]).resolve() == Path(sys.executable).resolve():
            return KERNEL
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    install(kernel_name=KERNEL, display_name="Python (workbook)", prefix=sys.prefix)
    return KERNEL


def select(only: str | None) -> list[str]:
    """Notebook stems to run, in order; `only` is a comma list of numbers like "01,02"."""
    stems = sorted(NOTEBOOKS)
    if not only:
        return stems
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    unknown = [w for w in wanted if not any(s.startswith(w + "_") for s in stems)]
    if unknown:
        raise WorkbookError(f"--only names unknown notebooks {unknown}",
                            f"use numbers from {[s.split('_')[0] for s in stems]}")
    return [s for s in stems if s.split("_")[0] in wanted]


def run_pilot(task: str, out: str | None = None, smoke: bool = False, only: str | None = None,
              task_options: dict | None = None, device: str = "cpu", progress: bool = True,
              params: dict[str, Any] | None = None) -> tuple[Path, pd.DataFrame]:
    """Run the selected notebooks for `task`; returns the run folder and its index table.
    `params` go to every notebook that has a parameter of that name."""
    import papermill as pm

    stems = select(only)
    load_task(task, **(task_options or {}))  # fail now, not inside the first notebook
    known = {k: v for stem in stems for k, v in NOTEBOOKS[stem].items()}
    validate({k: v for k, v in (params or {}).items()}, "the selected notebooks", known)
    run = claim_dir(out) if out else new_run_dir(task.split(":")[0].split(".")[-1])
    plans = {}
    for stem in stems:  # check every notebook's parameters before running any
        given = {"task": task, "task_options": task_options or {}, "device": device,
                 "out_dir": str((run / stem).resolve()), **(SMOKE[stem] if smoke else {}),
                 **{k: v for k, v in (params or {}).items() if k in NOTEBOOKS[stem]}}
        plans[stem] = validate(given, stem)
    kernel = ensure_kernel()
    rows = []
    for stem in stems:
        start = time.perf_counter()
        row = {"notebook": stem, "verdict": "error", "summary": f"{stem}/summary.json",
               "executed": f"{stem}.ipynb", "error": ""}
        try:
            pm.execute_notebook(NOTEBOOK_DIR / f"{stem}.ipynb", run / f"{stem}.ipynb",
                                parameters=plans[stem], kernel_name=kernel,
                                progress_bar=progress, cwd=os.getcwd())
            row["verdict"] = json.loads((run / stem / "summary.json").read_text())["verdict"]
        except pm.PapermillExecutionError as exc:  # recorded; the other notebooks still run
            row["error"] = f"{exc.ename}: {exc.evalue}"[:500]
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(f"{stem}: {row['verdict']} ({row['seconds']} s) {row['error']}", flush=True)
    index = pd.DataFrame(rows)
    write_json(run / "index.json", {"task": task, "task_options": task_options or {},
                                    "smoke": smoke, "notebooks": rows})
    index.to_csv(run / "index.csv", index=False)
    report(run, index, task)
    return run, index


def report(run: Path, index: pd.DataFrame, task: str) -> Path:
    """One page in the run folder: every notebook's verdict with a link to it, the gate table,
    the selection sheet, the plan and the conclusion (those that this run produced)."""
    import html

    def table(path: Path, columns: list[str] | None = None) -> str:
        if not path.exists():
            return "<p><i>not produced in this run</i></p>"
        frame = pd.read_csv(path)
        return frame[[c for c in columns if c in frame]].to_html(index=False) if columns \
            else frame.to_html(index=False)

    verdicts = index.assign(notebook=[f'<a href="{r.executed}">{r.notebook}</a>'
                                      for r in index.itertuples()])
    conclusion = run / "08_rental_plan" / "conclusion.md"
    parts = [f"<h1>Pilot report: {html.escape(task)}</h1>",
             "<h2>Verdicts</h2>",
             verdicts[["notebook", "verdict", "seconds", "error"]].to_html(index=False,
                                                                         escape=False),
             "<h2>Phase gates</h2>",
             table(run / "03_phase_gates" / "gates.csv",
                   ["phase", "micro_batch", "seq_len", "precision", "peak_allocated_bytes",
                    "peak_reserved_bytes", "time_s", "verdict", "detail"]),
             "<h2>Selection sheet</h2>",
             table(run / "08_rental_plan" / "selection.csv",
                   ["candidate", "gpu", "gpu_memory_gib", "strategy", "precision",
                    "micro_batch", "accumulation", "activation_checkpointing",
                    "required_gib", "fits", "time_per_update_s", "budget_hours", "expected"]),
             "<h2>Plan</h2>", table(run / "08_rental_plan" / "plan.csv"),
             "<h2>Conclusion</h2>",
             f"<pre>{html.escape(conclusion.read_text())}</pre>" if conclusion.exists()
             else "<p><i>not produced in this run</i></p>"]
    path = run / "report.html"
    path.write_text("<!doctype html><meta charset='utf-8'><title>pilot report</title>"
                    "<style>body{font-family:sans-serif;max-width:70em;margin:auto}"
                    "table{border-collapse:collapse;font-size:small}"
                    "td,th{border:1px solid #ccc;padding:2px 6px}</style>" + "".join(parts))
    return path
