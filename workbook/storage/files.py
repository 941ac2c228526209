"""Plain files, written atomically and read without following links: the primitives every
stored file goes through (umask modes, no-replace publishing, named write errors)."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from ..base.errors import WorkbookError, reason

# Messages of write failures that torch and safetensors raise as something other than OSError.
_WRITE_FAILURES = ("No space left", "unexpected pos", "file write failed", "Read-only",
                   "Permission denied", "inline_container", "File too large", "Disk quota")


_UMASK = os.umask(0o022)
os.umask(_UMASK)


# O_NONBLOCK: opening a named pipe planted under a file's name must not wait for a writer.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
    getattr(os, "O_BINARY", 0)


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


def with_article(what: str) -> str:
    """`what` with its article, for a message: "an archive", "a study"."""
    return f"{'an' if what[:1] in 'aeiou' else 'a'} {what}"


def kind_of(mode: int) -> str:
    """What an entry that is not a plain file is, in words ("a symbolic link", "a folder",
    "a named pipe"...), from its `st_mode`."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a plain file"


def link_target(path: Path) -> str:
    """" (to TARGET)" naming where a symbolic link points, for a message; "" when it cannot be
    read."""
    try:
        return f" (to {shown_name(os.readlink(path))})"
    except OSError:
        return ""


def not_plain(what: str, folder: Path, name: str, mode: int) -> WorkbookError:
    """The error for an entry of a folder that is not a plain file (a link, a pipe, a folder)."""
    kind = kind_of(mode) + (link_target(folder / name) if stat.S_ISLNK(mode) else "")
    return WorkbookError(f"{what} {folder}: {shown_name(name)} is {kind}",
                         f"{with_article(what)} holds plain files only - copy the real file "
                         f"in, or use an intact {what}")


def plain_folder(path: Path, what: str, holds: str = "") -> None:
    """Refuse a folder that is a symbolic link: what it points at could be anything. `holds`
    names what the folder holds when it is not itself the `what` (a study's design)."""
    if path.is_symlink():
        name, noun = (f"the folder of the {holds}", holds) if holds else (what, what)
        rule = f"{with_article(noun)} " + ("lives in a plain folder" if holds else
                                           "is a plain folder")
        raise WorkbookError(f"{name} {path} is a symbolic link{link_target(path)}",
                            f"{rule}, never a link - name the real folder if you trust it, or "
                            f"use an intact {noun}")


def open_plain(path: Path) -> BinaryIO:
    """Open a plain file for reading without following a link (OSError ELOOP for a link,
    EINVAL for a pipe, a device or a folder)."""
    fd = os.open(path, os.O_RDONLY | NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a plain file", str(path))
    return os.fdopen(fd, "rb")


def sha256_of(handle: BinaryIO) -> str:
    """The sha256 of what is left to read in an open binary file (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: handle.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


def sha256(path: Path) -> str:
    """The sha256 of a plain file (a link is refused: OSError)."""
    with open_plain(Path(path)) as handle:
        return sha256_of(handle)


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


def read_plain(path: Path, what: str, fix: str) -> bytes:
    """The bytes of a plain file (never through a link, a pipe or a device), or a
    WorkbookError naming it."""
    try:
        with open_plain(path) as handle:
            return handle.read()
    except OSError as exc:
        if path.is_symlink():
            raise WorkbookError(f"{what} {path} is a symbolic link{link_target(path)}",
                                "a folder the workbook reads holds plain files only - copy the "
                                "real file in, or use an intact copy") from None
        raise WorkbookError(f"cannot read {what} {path}: {exc.strerror or exc}", fix) from None


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN and infinities become strings, numpy scalars plain numbers."""
    if hasattr(value, "item") and not isinstance(value, (list, dict)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def public_mode(path: str | Path) -> None:
    """Give a file the mode an ordinary new file gets (0666 less the umask: 0644 under 022),
    whatever its writer chose: a temporary file is made 0600, which would keep another account
    from reading the result."""
    os.chmod(path, file_mode())


def publish(tmp: str | Path, path: str | Path, overwrite: bool = True) -> None:
    """Move a complete temporary file to its final name: `os.replace`, or with `overwrite`
    False a hard link that fails on an existing name (no-replace, atomic), then the temporary
    name is removed. Where links are not supported it checks and renames."""
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise WorkbookError(f"{path} already exists",
                            "give the output a new name (outputs are never overwritten)") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if os.path.lexists(path):
            raise WorkbookError(f"{path} already exists", "give the output a new name "
                                "(outputs are never overwritten)") from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def write_text(path: str | Path, text: str, overwrite: bool = True) -> Path:
    """Write a text file atomically: a temporary file in the same folder, then a rename (with
    `overwrite` False, never over an existing file: see `publish`). The file gets the umask's
    mode. A failed write (disk full, permissions) leaves neither a partial file nor the
    temporary one and becomes a `WorkbookError` naming the path."""
    path = Path(path)
    tmp = None
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp",
                                         prefix=f".{path.name}.", encoding="utf-8") as handle:
            tmp = handle.name
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        public_mode(tmp)  # a temporary file is private; the result is not
        publish(tmp, path, overwrite)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise write_error("file", path, exc) from exc
        raise
    return path


def write_json(path: str | Path, data: Any, overwrite: bool = True) -> Path:
    """Write JSON atomically (see `write_text`)."""
    return write_text(path, json.dumps(_clean(data), indent=1, sort_keys=True), overwrite)


def scratch_folder(prefix: str) -> str:
    """A private temporary folder for output the pilot never reads back (a framework's log
    and checkpoint folder it insists on), removed when the process exits."""
    import atexit
    import shutil

    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path
