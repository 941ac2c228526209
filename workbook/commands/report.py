"""The pilot's report: one page that a person decides from (figures and the decision's tables
embedded; it says that its file links need the run folder) - the verdict of every notebook
first, then the decision at a glance, then each notebook's key figures and figures, then the
tables in human units, whole. Written from jinja2 templates (`templates/`) that escape every
string that comes from a task, the data or a run."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2
import pandas as pd
from markupsafe import Markup

from ..base import frontend
from ..base.errors import WorkbookError
from ..notebooks import registry
from ..notebooks.registry import GATES, RENTAL
from ..notebooks.rental import glance
from ..storage import runs
from ..storage.files import write_text
from ..storage.runs import overall_verdict

COLOURS = {"pass": "#1a7f37", "fail": "#cf222e", "error": "#8250df", "interrupted": "#9a6700",
           "provisional": "#9a6700"}
TEMPLATES = jinja2.Environment(loader=jinja2.PackageLoader("workbook.commands", "templates"),
                               autoescape=True, undefined=jinja2.StrictUndefined,
                               trim_blocks=False)
TEMPLATES.globals["zip"] = zip


@dataclass
class Sheet:
    """A table as the template shows it: headers in words and cells in human units."""

    columns: list[str]
    rows: list[list[str]]


def sheet(frame: pd.DataFrame | None, columns: list[str] | None = None,
          words: bool = False) -> Sheet | None:
    """A table whole (never cut into parts; the page scrolls it in its box when wider) in
    human units (`human`), or already in words (`words`); None when there is none."""
    if frame is None or frame.empty:
        return None
    if columns:
        frame = frame[[c for c in columns if c in frame]]
    shown = frame if words else human(frame)
    return Sheet([str(c) for c in shown.columns],
                 [[str(v) for v in row] for row in shown.itertuples(index=False)])


def human(frame: pd.DataFrame) -> pd.DataFrame:
    """`frontend.human` as a page needs it: MiB, GFLOP, seconds in ms below one second,
    floats to 4 significant digits, no all-empty column, '-' for empty cells (never NaN), yes/no,
    and headers in words with their unit."""
    return frontend.human(frame, words=False)


def _csv(path: Path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path.exists() else None


def _images(folder: Path) -> list[tuple[str, str]]:
    """Every PNG the notebook saved, as (name, base64) to embed."""
    return [(png.stem, base64.b64encode(png.read_bytes()).decode())
            for png in sorted(folder.glob("*.png"))]


NOT_GIVEN = {"plan_fits": "not judged: no device memory given (device_memory_gib), or a phase "
                          "not predicted (plan_unpredicted)"}


def run_and_predicted(summaries: dict) -> list[str]:
    """What ran here and what was only predicted, from 03's summary: the gates' shape on this
    machine against the rented shape sized on fake tensors, and - unless 08's conclusion says
    it ("Sized for: ...") - the models they belong to."""
    gates = (summaries.get(GATES.stem) or {}).get("figures", {})
    lines = []
    if gates.get("ran_at") and gates.get("plan"):
        lines.append(f"The gates ran {gates['ran_at']}; the rented shape {gates['plan']} was "
                     "predicted on fake tensors, not run.")
    if not summaries.get(RENTAL.stem):
        lines += [f"{line[0].upper()}{line[1:]}." for line in gates.get("models") or []
                  if len(gates.get("models")) > 1]
    return lines


def _key_figures(stem: str, summary: dict | None) -> list[tuple[str, str]]:
    """A notebook's key figures in a fixed order of importance (its registry entry's), with
    human labels and units, yes/no, never a Python literal (`registry.key_figures`); a figure
    of none says why where `NOT_GIVEN` knows: (label, value)."""
    if not summary:
        return []
    figures = {name: NOT_GIVEN.get(name) if value is None else value
               for name, value in summary.get("figures", {}).items()}
    rows = registry.key_figures(stem, figures)
    if summary.get("flags"):
        rows.append(("flagged checks", ", ".join(map(str, summary["flags"]))))
    return rows


def _summary(folder: Path) -> dict | None:
    """A notebook's summary.json (None when it wrote none, or one that cannot be read)."""
    try:
        return runs.read_summary(folder)
    except WorkbookError:
        return None


# Attributes that make a browser follow or load a URL; a scheme other than these is dropped.
_URL_ATTRIBUTES = ("href", "src", "action", "formaction", "xlink:href", "poster", "background",
                   "cite", "data", "srcset", "ping", "manifest", "codebase", "longdesc",
                   "dynsrc", "lowsrc")
_SCHEMES = ("http", "https", "mailto")
_IMAGES = re.compile(r"data:image/(png|jpeg|gif|webp);base64,[a-z0-9+/=\s]*$", re.I)
_ATTRIBUTE = re.compile(r"""(\s(?:%s)\s*=\s*)("[^"]*"|'[^']*'|[^\s"'>]+)"""
                        % "|".join(re.escape(a) for a in _URL_ATTRIBUTES), re.I)
_HANDLER = re.compile(r"""\son[a-z]+\s*=\s*("[^"]*"|'[^']*'|[^\s"'>]+)""", re.I)
_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*):")
SAFE_URL = "#link-removed"


def safe_url(url: str, loads: bool = False) -> bool:
    """Whether a URL may stay live in a page the workbook writes: http(s), mailto, a relative
    path or an #anchor; for what a page loads (`loads`: src) also an embedded PNG/JPEG/GIF/WebP.
    Entities, whitespace and control characters are undone first, as a browser does
    (`java&#x09;script:` is `javascript:`)."""
    text = "".join(c for c in html.unescape(url) if c.isprintable() and not c.isspace())
    scheme = _SCHEME.match(text.lower())
    if scheme is None:
        return not text.lower().startswith(("&", "\\"))
    if loads and _IMAGES.match(html.unescape(url).strip()):
        return True
    return scheme.group(1) in _SCHEMES


def safe_links(page: str) -> str:
    """`page` with every link or loaded URL of another scheme (javascript:, vbscript:, data:
    outside an embedded image, file:...) replaced by SAFE_URL and every inline event handler
    (onclick=...) removed. The whole page is searched, not only what looks like a tag (a `>`
    inside a quoted value cannot hide an attribute; text holds these only escaped). Applied to
    every HTML file the workbook writes from what parameters, tasks and notebooks hold."""
    def attribute(match: re.Match) -> str:
        value = match.group(2)
        url = value[1:-1] if value[:1] in "\"'" else value
        loads = not match.group(1).strip().lower().startswith(("href", "xlink", "action",
                                                              "formaction", "ping", "cite"))
        return match.group(0) if safe_url(url, loads) else f'{match.group(1)}"{SAFE_URL}"'

    return _ATTRIBUTE.sub(attribute, _HANDLER.sub(" ", page))


def export_html(notebook: Path) -> Path | None:
    """The executed notebook as HTML beside it (opens in any browser), its links made safe
    (`safe_links`: a parameter that holds a javascript: link shows as text, never runs) and its
    paths relative to the run folder it lies in (`runs.shown_in`: its `out_dir` parameter too);
    None if it cannot."""
    try:
        from nbconvert import HTMLExporter

        body, _ = HTMLExporter().from_filename(str(notebook))
        return write_text(notebook.with_suffix(".html"),
                          safe_links(runs.shown_in(body, notebook.parent)))
    except Exception:  # a broken notebook keeps its .ipynb link
        return None


def write_report(run: Path, index: pd.DataFrame, task: str, export: bool = True) -> Path:
    """report.html in the run folder (`templates/report.html.j2`). The decision leads: every
    summary's `headline` (a finding no plan can outweigh, e.g. 02's diverging learning rate),
    then 08's decision at a glance (`rental.glance`: one line, the priced plans, the chart of
    cost against hours, the open risks, the launch files), then 08's reasoning, folded. With
    `export` False (the disk is full: the report comes first) the executed notebooks are
    linked as they are, not exported to HTML. Paths into the run folder show relative to it
    (`runs.shown_in`), as a reader of the page opens them."""
    import mistune

    rows = index.to_dict(orient="records")
    overall = overall_verdict([r["verdict"] for r in rows])
    summaries = {r["notebook"]: _summary(run / r["notebook"]) for r in rows}
    notebooks = []
    for r in rows:
        stem = r["notebook"]
        folder = run / stem
        executed = run / r["executed"]
        exported = export_html(executed) if export and executed.exists() else None
        links = ([("executed notebook", exported.name)] if exported else
                 [("executed notebook (.ipynb)", r["executed"])] if executed.exists() else [])
        links += [("its folder", f"{stem}/")] if folder.exists() else []
        notebooks.append({"stem": stem, "title": registry.title(stem), "verdict": r["verdict"],
                          "seconds": r["seconds"], "links": links, "error": r.get("error"),
                          "figures": _key_figures(stem, summaries[stem]),
                          "images": _images(folder) if folder.exists() else [],
                          "parts": _tables(run, stem)})
    # a notebook that passed but says its result is not settled (06's study, 02's budget)
    provisional = {stem for stem, s in summaries.items() if s and s.get("verdict") == "pass"
                   and (s.get("figures") or {}).get("conclusive") is False}
    page = TEMPLATES.get_template("report.html.j2").render(
        task=task, run_name=run.name, rows=rows, overall=overall, colours=COLOURS,
        provisional=provisional, exported={nb["stem"]: nb["links"][0][1] for nb in notebooks
                                           if nb["links"] and nb["links"][0][1].endswith(".html")},
        # a task name is one long word: it may break after a dot, colon, slash or underscore
        title_parts=re.split(r"(?<=[.:/_])", task),
        style=Markup((Path(__file__).parent / "templates" / "report.css").read_text()),
        decision=_decision(run, rows, summaries, mistune.create_markdown(escape=True)),
        notebooks=notebooks, on_page={r["notebook"] for r in rows})
    return write_text(run / "report.html", safe_links(runs.shown_in(page, run)))


def _decision(run: Path, rows: list[dict], summaries: dict, render) -> dict | None:
    """What the decision shows: the headlines, 08's glance (with its chart and launch links),
    its conclusion (markdown rendered, HTML escaped) and what ran against what was predicted;
    None when there is none of them."""
    headlines = [s["headline"] for s in summaries.values() if s and s.get("headline")]
    path = run / RENTAL.stem / "conclusion.md"
    conclusion = Markup(render(path.read_text())) if path.exists() else ""
    scope = run_and_predicted(summaries)
    seen = glance.read(run, {r["notebook"]: r["verdict"] for r in rows})
    if not (headlines or conclusion or scope or seen):
        return None
    decision = {"headlines": headlines, "conclusion": conclusion, "scope": scope,
                "glance": seen, "plans": None, "chart": None, "risks": [], "launch": None}
    if seen is not None:
        png = glance.chart(seen.points)
        decision.update(plans=sheet(seen.plans, words=True), risks=seen.risks,
                        chart=base64.b64encode(png).decode() if png else None,
                        launch=_launch_links(run, seen.launch))
    return decision


def _launch_links(run: Path, index: dict) -> dict | None:
    """The recommended plan's launch files as (name, link from the report), the launch folder
    and the plans that got none, with why."""
    if not index:
        return None
    plans = index.get("plans") or []
    first = next((p for p in plans if p.get("name") == "recommended"), plans[0] if plans
                 else None)
    base = f"{RENTAL.stem}/"
    files = (first or {}).get("files") or {}
    recommended = [(Path(files[k]).name, base + files[k])
                   for k in ("sky", "sky_spot", "torchrun", "settings")
                   if k in files and (run / RENTAL.stem / files[k]).exists()]
    folder = base + f"{glance.FOLDER}/"
    return {"recommended": recommended,
            "folder": folder if (run / folder).exists() else "",
            "not_written": list((index.get("not_written") or {}).items())}


def _tables(run: Path, stem: str) -> list[dict]:
    """The tables a decision rests on, as the notebook's registry entry declares them:
    {heading, table} or {heading, text}."""
    folder, parts = run / stem, []
    for part in registry.entry(stem).report:
        if isinstance(part, registry.ReportNote):
            value = ((_summary(folder) or {}).get("figures") or {}).get(part.figure)
            if isinstance(value, dict) and value.get(part.key):
                parts.append({"heading": part.heading, "text": str(value[part.key])})
        elif not part.optional or (folder / part.file).exists():
            parts.append({"heading": part.heading, "text": None,
                          "table": sheet(_csv(folder / part.file),
                                         list(part.columns) if part.columns else None)})
    return parts
