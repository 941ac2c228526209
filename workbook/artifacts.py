"""Artifact folders (checkpoints, archives): written whole or not at all, and verified before
anything in them is read. The writer fills a temporary sibling folder, lists every file with
its size and sha256 in `manifest.json`, fsyncs and renames; a failure (disk full, permissions,
a read-only mount) removes the temporary folder and becomes one `WorkbookError` naming the path.
A manifest is not a signature - anyone who can write the folder can recompute it - so nothing
read from a folder is ever imported or called; the manifest catches damage and edits."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from .errors import WorkbookError, reason

MANIFEST = "manifest.json"
FORMAT = "workbook-manifest-1"
# Messages of write failures that torch and safetensors raise as something other than OSError.
_WRITE_FAILURES = ("No space left", "unexpected pos", "file write failed", "Read-only",
                   "Permission denied", "inline_container", "File too large", "Disk quota")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_failure(exc: BaseException) -> bool:
    """Whether `exc` means the disk refused a write (rather than a bug in what was written)."""
    return isinstance(exc, OSError) or any(s in str(exc) for s in _WRITE_FAILURES)


def write_error(what: str, path: Path, exc: Exception, left: str = "") -> WorkbookError:
    """The error for a write the disk refused, with the fix for its cause."""
    import errno

    why = getattr(exc, "strerror", None) or reason(exc)
    code = getattr(exc, "errno", None)
    if isinstance(exc, FileNotFoundError) and not Path(path).parent.exists():
        fix = f"create the folder {Path(path).parent} first, or write into an existing one"
    elif isinstance(exc, PermissionError):
        fix = "choose a folder you can write to"
    elif code in (errno.ENOSPC, errno.EDQUOT):
        fix = "free disk space (or raise the quota) and run again"
    else:
        fix = "free disk space or choose a writable folder"
    return WorkbookError(f"cannot write {what} {path}: {why}", fix + left)


def write_folder(path: str | Path, fill: Callable[[Path], None], what: str = "folder") -> Path:
    """Create the artifact folder `path` (never over an existing one): `fill(tmp)` writes the
    files into a temporary folder, which gets its manifest and is renamed into place."""
    path = Path(path)
    if path.exists():
        raise WorkbookError(f"{what} {path} already exists",
                            f"write the {what} under a new name; it is never overwritten")
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
        files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)}
                 for f in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))
        for f in tmp.iterdir():  # on disk before the rename makes the folder visible
            with f.open("rb") as handle:
                os.fsync(handle.fileno())
        os.rename(tmp, path)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and write_failure(exc):
            raise write_error(what, path, exc, "; nothing was left behind") from exc
        raise
    return path


def write_file(path: Path, write: Callable[[Path], None], what: str = "file") -> Path:
    """One binary file written by `write(tmp)` under a temporary name, fsynced and renamed
    into place."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        write(tmp)
        with tmp.open("rb") as handle:  # on disk before the rename makes it visible
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, Exception) and write_failure(exc):
            raise write_error(what, path, exc) from exc
        raise
    return path


def verify(path: str | Path, what: str = "folder") -> dict[str, dict]:
    """Check the folder against its manifest: every file listed with size and digest, nothing
    missing, changed or extra. Returns the manifest's file table."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise WorkbookError(f"{path} is not a {what} (no {MANIFEST})",
                            f"point at a {what} folder written by the workbook")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WorkbookError(f"{path / MANIFEST} is not valid JSON ({exc})",
                            f"the {what} is damaged; use an intact copy") from None
    ours = isinstance(manifest, dict) and manifest.get("format") == FORMAT
    files = manifest.get("files") if ours else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and
            isinstance(v.get("bytes"), int) for v in files.values()):
        raise WorkbookError(f"{path / MANIFEST} lists no files in the {FORMAT} format",
                            f"the {what} is damaged or forged; use an intact copy")
    present = {f.name for f in path.iterdir()} - {MANIFEST}
    odd = sorted(n for n in files if "/" in n or "\\" in n or n in ("", ".", "..", MANIFEST))
    extra, missing = sorted(present - set(files)), sorted(set(files) - present)
    for problem, names in (("names files outside it", odd), ("lacks", missing),
                           ("holds files its manifest does not list", extra)):
        if names:
            raise WorkbookError(f"{what} {path} {problem}: {', '.join(names)}",
                                f"do not load it; use an intact {what}")
    for name, entry in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != entry["bytes"] or sha256(f) != entry["sha256"]:
            raise WorkbookError(f"{f} does not match its manifest (changed or truncated)",
                                f"do not load it; use an intact {what}")
    return files


def read_json(path: Path, what: str = "file") -> dict:
    """A JSON object from a verified folder, or a clear error when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WorkbookError(f"cannot read {what} {path}: {exc}",
                            "the folder is damaged; use an intact copy") from None
    if not isinstance(data, dict):
        raise WorkbookError(f"{what} {path} is not a JSON object", "use an intact copy")
    return data


def reseal(path: str | Path) -> None:
    """Recompute the manifest of an edited folder, as anyone who can write it can: used to show
    that the loaders stay safe when the manifest is forged."""
    path = Path(path)
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)}
             for f in sorted(path.iterdir()) if f.name != MANIFEST}
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))


def seal_file(path: str | Path) -> Path:
    """A manifest for one file in a folder that is not written once (a study's plan.json):
    `<name>.manifest.json` with its size and sha256, written after the file."""
    from .runs import write_json

    path = Path(path)
    return write_json(path.with_name(path.name + ".manifest.json"), {
        "format": FORMAT, "files": {path.name: {"bytes": path.stat().st_size,
                                                 "sha256": sha256(path)}}})


def verify_file(path: str | Path, what: str = "file") -> None:
    """Check one sealed file against its `<name>.manifest.json`; refuse it when the manifest is
    missing, malformed or does not match."""
    path = Path(path)
    manifest = path.with_name(path.name + ".manifest.json")
    if not manifest.is_file():
        raise WorkbookError(f"{what} {path} has no {manifest.name}",
                            "use a folder written by this workbook version, or start anew")
    entry = read_json(manifest, f"manifest of {path.name}").get("files", {})
    entry = entry.get(path.name) if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or not path.is_file() or \
            path.stat().st_size != entry.get("bytes") or sha256(path) != entry.get("sha256"):
        raise WorkbookError(f"{path} does not match {manifest.name} (changed or truncated)",
                            f"do not use this {what}; start a new one in a new folder")
