"""Headless or interactive: a run without a frontend (the pilot, papermill, nbval, CI) creates no
live widget, because `ipywidgets.interact` under papermill/nbclient hangs now and then
(papermill#723, nbclient#312); interactive views always have a static equivalent. Progress
bars: tqdm's widget in JupyterLab, one stdout line when headless."""

from __future__ import annotations

import os

HEADLESS_ENV = "WORKBOOK_HEADLESS"  # "1": no live widgets (set by the pilot and `make test`)


def headless() -> bool:
    """True when this process (a kernel started by the pilot or the tests) has no frontend."""
    return os.environ.get(HEADLESS_ENV, "") not in ("", "0")


class QuietBar:
    """A headless progress bar: nothing while it runs (no stderr block in an exported notebook,
    which reads like an error), one short stdout line when it closes."""

    def __init__(self, total=None, initial=0, disable=False, desc="", unit="updates", **_):
        self.total, self.n, self.disable, self.desc, self.postfix = total, initial, disable, \
            desc, {}
        self.unit = unit
        self.closed = False

    def update(self, n=1):
        self.n += n

    def set_postfix(self, refresh=True, **kwargs):
        self.postfix.update(kwargs)

    def set_description(self, desc="", refresh=True):
        self.desc = desc

    def refresh(self):
        pass

    def close(self):
        if self.closed or self.disable:
            self.closed = True
            return
        self.closed = True
        done = f"{self.n} of {self.total}" if self.total else f"{self.n}"
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        print(f"{self.desc + ': ' if self.desc else ''}{done} {self.unit}{extra}", flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def progress_bar(**kwargs):
    """A tqdm bar in JupyterLab (a widget); headless, a `QuietBar`: no bar, no stderr, one
    stdout line at the end."""
    if headless():
        return QuietBar(**kwargs)
    from tqdm.auto import tqdm

    return tqdm(**kwargs)
