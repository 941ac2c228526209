"""Headless or interactive: a run without a frontend (the pilot, papermill, nbval, CI) creates no
live widget, because `ipywidgets.interact` under papermill/nbclient hangs now and then
(papermill#723, nbclient#312). Interactive views always have a static equivalent."""

from __future__ import annotations

import os

HEADLESS_ENV = "WORKBOOK_HEADLESS"  # "1": no live widgets (set by the pilot and `make test`)


def headless() -> bool:
    """True when this process (a kernel started by the pilot or the tests) has no frontend."""
    return os.environ.get(HEADLESS_ENV, "") not in ("", "0")


def progress_bar(**kwargs):
    """A tqdm bar: a widget in JupyterLab, plain text in a headless run."""
    if headless():  # a line at the start and the end, not one output per refresh
        from tqdm.std import tqdm

        return tqdm(mininterval=60, **kwargs)
    from tqdm.auto import tqdm

    return tqdm(**kwargs)


def readable(frame):
    """A table for people: byte columns (`*_bytes`) in MiB and FLOP counts (`flops*`) in GFLOP,
    rounded to two decimals, in place of the raw integers the records keep."""
    columns = {}
    for name in frame.columns:
        if name.endswith("_bytes"):
            columns[name.removesuffix("_bytes") + "_mib"] = (frame[name] / 2**20).round(2)
        elif name.startswith("flops"):
            columns["g" + name] = (frame[name] / 1e9).round(2)
        else:
            columns[name] = frame[name]
    return frame.__class__(columns)


def show_full_text() -> None:
    """Tables in this notebook show whole cells (repro commands, reasons), never cut with '...'."""
    import pandas as pd

    pd.set_option("display.max_colwidth", None)
