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
from workbook.commands.cli import main
from workbook.storage.artifacts import reseal
from workbook.storage.runs import seal_file
from workbook.training.checkpoint import load_checkpoint, load_state, save_checkpoint
from workbook.training.loop import UpdateShape

OWN = "tests.own_task:task"


@dataclass
class Outcome:
    handled: bool
    message: str = ""
    code_ran: bool = False
    left: list[str] = field(default_factory=list)
    skipped: str = ""  # why this machine cannot run the probe (then it proves nothing)
    sql_ran: bool = False  # SQL planted in a ledger ran (its effect is seen)
    overwritten: bool = False  # an output that existed before was changed


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
    from workbook.notebooks.resume.archive import write_archive

    model = __import__("tests.own_task", fromlist=["task"]).task.build_model()
    path = write_archive(tmp / "archive", OWN, {}, model, {}, pd.DataFrame({"x": [1]}), [], 2)
    marker = tmp / "marker"
    _swap_task(path, "config.json", marker)
    rc, err = _cli(["reload", "--archive", str(path), "--task", OWN])
    return Outcome(rc == 2 and "records the task 'os:system'" in err, err, marker.exists())


def checkpoint_names_another_task(tmp: Path) -> Outcome:
    from workbook.notebooks.resume import recipe, run_recipe

    spec = recipe(OWN, {}, TrainConfig(UpdateShape(4, 2), lr=1e-3), 64)
    run_recipe(spec, 2, tmp, checkpoint_at=(1,))
    path, marker = tmp / "ckpt-000001", tmp / "marker"
    _swap_task(path, "meta.json", marker, nested="recipe")
    rc, err = _cli(["resume", "--checkpoint", str(path), "--to", "2", "--out",
                    str(tmp / "out"), "--task", OWN])
    return Outcome(rc == 2 and "records the task 'os:system'" in err, err, marker.exists())


def _study(tmp: Path):
    from workbook.notebooks.study import Study, StudyDesign

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
    from workbook.notebooks.study import Study

    folder = _study(tmp)
    (folder / "design.json").write_text("{ not json")
    return _refused(lambda: Study(folder, task=OWN), "study design", "design.json")


def design_extended(tmp: Path) -> Outcome:
    from workbook.notebooks.study import Study

    folder = _study(tmp)
    data = json.loads((folder / "design.json").read_text())
    (folder / "design.json").write_text(json.dumps({**data, "surprise": 1}))
    _reseal(folder, "design.json")
    return _refused(lambda: Study(folder, task=OWN), "not a study design this workbook wrote",
                    "surprise")


def design_edited(tmp: Path) -> Outcome:
    from workbook.notebooks.study import Study

    folder = _study(tmp)
    data = json.loads((folder / "design.json").read_text())
    (folder / "design.json").write_text(json.dumps({**data, "updates": 10**9}))
    return _refused(lambda: Study(folder, task=OWN), "does not match design.json.manifest.json")


def ledger_truncated(tmp: Path) -> Outcome:
    from workbook.storage.ledger import Ledger

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
    from workbook.notebooks.resume import tamper_checks

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
    return _refused(lambda: load_checkpoint(path, torch.nn.Linear(4, 3)),
                    "meta.json is not valid JSON", "checkpoint meta")


def resume_to_an_earlier_update(tmp: Path) -> Outcome:
    from workbook.notebooks.resume import recipe, run_recipe

    spec = recipe(OWN, {}, TrainConfig(UpdateShape(4, 2), lr=1e-3), 64)
    run_recipe(spec, 3, tmp, checkpoint_at=(2,))
    rc, err = _cli(["resume", "--checkpoint", str(tmp / "ckpt-000002"), "--to", "1",
                    "--out", str(tmp / "out"), "--task", OWN])
    return Outcome(rc == 2 and "--to 1 lies before" in err, err)


def hostile_strings_in_the_report(tmp: Path) -> Outcome:
    from workbook.commands.report import write_report as report

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
                       "cannot write checkpoint", f"free space on {disk}")
        out.left = sorted(p.name for p in disk.iterdir())
        return out


def full_disk_json(tmp: Path) -> Outcome:
    from workbook.storage.files import write_json

    with _full_disk(tmp, "64k") as disk:
        if disk is None:
            return Outcome(False, skipped="tmpfs cannot be mounted here (not root?)")
        out = _refused(lambda: write_json(disk / "index.json", {"x": "y" * 200_000}),
                       "cannot write", "index.json")
        out.left = sorted(p.name for p in disk.iterdir())
        return out


def out_under_a_file(tmp: Path) -> Outcome:
    from workbook.commands.pilot import run_pilot

    (tmp / "file").write_text("x")
    return _refused(lambda: run_pilot(OWN, out=str(tmp / "file" / "run"), only="01"),
                    "cannot create the output folder")


def out_is_a_file(tmp: Path) -> Outcome:
    from workbook.commands.pilot import run_pilot

    (tmp / "file").write_text("x")
    return _refused(lambda: run_pilot(OWN, out=str(tmp / "file"), only="01"), "is a file")


def only_names_nothing(tmp: Path) -> Outcome:
    from workbook.commands.pilot import run_pilot

    out = _refused(lambda: run_pilot(OWN, out=str(tmp / "run"), only=","), "names no notebook")
    out.left = [p.name for p in tmp.iterdir()]
    return out


def pilot_option_as_parameter(tmp: Path) -> Outcome:
    from workbook.commands.pilot import run_pilot

    return _refused(lambda: run_pilot(OWN, out=str(tmp / "run"), params={"out_dir": "/tmp"}),
                    "use --out instead of -p out_dir")


def cuda_without_a_gpu(tmp: Path) -> Outcome:
    from workbook.commands.pilot import run_pilot

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
    from workbook.notebooks.inspection import inspect_task

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
    from workbook.notebooks.inspection import batch_view, inspect_task

    task = _own_variant(encode=lambda ex: {"x": data[ex["id"]]["x"],
                                           "labels": torch.tensor(-100)})
    try:
        ins = inspect_task(task, probe_size=4)
        batch_view(task, ins.items["train"][:2])
    except Exception as exc:  # the README's decode once crashed here
        return Outcome(False, repr(exc))
    return Outcome("zero targets" in [f.check for f in ins.flags], str(ins.flags[:1]))


# --- fields of the wrong type, range or shape in files the workbook wrote -------------------
def _resume_checkpoint(tmp: Path) -> Path:
    """A checkpoint of notebook 07's run (own task): after update 2 of 4."""
    from workbook.notebooks.resume import recipe, run_recipe

    spec = recipe(OWN, {}, TrainConfig(UpdateShape(4, 2), lr=1e-3), 64)
    run_recipe(spec, 2, tmp, checkpoint_at=(2,))
    return tmp / "ckpt-000002"


def _edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    _reseal(path.parent, path.name)


def _edit_state(path: Path, edit: Callable[[dict], object]) -> None:
    state = torch.load(path / "state.pt", weights_only=True)
    state = edit(state) or state
    torch.save(state, path / "state.pt")
    reseal(path)


def _resume(tmp: Path, path: Path, *words: str) -> Outcome:
    rc, err = _cli(["resume", "--checkpoint", str(path), "--to", "4", "--out",
                    str(tmp / "out"), "--task", OWN])
    return Outcome(rc == 2 and all(w in err for w in words), err[-400:])


def _state_probe(edit: Callable[[dict], object], *words: str) -> Callable[[Path], Outcome]:
    def run(tmp: Path) -> Outcome:
        path = _resume_checkpoint(tmp)
        _edit_state(path, edit)
        return _resume(tmp, path, *words)
    return run


def _meta_probe(edit: Callable[[dict], object], *words: str) -> Callable[[Path], Outcome]:
    def run(tmp: Path) -> Outcome:
        path = _resume_checkpoint(tmp)
        _edit_json(path / "meta.json", edit)
        return _resume(tmp, path, *words)
    return run


def _set(where: str, value: object) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        *parents, last = where.split(".")
        for key in parents:
            data = data[key]
        data[last] = value
    return edit


state_is_a_list = _state_probe(lambda s: [1, 2, 3], "checkpoint state", "should be a valid "
                               "dictionary")
state_without_random_states = _state_probe(lambda s: s.pop("rng") and None,
                                           "field 'rng' is missing")
state_without_counters = _state_probe(lambda s: s.pop("counters") and None,
                                      "field 'counters' is missing")
counter_five = _state_probe(_set("counters.step", "five"), "field 'counters.step'",
                            "'five'")
negative_step = _state_probe(_set("counters.step", -3), "field 'counters.step'",
                             "greater than or equal to 0")
negative_data_position = _state_probe(_set("counters.group", -1), "field 'counters.group'")
position_beyond_the_pass = _state_probe(_set("counters.group", 10**6), "beyond the pass")
step_not_the_position = _state_probe(_set("counters.step", 7), "its step 7 is not the one")
numpy_state_cut_short = _state_probe(
    lambda s: s["rng"]["numpy"].__setitem__(1, s["rng"]["numpy"][1][:10]) and None,
    "NumPy's keys must be a torch.int64 tensor of shape (624,)")
threads_zero = _meta_probe(_set("threads", 0), "field 'threads'", "greater than or equal to 1")
threads_nan = _meta_probe(_set("threads", float("nan")), "field 'threads'")
threads_many = _meta_probe(_set("threads", "many"), "field 'threads'", "'many'")
options_a_list = _meta_probe(_set("recipe.task_options", []), "field 'recipe.task_options'",
                             "valid dictionary")
grad_clip_nan = _meta_probe(_set("recipe.config.grad_clip", float("nan")),
                            "field 'recipe.config.grad_clip'", "finite number")
string_learning_rate = _meta_probe(_set("recipe.config.lr", "1e-3"),
                                   "field 'recipe.config.lr'", "valid number")
negative_train_limit = _meta_probe(_set("recipe.train_limit", -5), "field 'recipe.train_limit'")


def huge_integer_in_meta(tmp: Path) -> Outcome:
    import re

    path = _resume_checkpoint(tmp)
    text = re.sub(r'"threads": \d+', '"threads": ' + "9" * 5000, (path / "meta.json").read_text())
    (path / "meta.json").write_text(text)
    reseal(path)
    return _resume(tmp, path, "an integer of 5000 digits")


def deeply_nested_meta(tmp: Path) -> Outcome:
    path = _resume_checkpoint(tmp)
    data = json.loads((path / "meta.json").read_text())
    text = json.dumps(data)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (path / "meta.json").write_text(text)
    reseal(path)
    return _resume(tmp, path, "nests arrays or objects 100001 deep")


def manifest_entry_of_the_wrong_type(tmp: Path) -> Outcome:
    path = _checkpoint(tmp)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["state.pt"]["bytes"] = str(manifest["files"]["state.pt"]["bytes"])
    (path / "manifest.json").write_text(json.dumps(manifest))
    return _refused(lambda: load_state(path), "field 'files.state.pt.bytes'")


def weights_in_another_dtype(tmp: Path) -> Outcome:
    from safetensors.torch import save_model

    path = _checkpoint(tmp)
    save_model(torch.nn.Linear(4, 3).half(), str(path / "model.safetensors"))
    reseal(path)
    return _refused(lambda: load_checkpoint(path, torch.nn.Linear(4, 3)),
                    "is stored as float16, the model's is float32")


def optimizer_state_of_another_shape(tmp: Path) -> Outcome:
    path = _resume_checkpoint(tmp)

    def edit(state: dict) -> None:
        moments = state["optimizer"]["state"][0]
        moments["exp_avg"] = torch.zeros(3, 3)
    _edit_state(path, edit)
    return _resume(tmp, path, "the optimizer state does not fit", "state[0]['exp_avg'] has "
                   "shape (3, 3)")


def optimizer_state_in_another_dtype(tmp: Path) -> Outcome:
    path = _resume_checkpoint(tmp)

    def edit(state: dict) -> None:
        moments = state["optimizer"]["state"][1]
        moments["exp_avg_sq"] = moments["exp_avg_sq"].half()
    _edit_state(path, edit)
    return _resume(tmp, path, "state[1]['exp_avg_sq'] is stored as float16")


def _archive(tmp: Path) -> Path:
    from workbook.notebooks.resume.archive import write_archive

    model = __import__("tests.own_task", fromlist=["task"]).task.build_model()
    return write_archive(tmp / "archive", OWN, {}, model, {}, pd.DataFrame({"x": [1]}), [], 2)


def _reload(path: Path, *words: str) -> Outcome:
    rc, err = _cli(["reload", "--archive", str(path), "--task", OWN])
    return Outcome(rc == 2 and all(w in err for w in words), err[-400:])


def control_outputs_of_dtype_bool(tmp: Path) -> Outcome:
    from safetensors.torch import save_file

    path = _archive(tmp)
    save_file({"logits": torch.ones(2, 2, dtype=torch.bool)},
              str(path / "control_outputs.safetensors"))
    reseal(path)
    return _reload(path, "control_outputs.safetensors", "stored as bool")


def archive_options_a_list(tmp: Path) -> Outcome:
    path = _archive(tmp)
    _edit_json(path / "config.json", _set("task_options", ["a"]))
    return _reload(path, "field 'task_options'")


def control_inputs_not_strings(tmp: Path) -> Outcome:
    path = _archive(tmp)
    (path / "control_inputs.json").write_text(json.dumps([{"id": 1}, 2]))
    reseal(path)
    return _reload(path, "control_inputs.json", "field 'ids[0]'")


def _design_probe(edit: Callable[[dict], object], *words: str) -> Callable[[Path], Outcome]:
    def run(tmp: Path) -> Outcome:
        from workbook.notebooks.study import Study

        folder = _study(tmp)
        _edit_json(folder / "design.json", edit)
        return _refused(lambda: Study(folder, task=OWN), *words)
    return run


design_divergence_nan = _design_probe(_set("divergence_multiple", float("nan")),
                                      "field 'divergence_multiple'", "finite number")
design_lr_a_string = _design_probe(_set("lrs", ["0.001"]), "field 'lrs[0]'")
design_negative_seed = _design_probe(_set("seeds", [-1]), "field 'seeds[0]'")
design_shape_of_the_wrong_type = _design_probe(_set("shape", [4, 1]), "field 'shape'")


def design_nested_deep(tmp: Path) -> Outcome:
    from workbook.notebooks.study import Study

    folder = _study(tmp)
    text = (folder / "design.json").read_text().rstrip()[:-1] + ', "x": ' + "[" * 5000 + \
        "]" * 5000 + "}"
    (folder / "design.json").write_text(text)
    _reseal(folder, "design.json")
    return _refused(lambda: Study(folder, task=OWN), "nests arrays or objects 5001 deep")


def resumed_records_of_the_wrong_type(tmp: Path) -> Outcome:
    from workbook.notebooks.resume import read_records

    (tmp / "r.json").write_text(json.dumps([{"step": "1", "epoch": 0, "loss": 1.0, "lr": 0.1,
                                             "ids": []}]))
    return _refused(lambda: read_records(tmp / "r.json"), "field 'records[0].step'")


def result_with_a_huge_exit_code(tmp: Path) -> Outcome:
    from workbook.storage.processes import read_result

    (tmp / "r.json").write_text('{"exit_code": ' + "1" * 5000 + ', "result": null, '
                                '"error": null}')
    return Outcome(read_result(tmp / "r.json") is None, "no result: not in the format")


def _no_result(text: str) -> Callable[[Path], Outcome]:
    def run(tmp: Path) -> Outcome:
        from workbook.storage.processes import read_result

        (tmp / "r.json").write_text(text)
        return Outcome(read_result(tmp / "r.json") is None, "no result: not in the format")
    return run


result_error_not_a_record = _no_result('{"exit_code": 1, "result": null, "error": "boom"}')
result_nested_deep = _no_result('{"exit_code": 0, "result": {"x": ' + "[" * 100_000 +
                                "]" * 100_000 + '}, "error": null}')
result_exit_code_a_boolean = _no_result('{"exit_code": true, "result": {}, "error": null}')


def task_prints_while_loading(tmp: Path) -> Outcome:
    """A task that prints (a forged result among it) while the fresh `reload` loads it: the
    result comes from the file the child hands back, so the reload is identical."""
    from workbook.notebooks.resume.archive import reload_in_new_process, write_archive

    noisy = "tests.noisy_task:task"
    quiet = io.TextIOWrapper(io.BytesIO())  # its prints here (bytes too) stay out of the way
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        model = __import__("tests.noisy_task", fromlist=["task"]).task.build_model()
        path = write_archive(tmp / "archive", noisy, {}, model, {}, pd.DataFrame({"x": [1]}),
                             [], 2)
    reloaded = reload_in_new_process(path, noisy)
    return Outcome(reloaded.get("identical") is True and "error" not in reloaded, str(reloaded))


# --- links ----------------------------------------------------------------------------------
def _linked(tmp: Path, name: str) -> Path:
    path = _checkpoint(tmp)
    outside = tmp / f"outside-{name}"
    (path / name).rename(outside)
    (path / name).symlink_to(outside)
    reseal(path)  # a forger's tool follows the link
    return path


def state_is_a_link_outside(tmp: Path) -> Outcome:
    path = _linked(tmp, "state.pt")
    return _refused(lambda: load_state(path), "state.pt is a symbolic link")


def weights_are_a_link_outside(tmp: Path) -> Outcome:
    path = _linked(tmp, "model.safetensors")
    return _refused(lambda: load_checkpoint(path, torch.nn.Linear(4, 3)),
                    "model.safetensors is a symbolic link")


def manifest_is_a_link(tmp: Path) -> Outcome:
    path = _checkpoint(tmp)
    (path / "manifest.json").rename(tmp / "m.json")
    (path / "manifest.json").symlink_to(tmp / "m.json")
    return _refused(lambda: load_state(path), "manifest.json is a symbolic link")


def checkpoint_folder_is_a_link(tmp: Path) -> Outcome:
    path = _checkpoint(tmp)
    (tmp / "link").symlink_to(path)
    return _refused(lambda: load_state(tmp / "link"), "is a symbolic link")


def archive_config_is_a_link(tmp: Path) -> Outcome:
    path = _archive(tmp)
    (path / "config.json").rename(tmp / "config.json")
    (path / "config.json").symlink_to(tmp / "config.json")
    reseal(path)
    return _reload(path, "config.json is a symbolic link")


def design_is_a_link(tmp: Path) -> Outcome:
    from workbook.notebooks.study import Study

    folder = _study(tmp)
    (folder / "design.json").rename(tmp / "design.json")
    (folder / "design.json").symlink_to(tmp / "design.json")
    return _refused(lambda: Study(folder, task=OWN), "design.json is a symbolic link")


def named_pipe_in_a_checkpoint(tmp: Path) -> Outcome:
    import os

    path = _checkpoint(tmp)
    (path / "state.pt").unlink()
    os.mkfifo(path / "state.pt")
    return _refused(lambda: load_state(path), "state.pt is a named pipe")


# --- the ledger -----------------------------------------------------------------------------
def _ledger(tmp: Path, trials: int = 2) -> Path:
    from workbook.storage.ledger import Ledger

    folder = tmp / "study"
    folder.mkdir()
    ledger = Ledger(folder / "ledger.sqlite")
    ledger.add_study("s", "design.json")
    for n in range(trials):
        tid = ledger.start_trial("s", {"lr": 0.1 * (n + 1), "seed": 0}, "repro")
        (folder / "trials" / str(tid)).mkdir(parents=True)
        ledger.end_trial(tid, "finished", "", 1)
    ledger.close()
    return folder / "ledger.sqlite"


def _sql(path: Path, *statements: str) -> None:
    import sqlite3

    db = sqlite3.connect(path, isolation_level=None)
    for statement in statements:
        db.execute(statement)
    db.close()


def _rows(path: Path, table: str = "trials") -> int:
    import sqlite3

    db = sqlite3.connect(path)
    try:
        return db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    finally:
        db.close()


def _planted(statement: str, *words: str, write: bool = True) -> Callable[[Path], Outcome]:
    def run(tmp: Path) -> Outcome:
        from workbook.storage.ledger import Ledger

        path = _ledger(tmp)
        _sql(path, statement)
        before = path.read_bytes()

        def use() -> None:
            ledger = Ledger(path)
            if write:
                ledger.start_trial("s", {"lr": 0.5, "seed": 0}, "repro")
            ledger.close()
        out = _refused(use, *words)
        out.sql_ran = _rows(path) != 2
        out.handled = out.handled and path.read_bytes() == before
        return out
    return run


trigger_that_deletes_rows = _planted(
    "CREATE TRIGGER wipe AFTER INSERT ON trials BEGIN DELETE FROM trials; END",
    "holds a trigger 'wipe'")
trigger_on_update = _planted(
    "CREATE TRIGGER wipe2 AFTER UPDATE ON trials BEGIN DELETE FROM trials; END",
    "holds a trigger 'wipe2'")
view_planted = _planted("CREATE VIEW v AS SELECT * FROM trials", "holds a view 'v'")
foreign_table = _planted("CREATE TABLE notes (x)", "holds a table 'notes'")
foreign_column = _planted("ALTER TABLE trials ADD COLUMN extra TEXT",
                          "the column(s) 'extra' the workbook did not create")


def ledger_of_zero_bytes(tmp: Path) -> Outcome:
    from workbook.storage.ledger import Ledger

    path = _ledger(tmp)
    for extra in ("-wal", "-shm"):
        Path(f"{path}{extra}").unlink(missing_ok=True)
    path.write_bytes(b"")
    out = _refused(lambda: Ledger(path), "is empty (0 bytes)")
    out.handled = out.handled and path.stat().st_size == 0
    return out


def ledger_missing_a_column(tmp: Path) -> Outcome:
    from workbook.storage.ledger import Ledger

    path = _ledger(tmp)
    _sql(path, "ALTER TABLE trials DROP COLUMN repro")
    return _refused(lambda: Ledger(path), "lacks the column(s) 'repro'")


def trial_parameters_of_the_wrong_type(tmp: Path) -> Outcome:
    from workbook.notebooks.study import Study

    folder = _study(tmp)
    study = Study(folder, task=OWN)
    study.ledger.start_trial("s", {"lr": 0.1, "seed": 0}, "repro")
    study.ledger.db.execute("UPDATE trials SET params = '[1, 2]'")
    try:
        return _refused(study.trial_table, "trial's parameters", "valid dictionary")
    finally:
        study.ledger.close()


def ledger_locked_by_another_process(tmp: Path) -> Outcome:
    import subprocess
    import sys

    from workbook.storage import ledger as module
    from workbook.storage.ledger import Ledger

    path = _ledger(tmp)
    hold = ("import sqlite3, sys\ndb = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "db.execute('BEGIN IMMEDIATE')\nprint('held', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", hold, str(path)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    before, module.BUSY_S = module.BUSY_S, 0.5
    try:
        proc.stdout.readline()
        ledger = Ledger(path)
        try:
            return _refused(lambda: ledger.start_trial("s", {"lr": 1.0, "seed": 0}, "r"),
                            f"locked by another process (pid {proc.pid})")
        finally:
            ledger.close()
    finally:
        module.BUSY_S = before
        proc.stdin.close()
        proc.wait(timeout=30)


# --- nothing is overwritten -----------------------------------------------------------------
def _kept(path: Path, call: Callable[[], object], *words: str) -> Outcome:
    """`call` must refuse to write over `path`, which stays byte for byte as it was."""
    before = path.read_bytes() if path.is_file() else sorted(p.name for p in path.iterdir())
    try:
        result = call()
        out = Outcome(isinstance(result, int) and result == 2, f"returned {result!r}")
    except WorkbookError as exc:
        out = Outcome(all(w in str(exc) for w in words), str(exc))
    after = path.read_bytes() if path.is_file() else sorted(p.name for p in path.iterdir())
    out.overwritten = after != before
    return out


def resume_out_exists(tmp: Path) -> Outcome:
    path = _resume_checkpoint(tmp)
    (tmp / "out.json").write_text("mine")
    return _kept(tmp / "out.json", lambda: _cli(["resume", "--checkpoint", str(path), "--to", "4",
                                                 "--out", str(tmp / "out"), "--task", OWN])[0])


def result_file_exists(tmp: Path) -> Outcome:
    path = _archive(tmp)
    (tmp / "r.json").write_text("mine")
    return _kept(tmp / "r.json", lambda: _cli(["reload", "--archive", str(path), "--task", OWN,
                                               "--result", str(tmp / "r.json")])[0])


def pilot_out_holds_a_run(tmp: Path) -> Outcome:
    from workbook.commands.pilot import run_pilot

    (tmp / "run").mkdir()
    (tmp / "run" / "index.json").write_text("{}")
    return _kept(tmp / "run" / "index.json",
                 lambda: run_pilot(OWN, out=str(tmp / "run"), only="01"), "already holds a run")


def two_pilots_claim_one_out(tmp: Path) -> Outcome:
    from workbook.storage.runs import claim_dir

    claim_dir(tmp / "run")
    return _kept(tmp / "run" / ".workbook-claim", lambda: claim_dir(tmp / "run"),
                 "already holds a run")


def checkpoint_over_an_existing_one(tmp: Path) -> Outcome:
    path = _checkpoint(tmp)
    return _kept(path / "model.safetensors", lambda: save_checkpoint(path, torch.nn.Linear(4, 3)),
                 "checkpoint", "already exists")


def archive_over_an_existing_one(tmp: Path) -> Outcome:
    from workbook.notebooks.resume.archive import write_archive

    path = _archive(tmp)
    model = __import__("tests.own_task", fromlist=["task"]).task.build_model()
    return _kept(path / "config.json", lambda: write_archive(
        path, OWN, {}, model, {}, pd.DataFrame({"x": [1]}), [], 2), "already exists")


def ddp_launch_folder_used_twice(tmp: Path) -> Outcome:
    import argparse
    import os

    from workbook.notebooks.parallel.process import claim_launch

    args = argparse.Namespace(spec="{}", out=str(tmp / "launch"), resume_from=None, then=[])
    env = {"RANK": "0", "WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        claim_launch(args)
        (tmp / "launch" / "result.json").write_text("first launch")
        return _kept(tmp / "launch" / "result.json", lambda: claim_launch(args),
                     "already holds a run")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def archive_files_get_the_umask_mode(tmp: Path) -> Outcome:
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = _archive(tmp)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    return Outcome(set(modes.values()) == {0o644}, str(modes))


# --- suggested commands are shell-safe ------------------------------------------------------
def _pasted(command: str, tmp: Path) -> Outcome:
    """Paste `command` into bash in place of running it (its words printed): nothing in it
    may run, and bash must see the words the workbook meant."""
    import shlex
    import subprocess

    done = subprocess.run(["bash", "-c", "printf '%s\\n' " + command.split(" ", 1)[1]],
                          cwd=tmp, capture_output=True, text=True, timeout=30)
    words = done.stdout.splitlines()
    ran = (tmp / "PWNED").exists()
    return Outcome(not ran and words == shlex.split(command)[1:], command[:160], ran)


EVIL = "x$(touch PWNED)`touch PWNED`;touch PWNED"


def repro_with_a_hostile_task_name(tmp: Path) -> Outcome:
    from workbook.storage.processes import task_args, workbook_command

    return _pasted(workbook_command(["trial", *task_args(f"{EVIL}:task", {})]), tmp)


def repro_with_a_hostile_option(tmp: Path) -> Outcome:
    from workbook.storage.processes import task_args, workbook_command

    return _pasted(workbook_command(["pilot", *task_args(OWN, {"n": f"'; {EVIL} #"})]), tmp)


def study_repro_with_a_hostile_folder(tmp: Path) -> Outcome:
    from workbook.notebooks.study import Study

    folder = _study(tmp)
    evil = folder.rename(tmp / f"s {EVIL}")
    study = Study(evil, task=OWN)
    try:
        return _pasted(study.repro(1e-3, 0, 1), tmp)
    finally:
        study.ledger.close()


def ddp_fix_with_a_hostile_spec(tmp: Path) -> Outcome:
    rc, err = _cli(["ddp", "--spec", f'{{"task": "{EVIL}"}}', "--out", str(tmp / EVIL)])
    line = next((ln for ln in err.splitlines() if "torchrun --standalone" in ln), "")
    command = line[line.index("torchrun"):] if line else ""
    if rc != 2 or not command:
        return Outcome(False, err)
    return _pasted(command, tmp)


def timeout_fix_with_a_hostile_path(tmp: Path) -> Outcome:
    from workbook.storage.processes import fresh_process

    try:
        fresh_process(["reload", "--archive", str(tmp / EVIL), "--task", OWN], 0.01)
    except WorkbookError as exc:
        command = exc.fix[exc.fix.index("python"):exc.fix.index(" by hand")]
        return _pasted(command, tmp)
    return Outcome(False, "no timeout")


# --- parameters that cannot mean anything ---------------------------------------------------
def _cli_exit(args: list[str]) -> tuple[int, str]:
    """`_cli`, where argparse's own refusal (SystemExit 2) counts as an exit code."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(args)
        except SystemExit as exc:
            rc = exc.code
    return rc, err.getvalue()


def _cli_refused(args: list[str], *words: str) -> Callable[[Path], Outcome]:
    def run(tmp: Path) -> Outcome:
        rc, err = _cli_exit([a.replace("TMP", str(tmp)) for a in args])
        return Outcome(rc == 2 and all(w in err for w in words), err[-300:])
    return run


timeout_infinite = _cli_refused(["pilot", "--timeout", "inf", "--out", "TMP/r"],
                                "'inf' is not a positive finite number of seconds")
timeout_nan = _cli_refused(["pilot", "--timeout", "nan", "--out", "TMP/r"],
                           "'nan' is not a positive finite number")
timeout_negative = _cli_refused(["pilot", "--timeout", "-5", "--out", "TMP/r"],
                                "'-5' is not a positive finite number")
many_unary_minus_signs = _cli_refused(["pilot", "-p", "budget=" + "-" * 100_000 + "1"],
                                      "longer than")
budget_overflows = _cli_refused(["pilot", "--task", OWN, "-p", "budget=1e999", "--out",
                                 "TMP/r"], "parameter 'budget'")
probe_size_negative = _cli_refused(["pilot", "--task", OWN, "-p", "probe_size=-3", "--out",
                                    "TMP/r"], "parameter 'probe_size'")
utilisation_zero = _cli_refused(["pilot", "--task", OWN, "-p", "utilisation=0", "--out",
                                 "TMP/r"], "parameter 'utilisation'", "(0, 1]")
seed_beyond_numpy = _cli_refused(["trial", "--study", "TMP", "--task", OWN, "--lr", "0.1",
                                  "--seed", str(2**32)], "outside 0..4294967295")
trial_lr_nan = _cli_refused(["trial", "--study", "TMP", "--task", OWN, "--lr", "nan"],
                            "not a positive finite number")


# --- the user's own pieces raising ----------------------------------------------------------
def _piece(call: Callable[[], object], *words: str) -> Callable[[Path], Outcome]:
    def run(tmp: Path) -> Outcome:
        return _refused(call, *words)
    return run


def _prepared(**changes):
    from workbook.contract.data import prepare

    return lambda: prepare(_own_variant(**changes))


def _raises(*_):
    raise RuntimeError("disk on fire")


model_factory_returns_a_class = _piece(
    lambda: _own_variant(build_model=lambda: torch.nn.Linear).build_model(),
    "build_model returned a type, not a torch.nn.Module")
model_factory_raises = _piece(lambda: _own_variant(build_model=_raises).build_model(),
                              "the task's build_model failed: RuntimeError: disk on fire")
examples_not_dicts = _piece(_prepared(load_examples=lambda: [[1, 2], [3, 4]]),
                            "raw examples are not dicts")
load_examples_raises = _piece(_prepared(load_examples=_raises),
                              "the task's load_examples failed: disk on fire")
encode_raises = _piece(_prepared(encode=_raises), "encode failed on example", "disk on fire")


def collate_raises(tmp: Path) -> Outcome:
    from workbook.contract.data import collate_items, prepare

    task = _own_variant(collate=_raises)
    items = prepare(task).train[:2]
    return _refused(lambda: collate_items(task, items), "the task's collate raised "
                    "RuntimeError (disk on fire) on a batch of 2 examples")


def save_state_raises(tmp: Path) -> Outcome:
    model = torch.nn.Linear(4, 3)
    out = _refused(lambda: save_checkpoint(tmp / "c", model, own=_raises),
                   "the task's save_state failed: disk on fire")
    out.handled = out.handled and not (tmp / "c").exists()
    return out


# --- a full disk ----------------------------------------------------------------------------
def _on_full_disk(size: str, write: Callable[[Path], object], *words: str
                  ) -> Callable[[Path], Outcome]:
    def run(tmp: Path) -> Outcome:
        with _full_disk(tmp, size) as disk:
            if disk is None:
                return Outcome(False, skipped="tmpfs cannot be mounted here (not root?)")
            out = _refused(lambda: write(disk), *[w.replace("DISK", str(disk)) for w in words])
            out.left = sorted(p.name for p in disk.rglob("*") if "src" not in p.parts)
            return out
    return run


def _archive_on(disk: Path) -> None:
    from workbook.notebooks.resume.archive import write_archive

    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 300_000))
    task = __import__("tests.own_task", fromlist=["task"]).task
    task.build_model  # noqa: B018 - the task is the own task; the model is only written
    write_archive(disk / "archive", OWN, {}, model, {}, pd.DataFrame({"x": [1]}), [], 2)


def _tampered_copy_on(disk: Path) -> None:
    from workbook.storage.artifacts import copy_folder

    (disk / "src").mkdir()
    (disk / "src" / "big").write_bytes(b"x" * 150_000)
    copy_folder(disk / "src", disk / "copy", {"more": b"y" * 200_000})


def _figure_on(disk: Path) -> None:
    import numpy as np

    from workbook.notebooks.plots import _done

    plt = __import__("matplotlib.pyplot", fromlist=["figure"])
    fig = plt.figure(figsize=(6, 6))
    plt.imshow(np.random.default_rng(0).random((600, 600)), interpolation="nearest")
    _done(fig, disk / "figure.png")


def _weights_on(disk: Path) -> None:
    from safetensors.torch import save_file

    from workbook.storage.artifacts import write_file

    write_file(disk / "w.safetensors", lambda tmp: save_file({"w": torch.zeros(200_000)},
                                                             str(tmp)), "resumed weights")


full_disk_archive = _on_full_disk("512k", _archive_on, "cannot write archive",
                                  "free space on DISK")
full_disk_tampered_copy = _on_full_disk("256k", _tampered_copy_on, "cannot write copy",
                                        "free space on DISK")
full_disk_figure = _on_full_disk("256k", _figure_on, "cannot write figure", "figure.png",
                                 "free space on DISK")
full_disk_weights = _on_full_disk("256k", _weights_on, "cannot write resumed weights",
                                  "free space on DISK")


def full_disk_during_07(tmp: Path) -> Outcome:
    """The pilot's run folder on a disk that fills during 07: the row names the path and the
    fix, index.json and report.html are written, and no 0-byte or truncated file is left under
    a final name. The pilot runs in this process (`workbook pilot` as the command line calls
    it; its kernel is a process of its own): a full disk needs no process of the pilot's own."""
    # 54 kB beside the pilot's 4 MiB reserve: full within 07's first cells (with 154 kB its
    # whole run cell fitted first, 10 s more)
    with _full_disk(tmp, "4150k") as disk:
        if disk is None:
            return Outcome(False, skipped="tmpfs cannot be mounted here (not root?)")
        out = disk / "run"
        rc, err = _cli(["pilot", "--task", OWN, "--smoke", "--only", "07", "--out", str(out)])
        index = json.loads((out / "index.json").read_text()) if (out / "index.json").exists() \
            else {"notebooks": [{}]}
        error = index["notebooks"][0].get("error", "")
        empty = [str(p.relative_to(disk)) for p in out.rglob("*") if p.is_file() and
                 not p.stat().st_size and p.name != ".workbook-claim"]
        handled = rc == 1 and "No space left" in error and \
            f"free space on {disk}" in error and (out / "report.html").exists() and not empty
        outcome = Outcome(handled, f"rc {rc}; {error[:300]}; empty {empty}; {err[-300:]}")
        outcome.left = [str(p.relative_to(disk)) for p in disk.rglob("*")
                        if ".partial" in p.name or p.name.endswith(".tmp") or
                        p.name == ".workbook-reserve"]
        return outcome


# --- exports carry what parameters hold -----------------------------------------------------
JS = "javascript:alert(document.cookie)"


def _exported(tmp: Path, cells: list, outputs: list) -> Outcome:
    import nbformat

    from workbook.commands.report import export_html

    nb = nbformat.v4.new_notebook()
    nb.cells = [*cells, nbformat.v4.new_code_cell("x", outputs=outputs, execution_count=1)]
    path = tmp / "nb.ipynb"
    nbformat.write(nb, path)
    html = export_html(path)
    if html is None:
        return Outcome(False, "not exported")
    page = html.read_text().lower()
    live = [m for m in ("javascript:", "vbscript:", "data:text/html", "onerror=", "onclick=")
            if m in page]
    return Outcome(not live and "#link-removed" in page, f"live: {live}")


def _display(mime: str, text: str) -> list:
    import nbformat

    return [nbformat.v4.new_output("display_data", data={mime: text})]


def export_markdown_link(tmp: Path) -> Outcome:
    return _exported(tmp, [], _display("text/markdown", f"cheapest: [B300]({JS})"))


def export_html_link(tmp: Path) -> Outcome:
    return _exported(tmp, [], _display("text/html", f"<a href={JS}>plan</a>"))


def export_entity_obfuscated_link(tmp: Path) -> Outcome:
    import nbformat

    cell = nbformat.v4.new_markdown_cell('<a href="jav&#x61;script&#58;alert(1)">x</a>')
    return _exported(tmp, [cell], _display("text/html", "<a href='&#106;avascript:1'>y</a>"))


def export_event_handler(tmp: Path) -> Outcome:
    return _exported(tmp, [], _display("text/html", '<img src="x.png" onerror="alert(1)">'
                                       '<a href="vbscript:msgbox">v</a>'))


def export_data_frame(tmp: Path) -> Outcome:
    return _exported(tmp, [], _display("text/html", '<iframe src="data:text/html,<script>'
                                       'alert(1)</script>"></iframe><a title=">" href='
                                       f'"{JS}">t</a>'))


def report_conclusion_link(tmp: Path) -> Outcome:
    from workbook.commands.report import write_report

    (tmp / "08_rental_plan").mkdir()
    (tmp / "08_rental_plan" / "conclusion.md").write_text(
        f"Rent [the B300]({JS}) or <a href='{JS}'>this</a>.")
    index = pd.DataFrame([{"notebook": "08_rental_plan", "verdict": "pass", "seconds": 1.0,
                           "executed": "08_rental_plan.ipynb", "error": ""}])
    page = write_report(tmp, index, OWN).read_text().lower()
    return Outcome("javascript:" not in page.replace("javascript:alert(document.cookie)</a>",
                                                     ""),
                   "live javascript: link" if "href=\"javascript" in page else "no live link")


# --- processes ------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    from workbook.storage.processes import process_alive

    return process_alive(pid)


def _wait_file(path: Path, seconds: float) -> bool:
    import time

    deadline = time.time() + seconds
    while time.time() < deadline and not path.exists():
        time.sleep(0.1)
    return path.exists()


STUCK = "tests.stuck_task:stuck_child"


def _stuck_archive(tmp: Path, **options) -> tuple[Path, list[str]]:
    """An archive of the task that hangs while loading its examples in `workbook reload`
    (tests/stuck_task.py), and the arguments that reload it."""
    from workbook.notebooks.resume.archive import write_archive
    from workbook.storage.processes import task_args

    options = {"pid_file": str(tmp / "child.pid"), **options}
    model = __import__("tests.own_task", fromlist=["task"]).task.build_model()
    path = write_archive(tmp / "stuck-archive", STUCK, options, model, {},
                         pd.DataFrame({"x": [1]}), [], 2)
    return path, ["reload", "--archive", str(path), *task_args(STUCK, options)]


# A child that only starts (no torch, no task): it writes its pid - and, with GRANDCHILD set,
# the pid of a process it starts in a session of its own, as torchrun's workers are - to the
# file its last argument names, then sleeps. For the probes whose claim is what the workbook
# does to a child (`start_child`, `stop_tree`), not what a workbook command does when signalled
# (that is `child_outlives_a_killed_parent`'s and `child_interrupted_cleans_up`'s, on
# `workbook reload`): started as `fresh_process([pid_file], limit, launcher=LIGHT)`.
LIGHT_CHILD = """
import os, subprocess, sys, time
pids = [os.getpid()]
if os.environ.get("GRANDCHILD"):
    pids.append(subprocess.Popen(["sleep", "3600"], start_new_session=True).pid)
with open(sys.argv[-1] + ".tmp", "w") as handle:
    handle.write(" ".join(map(str, pids)))
os.rename(sys.argv[-1] + ".tmp", sys.argv[-1])
time.sleep(3600)
"""
LIGHT = ("-c", LIGHT_CHILD)

PARENT = """
import sys
from workbook.storage.processes import fresh_process
fresh_process(sys.argv[2:], 600, launcher=("-c", sys.argv[1]) if sys.argv[1] else ())
"""


def _stuck_child(tmp: Path, how: str, light: bool = False) -> Outcome:
    """A parent (as a kernel is) runs `workbook reload` with a task stuck while loading - or,
    `light`, LIGHT_CHILD; the parent ends by `how`. The child must not outlive it."""
    import os
    import signal
    import subprocess
    import sys

    pid_file = tmp / "child.pid"
    args = [LIGHT_CHILD, str(pid_file)] if light else ["", *_stuck_archive(tmp)[1]]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, *args],
        env={**os.environ, "PYTHONPATH": os.getcwd()}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        if not _wait_file(pid_file, 120):
            return Outcome(False, "the child never started: " + parent.stderr.read()[-300:])
        child = int(pid_file.read_text())
        parent.send_signal({"kill": signal.SIGKILL, "term": signal.SIGTERM}[how])
        parent.wait(timeout=60)
        left = not _ended([child], 20)
        if left:
            os.kill(child, signal.SIGKILL)
        return Outcome(not left, f"child {child} {'still runs' if left else 'ended'} after "
                       f"the parent ({how})")
    finally:
        parent.kill()
        parent.wait()


def _ended(pids: list[int], seconds: float) -> bool:
    """Whether every one of `pids` has ended, waiting at most `seconds`."""
    import time

    deadline = time.monotonic() + seconds
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(_alive, pids))


def child_outlives_a_killed_parent(tmp: Path) -> Outcome:
    """The whole chain on `workbook reload`: the parent killed, the child asked to end
    (PR_SET_PDEATHSIG's SIGTERM) and ending through its own handling of it."""
    return _stuck_child(tmp, "kill")


def child_outlives_a_terminated_parent(tmp: Path) -> Outcome:
    return _stuck_child(tmp, "term", light=True)


def child_of_a_timeout_and_its_own_child(tmp: Path) -> Outcome:
    """A timeout stops the child and the process it started in its own session (torchrun's
    workers)."""
    import os
    import signal
    from unittest import mock

    from workbook.storage.processes import fresh_process

    pid_file = tmp / "child.pid"
    # the light child writes its pids within a second of its start on a loaded machine; a
    # limit that ended it before that is tried once longer
    for limit in (1, 20):
        try:
            with mock.patch.dict(os.environ, {"GRANDCHILD": "1"}):
                fresh_process([str(pid_file)], limit, launcher=LIGHT)
        except WorkbookError as exc:
            pids = [int(p) for p in pid_file.read_text().split()] if pid_file.exists() else []
            if not pids and limit < 20:
                continue
            alive = [] if _ended(pids, 5) else [p for p in pids if _alive(p)]
            for pid in alive:  # not left running when the probe fails
                os.kill(pid, signal.SIGKILL)
            return Outcome(len(pids) == 2 and not alive and "did not finish" in exc.problem,
                           f"{pids} alive {alive}: {exc.problem}")
        return Outcome(False, "no timeout")
    return Outcome(False, "the child wrote no pids within 20 s")


def child_interrupted_cleans_up(tmp: Path) -> Outcome:
    """SIGTERM to `workbook reload` (its parent ended): exit 130, its result file says so, and
    nothing temporary is left."""
    import os
    import signal
    import subprocess
    import sys

    pid_file, result = tmp / "child.pid", tmp / "result.json"
    _, args = _stuck_archive(tmp)
    proc = subprocess.Popen(
        [sys.executable, "-m", "workbook", *args, "--result", str(result)],
        env={**os.environ, "PYTHONPATH": os.getcwd()}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        if not _wait_file(pid_file, 120):
            return Outcome(False, proc.stderr.read()[-300:])
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    outcome = json.loads(result.read_text()) if result.exists() else {}
    return Outcome(proc.returncode == 130 and outcome.get("exit_code") == 130 and
                   "Traceback" not in err, f"rc {proc.returncode}, {outcome}, {err[-200:]}")


def _pilot_signalled(tmp: Path, sig_name: str) -> Outcome:
    """The pilot signalled while 07's fresh `workbook resume` child is stuck: exit 130, no
    traceback, no child left running, no partial notebook, an index and a report."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out, pid_file = tmp / "run", tmp / "child.pid"
    proc = subprocess.Popen(
        [sys.executable, "-m", "workbook", "pilot", "--task", STUCK,
         f"--option=pid_file={str(pid_file)!r}", "--option=only_in='resume'", "--smoke",
         "--only", "07", "--out", str(out)], env={**os.environ, "PYTHONPATH": os.getcwd()},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if not _wait_file(pid_file, 300):
            proc.kill()
            return Outcome(False, "07 never started its resume: " + proc.stderr.read()[-300:])
        child = int(pid_file.read_text())
        if sig_name == "SIGINT":  # Ctrl-C in a terminal: the whole foreground process group
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(getattr(signal, sig_name))
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    deadline = time.time() + 20
    while time.time() < deadline and _alive(child):
        time.sleep(0.2)
    left = _alive(child)
    if left:
        os.kill(child, signal.SIGKILL)
    partial = [p.name for p in out.glob(".*partial*")]
    handled = proc.returncode == 130 and "Traceback" not in err and "ZMQError" not in err \
        and not left and not partial and (out / "index.json").exists() and \
        (out / "report.html").exists()
    return Outcome(handled, f"rc {proc.returncode}, child left {left}, partial {partial}, "
                   f"stderr {err[-300:]!r}")


def pilot_terminated_while_a_child_is_stuck(tmp: Path) -> Outcome:
    return _pilot_signalled(tmp, "SIGTERM")


def pilot_interrupted_while_a_child_is_stuck(tmp: Path) -> Outcome:
    return _pilot_signalled(tmp, "SIGINT")


def child_stopped_at_a_normal_exit(tmp: Path) -> Outcome:
    """A parent that returns without waiting for its child (an exception, the end of a
    script): the child is stopped at the parent's exit."""
    import os
    import subprocess
    import sys

    pid_file = tmp / "child.pid"
    script = ("import sys, time\nfrom pathlib import Path\nfrom workbook.storage.processes import "
              "start_child\nstart_child(sys.argv[2:])\nwhile not Path(sys.argv[1]).exists():\n"
              "    time.sleep(0.05)\n")
    done = subprocess.run(
        [sys.executable, "-c", script, str(pid_file), sys.executable, *LIGHT, str(pid_file)],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True, text=True, timeout=180)
    child = int(pid_file.read_text()) if pid_file.exists() else 0
    left = not _ended([child], 2)
    return Outcome(done.returncode == 0 and child and not left,
                   f"child {child} left {left} {done.stderr[-200:]}")


# Probes `make test` leaves to `make test-all` (the benchmark runs all): a whole pilot signalled
# while 07's child is stuck - 20 s each, and its kernel's DeadKernelError traceback reaches
# stderr in about one run of three (seen before and after the layers moved, 2026-12-02).
SLOW = {"pilot_terminated_while_a_child_is_stuck", "pilot_interrupted_while_a_child_is_stuck"}


PROBES: dict[str, Callable[[Path], Outcome]] = {
    name: globals()[name] for name in [
        "archive_names_another_task", "checkpoint_names_another_task",
        "design_names_another_task", "design_not_json", "design_extended", "design_edited",
        "ledger_truncated", "empty_manifest_with_a_changed_weight", "manifest_not_json",
        "extra_file", "manifest_names_a_file_outside", "malicious_pickle",
        "weights_of_another_shape", "bad_safetensors_header", "empty_state", "meta_not_json",
        "resume_to_an_earlier_update", "hostile_strings_in_the_report", "full_disk_checkpoint",
        "full_disk_json", "out_under_a_file", "out_is_a_file", "only_names_nothing",
        "pilot_option_as_parameter", "cuda_without_a_gpu", "task_module_with_a_syntax_error",
        "nan_in_inputs", "every_label_ignored", "state_is_a_list",
        "state_without_random_states", "state_without_counters", "counter_five", "negative_step",
        "negative_data_position", "position_beyond_the_pass", "step_not_the_position",
        "numpy_state_cut_short", "threads_zero", "threads_nan", "threads_many", "options_a_list",
        "grad_clip_nan", "string_learning_rate", "negative_train_limit", "huge_integer_in_meta",
        "deeply_nested_meta", "manifest_entry_of_the_wrong_type", "weights_in_another_dtype",
        "optimizer_state_of_another_shape", "optimizer_state_in_another_dtype",
        "control_outputs_of_dtype_bool", "archive_options_a_list", "control_inputs_not_strings",
        "design_divergence_nan", "design_lr_a_string", "design_negative_seed",
        "design_shape_of_the_wrong_type", "design_nested_deep",
        "resumed_records_of_the_wrong_type", "result_with_a_huge_exit_code",
        "result_error_not_a_record", "result_nested_deep", "result_exit_code_a_boolean",
        "task_prints_while_loading",
        "state_is_a_link_outside", "weights_are_a_link_outside", "manifest_is_a_link",
        "checkpoint_folder_is_a_link", "archive_config_is_a_link", "design_is_a_link",
        "named_pipe_in_a_checkpoint", "trigger_that_deletes_rows", "trigger_on_update",
        "view_planted", "foreign_table", "foreign_column", "ledger_of_zero_bytes",
        "ledger_missing_a_column", "trial_parameters_of_the_wrong_type",
        "ledger_locked_by_another_process", "resume_out_exists", "result_file_exists",
        "pilot_out_holds_a_run", "two_pilots_claim_one_out", "checkpoint_over_an_existing_one",
        "archive_over_an_existing_one", "ddp_launch_folder_used_twice",
        "archive_files_get_the_umask_mode", "repro_with_a_hostile_task_name",
        "repro_with_a_hostile_option", "study_repro_with_a_hostile_folder",
        "ddp_fix_with_a_hostile_spec", "timeout_fix_with_a_hostile_path", "timeout_infinite",
        "timeout_nan", "timeout_negative", "many_unary_minus_signs", "budget_overflows",
        "probe_size_negative", "utilisation_zero", "seed_beyond_numpy", "trial_lr_nan",
        "model_factory_returns_a_class", "model_factory_raises", "examples_not_dicts",
        "load_examples_raises", "encode_raises", "collate_raises", "save_state_raises",
        "full_disk_archive", "full_disk_tampered_copy", "full_disk_figure", "full_disk_weights",
        "full_disk_during_07", "export_markdown_link", "export_html_link",
        "export_entity_obfuscated_link", "export_event_handler", "export_data_frame",
        "report_conclusion_link", "child_outlives_a_killed_parent",
        "child_outlives_a_terminated_parent", "child_of_a_timeout_and_its_own_child",
        "child_interrupted_cleans_up", "pilot_terminated_while_a_child_is_stuck",
        "pilot_interrupted_while_a_child_is_stuck", "child_stopped_at_a_normal_exit"]}

def probe(name: str, folder: Path | None = None) -> Outcome:
    """Run one probe in `folder` (a new temporary one by default); records leftovers."""
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(folder or scratch)
        try:
            outcome = PROBES[name](tmp)
        except Exception as exc:  # a traceback is a probe not handled
            import traceback

            outcome = Outcome(False, f"{type(exc).__name__}: {exc} "
                              f"{traceback.format_exc(limit=-3)}")
        outcome.left += _leftovers(tmp)
        shutil.rmtree(tmp / "small", ignore_errors=True)
        return outcome

