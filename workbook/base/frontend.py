"""What a person reads: tables a notebook displays go through `table` (or `human`) - words and
units, never NaN, raw bytes, raw JSON, a dict repr, ANSI codes or more than 4 significant
digits - and key figures in words (`figure_word`, `figure_table`). Whether a live widget may be
shown, and the progress bars, are `progress`'s."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from .errors import ANSI


def readable(frame):
    """A table for people: byte columns (`*_bytes`) in MiB and FLOP counts (`flops*`) in GFLOP,
    rounded to two decimals, in place of the raw integers the records keep."""
    columns = {}
    for name in frame.columns:
        if str(name).endswith("_bytes"):
            columns[name.removesuffix("_bytes") + "_mib"] = (frame[name] / 2**20).round(2)
        elif str(name).startswith("flops"):
            columns["g" + name] = (frame[name] / 1e9).round(2)
        else:
            columns[name] = frame[name]
    return frame.__class__(columns)


SIGNIFICANT = 4


def number(value: float) -> str:
    """A float for reading: at most 4 significant digits, no '-0', thousands separated."""
    if not math.isfinite(value):
        return "-" if math.isnan(value) else ("infinite" if value > 0 else "-infinite")
    if value == 0:
        return "0"
    if abs(value) >= 10**SIGNIFICANT:
        digits = int(math.floor(math.log10(abs(value)))) + 1
        return f"{round(value, SIGNIFICANT - digits):,.0f}"
    text = f"{value:.{SIGNIFICANT}g}"
    if "e" in text:  # 1e-05, 1.235e-07: keep it short
        mantissa, exponent = text.split("e")
        return f"{mantissa}e{int(exponent)}"
    return "0" if float(text) == 0 else text


def word(value) -> str:
    """Any cell as words: yes/no, '-' for none or NaN, floats to 4 significant digits, dicts
    (or JSON objects) as 'key: value, ...', lists joined, ANSI codes removed."""
    import numpy as np

    if value is None:
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return f"{int(value)}"
    if isinstance(value, (float, np.floating)):
        return number(float(value))
    if isinstance(value, bytes):
        return f"{len(value):,} bytes"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {word(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple, set, np.ndarray)):
        return ", ".join(word(v) for v in value) or "-"
    try:
        import pandas as pd

        if pd.isna(value):
            return "-"
    except (TypeError, ValueError):
        pass
    text = ANSI.sub("", str(value))
    if text in ("True", "False"):
        return "yes" if text == "True" else "no"
    if text in ("None", "nan", "NaN", ""):
        return "-" if text else ""
    if text[:1] in "{[" and text[-1:] in "}]":  # raw JSON (a metrics column read back)
        try:
            return word(json.loads(text))
        except ValueError:
            pass
    return text


UNITS = {"_mib": " (MiB)", "_gib": " (GiB)", "_ms": " (ms)", "_s": " (s)", "_pct": " (%)",
         "_gflops": " (GFLOP)"}


def header(name) -> str:
    """A column name in words with its unit: 'peak_allocated_mib' -> 'peak allocated (MiB)'."""
    name = str(name)
    unit = next((u for u in UNITS if name.endswith(u)), None)
    base = name.removesuffix(unit) + UNITS[unit] if unit else name
    return base.replace("_", " ")


def human(frame, words: bool = True):
    """`readable` (MiB, GFLOP) plus what a person needs: seconds in ms below one second, no
    all-empty column, headers in words with their unit, and - with `words` - every cell as
    text (`word`): never NaN, a dict repr, raw JSON, ANSI codes or more than 4 significant
    digits. Without `words`, floats are rounded to 4 significant digits and empty cells are '-'."""
    import numpy as np
    import pandas as pd

    empty = [c for c in frame.columns
             if frame[c].isna().all() or (frame[c].astype(str) == "").all()]
    frame = readable(frame.drop(columns=empty))
    out = {}
    for name in frame.columns:
        column = frame[name]
        if str(name).endswith("_s") and pd.api.types.is_numeric_dtype(column) \
                and not pd.api.types.is_bool_dtype(column):
            small = column.abs().max() < 1
            column = (column * (1000 if small else 1))
            name = str(name).removesuffix("_s") + ("_ms" if small else "_s")
        if words:
            out[name] = column.map(word)
        elif pd.api.types.is_float_dtype(column):
            out[name] = column.map(lambda v: v if not math.isfinite(v) or v == 0
                                   else float(f"{v:.4g}"))
        else:
            out[name] = column.map(lambda v: word(v) if isinstance(v, (bool, np.bool_, str))
                                   else v)
    shown = pd.DataFrame(out, index=frame.index).astype(object).where(lambda f: f.notna(), "-")
    return shown.rename(columns=header)


def table(frame, index: bool = False):
    """A frame as a notebook shows it: `human` words and units, one table however wide (the
    notebook scrolls it sideways; never cut into parts). `index` keeps the frame's index (a
    transposed table's row names). None stays None."""
    import pandas as pd

    if frame is None:  # a table a notebook's settings left out (demonstrate_faults=False)
        return None
    if isinstance(frame, pd.Series):
        frame = frame.to_frame()
    if index and list(frame.columns) == [0]:  # a transposed one-row table
        frame = frame.rename(columns={0: "value"})
    shown = human(frame)
    if index:  # the row names in words, as the frame's index
        shown.index = [header(i) for i in shown.index]
    else:
        shown = shown.reset_index(drop=True)
    return shown


def show_full_text() -> None:
    """Tables in this notebook show whole cells (repro commands, reasons) and every column,
    never cut with '...' (a wide one scrolls sideways)."""
    import pandas as pd

    pd.set_option("display.max_colwidth", None)
    pd.set_option("display.max_columns", None)


def key_figures(figures: dict, labels: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(label, value in words) of a notebook's key figures: those `labels` names first, in its
    order of importance (a notebook's registry entry), then the rest, their names in words;
    sizes in MiB/GiB, seconds in ms below one second, never a Python literal."""
    labels = labels or {}
    names = [n for n in labels if n in figures] + [n for n in figures if n not in labels]
    return [(labels.get(n) or header(n.removesuffix("_bytes")), figure_word(n, figures[n]))
            for n in names]


def figure_word(name: str, value) -> str:
    """One key figure in words: `word`, with sizes (`*_bytes`) in MiB or GiB and seconds
    (`*_s`) in ms below one second; a dict of them as 'key: value; ...'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if name.endswith("_bytes"):
            return f"{value / 2**30:,.2f} GiB" if value >= 2**30 else f"{value / 2**20:,.2f} MiB"
        if name.endswith("_s"):
            return f"{number(value * 1000)} ms" if abs(value) < 1 else f"{number(value)} s"
    if isinstance(value, dict):
        return "; ".join(f"{_key(k)}: {figure_word(str(k), v)}" for k, v in value.items()) \
            or "none"
    if isinstance(value, list):
        if value and all(isinstance(v, dict) for v in value):  # records: "name: key value, ..."
            return "; ".join(
                f"{word(next(iter(r.values())))}: " + ", ".join(
                    f"{_key(k)} {figure_word(str(k), v)}" for k, v in list(r.items())[1:]
                    if v not in (None, "", [])) for r in value)
        return ", ".join(word(v) for v in value) if value else "none"
    return word(value)


def _key(name) -> str:
    """A dict key in words: an identifier ('max_param_diff') as 'max param diff', a phrase as
    it is."""
    name = str(name)
    return header(name) if "_" in name and " " not in name else name


def figure_table(figures: dict, labels: Mapping[str, str] | None = None):
    """Key figures as a table of words: a label (from `labels`, else the name in words) and the
    value (`figure_word`), most important first (`key_figures`)."""
    import pandas as pd

    rows = key_figures(figures, labels)
    return pd.DataFrame(rows, columns=["figure", "value"]).set_index("figure").rename_axis(None)


def show(frame, index: bool = False) -> None:
    """Display `table(frame)`; for use inside a cell's code."""
    from IPython.display import display

    shown = table(frame, index=index)
    if shown is not None:
        display(shown)
