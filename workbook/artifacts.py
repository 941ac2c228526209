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
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from . import schemas
from .errors import WorkbookError, reason

MANIFEST = "manifest.json"
FORMAT = "workbook-manifest-1"
# Messages of write failures that torch and safetensors raise as something other than OSError.
_WRITE_FAILURES = ("No space left", "unexpected pos", "file write failed", "Read-only",
                   "Permission denied", "inline_container", "File too large", "Disk quota")
_UMASK = os.umask(0o022)
os.umask(_UMASK)
# O_NONBLOCK: opening a named pipe planted under a file's name must not wait for a writer.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
    getattr(os, "O_BINARY", 0)
# Hard links are not refused: a file with st_nlink > 1 is what backups by hard link (rsnapshot,
# rsync --link-dest, `cp -al`) and deduplicating tools leave, a hard link only reaches a file its
# maker could already read and write (fs.protected_hardlinks), the writers never write through
# an existing name (they rename a new file into place), and a change made through the other name
# breaks the sha256. A writer gives every file it seals an inode of its own (see write_folder).


def umask() -> int:
    """The process's umask now (read from /proc where it can be, else the one at import)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _UMASK


def file_mode() -> int:
    """The mode of a file the workbook writes: what the umask gives a new file (0644 under 022)."""
    return 0o666 & ~umask()


def shown_name(text: object, limit: int = 120) -> str:
    """A name read from disk, safe to print (control characters escaped, length bounded)."""
    text = str(text)
    safe = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return safe + ("..." if len(text) > limit else "")


def _a(what: str) -> str:
    return f"{'an' if what[:1] in 'aeiou' else 'a'} {what}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a plain file"


def _target(path: Path) -> str:
    try:
        return f" (to {shown_name(os.readlink(path))})"
    except OSError:
        return ""


def not_plain(what: str, folder: Path, name: str, mode: int) -> WorkbookError:
    """The error for an entry of a folder that is not a plain file (a link, a pipe, a folder)."""
    kind = _kind(mode) + (_target(folder / name) if stat.S_ISLNK(mode) else "")
    return WorkbookError(f"{what} {folder}: {shown_name(name)} is {kind}",
                         f"{_a(what)} holds plain files only - copy the real file in, or use an "
                         f"intact {what}")


def plain_folder(path: Path, what: str, holds: str = "") -> None:
    """Refuse a folder that is a symbolic link: what it points at could be anything. `holds`
    names what the folder holds when it is not itself the `what` (a study's design)."""
    if path.is_symlink():
        name, noun = (f"the folder of the {holds}", holds) if holds else (what, what)
        rule = f"{_a(noun)} lives in a plain folder" if holds else f"{_a(noun)} is a plain folder"
        raise WorkbookError(f"{name} {path} is a symbolic link{_target(path)}",
                            f"{rule}, never a link - name the real folder if you trust it, or "
                            f"use an intact {noun}")


def open_plain(path: Path) -> BinaryIO:
    """Open a plain file for reading without following a link (OSError ELOOP for a link,
    EINVAL for a pipe, a device or a folder)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a plain file", str(path))
    return os.fdopen(fd, "rb")


def _digest(handle: BinaryIO) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: handle.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


def sha256(path: Path) -> str:
    """The sha256 of a plain file (a link is refused: OSError)."""
    with open_plain(Path(path)) as handle:
        return _digest(handle)


def write_failure(exc: BaseException) -> bool:
    """Whether `exc` means the disk refused a write (rather than a bug in what was written)."""
    return isinstance(exc, OSError) or any(s in str(exc) for s in _WRITE_FAILURES)


def write_error(what: str, path: Path, exc: Exception, left: str = "") -> WorkbookError:
    """The error for a write the disk refused, with the fix for its cause."""
    why = getattr(exc, "strerror", None) or reason(exc)
    code = getattr(exc, "errno", None)
    if isinstance(exc, FileNotFoundError) and not Path(path).parent.exists():
        fix = f"create the folder {Path(path).parent} first, or write into an existing one"
    elif isinstance(exc, PermissionError):
        fix = "choose a folder you can write to"
    elif code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(exc):
        fix = f"free space on {mount_point(path)} (or raise the quota) and run again"
    else:
        fix = "free disk space or choose a writable folder"
    return WorkbookError(f"cannot write {what} {path}: {why}", fix + left)


def mount_point(path: str | Path) -> str:
    """The mount point of the file system that holds (or would hold) `path`."""
    current = os.path.abspath(path)
    while not os.path.exists(current) and os.path.dirname(current) != current:
        current = os.path.dirname(current)
    while not os.path.ismount(current) and os.path.dirname(current) != current:
        current = os.path.dirname(current)
    return current


def _exists(path: Path, what: str) -> WorkbookError:
    link = f" (a symbolic link{_target(path)})" if path.is_symlink() else ""
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
                            f"{_kind(st.st_mode)}{_target(f) if stat.S_ISLNK(st.st_mode) else ''}",
                            f"write plain files into {_a(what)} (no links, folders or pipes)")
    if st.st_nlink > 1:  # another name elsewhere would share the sealed file: copy it
        copy = tmp / f".{name}.own"
        shutil.copyfile(f, copy, follow_symlinks=False)
        os.replace(copy, f)
    os.chmod(f, file_mode())
    with open_plain(f) as handle:
        os.fsync(handle.fileno())
        handle.seek(0)
        return {"bytes": os.fstat(handle.fileno()).st_size, "sha256": _digest(handle)}


def write_folder(path: str | Path, fill: Callable[[Path], None], what: str = "folder") -> Path:
    """Create the artifact folder `path` (never over an existing one): `fill(tmp)` writes the
    files into a temporary folder, which gets its manifest and is renamed into place."""
    path = Path(path)
    if os.path.lexists(path):
        raise _exists(path, what)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temporary(path)
        fill(tmp)
        if os.path.lexists(tmp / MANIFEST):
            raise WorkbookError(f"the {what} being written holds its own {MANIFEST}",
                                f"leave {MANIFEST} to the workbook: it lists the {what}'s files")
        files = {n: _seal_entry(tmp, n, what) for n in sorted(os.listdir(tmp))}
        manifest = json.dumps({"format": FORMAT, "files": files}, indent=1).encode()
        fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW,
                     file_mode())
        with os.fdopen(fd, "wb") as handle:
            handle.write(manifest)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp / MANIFEST, file_mode())
        os.chmod(tmp, 0o777 & ~umask())
        _fsync_folder(tmp)
        os.rename(tmp, path)  # onto a free name: an empty folder made meanwhile is all it replaces
        _fsync_folder(path.parent)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, WorkbookError) and \
                write_failure(exc):
            raise write_error(what, path, exc, "; nothing was left behind") from exc
        raise
    return path


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


def read_plain(path: Path, what: str, fix: str) -> bytes:
    """The bytes of a plain file (never through a link, a pipe or a device), or a
    WorkbookError naming it."""
    try:
        with open_plain(path) as handle:
            return handle.read()
    except OSError as exc:
        if path.is_symlink():
            raise WorkbookError(f"{what} {path} is a symbolic link{_target(path)}",
                                "a folder the workbook reads holds plain files only - copy the "
                                "real file in, or use an intact copy") from None
        raise WorkbookError(f"cannot read {what} {path}: {exc.strerror or exc}", fix) from None


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
        raise WorkbookError(f"{path} is not {_a(what)} (no {MANIFEST})",
                            f"point at {_a(what)} folder written by the workbook")
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
                same = size == entry["bytes"] and _digest(handle) == entry["sha256"]
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
    if os.path.lexists(path):
        raise _exists(path, what)
    tmp = None
    try:
        tmp = _temporary(path)
        for entry in sorted(os.scandir(source), key=lambda e: e.name):
            if not entry.is_file(follow_symlinks=False):
                raise not_plain("folder", source, entry.name,
                                entry.stat(follow_symlinks=False).st_mode)
            shutil.copyfile(entry.path, tmp / entry.name, follow_symlinks=False)
        for name, data in (changes or {}).items():
            (tmp / name).write_bytes(data)
        for name in os.listdir(tmp):
            _seal_entry(tmp, name, what)
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
    return path


def replace_file(path: str | Path, data: bytes, what: str = "file") -> Path:
    """Write `data` to `path`, replacing what is there, through a temporary name in its
    folder and a rename: the old file or the new one, never a truncated one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, file_mode())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, file_mode())
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
                files[f.name] = {"bytes": f.stat().st_size, "sha256": _digest(handle)}
    replace_file(path / MANIFEST, json.dumps({"format": FORMAT, "files": files},
                                             indent=1).encode(), "manifest")


def seal_file(path: str | Path) -> Path:
    """A manifest for one file in a folder that is not written once (a study's plan.json):
    `<name>.manifest.json` with its size and sha256, written after the file."""
    from .runs import write_json

    path = Path(path)
    return write_json(path.with_name(path.name + ".manifest.json"), {
        "format": FORMAT, "files": {path.name: {"bytes": os.lstat(path).st_size,
                                                 "sha256": sha256(path)}}})


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
