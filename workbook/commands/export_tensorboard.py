"""A pilot run as TensorBoard event files: `DIR/<run name>/` holds one TensorBoard run per
notebook (its key figures as scalars, its verdict, parameters and figures in the Text and Images
tabs), `pilot/` for the whole run, and `06_lr_study/trial-N/` per trial of 06 (its curves with
steps, and its lr, seed and outcome in the HParams tab, diverged trials included).

Written with torch's `SummaryWriter` (TensorBoard's own event format) into a private folder
beside the destination and renamed into place whole, with `workbook-export.json` naming the
pilot and the content: an export already there with the same content adds nothing, one whose
content changed is replaced, and a failed one leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from ..base.errors import WorkbookError, reason
from ..storage import schemas
from ..storage.files import read_plain, umask
from .export_plan import INSTALL, Entry, Pilot, inside

MARKER = "workbook-export.json"
PNG = b"\x89PNG\r\n\x1a\n"
COLOURS = {0: 1, 2: 3, 4: 2, 6: 4, 3: 3}  # PNG colour type -> channels TensorBoard names
HPARAM_METRICS = ("best_metric", "best_step", "stop_step")  # the same list for every trial


def import_tensorboard() -> Any:
    """torch's SummaryWriter (it needs the `tensorboard` package: the `export` extra)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise WorkbookError(f"--tensorboard needs the tensorboard package, which is not "
                            f"installed ({reason(exc)})", INSTALL) from None
    return SummaryWriter


def destination(logdir: str | Path, plan: Pilot) -> Path:
    """`DIR/<run name>`, checked before anything is written: outside the run folder, not the
    run folder itself, and either new or an earlier export of this same pilot."""
    logdir = Path(os.path.abspath(logdir))
    target = logdir / plan.name
    if inside(logdir, plan.run) or inside(target, plan.run):
        raise WorkbookError(f"--tensorboard {logdir} would write into the run folder "
                            f"{plan.run}, which an export never changes",
                            "give a folder outside it, e.g. --tensorboard "
                            f"{plan.run.parent.parent / 'tensorboard'}")
    for part in (logdir, *logdir.parents):
        if os.path.lexists(part):
            if not part.is_dir():
                raise WorkbookError(f"--tensorboard {logdir}: {part} is a file, not a folder",
                                    "give --tensorboard a folder")
            break
    if os.path.lexists(target):
        earlier = _marker(target)
        if earlier is None:
            raise WorkbookError(f"{target} exists and is not a workbook export",
                                "give --tensorboard another folder (nothing there is "
                                "overwritten)")
        if earlier.get("pilot_id") != plan.pilot_id:
            raise WorkbookError(f"{target} holds the export of another pilot run (from "
                                f"{earlier.get('run_folder')}) of the same name",
                                "give --tensorboard another folder for this run")
    return target


def _marker(target: Path) -> dict | None:
    if target.is_symlink() or not target.is_dir():
        return None
    path = target / MARKER
    try:
        data = schemas.parse_json(read_plain(path, "export marker", ""), path, "export marker")
    except WorkbookError:
        return None
    return data if isinstance(data, dict) and data.get("pilot_id") else None


def _markdown_table(rows: dict[str, str], head: tuple[str, str]) -> str:
    cells = "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows.items())
    return f"| {head[0]} | {head[1]} |\n|---|---|\n{cells}"


def _image(writer: Any, name: str, path: Path, walltime: float) -> bool:
    """A PNG figure as TensorBoard's image summary, its bytes as they are (not re-encoded)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    data = read_plain(path, "figure", "")
    if not data.startswith(PNG) or len(data) < 26:
        return False
    width, height = struct.unpack(">II", data[16:24])
    image = Summary.Image(height=height, width=width, colorspace=COLOURS.get(data[25], 4),
                          encoded_image_string=data)
    writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=f"figures/{name}",
                                                                image=image)]), 0, walltime)
    return True


def _write_entry(writer_type: Any, folder: Path, entry: Entry) -> None:
    from torch.utils.tensorboard.summary import hparams

    now = time.time()
    stamp = (entry.end_ms or entry.start_ms or int(now * 1000)) / 1000
    writer = writer_type(log_dir=str(folder), max_queue=10_000, flush_secs=3600)
    try:
        for name, value in entry.metrics.items():
            writer.add_scalar(name, value, 0, walltime=stamp)
        for name, points in entry.curves.items():
            for step, value, at in points:
                writer.add_scalar(name, value, step, walltime=at / 1000)
        writer.add_text("verdict" if entry.role == "notebook" else "description", entry.note,
                        0, walltime=stamp)
        if entry.params:
            writer.add_text("parameters", _markdown_table(entry.params, ("parameter", "value")),
                            0, walltime=stamp)
        if entry.tags:
            writer.add_text("tags", _markdown_table(entry.tags, ("tag", "value")), 0,
                            walltime=stamp)
        for name, path in entry.images.items():
            _image(writer, name, path, stamp)
        if entry.hparams:
            chosen = {**entry.hparams, "outcome": entry.tags.get("outcome", "")}
            for summary in hparams(chosen, dict.fromkeys(HPARAM_METRICS, 0.0)):
                writer.file_writer.add_summary(summary, 0, stamp)
    finally:
        writer.close()


def _folder(root: Path, entry: Entry) -> Path:
    """Where an entry's events go: `pilot/`, `NN_name/`, `06_lr_study/trial-N/`."""
    return root / ("pilot" if entry.role == "pilot" else entry.key)


def export(plan: Pilot, logdir: str | Path) -> dict[str, Any]:
    """Write `plan` as event files under `logdir/<run name>`. Returns `action` ("exported",
    "unchanged" or "replaced"), the `folder`, the number of TensorBoard `runs` and how to
    `view` it."""
    writer_type = import_tensorboard()
    target = destination(logdir, plan)
    result = {"folder": str(target), "runs": len(plan.entries),
              "view": f"tensorboard --logdir {target.parent}"}
    earlier = _marker(target)
    if earlier is not None and earlier.get("digest") == plan.digest:
        return {**result, "action": "unchanged"}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{plan.name}.partial-{os.getpid()}-",
                                        dir=target.parent))
    except OSError as exc:
        raise WorkbookError(f"cannot write the TensorBoard folder {target.parent}: "
                            f"{exc.strerror or reason(exc)}",
                            "give --tensorboard a folder you can write") from None
    old = None
    try:
        for entry in plan.entries:
            _write_entry(writer_type, _folder(partial, entry), entry)
        (partial / MARKER).write_text(json.dumps(
            {"format": 1, "pilot_id": plan.pilot_id, "digest": plan.digest,
             "run_folder": str(plan.run), "runs": len(plan.entries),
             "missing": plan.missing}, indent=1))
        if earlier is not None:  # the earlier export steps aside, then goes once this is in
            old = target.with_name(f".{plan.name}.old-{os.getpid()}")
            os.rename(target, old)
        os.chmod(partial, 0o777 & ~umask())  # mkdtemp's folder is private (0700)
        os.rename(partial, target)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if old is not None and not os.path.lexists(target):
            with contextlib.suppress(OSError):
                os.rename(old, target)
        if not isinstance(exc, Exception):
            raise
        raise WorkbookError(f"the TensorBoard export to {target} failed: {reason(exc, 400)}; "
                            "nothing of it was kept", "fix the cause and export again") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return {**result, "action": "replaced" if earlier is not None else "exported"}
