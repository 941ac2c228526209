"""The house: layer folders whose imports point downwards only, no import circle (function-level
imports included), no module past the size one reads in a sitting, no module outside
`contract/kinds/` that branches on a target kind's name, no notebook known by its stem
outside the notebooks' registry, no private name imported from another module, no stored
dataclass repeated by a hand-written schema, and ARCHITECTURE.md naming every module."""

import ast
import dataclasses
import re
import typing
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "workbook"
# top to bottom; `samples` sits beside the house and may use any layer but commands
LAYERS = ("commands", "notebooks", "training", "contract", "storage", "base")
MAX_LINES = 600


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path], typing: bool = False) -> set[str]:
    """The workbook modules a module imports, at any depth of its code, less the imports made
    only for type checking (with `typing`, those too)."""
    tree = ast.parse(path.read_text())
    typing_only = set() if typing else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
        and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in known and m != name}


def layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


GRAPH = {name: imports_of(name, path, modules()) for name, path in modules().items()}
# the same with the imports made only for type checking
TYPED_GRAPH = {name: imports_of(name, path, modules(), typing=True)
               for name, path in modules().items()}


def test_there_is_no_import_circle():
    seen, stack, circles = {}, [], []

    def visit(node):
        seen[node] = "open"
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if seen.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = "done"

    for node in sorted(GRAPH):
        if node not in seen:
            visit(node)
    assert not circles, " ; ".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize("graph", [GRAPH, TYPED_GRAPH], ids=["run", "type-checking too"])
def test_imports_point_downwards(graph):
    """A type a lower layer names belongs to it: an upward import made only for type checking
    (the contract's `RunLength.shape` naming training's `UpdateShape`) is one too."""
    upward = []
    for name, targets in graph.items():
        mine = layer(name)
        if mine not in LAYERS:
            continue
        for target in targets:
            theirs = layer(target)
            if theirs in LAYERS and LAYERS.index(theirs) < LAYERS.index(mine):
                upward.append(f"{name} ({mine}) imports {target} ({theirs})")
            if theirs == "samples":
                upward.append(f"{name} imports the sample {target}")
    assert not upward, "\n".join(upward)


def test_every_module_lives_in_a_layer():
    loose = [n for n in GRAPH if n.count(".") == 1 and layer(n) is None
             and n not in ("workbook.__main__", "workbook.samples")]
    assert not loose, loose


def test_no_module_is_longer_than_one_sitting():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_only_the_kinds_branch_on_a_kind():
    pattern = re.compile(r"kind\s*(==|!=)|kind (not )?in \(\s*\"")
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
             for p in PACKAGE.rglob("*.py") if "kinds" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


# A notebook stem ("03_phase_gates") held as a string: a link no import shows. Only the
# registry holds them; every other module names a notebook by its entry (`registry.GATES.stem`).
STEM = re.compile(r"\b\d\d_[a-z][a-z_]*")
REGISTRY = "workbook.notebooks.registry"


def stems_in(source: str) -> list[str]:
    """The notebook stems a module's code holds as strings ("line: stem"); docstrings and
    comments, which only describe, aside."""
    tree = ast.parse(source)
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)}
    found = [(node.lineno, stem) for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and id(node) not in docs for stem in STEM.findall(node.value)]
    return [f"{line}: {stem}" for line, stem in sorted(found)]


def test_a_stem_held_as_a_string_is_found_and_a_named_entry_is_not():
    planted = 'path = run / "03_phase_gates" / "gates.csv"\nwhy = f"see {x} in 06_lr_study/"\n'
    assert stems_in(planted) == ["1: 03_phase_gates", "2: 06_lr_study"]
    clean = ('"""Reads 03_phase_gates\' folder."""\n\ndef f(run):\n    """Of 06_lr_study."""\n'
             '    return run / GATES.stem / "gates.csv"  # 03_phase_gates\n')
    assert stems_in(clean) == []


def test_only_the_registry_knows_a_notebook_by_its_stem():
    found = [f"{path.relative_to(PACKAGE.parent)}:{where}" for name, path in modules().items()
             if name != REGISTRY for where in stems_in(path.read_text())]
    assert not found, "name the notebook by its registry entry (workbook.notebooks.registry): " \
        + "; ".join(found)


# A name one module keeps private, imported by another: the two are one module in fact, or the
# name is shared and should say so (public, with a docstring), or it belongs to its only user.
def private_imports(name: str, source: str, known, package: bool = False) -> list[str]:
    """"line: from MODULE import _NAME" for each underscore name the module `name` (a package's
    `__init__` with `package`) imports from another workbook module (`known`: their names), at
    any depth of its code; a third party's private names (torch's `_BatchNorm`) are not ours to
    rule, and a module is a module, whatever its name."""
    package_parts = name.split(".") if package else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            base = ".".join(package_parts[:len(package_parts) - node.level + 1]
                            + ([base] if base else []))
        if base.split(".")[0] != "workbook":
            continue
        found += [f"{node.lineno}: from {base} import {a.name}" for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__")
                  and f"{base}.{a.name}" not in known]
    return found


def test_a_private_name_imported_from_a_sibling_is_found_and_a_public_one_is_not():
    known = {"workbook.storage.files", "workbook.storage.artifacts", "workbook.storage"}
    planted = ("from .files import NOFOLLOW, _digest\n"
               "def f():\n    from ..storage.files import _kind\n"
               "from torch.nn.modules.batchnorm import _BatchNorm\n")
    assert private_imports("workbook.storage.artifacts", planted, known) == [
        "1: from workbook.storage.files import _digest",
        "3: from workbook.storage.files import _kind"]
    clean = ("from __future__ import annotations\nfrom .files import NOFOLLOW, sha256_of\n"
             "from . import files\nfrom torch.nn.modules.batchnorm import _BatchNorm\n")
    assert private_imports("workbook.storage.artifacts", clean, known) == []


def test_no_module_imports_a_private_name_of_another():
    known = modules()
    found = [f"{path.relative_to(PACKAGE.parent)}:{where}" for name, path in sorted(known.items())
             for where in private_imports(name, path.read_text(), known,
                                          path.name == "__init__.py")]
    assert not found, "make the name public in its module (with a docstring), or move it to " \
        "its only user: " + "; ".join(found)


@pytest.mark.parametrize("short", ["loop", "task", "adapters", "campaign", "runs", "gates",
                                   "archive", "forward_failure"])
def test_the_short_public_names_are_the_layered_modules(short):
    """`wb.<short>` (and `from workbook import <short>`) is the layered module itself; no import
    hook: a dotted import names the layered path."""
    import importlib
    import sys

    import workbook

    module = getattr(workbook, short)
    assert module is importlib.import_module(module.__name__)
    assert module.__name__.count(".") >= 2 and f"workbook.{short}" not in sys.modules
    assert not any(type(f).__module__.startswith("workbook") for f in sys.meta_path)


def test_no_file_imports_a_short_name_as_a_dotted_path():
    """`from workbook.<short> import ...` has no module behind it (short names are attributes):
    the code, the docs and the notebooks name the layered path."""
    import workbook

    short = "|".join(sorted(dir(workbook)))
    pattern = re.compile(rf"(?:from|import) workbook\.(?:{short})\b")
    root = PACKAGE.parent
    files = [p for d in ("workbook", "tests", "examples", "benchmarks", "docs", "notebooks")
             for p in (root / d).rglob("*") if p.suffix in (".py", ".md", ".ipynb")]
    found = [f"{p.relative_to(root)}: {m.group(0)}" for p in [*files, root / "README.md"]
             for m in pattern.finditer(p.read_text(errors="replace"))]
    assert not found, "name the layered module (workbook.contract.adapters, ...): " + \
        "; ".join(found)


def test_a_family_part_is_an_attribute_of_its_entry():
    import workbook as wb
    from workbook.notebooks.gates import settings

    assert wb.gates.settings is settings
    assert wb.archive.__package__ == "workbook.notebooks.resume"


def shadowed_parts(package) -> list[str]:
    """The parts of a family package that its entry (`__init__`) hides behind a name of its own
    (`from .launch import launch` makes `parallel.launch` the function, not the module):
    `from workbook.notebooks.parallel import <part>` would give the wrong object."""
    import importlib
    import pkgutil

    return sorted(part.name for part in pkgutil.iter_modules(package.__path__)
                  if importlib.import_module(f"{package.__name__}.{part.name}")  # imported first
                  is not getattr(package, part.name))


def test_a_part_hidden_by_its_entrys_name_is_found_and_a_distinct_one_is_not(tmp_path,
                                                                               monkeypatch):
    import sys

    family = tmp_path / "planted_family"
    family.mkdir()
    (family / "launches.py").write_text("def launch():\n    return 1\n")
    (family / "launch.py").write_text("def launch():\n    return 2\n")
    (family / "__init__.py").write_text("from .launch import launch\nfrom .launches import "
                                        "launch as launched\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import planted_family

    try:
        assert shadowed_parts(planted_family) == ["launch"]  # `launches` stays the module
    finally:
        for name in [n for n in sys.modules if n.startswith("planted_family")]:
            del sys.modules[name]


def test_every_family_part_is_reached_by_its_name():
    import importlib
    import pkgutil

    import workbook.notebooks as notebooks

    families = [importlib.import_module(f"{notebooks.__name__}.{m.name}")
                for m in pkgutil.iter_modules(notebooks.__path__) if m.ispkg]
    assert len(families) >= 7
    hidden = {f.__name__: found for f in families if (found := shadowed_parts(f))}
    assert not hidden, f"rename the part or the entry's name: {hidden}"


def test_a_family_part_is_in_the_notebooks_layer():
    """The notebooks' families are packages: their parts are seen by every rule above."""
    assert layer("workbook.notebooks.gates.settings") == "notebooks"
    assert {"workbook.notebooks.gates", "workbook.notebooks.gates.settings",
            "workbook.notebooks.rental.prices"} <= set(modules())
    assert "workbook.notebooks.gates.settings" in GRAPH["workbook.notebooks.gates"]


# --- a stored dataclass is declared once: its file's schema is derived from its fields --------
def _stored():
    from workbook.contract.shape import UpdateShape
    from workbook.notebooks.study import StudyDesign
    from workbook.training.launch_spec import LaunchBase
    from workbook.training.loop import TrainConfig
    from workbook.training.replica import ReplicaSpec
    from workbook.training.sharded_replica import ShardedSpec

    return [UpdateShape, TrainConfig, LaunchBase, ReplicaSpec, ShardedSpec, StudyDesign]


def test_no_schema_repeats_a_stored_dataclass_by_hand():
    """storage/schemas.py declares no model with a stored dataclass's fields (the schemas of
    UpdateShape, TrainConfig, the launch specs and StudyDesign are `schemas.derived` from the
    classes), and each derived schema has exactly its class's fields and defaults."""
    import pydantic

    from workbook.contract.shape import PRECISIONS, UpdateShape
    from workbook.storage import schemas

    stored = {cls: {f.name for f in dataclasses.fields(cls)} for cls in _stored()}
    by_hand = [name for name, model in vars(schemas).items() if isinstance(model, type)
               and issubclass(model, pydantic.BaseModel) and model.__module__ == schemas.__name__
               and any(set(model.model_fields) == names for names in stored.values())]
    assert not by_hand, f"schemas that repeat a stored dataclass: {by_hand}"
    for cls, names in stored.items():
        model = schemas.derived(cls)
        assert set(model.model_fields) == names, cls
        made = model.model_validate({"name": "n", "task": "a:b"} if "name" in names else
                                    {"task": "a:b"} if "task" in names else {})
        default = cls(**{k: v for k, v in made.model_dump().items() if k in ("name", "task")})
        assert made.model_dump() == dataclasses.asdict(default), cls
    precision = schemas.derived(UpdateShape).model_fields["precision"].annotation
    assert typing.get_args(precision) == tuple(PRECISIONS)


def test_architecture_names_every_module():
    """ARCHITECTURE.md draws the house as it is: every module and family of the package is
    named in it (in backticks; a part as its family's `_suffix`, e.g. `lightning` + `_hooks`)."""
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`([A-Za-z_][\w/.]*)`", text))

    def is_named(stem: str) -> bool:
        return stem in named or f"{stem}/" in named or any(
            stem.endswith(n) and stem[:-len(n)] in named for n in named if n.startswith("_"))

    missing = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if path.parent != PACKAGE and not is_named(
                         path.parent.name if path.stem in ("__init__", "__main__") else path.stem))
    assert not missing, f"name these in ARCHITECTURE.md: {missing}"
