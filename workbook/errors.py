"""The one error type a user can cause: every message names the problem and the fix."""


class WorkbookError(Exception):
    """A problem in the user's task, data or parameters, with the way to fix it."""

    def __init__(self, problem: str, fix: str):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}\n  -> fix: {fix}")
