"""Hostile and careless input, each a probe that plants one problem and reports how it was met:
`handled` (a clear WorkbookError or the right diagnosis, never a traceback or silent success),
`code_ran` (a marker file that code named in a folder would have created) and `left` (partial
folders or temporary files left behind). Used by tests/test_hostile.py and
benchmarks/hostile_inputs.py."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from workbook import TrainConfig, WorkbookError
from workbook.artifacts import reseal, seal_file
from workbook.checkpoint import load_checkpoint, load_state, save_checkpoint
from workbook.cli import main
from workbook.loop import UpdateShape

OWN = "tests.own_task:task"


@dataclass
class Outcome:
    handled: bool
    message: str = ""
    code_ran: bool = False
    left: list[str] = field(default_factory=list)
    skipped: str = ""  # why this machine cannot run the probe (then it proves nothing)


def _cli(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(args)
    return rc, err.getvalue()


def _refused(call: Callable, *words: str) -> Outcome:
    try:
        call()
    except WorkbookError as exc:
        return Outcome(all(w in str(exc) for w in words), str(exc))
    return Outcome(False, "accepted")


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if ".partial" in p.name or p.name.endswith(".tmp"))


def _checkpoint(tmp: Path) -> Path:
    model = torch.nn.Linear(4, 3)
    return save_checkpoint(tmp / "ckpt", model, torch.optim.AdamW(model.parameters()),
                           counters={"step": 1})


def _swap_task(path: Path, name: str, marker: Path, nested: str | None = None) -> None:
    """What an attacker with write access does: name `os:system` as the task, re-seal."""
    data = json.loads((path / name).read_text())
    target = data[nested] if nested else data
    target.update(task="os:system", task_options={"command": f"touch {marker}"})
    (path / name).write_text(json.dumps(data))
    _reseal(path, name)


def _reseal(path: Path, name: str) -> None:
    """Recompute whatever manifest covers `name`, as anyone who can write the folder can."""
    if (path / "manifest.json").exists():
        reseal(path)
    elif (path / f"{name}.manifest.json").exists():
        seal_file(path / name)


def archive_names_another_task(tmp: Path) -> Outcome:
    from workbook.archive import write_archive

    model = __import__("tests.own_task", fromlist=["task"]).task.build_model()
    path = write_archive(tmp / "archive", OWN, {}, model, {}, pd.DataFrame({"x": [1]}), [], 2)
    marker = tmp / "marker"
    _swap_task(path, "config.json", marker)
    rc, err = _cli(["reload", "--archive", str(path), "--task", OWN])
    return Outcome(rc == 2 and "records the task 'os:system'" in err, err, marker.exists())


def checkpoint_names_another_task(tmp: Path) -> Outcome:
    from workbook.resume import recipe, run_recipe

    spec = recipe(OWN, {}, TrainConfig(UpdateShape(4, 2), lr=1e-3), 64)
    run_recipe(spec, 2, tmp, checkpoint_at=(1,))
    path, marker = tmp / "ckpt-000001", tmp / "marker"
    _swap_task(path, "meta.json", marker, nested="recipe")
    rc, err = _cli(["resume", "--checkpoint", str(path), "--to", "2", "--out",
                    str(tmp / "out"), "--task", OWN])
    return Outcome(rc == 2 and "records the task 'os:system'" in err, err, marker.exists())


def _study(tmp: Path):
    from workbook.study import Study, StudyDesign

    design = StudyDesign(name="s", task=OWN, lrs=[1e-3], updates=4, shape=UpdateShape(4, 1),
                         eval_every=2, eval_batch=8, metric="accuracy", prediction_examples=0)
    study = Study(tmp / "study", design)
    study.ledger.close()
    return tmp / "study"


def design_names_another_task(tmp: Path) -> Outcome:
    folder, marker = _study(tmp), tmp / "marker"
    _swap_task(folder, "design.json", marker)
    rc, err = _cli(["trial", "--study", str(folder), "--task", OWN, "--lr", "0.001"])
    return Outcome(rc == 2 and "records the task 'os:system'" in err, err, marker.exists())


def design_not_json(tmp: Path) -> Outcome:
    from workbook.study import Study

    folder = _study(tmp)
    (folder / "design.json").write_text("{ not json")
    return _refused(lambda: Study(folder, task=OWN), "study design", "design.json")


def design_extended(tmp: Path) -> Outcome:
    from workbook.study import Study

    folder = _study(tmp)
    data = json.loads((folder / "design.json").read_text())
    (folder / "design.json").write_text(json.dumps({**data, "surprise": 1}))
    _reseal(folder, "design.json")
    return _refused(lambda: Study(folder, task=OWN), "not a study design this workbook wrote",
                    "surprise")


def design_edited(tmp: Path) -> Outcome:
    from workbook.study import Study

    folder = _study(tmp)
    data = json.loads((folder / "design.json").read_text())
    (folder / "design.json").write_text(json.dumps({**data, "updates": 10**9}))
    return _refused(lambda: Study(folder, task=OWN), "does not match design.json.manifest.json")


def ledger_truncated(tmp: Path) -> Outcome:
    from workbook.ledger import Ledger

    folder = _study(tmp)
    ledger = folder / "ledger.sqlite"
    for extra in ("-wal", "-shm"):
        Path(f"{ledger}{extra}").unlink(missing_ok=True)
    ledger.write_bytes(ledger.read_bytes()[:1500])
    return _refused(lambda: Ledger(ledger), "ledger", "cannot be opened")


def empty_manifest_with_a_changed_weight(tmp: Path) -> Outcome:
    path = _checkpoint(tmp)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    (path / "manifest.json").write_text("{}")
    return _refused(lambda: load_checkpoint(path, torch.nn.Linear(4, 3)), "lists no files")


def manifest_not_json(tmp: Path) -> Outcome:
    path = _checkpoint(tmp)
    (path / "manifest.json").write_text("nope")
    return _refused(lambda: load_state(path), "manifest.json is not valid JSON")


def extra_file(tmp: Path) -> Outcome:
    path = _checkpoint(tmp)
    (path / "notes.txt").write_text("hello")
    return _refused(lambda: load_state(path), "does not list: notes.txt")


def manifest_names_a_file_outside(tmp: Path) -> Outcome:
    path = _checkpoint(tmp)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["../secret"] = {"bytes": 1, "sha256": "0" * 64}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return _refused(lambda: load_state(path), "names files outside it")


def malicious_pickle(tmp: Path) -> Outcome:
    from workbook.resume import tamper_checks

    table = tamper_checks(_checkpoint(tmp), tmp)
    ran = bool(table["code ran"].fillna(False).any())
    return Outcome(bool(table.refused.all()), "; ".join(table.message), ran)


def _resealed(tmp: Path, name: str, data: bytes) -> Path:
    path = _checkpoint(tmp)
    (path / name).write_bytes(data)
    reseal(path)
    return path


def weights_of_another_shape(tmp: Path) -> Outcome:
    from safetensors.torch import save_model

    other = tmp / "other.safetensors"
    save_model(torch.nn.Linear(5, 3), str(other))
    path = _resealed(tmp, "model.safetensors", other.read_bytes())
    return _refused(lambda: load_checkpoint(path, torch.nn.Linear(4, 3)),
                    "cannot be loaded into the model")


def bad_safetensors_header(tmp: Path) -> Outcome:
    path = _resealed(tmp, "model.safetensors", b"\xff" * 8 + b"{garbage")
    return _refused(lambda: load_checkpoint(path, torch.nn.Linear(4, 3)),
                    "cannot be loaded into the model")


def empty_state(tmp: Path) -> Outcome:
    path = _resealed(tmp, "state.pt", b"")
    return _refused(lambda: load_state(path), "state.pt cannot be read")


def meta_not_json(tmp: Path) -> Outcome:
    path = _resealed(tmp, "meta.json", b"{oops")
    return _refused(lambda: load_checkpoint(path, torch.nn.Linear(4, 3)), "meta", "cannot read")


def resume_to_an_earlier_update(tmp: Path) -> Outcome:
    from workbook.resume import recipe, run_recipe

    spec = recipe(OWN, {}, TrainConfig(UpdateShape(4, 2), lr=1e-3), 64)
    run_recipe(spec, 3, tmp, checkpoint_at=(2,))
    rc, err = _cli(["resume", "--checkpoint", str(tmp / "ckpt-000002"), "--to", "1",
                    "--out", str(tmp / "out"), "--task", OWN])
    return Outcome(rc == 2 and "--to 1 lies before" in err, err)


def hostile_strings_in_the_report(tmp: Path) -> Outcome:
    from workbook.report import write_report as report

    evil = "<img src=x onerror=alert(1)>"
    (tmp / "03_phase_gates").mkdir()
    pd.DataFrame({"phase": [evil], "verdict": ["fail"], "detail": [evil]}).to_csv(
        tmp / "03_phase_gates" / "gates.csv", index=False)
    index = pd.DataFrame([{"notebook": "03_phase_gates", "verdict": "error", "seconds": 1.0,
                           "executed": f"{evil}.ipynb", "error": f"KeyError: {evil}"}])
    page = report(tmp, index, f"x:{evil}").read_text()
    return Outcome(evil not in page and "&lt;img" in page, page[:200])


@contextlib.contextmanager
def _full_disk(tmp: Path, size: str = "256k"):
    """A tiny tmpfs (root only): the disk fills up during the write."""
    mount = tmp / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, timeout=30)
    if done.returncode:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def full_disk_checkpoint(tmp: Path) -> Outcome:
    with _full_disk(tmp) as disk:
        if disk is None:
            return Outcome(False, skipped="tmpfs cannot be mounted here (not root?)")
        model = torch.nn.Linear(300, 300)  # 360 kB of weights, 720 kB of Adam state
        out = _refused(lambda: save_checkpoint(disk / "ckpt", model,
                                               torch.optim.AdamW(model.parameters())),
                       "cannot write checkpoint", "free disk space")
        out.left = sorted(p.name for p in disk.iterdir())
        return out


def full_disk_json(tmp: Path) -> Outcome:
    from workbook.runs import write_json

    with _full_disk(tmp, "64k") as disk:
        if disk is None:
            return Outcome(False, skipped="tmpfs cannot be mounted here (not root?)")
        out = _refused(lambda: write_json(disk / "index.json", {"x": "y" * 200_000}),
                       "cannot write", "index.json")
        out.left = sorted(p.name for p in disk.iterdir())
        return out


def out_under_a_file(tmp: Path) -> Outcome:
    from workbook.pilot import run_pilot

    (tmp / "file").write_text("x")
    return _refused(lambda: run_pilot(OWN, out=str(tmp / "file" / "run"), only="01"),
                    "cannot create the output folder")


def out_is_a_file(tmp: Path) -> Outcome:
    from workbook.pilot import run_pilot

    (tmp / "file").write_text("x")
    return _refused(lambda: run_pilot(OWN, out=str(tmp / "file"), only="01"), "is a file")


def only_names_nothing(tmp: Path) -> Outcome:
    from workbook.pilot import run_pilot

    out = _refused(lambda: run_pilot(OWN, out=str(tmp / "run"), only=","), "names no notebook")
    out.left = [p.name for p in tmp.iterdir()]
    return out


def pilot_option_as_parameter(tmp: Path) -> Outcome:
    from workbook.pilot import run_pilot

    return _refused(lambda: run_pilot(OWN, out=str(tmp / "run"), params={"out_dir": "/tmp"}),
                    "use --out instead of -p out_dir")


def cuda_without_a_gpu(tmp: Path) -> Outcome:
    from workbook.pilot import run_pilot

    if torch.cuda.is_available():
        return Outcome(False, skipped="a GPU is present")
    out = _refused(lambda: run_pilot(OWN, out=str(tmp / "run"), device="cuda"),
                   "no CUDA GPU is visible")
    out.left = [p.name for p in tmp.iterdir()]
    return out


def task_module_with_a_syntax_error(tmp: Path) -> Outcome:
    import sys

    (tmp / "broken_task_mod.py").write_text("def task(:\n    pass\n")
    sys.path.insert(0, str(tmp))
    try:
        from workbook import load_task

        return _refused(lambda: load_task("broken_task_mod:task"), "syntax error", "line 1")
    finally:
        sys.path.remove(str(tmp))


def _own_variant(**changes):
    import dataclasses

    from tests.own_task import task

    return dataclasses.replace(task, **changes)


def nan_in_inputs(tmp: Path) -> Outcome:
    from tests.own_task import data
    from workbook.inspection import inspect_task

    def encode(ex):
        item = dict(data[ex["id"]])
        if ex["id"] % 50 == 0:
            item["x"] = item["x"].clone()
            item["x"][0] = float("nan")
        return item

    ins = inspect_task(_own_variant(encode=encode), probe_size=8)
    checks = [f.check for f in ins.flags]
    return Outcome(checks == ["non-finite inputs"], str(checks))


def every_label_ignored(tmp: Path) -> Outcome:
    from tests.own_task import data
    from workbook.inspection import batch_view, inspect_task

    task = _own_variant(encode=lambda ex: {"x": data[ex["id"]]["x"],
                                           "labels": torch.tensor(-100)})
    try:
        ins = inspect_task(task, probe_size=4)
        batch_view(task, ins.items["train"][:2])
    except Exception as exc:  # the README's decode once crashed here
        return Outcome(False, repr(exc))
    return Outcome("zero targets" in [f.check for f in ins.flags], str(ins.flags[:1]))


PROBES: dict[str, Callable[[Path], Outcome]] = {
    f.__name__: f for f in [
        archive_names_another_task, checkpoint_names_another_task, design_names_another_task,
        design_not_json, design_extended, design_edited, ledger_truncated,
        empty_manifest_with_a_changed_weight,
        manifest_not_json, extra_file, manifest_names_a_file_outside, malicious_pickle,
        weights_of_another_shape, bad_safetensors_header, empty_state, meta_not_json,
        resume_to_an_earlier_update, hostile_strings_in_the_report, full_disk_checkpoint,
        full_disk_json, out_under_a_file, out_is_a_file, only_names_nothing,
        pilot_option_as_parameter, cuda_without_a_gpu, task_module_with_a_syntax_error,
        nan_in_inputs, every_label_ignored]}


def probe(name: str, folder: Path | None = None) -> Outcome:
    """Run one probe in `folder` (a new temporary one by default); records leftovers."""
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(folder or scratch)
        outcome = PROBES[name](tmp)
        outcome.left += _leftovers(tmp)
        shutil.rmtree(tmp / "small", ignore_errors=True)
        return outcome

