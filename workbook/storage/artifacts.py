"""Artifact folders (checkpoints, archives): written whole or not at all, and verified before
anything in them is read. The writer fills a private temporary sibling folder, lists every file
with its size and sha256 in `manifest.json`, fsyncs and renames; a failure (disk full,
permissions, a read-only mount) removes the temporary folder and becomes one `WorkbookError`
naming the path. A manifest is not a signature - anyone who can write the folder can recompute
it - so nothing read from a folder is ever imported or called, and no link in it is followed:
a folder holds plain files only, and a symbolic link (the folder itself or a file in it), a
named pipe or a device is refused with its name. Files written get the mode the umask gives
(0644 under 022), whatever mode the library that wrote them chose."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from ..base.errors import WorkbookError
from . import schemas
from .files import (
    NOFOLLOW,
    file_mode,
    kind_of,
    link_target,
    not_plain,
    open_plain,
    plain_folder,
    read_plain,
    sha256,
    sha256_of,
    shown_name,
    umask,
    with_article,
    write_error,
    write_failure,
)

MANIFEST = "manifest.json"
FORMAT = "workbook-manifest-1"
# Hard links are not refused: a file with st_nlink > 1 is what backups by hard link (rsnapshot,
# rsync --link-dest, `cp -al`) and deduplicating tools leave, a hard link only reaches a file its
# maker could already read and write (fs.protected_hardlinks), the writers never write through
# an existing name (they rename a new file into place), and a change made through the other name
# breaks the sha256. A writer gives every file it seals an inode of its own (see write_folder).


def _exists(path: Path, what: str) -> WorkbookError:
    link = f" (a symbolic link{link_target(path)})" if path.is_symlink() else ""
    return WorkbookError(f"{what} {path} already exists{link}",
                         f"write the {what} under a new name; it is never overwritten")


def _fsync_folder(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not every platform syncs a folder
    finally:
        os.close(fd)


def _temporary(path: Path) -> Path:
    """A new private (0700) folder beside `path`: nobody else can plant a name in it."""
    return Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.partial-{os.getpid()}-"))


def _seal_entry(tmp: Path, name: str, what: str) -> dict:
    """One file of a folder being written: a plain file with an inode of its own, the umask's
    mode, on disk; returns its manifest entry."""
    f = tmp / name
    st = os.lstat(f)
    if not stat.S_ISREG(st.st_mode):
        raise WorkbookError(f"the {what} being written holds {shown_name(name)}, which is "
                            f"{kind_of(st.st_mode)}"
                            f"{link_target(f) if stat.S_ISLNK(st.st_mode) else ''}",
                            f"write plain files into {with_article(what)} (no links, folders "
                            "or pipes)")
    if st.st_nlink > 1:  # another name elsewhere would share the sealed file: copy it
        copy = tmp / f".{name}.own"
        shutil.copyfile(f, copy, follow_symlinks=False)
        os.replace(copy, f)
    os.chmod(f, file_mode())
    with open_plain(f) as handle:
        os.fsync(handle.fileno())
        handle.seek(0)
        return {"bytes": os.fstat(handle.fileno()).st_size, "sha256": sha256_of(handle)}


def write_folder(path: str | Path, fill: Callable[[Path], None], what: str = "folder") -> Path:
    """Create the artifact folder `path` (never over an existing one): `fill(tmp)` writes the
    files into a temporary folder, which gets its manifest and is renamed into place."""
    path = Path(path)
    with _new_folder(path, what, parents=True) as tmp:
        fill(tmp)
        if os.path.lexists(tmp / MANIFEST):
            raise WorkbookError(f"the {what} being written holds its own {MANIFEST}",
                                f"leave {MANIFEST} to the workbook: it lists the {what}'s files")
        files = {n: _seal_entry(tmp, n, what) for n in sorted(os.listdir(tmp))}
        _write_new(tmp / MANIFEST, json.dumps({"format": FORMAT, "files": files},
                                              indent=1).encode())
    return path


def _write_new(path: Path, data: bytes) -> None:
    """`data` into the new file `path` (never over a file or through a link), synced, with
    an ordinary file's mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, file_mode())
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(path, file_mode())


@contextlib.contextmanager
def _new_folder(path: Path, what: str, parents: bool = False) -> Iterator[Path]:
    """A private temporary folder beside `path` to fill, fsynced and renamed to `path` when the
    block ends (onto a free name: an empty folder made meanwhile is all it replaces); on any
    failure it is removed, and a failure to write named with `path`."""
    if os.path.lexists(path):
        raise _exists(path, what)
    tmp = None
    try:
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temporary(path)
        yield tmp
        os.chmod(tmp, 0o777 & ~umask())
        _fsync_folder(tmp)
        os.rename(tmp, path)
        _fsync_folder(path.parent)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, WorkbookError) and \
                write_failure(exc):
            raise write_error(what, path, exc, "; nothing was left behind") from exc
        raise


def write_file(path: Path, write: Callable[[Path], None], what: str = "file") -> Path:
    """One binary file written by `write(tmp)` under a temporary name in a private folder,
    fsynced and moved into place - never over an existing file."""
    path = Path(path)
    if os.path.lexists(path):
        raise _exists(path, what)
    tmp = None
    try:
        tmp = _temporary(path)
        write(tmp / path.name)
        _seal_entry(tmp, path.name, what)
        try:  # a hard link refuses an existing name atomically; a rename is the fallback
            os.link(tmp / path.name, path)
        except FileExistsError:
            raise _exists(path, what) from None
        except OSError:
            if os.path.lexists(path):
                raise _exists(path, what) from None
            os.rename(tmp / path.name, path)
        _fsync_folder(path.parent)
    except BaseException as exc:
        if isinstance(exc, Exception) and not isinstance(exc, WorkbookError) and \
                write_failure(exc):
            raise write_error(what, path, exc) from exc
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def verify(path: str | Path, what: str = "folder") -> dict[str, dict]:
    """Check the folder against its manifest: every file listed with size and digest, nothing
    missing, changed or extra, and every entry a plain file (no link, pipe or folder). Returns
    the manifest's file table."""
    path = Path(path)
    plain_folder(path, what)
    try:
        entries = {e.name: e.stat(follow_symlinks=False).st_mode for e in os.scandir(path)}
    except OSError:
        entries = {}
    if MANIFEST not in entries:
        raise WorkbookError(f"{path} is not {with_article(what)} (no {MANIFEST})",
                            f"point at {with_article(what)} folder written by the workbook")
    for name, mode in sorted(entries.items()):
        if not stat.S_ISREG(mode):
            raise not_plain(what, path, name, mode)
    raw = read_plain(path / MANIFEST, f"the manifest of {what}", f"use an intact {what}")
    fix = f"the {what} is damaged or forged; use an intact copy"
    data = schemas.parse_json(raw, path / MANIFEST, "manifest", fix)
    if not isinstance(data, dict) or data.get("format") != FORMAT or not data.get("files"):
        raise WorkbookError(f"{path / MANIFEST} lists no files in the {FORMAT} format", fix)
    files = {n: e.model_dump() for n, e in
             schemas.check(schemas.Manifest, data, path / MANIFEST, "manifest", fix).files.items()}
    present = set(entries) - {MANIFEST}
    odd = sorted(n for n in files if "/" in n or "\\" in n or n in ("", ".", "..", MANIFEST))
    extra, missing = sorted(present - set(files)), sorted(set(files) - present)
    for problem, names in (("names files outside it", odd), ("lacks", missing),
                           ("holds files its manifest does not list", extra)):
        if names:
            raise WorkbookError(f"{what} {path} {problem}: "
                                f"{', '.join(shown_name(n) for n in names)}",
                                f"do not load it; use an intact {what}")
    for name, entry in files.items():
        try:
            with open_plain(path / name) as handle:
                size = os.fstat(handle.fileno()).st_size
                same = size == entry["bytes"] and sha256_of(handle) == entry["sha256"]
        except OSError:  # replaced since the listing (by a link, a pipe...)
            same = False
        if not same:
            raise WorkbookError(f"{path / name} does not match its manifest (changed or "
                                "truncated)", f"do not load it; use an intact {what}")
    return files


def read_json(path: Path, what: str = "file") -> dict:
    """A JSON object from a verified folder, parsed bounded (size, nesting, integer length:
    `schemas.parse_json`), or a clear error when it is not one (a link is never followed)."""
    path = Path(path)
    fix = "the folder is damaged; use an intact copy"
    data = schemas.parse_json(read_plain(path, what, fix), path, what, fix)
    if not isinstance(data, dict):
        raise WorkbookError(f"{what} {path} is not a JSON object", "use an intact copy")
    return data


def copy_folder(source: str | Path, path: str | Path, changes: dict[str, bytes] | None = None,
                what: str = "copy") -> Path:
    """A copy of the folder `source` at the new name `path`, with the files in `changes`
    replaced by their bytes: filled in a private temporary folder and renamed, so a full disk
    leaves no 0-byte or truncated file under a final name (and no temporary one)."""
    source, path = Path(source), Path(path)
    with _new_folder(path, what) as tmp:
        for entry in sorted(os.scandir(source), key=lambda e: e.name):
            if not entry.is_file(follow_symlinks=False):
                raise not_plain("folder", source, entry.name,
                                entry.stat(follow_symlinks=False).st_mode)
            shutil.copyfile(entry.path, tmp / entry.name, follow_symlinks=False)
        for name, data in (changes or {}).items():
            (tmp / name).write_bytes(data)
        for name in os.listdir(tmp):
            _seal_entry(tmp, name, what)
    return path


def replace_file(path: str | Path, data: bytes, what: str = "file") -> Path:
    """Write `data` to `path`, replacing what is there, through a temporary name in its
    folder and a rename: the old file or the new one, never a truncated one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_new(tmp, data)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise write_error(what, path, exc) from exc
        raise
    return path


def reseal(path: str | Path) -> None:
    """Recompute the manifest of an edited folder, as anyone who can write it can (links
    followed, as a forger's tool would): used to show that the loaders stay safe when the
    manifest is forged."""
    path = Path(path)
    files = {}
    for f in sorted(path.iterdir()):
        if f.name != MANIFEST:
            with f.open("rb") as handle:
                files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_of(handle)}
    replace_file(path / MANIFEST, json.dumps({"format": FORMAT, "files": files},
                                             indent=1).encode(), "manifest")


def verify_file(path: str | Path, what: str = "file") -> None:
    """Check one sealed file against its `<name>.manifest.json`; refuse it when the manifest is
    missing, malformed or does not match, or when the file, its manifest or their folder is a
    link."""
    path = Path(path)
    plain_folder(path.parent, "folder", holds=what)
    manifest = path.with_name(path.name + ".manifest.json")
    if not os.path.lexists(manifest):
        raise WorkbookError(f"{what} {path} has no {manifest.name}",
                            "use a folder written by this workbook version, or start anew")
    for f in (manifest, path):
        mode = os.lstat(f).st_mode if os.path.lexists(f) else stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise not_plain(what, path.parent, f.name, mode)
    fix = f"do not use this {what}; start a new one in a new folder"
    files = schemas.check(schemas.Manifest, read_json(manifest, f"manifest of {path.name}"),
                          manifest, "manifest", fix).files
    entry = files.get(path.name)
    try:
        same = entry is not None and os.lstat(path).st_size == entry.bytes and \
            sha256(path) == entry.sha256
    except OSError:
        same = False
    if not same:
        raise WorkbookError(f"{path} does not match {manifest.name} (changed or truncated)",
                            f"do not use this {what}; start a new one in a new folder")
