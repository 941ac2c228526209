"""Notebook parameters as a notebook, a script and the pilot give them, checked by the
notebook's one parameter model (`notebooks/parameters.py`, named on its registry entry):
a kernel's executed parameter cells (`check`), a script's changes (`of`), the `--smoke` YAML
(`smoke`), the pilot's `-p` (`validate`). papermill silently ignores unknown names, so each
notebook checks its own namespace here and fails with a clear message on a typo, a wrong type
or a value out of range. A learning rate 0 (an empty `lrs`) is filled from the task."""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..base.errors import WorkbookError
from ..notebooks import parameters, registry
from ..notebooks.parameters import NotebookParams

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
# Small sizes for CI and a first look (`--smoke`): one papermill parameters file per notebook,
# usable by hand: `papermill notebooks/02_overfit.ipynb o.ipynb -f notebooks/smoke/02_overfit.yaml`
SMOKE_DIR = NOTEBOOK_DIR / "smoke"

# Names IPython itself puts in a notebook's namespace.
_IPYTHON = {"In", "Out", "get_ipython", "exit", "quit", "open"}
_LITERALS = (str, int, float, bool, list, dict, tuple, type(None))


def stems() -> list[str]:
    """The workbook's notebooks, in order: `NN_name` for every notebooks/NN_name.ipynb."""
    return sorted(p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def defaults(notebook: str) -> dict[str, Any]:
    """The notebook's parameters and their defaults (its model's)."""
    return dict(registry.entry(notebook).parameters())


def smoke(notebook: str) -> dict[str, Any]:
    """The small sizes of `--smoke` for this notebook (notebooks/smoke/NN_name.yaml), checked
    by its model."""
    import yaml

    path = SMOKE_DIR / f"{notebook}.yaml"
    values = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    parameters.check([registry.entry(notebook).parameters], values,
                     f"{path.name} for notebook {notebook}", registry.owners)
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


def check(namespace: dict[str, Any], notebook: str) -> NotebookParams:
    """The notebook's parameters from `namespace`, checked by its model. In a kernel they are
    read from the executed parameter cells (so re-running the check after later cells is
    fine); elsewhere every literal-valued global counts."""
    history = namespace.get("In")
    if isinstance(history, list):
        given = {k: namespace[k] for k in parameter_names(history) if k in namespace}
    else:
        given = {k: v for k, v in namespace.items()
                 if not k.startswith("_") and k not in _IPYTHON and isinstance(v, _LITERALS)}
    return task_learning_rates(registry.entry(notebook).check(given), notebook)


def of(notebook: str, small: bool = False, **given: Any) -> NotebookParams:
    """A notebook's parameters for a script (`run(params, out)` of its module): its model's
    defaults, the `--smoke` sizes when `small`, then `given` - checked as the notebook checks
    them."""
    return task_learning_rates(registry.entry(notebook).check(
        {**(smoke(notebook) if small else {}), **given}), notebook)


def validate(given: Mapping[str, Any], notebooks: list[str],
             where: str = "the selected notebooks") -> None:
    """`given` (the pilot's `-p`) checked against the models of `notebooks` together: each name
    must be a parameter of one of them, each value in range for every one that has it."""
    parameters.check([registry.entry(s).parameters for s in notebooks], given, where,
                     registry.owners)


def task_learning_rates(p: NotebookParams, notebook: str = "") -> NotebookParams:
    """Fill `lr` 0 with the task's own learning rate (`Task.lr`, else the notebook's fallback,
    1e-3 for most), recording where it came from in `lr_from` ("parameter", "task",
    "fallback"). An empty `lrs` stays empty: 06's range test places the grid."""
    names = p.names()
    changes: dict[str, Any] = {}
    if "lr" in names:
        changes["lr_from"] = "parameter" if p.lr else None
    if not ("lr" in names and not p.lr):
        return p.model_copy(update=changes)
    from ..notebooks.overfit import FALLBACK_LR  # 02 memorises in a short budget

    own = p.load_task().lr
    fallback = FALLBACK_LR if notebook == registry.OVERFIT.stem else 1e-3
    changes["lr"], changes["lr_from"] = (own, "task") if own else (fallback, "fallback")
    return p.model_copy(update=changes)


# --- literal parsing of `-p NAME=VALUE`: bounded in size and nesting -----------------------
MAX_LITERAL_CHARS = 10_000
MAX_LITERAL_DEPTH = 20  # brackets and unary signs nested in one another


class LiteralError(WorkbookError, argparse.ArgumentTypeError):
    """A `-p` value too long or too deeply nested to parse (argparse reports it as it is)."""


def parse_literal(text: str) -> Any:
    """The Python literal that `text` spells (`8`, `1e-3`, `[0, 1]`, `{"a": 1}`), else `text`
    itself as a string (`cuda`, `a.b:c`). Refused, before the parser sees it: more than
    MAX_LITERAL_CHARS characters, or brackets and unary signs nested deeper than
    MAX_LITERAL_DEPTH (Python's parser fails on those with MemoryError or RecursionError)."""
    shown = text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"
    if len(text) > MAX_LITERAL_CHARS:
        raise LiteralError(f"the value {shown!r} is longer than {MAX_LITERAL_CHARS} characters",
                           "give a shorter value (set long lists in the parameters cell)")
    if _nesting(text) > MAX_LITERAL_DEPTH:
        raise LiteralError(f"the value {shown!r} nests brackets or signs deeper than "
                           f"{MAX_LITERAL_DEPTH}", "give a plain literal such as 8, -3, 1e-3 "
                           "or [0, 1]")
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError):
        return text
    except (MemoryError, RecursionError) as exc:
        raise LiteralError(f"the value {shown!r} is too complex to parse "
                           f"({type(exc).__name__})", "give a plain literal") from None


def _nesting(text: str) -> int:
    """How deep brackets and unary signs nest in `text`, read token by token (strings stay
    whole); text that is not Python tokens counts as flat (it is taken as a string)."""
    depth = deepest = signs = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
            signs = signs + 1 if tok.type == tokenize.OP and tok.string in ("-", "+", "~") else 0
            deepest = max(deepest, depth + signs)
    except (tokenize.TokenError, SyntaxError):
        pass
    return deepest
