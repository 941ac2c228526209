"""Notebook parameters. Each notebook's `parameters` cell is the only table of its defaults: names,
types and values are read from it. papermill silently ignores unknown names, so each notebook
checks its own namespace here and fails with a clear message on a typo or a wrong type."""

from __future__ import annotations

import argparse
import ast
import difflib
import fnmatch
import io
import json
import math
import tokenize
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..base.errors import WorkbookError
from ..storage.schemas import SEED_MAX

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
    "fallback"). An empty `lrs` stays empty: 06's range test places the grid."""
    if "lr" in p:
        p["lr_from"] = "parameter" if p["lr"] else None
    if not ("lr" in p and not p["lr"]):
        return p
    from ..contract.task import load_task
    from ..notebooks.overfit import FALLBACK_LR  # 02 memorises in a short budget
    from ..notebooks.registry import OVERFIT

    own = load_task(p["task"], **p.get("task_options", {})).lr
    fallback = FALLBACK_LR if notebook == OVERFIT.stem else 1e-3
    p["lr"], p["lr_from"] = (own, "task") if own else (fallback, "fallback")
    return p


SWITCHES = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}


def _as_switch(value: Any) -> Any:
    """A yes/no parameter as people write it on a command line (`-p fsdp=false`, `fsdp=0`,
    `fsdp=True`) as a bool; anything else is left for the type check to refuse."""
    if isinstance(value, str) and value.strip().lower() in SWITCHES:
        return SWITCHES[value.strip().lower()]
    if type(value) is int and value in (0, 1):
        return bool(value)
    return value


def validate(given: dict[str, Any], notebook: str,
             spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check parameter names and types against a notebook's defaults, fill in the rest, then
    check every value's range (RULES; every float finite), defaults included.
    With `spec`, `notebook` only names where the parameters go (e.g. "the selected notebooks")."""
    spec = spec if spec is not None else defaults(notebook)
    problems = []
    for name in sorted(set(given) - set(spec)):
        close = difflib.get_close_matches(name, spec, n=1)
        elsewhere = [stem for stem in stems() if name in defaults(stem)]
        problems.append(f"no parameter {name!r}" + (
            f" (it belongs to {', '.join(elsewhere)})" if elsewhere else "")
            + (f" - did you mean {close[0]!r}?" if close else ""))
    given = {k: _as_switch(v) if k in spec and type(spec[k]) is bool else v
             for k, v in given.items()}
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
    values = {**spec, **{k: v for k, v in given.items()}}
    out_of_range = [problem for name, value in values.items() for problem in
                    _range_problems(name, value, _rule(name), records=name != "task_options")]
    if out_of_range:
        raise WorkbookError("; ".join(f"parameter {path!r} of {notebook} is {value!r}; it must be "
                                      f"{need}" for path, value, need in out_of_range),
                            "give " + ("it a value" if len(out_of_range) == 1 else "each a value")
                            + " in its range (the notebook's parameters cell explains each)")
    return values


# --- ranges: a value of the right type that cannot mean anything is refused before any work ----
@dataclass(frozen=True)
class Rule:
    """An interval for a number (`lo`/`hi`, open or closed), with the reason shown when refused.
    A list or a name-to-number dict under the rule holds such numbers; `nonempty` asks for one."""

    why: str
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    nonempty: bool = False

    def holds(self, x: float) -> bool:
        return ((x > self.lo if self.lo_open else x >= self.lo)
                and (x < self.hi if self.hi_open else x <= self.hi))

    def interval(self) -> str:
        if self.hi == math.inf:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return (f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.hi_open else ']'}")



def _count(what: str) -> Rule:
    return Rule(what, lo=1)


def _off(what: str) -> Rule:
    return Rule(what, lo=0)


def _share(what: str, zero: bool = True, one: bool = False) -> Rule:
    return Rule(what, lo=0, hi=1, lo_open=not zero, hi_open=not one)


def _positive(what: str) -> Rule:
    return Rule(what, lo=0, lo_open=True)


# Name pattern (fnmatch) -> rule; the first match wins, so exact names come before patterns.
# Names inside records (the dicts of `candidates`, `variants`) are looked up here too.
# Every float, anywhere (lists and dicts included, task_options too), must also be finite.
RULES: tuple[tuple[str, Rule], ...] = (
    ("seed", Rule("NumPy's seed range", lo=0, hi=SEED_MAX)),
    ("seeds", Rule("one trial per seed; NumPy's seed range", lo=0, hi=SEED_MAX, nonempty=True)),
    ("lr", _off("0: the task's own learning rate")),
    ("lrs", _positive("learning rates; an empty list: a range test places them")),
    ("range_*_lr", _positive("a bound of the range test's rates")),
    ("extra_trials", _off("trials the study may add past its grid's edge; 0: none")),
    ("show_examples", _off("examples rendered; 0: none")),
    ("prediction_examples", _off("validation examples whose predictions are saved; 0: none")),
    ("boundary_step", _off("0: the first pass's last update")),
    ("twice_step", _off("0: halfway from mid_step to updates")),
    ("workers", _off("DataLoader worker processes; 0: none")),
    ("val_limit", _count("validation examples of the quality proxy")),
    ("short_length", _count("max_length of the truncation variant")),
    ("length", _off("positions per sequence; 0: the data's longest")),
    ("*_length", _off("positions per sequence; 0: the longest the model accepts or the data's")),
    ("*_limit", _off("use only the first N examples; 0: all")),
    ("eval_sample", _off("periodic evaluation sample; 0: the whole validation set")),
    ("utilisation", _share("the share of peak FLOP/s the training reaches", zero=False,
                           one=True)),
    ("input_bound_threshold", _share("the data-wait share of an update", zero=False, one=True)),
    ("headroom", _share("the share kept free on top of every peak")),
    ("allocator_cache_share", _share("reserved/allocated - 1 of the allocator", one=True)),
    ("*_share", _share("a share of the whole")),
    ("device_memory_gib", _off("GiB of the rental GPU; 0: not given")),
    ("cuda_context_gib", _off("GiB of CUDA context and workspaces")),
    ("gpus", _positive("GiB of memory of each GPU")),
    ("gpu_tflops", _positive("dense peak TFLOP/s of each GPU")),
    ("gpu_price_per_hour", _off("price per GPU-hour")),
    ("*tolerance", _off("an allowed deviation; 0: exact")),
    ("loss_threshold", _positive("the loss the subset must fall below")),
    ("budget", _positive("how many updates, examples or epochs the budget holds")),
    ("divergence_multiple", Rule("a multiple of the first loss; <= 1 stops every trial",
                                 lo=1, lo_open=True)),
    ("export_minutes", _off("minutes to save and export")),
    ("launch_timeout", _positive("seconds for one launch")),
    ("replicas", _count("data-parallel processes")),
    ("*micro_batch", _count("examples per forward/backward pass")),
    ("*accumulation", _count("passes per optimizer update")),
    ("*eval_batch", _count("examples per evaluation pass")),
    ("eval_every", _count("updates between evaluations")),
    ("top_n", _count("best checkpoints kept per trial")),
    ("checkpoint_at", _count("the update after which rank 0 checkpoints")),
    ("controls", _count("control inputs kept in the archive")),
    ("repeats", _count("runs of the variant")),
    ("probe_size", _count("examples that probe the loss function")),
    ("examples", _count("examples in the subset (at most the training split: the notebook "
                        "checks that)")),
    ("updates", _count("optimizer updates")),
    ("*_examples", _count("a count of examples")),
    ("*_updates", _count("a count of updates")),
    ("*_step", _count("an update number, from 1")),
)


def _rule(name: str) -> Rule | None:
    return next((rule for pattern, rule in RULES if fnmatch.fnmatchcase(name, pattern)), None)


def _range_problems(path: str, value: Any, rule: Rule | None,
                    records: bool) -> list[tuple[str, Any, str]]:
    """(path, value, what it must be) for each thing out of range in `value`: floats must be
    finite everywhere; numbers under a rule must hold it; a list or dict under a rule holds
    numbers of that rule; other dicts (records such as those of `candidates`, when `records`)
    are checked by the rules of their keys."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return [(path, value, "a finite number (not NaN or infinity)")]
        if isinstance(value, int) and abs(value) >= 2**63:
            return [(path, value, "a 64-bit integer (below 2**63 in size)")]
        if rule is not None and not rule.holds(value):
            return [(path, value, f"{rule.interval()} ({rule.why})")]
        return []
    problems = []
    if isinstance(value, (list, tuple)):
        if rule is not None and rule.nonempty and not value:
            problems.append((path, value, f"a non-empty list ({rule.why})"))
        for i, item in enumerate(value):
            problems += _range_problems(f"{path}[{i}]", item, rule,
                                        records and isinstance(item, dict))
    elif isinstance(value, dict):
        for key, item in value.items():
            name = f"{path}.{key}" if rule is None else f"{path}[{key!r}]"
            own = rule if rule is not None else (_rule(str(key)) if records else None)
            problems += _range_problems(name, item, own, records)
    return problems


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
