"""Run folders: every run gets a new folder, nothing already there is overwritten."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from .errors import WorkbookError

# Interactive runs land in the checkout's runs/ folder (ignored by git) unless WORKBOOK_RUNS is set.
RUNS_ROOT = Path(os.environ.get("WORKBOOK_RUNS", Path(__file__).resolve().parents[1] / "runs"))


def claim_dir(path: str | Path) -> Path:
    """Create `path` for a new run; an existing non-empty folder is refused, never reused."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise WorkbookError(f"output folder {path} already holds a run",
                            "choose a new --out folder (runs are never overwritten)")
    path.mkdir(parents=True, exist_ok=True)
    return path


def new_run_dir(label: str, root: str | Path | None = None) -> Path:
    """A fresh folder `root/<timestamp>-<label>`; a suffix keeps it unique within a second."""
    root = RUNS_ROOT if root is None else root
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "run"
    for n in range(1000):
        path = Path(root) / (f"{stamp}-{slug}" + (f"-{n}" if n else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise WorkbookError(f"no free run folder name under {root}", "clean up old runs")


def notebook_dir(out_dir: str, notebook: str) -> Path:
    """The folder a notebook writes into: the one it was given, or a new run folder."""
    return claim_dir(out_dir) if out_dir else new_run_dir(notebook)


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN and infinities become strings, numpy scalars plain numbers."""
    if hasattr(value, "item") and not isinstance(value, (list, dict)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str | Path, data: Any) -> Path:
    """Write JSON atomically: a temporary file in the same folder, then a rename."""
    path = Path(path)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        json.dump(_clean(data), tmp, indent=1, sort_keys=True)
    os.replace(tmp.name, path)
    return path


def write_summary(out_dir: Path, verdict: str, figures: dict[str, Any], **extra: Any) -> Path:
    """`summary.json`: the verdict ("pass"/"fail") and the key figures, read by the pilot."""
    if verdict not in ("pass", "fail"):
        raise ValueError(f"verdict must be 'pass' or 'fail', not {verdict!r}")
    return write_json(Path(out_dir) / "summary.json", {"verdict": verdict, "figures": figures,
                                                       **extra})


def save_table(frame: pd.DataFrame, out_dir: Path, name: str) -> Path:
    """Store a table as CSV (for people) and JSON records (for programs)."""
    frame.to_csv(Path(out_dir) / f"{name}.csv", index=False)
    write_json(Path(out_dir) / f"{name}.json", frame.to_dict(orient="records"))
    return Path(out_dir) / f"{name}.csv"
