"""Notebook parameters. Each notebook's `parameters` cell is the only table of its defaults: names,
types and values are read from it. papermill silently ignores unknown names, so each notebook
checks its own namespace here and fails with a clear message on a typo or a wrong type."""

from __future__ import annotations

import ast
import difflib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import WorkbookError

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
# Small sizes for CI and a first look (`--smoke`): one papermill parameters file per notebook,
# usable by hand: `papermill notebooks/02_overfit.ipynb o.ipynb -f notebooks/smoke/02_overfit.yaml`
SMOKE_DIR = NOTEBOOK_DIR / "smoke"

# Names IPython itself puts in a notebook's namespace.
_IPYTHON = {"In", "Out", "get_ipython", "exit", "quit", "open"}
_LITERALS = (str, int, float, bool, list, dict, tuple, type(None))


def stems() -> list[str]:
    """The workbook's notebooks, in order: `NN_name` for every notebooks/NN_name.ipynb."""
    return sorted(p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def _known(notebook: str) -> Path:
    path = NOTEBOOK_DIR / f"{notebook}.ipynb"
    if not path.exists():
        raise WorkbookError(f"unknown notebook {notebook!r}", f"use one of {stems()}")
    return path


def defaults(notebook: str) -> dict[str, Any]:
    """The notebook's parameters and their defaults, read from its `parameters` cell."""
    path = _known(notebook)
    return dict(_parameters_cell(str(path), path.stat().st_mtime_ns))


@lru_cache(maxsize=32)
def _parameters_cell(path: str, _mtime: int) -> tuple[tuple[str, Any], ...]:
    cells = json.loads(Path(path).read_text())["cells"]
    cell = next((c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if cell is None:
        raise WorkbookError(f"{path} has no cell tagged 'parameters'",
                            "tag the cell of plain literals with 'parameters' (papermill needs it)")
    source = "".join(cell["source"])
    pairs = []
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and _literal(node.value)):
            raise WorkbookError(f"{path}, parameters cell line {node.lineno}: not `name = literal`",
                                "keep only plain literals there; derive values in the next cell")
        pairs.append((node.targets[0].id, ast.literal_eval(node.value)))
    return tuple(pairs)


def smoke(notebook: str) -> dict[str, Any]:
    """The small sizes of `--smoke` for this notebook (notebooks/smoke/NN_name.yaml)."""
    import yaml

    path = SMOKE_DIR / f"{notebook}.yaml"
    values = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    validate(values, f"{path.name} for notebook {notebook}", defaults(notebook))
    return values


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
    spec = defaults(notebook)
    history = namespace.get("In")
    if isinstance(history, list):
        given = {k: namespace[k] for k in parameter_names(history) if k in namespace}
    else:
        given = {k: v for k, v in namespace.items()
                 if not k.startswith("_") and k not in _IPYTHON and isinstance(v, _LITERALS)}
    return task_learning_rates(validate(given, notebook, spec), notebook)


def of(notebook: str, small: bool = False, **given: Any) -> dict[str, Any]:
    """A notebook's parameters for a script (`run(params, out)` of its module): the defaults of
    its parameters cell, the `--smoke` sizes when `small`, then `given` - checked as the
    notebook checks them."""
    return task_learning_rates(validate({**(smoke(notebook) if small else {}), **given},
                                        notebook), notebook)


def task_learning_rates(p: dict[str, Any], notebook: str = "") -> dict[str, Any]:
    """Fill `lr` 0 with the task's own learning rate (`Task.lr`, else the notebook's fallback,
    1e-3 for most), recording where it came from in `lr_from` ("parameter", "task",
    "fallback"); fill an empty `lrs` with the task's (else 1e-4) as the control, then half and
    double it."""
    if "lr" in p:
        p["lr_from"] = "parameter" if p["lr"] else None
    if not ("lr" in p and not p["lr"]) and not ("lrs" in p and not p["lrs"]):
        return p
    from .overfit import FALLBACK_LR  # 02 memorises in a short budget
    from .task import load_task

    own = load_task(p["task"], **p.get("task_options", {})).lr
    if "lr" in p and not p["lr"]:
        fallback = FALLBACK_LR if notebook == "02_overfit" else 1e-3
        p["lr"], p["lr_from"] = (own, "task") if own else (fallback, "fallback")
    if "lrs" in p and not p["lrs"]:
        control = own or 1e-4
        p["lrs"] = [control, control / 2, control * 2]
    return p


def validate(given: dict[str, Any], notebook: str,
             spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check parameter names and types against a notebook's defaults; fill in the rest.
    With `spec`, `notebook` only names where the parameters go (e.g. "the selected notebooks")."""
    spec = spec if spec is not None else defaults(notebook)
    problems = []
    for name in sorted(set(given) - set(spec)):
        close = difflib.get_close_matches(name, spec, n=1)
        elsewhere = [stem for stem in stems() if name in defaults(stem)]
        problems.append(f"no parameter {name!r}" + (
            f" (it belongs to {', '.join(elsewhere)})" if elsewhere else "")
            + (f" - did you mean {close[0]!r}?" if close else ""))
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
        where = notebook if " " in notebook else f"notebook {notebook}"
        raise WorkbookError(f"{where}: " + "; ".join(problems),
                            "select the notebooks that take it (--only), or use only these "
                            f"parameters: {', '.join(sorted(spec))}")
    return {**spec, **{k: v for k, v in given.items()}}
