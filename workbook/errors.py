"""The one error type a user can cause: every message names the problem and the fix."""


class WorkbookError(Exception):
    """A problem in the user's task, data or parameters, with the way to fix it."""

    def __init__(self, problem: str, fix: str):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}\n  -> fix: {fix}")


def reason(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (or its type when it has none), for messages."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:limit]
