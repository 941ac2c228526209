"""Committed notebook outputs are documentation that nbval re-checks: what it compares must not
depend on the torch build, the CPU, the thread count or the checkout path."""

import configparser
import json
import os
import re
from pathlib import Path

import papermill as pm
import pytest

from workbook.commands.params import NOTEBOOK_DIR, stems
from workbook.commands.pilot import ensure_kernel

ROOT = Path(__file__).resolve().parents[1]
def sanitizers():
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "tests" / "nbval_sanitize.cfg")
    return [(re.compile(cfg[s]["regex"]), cfg[s]["replace"]) for s in cfg.sections()]


def sanitize(text: str) -> str:
    for regex, replace in sanitizers():
        text = regex.sub(replace, text)
    return text


def compared_texts(nb: dict) -> list[tuple[int, str]]:
    """(cell index, text) of every output nbval compares: cells not marked to be ignored."""
    texts = []
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or "NBVAL_IGNORE_OUTPUT" in source \
                or "NBVAL_SKIP" in source:
            continue
        stream = None  # consecutive prints of one stream as one text (a loaded machine
        for out in cell["outputs"]:  # flushes them in pieces; nbval coalesces them too)
            if out["output_type"] == "stream":
                if stream == (i, out["name"]):
                    texts[-1] = (i, texts[-1][1] + "".join(out["text"]))
                else:
                    texts.append((i, "".join(out["text"])))
                stream = (i, out["name"])
                continue
            stream = None
            for key, value in out.get("data", {}).items():
                if key.startswith("text/"):
                    texts.append((i, "".join(value)))
    return texts


# What must not survive sanitizing: float digits, byte- or FLOP-sized integers, machine paths.
NOISE = re.compile(r"(?<![\w.])\d+(?:\.\d+|[eE][-+]?\d+)(?![\w])|(?<![\w.])\d{7,}(?![\w.])|"
                   r"/work/|/root/|/home/|"
                   + re.escape(str(ROOT)))


def test_the_sanitizer_hides_float_digits_and_keeps_counts():
    assert sanitize("<td>3.3e-07</td>") == sanitize("<td>4.1e-07</td>")
    assert sanitize("loss 0.085729") == sanitize("loss 0.085728")
    assert sanitize("-1.5 and 1e-4 and 2E+3") == "FLOAT and FLOAT and FLOAT"
    assert sanitize("28412 targets, 200 updates, ckpt-000006, id_3") == \
        "28412 targets, 200 updates, ckpt-000006, id_3"
    assert sanitize("pass") != sanitize("fail")


@pytest.mark.parametrize("stem", stems())
def test_compared_outputs_hold_nothing_that_depends_on_the_machine(stem):
    nb = json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())
    noisy = [(i, m.group(0)) for i, text in compared_texts(nb)
             for m in [NOISE.search(sanitize(text))] if m]
    assert not noisy, (f"{stem}: compared outputs carry build- or machine-dependent text "
                       f"{noisy[:5]}: show rounded or relative values, or mark the cell "
                       "# NBVAL_IGNORE_OUTPUT")


ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:work|home|root|tmp|Users)/[^\s\"'<>]*")


@pytest.mark.parametrize("stem", stems())
def test_no_stored_output_shows_a_path_of_the_machine_that_ran_it(stem):
    """Every output a user opens - compared by nbval or not (# NBVAL_IGNORE_OUTPUT) - shows
    paths relative to the notebooks folder (`../runs/...`, `../.venv/...`), never the absolute
    path of the machine that executed it (a notebook executed from another checkout did)."""
    nb = json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())
    found = [(i, m.group(0)) for i, out in _outputs(nb)
             for text in [json.dumps(out.get("text") or out.get("data") or "")]
             for m in [ABSOLUTE_PATH.search(text)] if m]
    assert not found, f"{stem}: outputs show machine paths {found[:3]}: execute it from notebooks/"


def _outputs_with_threads(stem: str, tmp_path: Path, threads: int) -> list[tuple[int, str]]:
    """Execute a committed notebook with its defaults in a kernel limited to `threads`."""
    before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    try:
        pm.execute_notebook(NOTEBOOK_DIR / f"{stem}.ipynb", tmp_path / f"{stem}.ipynb",
                            parameters={"out_dir": str(tmp_path / stem)},
                            kernel_name=ensure_kernel(), progress_bar=False,
                            cwd=str(NOTEBOOK_DIR), execution_timeout=300)
    finally:
        for key, value in before.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    nb = json.loads((tmp_path / f"{stem}.ipynb").read_text())
    nb["cells"] = [c for c in nb["cells"] if "injected-parameters" not in
                   c["metadata"].get("tags", [])]
    here = str(tmp_path / stem)  # the committed run wrote under runs/ instead
    return [(i, sanitize(t.replace(here, "../runs/RUN"))) for i, t in compared_texts(nb)]


# `make test` runs nbval with one OpenMP thread, which re-runs every committed notebook that way;
# this is the guard for a pytest run without it (`make test-all`: 04, and 07 in 40 s)
@pytest.mark.slow
@pytest.mark.parametrize("stem", ["04_batch_accounting", "07_resume_reload"])
def test_compared_outputs_survive_another_thread_count(stem, tmp_path):
    """The cheap guard against build noise: the notebooks whose floats once differed between
    machines, re-run with one thread, give the committed outputs after sanitizing."""
    committed = json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())
    expected = [(i, sanitize(t)) for i, t in compared_texts(committed)]
    assert _outputs_with_threads(stem, tmp_path, 1) == expected


def _long_float(cell: str) -> bool:
    """A decimal with more than 4 significant digits (a count without a point is exact)."""
    match = re.fullmatch(r"\s*-?([\d,]*\.\d+)(?:e-?\d+)?\s*", cell)
    return bool(match) and len(match.group(1).replace(",", "").replace(".", "").strip("0")) > 4


def _outputs(nb: dict):
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            yield i, out


@pytest.mark.parametrize("stem", stems())
def test_committed_outputs_read_as_words(stem):
    """No progress bar on stderr (an export shows it as a pink error block), no NaN, dict repr,
    raw JSON, ANSI code or Python literal in a displayed table, and a last line that says why."""
    nb = json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())
    stderr = [i for i, out in _outputs(nb) if out.get("name") == "stderr"]
    assert not stderr, f"{stem}: stderr output in cells {stderr}"
    for i, out in _outputs(nb):
        html = "".join(out.get("data", {}).get("text/html", ""))
        if "<table" not in html:
            continue
        cells = re.findall(r"<td>(.*?)</td>", html, re.S)
        bad = [c for c in cells if c.strip() in ("NaN", "nan", "None", "True", "False", "[]")
               or c.lstrip().startswith("{") or "\x1b" in c or "[31m" in c
               or _long_float(c) or c.strip() == "-0.000"]
        assert not bad, f"{stem} cell {i}: {bad[:5]}"
    last = "".join(next(out["text"] for out in nb["cells"][-1]["outputs"]
                        if out.get("name") == "stdout")).strip().splitlines()[-1]
    assert re.match(r"verdict: (pass|fail) - \S", last), f"{stem}: last line {last!r}"
