"""The one error type a user can cause: every message names the problem and the fix."""

import re


class WorkbookError(Exception):
    """A problem in the user's task, data or parameters, with the way to fix it."""

    def __init__(self, problem: str, fix: str):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}\n  -> fix: {fix}")

    def __reduce__(self):  # pickled whole: a worker process's error reaches its parent as is
        return type(self), (self.problem, self.fix)


# terminal codes (colours, cursor moves) some libraries put in errors and cells
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")


def shorten(text: str, limit: int = 200) -> str:
    """One line of text for a table or a message: terminal colour codes removed, the first
    line only, and a cut made at a word and said with an ellipsis."""
    lines = ANSI.sub("", text).strip().splitlines()
    line = lines[0].strip() if lines else ""
    if len(line) <= limit:
        return line
    head = line[:limit - 1]
    return (head.rsplit(" ", 1)[0] if " " in head else head) + "\u2026"


def reason(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (or its type when it has none), for messages
    (`shorten`)."""
    return shorten(str(exc), limit) or type(exc).__name__


PROGRESS = re.compile(r"\d+%\s*\||\d+/\d+ \[\d|it/s\]|s/it\]|examples/s\]")  # tqdm's bars


def child_error(stderr: str, limit: int = 600) -> str:
    """What a child process said when it failed, for a message: its progress bars (a
    library's tqdm output, e.g. datasets' "Map: 100%|...") and colour codes left out, from
    the workbook's own "error: ..." line when there is one; the last `limit` characters."""
    lines = [line.strip() for line in ANSI.sub("", stderr).replace("\r", "\n").splitlines()]
    lines = [line for line in lines if line and not PROGRESS.search(line)]
    ours = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    text = "\n".join(lines[ours[-1]:] if ours else lines)
    return text[-limit:]
