"""The pilot's report: one page that a person decides from (figures and the decision's tables
embedded; it says that its file links need the run folder) - the verdict of every notebook
first, then the decision, then each notebook's key figures and figures, then the tables in
human units. Every string that comes from a task, the data or a run is escaped."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import pandas as pd

from ..base import frontend
from ..base.errors import WorkbookError
from ..notebooks import registry
from ..notebooks.registry import GATES, RENTAL
from ..storage import schemas
from ..storage.files import write_text

COLOURS = {"pass": "#1a7f37", "fail": "#cf222e", "error": "#8250df", "interrupted": "#9a6700"}
STYLE = """
body{font-family:system-ui,sans-serif;max-width:1180px;margin:0 auto;padding:0 16px;color:#1f2328;
overflow-wrap:break-word}
h1{font-size:1.6em}h2{border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:2em}
.offline{color:#57606a;font-size:14px;margin-top:-6px}
.banner{display:flex;flex-wrap:wrap;gap:8px;margin:12px 0}
.chip{color:#fff;border-radius:6px;padding:6px 10px;font-weight:600;text-decoration:none}
.overall{font-size:1.3em;padding:10px 14px;border-radius:8px;color:#fff;display:inline-block}
.decision{background:#f6f8fa;border:1px solid #d0d7de;border-radius:8px;padding:4px 18px}
.decision h1{font-size:1.2em}.headline{color:#cf222e;font-weight:600}
table{border-collapse:collapse;font-size:13px;margin:8px 0;max-width:100%}
td,th{border:1px solid #d0d7de;padding:3px 6px;text-align:left;vertical-align:top;
overflow-wrap:break-word}
th{background:#f6f8fa}.part{color:#57606a;font-size:12px;margin:10px 0 -4px}
img{max-width:100%;height:auto;border:1px solid #eee;margin:6px 0}
.links a{margin-right:14px}.error{color:#cf222e;overflow-wrap:anywhere}
@media (max-width:640px){
body{padding:0 10px}h1{font-size:1.35em}
td{overflow-wrap:anywhere}table:not(.sheet) td:first-child{overflow-wrap:break-word}
table.sheet,table.sheet tbody,table.sheet tr,table.sheet td{display:block;width:auto}
table.sheet thead{display:none}
table.sheet tr{border:1px solid #d0d7de;border-radius:6px;margin:8px 0}
table.sheet td{border:none;border-top:1px solid #eaeef2;display:grid;
grid-template-columns:minmax(7em,40%) minmax(0,1fr);gap:8px}
table.sheet td:first-child{border-top:none;background:#f6f8fa;font-weight:600}
table.sheet td::before{content:attr(data-label);color:#57606a;font-weight:400}
}
"""


def _escape(value) -> str:
    return html.escape(str(value))


def _sheet(frame: pd.DataFrame) -> str:
    """One table whose cells carry their header (`data-label`) for the phone layout."""
    head = "".join(f"<th>{_escape(c)}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(f'<td data-label="{_escape(c)}">{_escape(v)}</td>'
                                    for c, v in zip(frame.columns, row, strict=True))
                   + "</tr>"
                   for row in frame.itertuples(index=False))
    return f'<table class="sheet"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def human(frame: pd.DataFrame) -> pd.DataFrame:
    """`frontend.human` as a page needs it: MiB, GFLOP, seconds in ms below one second,
    floats to 4 significant digits, no all-empty column, '-' for empty cells (never NaN), yes/no,
    and headers in words with their unit."""
    return frontend.human(frame, words=False)


def _table(frame: pd.DataFrame | None, columns: list[str] | None = None) -> str:
    """A sheet in human units (`human`); one wider than the page is split into parts
    (`frontend.parts`), each with the columns that name a row, never a box that scrolls or
    cuts."""
    if frame is None or frame.empty:
        return "<p><i>not produced in this run</i></p>"
    if columns:
        frame = frame[[c for c in columns if c in frame]]
    pieces = frontend.parts(human(frame))
    return "".join(f'<p class="part">part {n} of {len(pieces)}</p>' * (len(pieces) > 1)
                   + _sheet(piece) for n, piece in enumerate(pieces, 1))


def _csv(path: Path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path.exists() else None


def _figures(folder: Path) -> str:
    """Every PNG the notebook saved, embedded."""
    parts = []
    for png in sorted(folder.glob("*.png")):
        data = base64.b64encode(png.read_bytes()).decode()
        parts.append(f'<img alt="{_escape(png.stem)}" src="data:image/png;base64,{data}">')
    return "".join(parts)


NOT_GIVEN = {"plan_fits": "not judged: no device memory given (device_memory_gib), or a phase "
                          "not predicted (plan_unpredicted)"}


def _shown(name: str, value) -> str:
    """A key figure as words (`frontend.figure_word`): yes/no, '-' (or why) for none, bytes
    in MiB or GiB, floats to 4 significant digits, lists and dicts joined whole (never cut)."""
    if value is None:
        return NOT_GIVEN.get(name, "-")
    return frontend.figure_word(name, value)


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


def _key_figures(stem: str, summary: dict | None) -> str:
    """A notebook's key figures in a fixed order of importance (its registry entry's), with
    human labels and units, yes/no, never a Python literal."""
    if not summary:
        return ""
    figures = summary.get("figures", {})
    labels = registry.labels(stem)
    rows = [{"figure": labels.get(name) or frontend.header(name.removesuffix("_bytes")),
             "value": _shown(name, figures[name])} for name in _ordered(stem, figures)]
    flags = summary.get("flags")
    if flags:
        rows.append({"figure": "flagged checks", "value": ", ".join(map(str, flags))})
    return pd.DataFrame(rows).to_html(index=False, escape=True, border=0) if rows else ""


def _ordered(stem: str, figures: dict) -> list[str]:
    """The figure names in `frontend.key_figures`' order."""
    labels = registry.labels(stem)
    return [n for n in labels if n in figures] + [n for n in figures if n not in labels]


def _summary(folder: Path) -> dict | None:
    """A notebook's summary.json (None when it wrote none, or one that does not parse)."""
    path = folder / "summary.json"
    try:
        return schemas.read(path, schemas.Summary, "notebook summary").model_dump() \
            if path.exists() else None
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
    (`safe_links`: a parameter that holds a javascript: link shows as text, never runs); None
    if it cannot."""
    try:
        from nbconvert import HTMLExporter

        body, _ = HTMLExporter().from_filename(str(notebook))
        return write_text(notebook.with_suffix(".html"), safe_links(body))
    except Exception:  # a broken notebook keeps its .ipynb link
        return None


def write_report(run: Path, index: pd.DataFrame, task: str, export: bool = True) -> Path:
    """report.html in the run folder. The decision leads with every summary's `headline` (a
    finding no plan can outweigh, e.g. 02's diverging learning rate), then 08's conclusion.
    With `export` False (the disk is full: the report comes first) the executed notebooks are
    linked as they are, not exported to HTML."""
    import mistune

    rows = index.to_dict(orient="records")
    overall = "pass" if rows and all(r["verdict"] == "pass" for r in rows) else \
        ("fail" if all(r["verdict"] in ("pass", "fail") for r in rows) else "error")
    chips = "".join(f'<a class="chip" href="#{_escape(r["notebook"])}" style="background:'
                    f'{COLOURS.get(r["verdict"], "#57606a")}">{_escape(r["notebook"][:2])} '
                    f'{_escape(r["verdict"])}</a>' for r in rows)
    # a task name is one long word: it may break after a dot, colon, slash or underscore
    title = re.sub(r"([.:/_])", r"\1<wbr>", _escape(task))
    parts = [f"<h1>Pilot report: {title}</h1>",
             '<p class="offline">The verdicts, key figures, figures and the tables the decision '
             "rests on are on this page. The links to the executed notebooks (every table) and "
             f"to their folders are files in the run folder <b>{_escape(run.name)}</b>: they "
             "open only while this page sits in that folder; to share them, send the whole "
             "folder.</p>",
             f'<div class="overall" style="background:{COLOURS[overall]}">overall: '
             f'{overall}</div><div class="banner">{chips}</div>']
    summaries = {r["notebook"]: _summary(run / r["notebook"]) for r in rows}
    first = [f'<p class="headline">{_escape(s["headline"])}</p>'
             for s in summaries.values() if s and s.get("headline")]
    conclusion = run / RENTAL.stem / "conclusion.md"
    scope = "".join(f"<p>{_escape(line)}</p>" for line in run_and_predicted(summaries))
    if first or conclusion.exists() or scope:
        render = mistune.create_markdown(escape=True)
        parts.append(f'<h2 id="decision">Decision</h2><div class="decision">{"".join(first)}'
                     + (render(conclusion.read_text()) if conclusion.exists() else "")
                     + scope + "</div>")
    for r in rows:
        stem = r["notebook"]
        folder = run / stem
        summary = summaries[stem]
        executed = run / r["executed"]
        exported = export_html(executed) if export and executed.exists() else None
        links = [f'<a href="{_escape(exported.name)}">executed notebook</a>' if exported else
                 (f'<a href="{_escape(r["executed"])}">executed notebook (.ipynb)</a>'
                  if executed.exists() else ""),
                 f'<a href="{_escape(stem)}/">its folder</a>' if folder.exists() else ""]
        parts.append(
            f'<h2 id="{_escape(stem)}">{_escape(registry.title(stem))}: '
            f'<span style="color:{COLOURS.get(r["verdict"], "#57606a")}">'
            f'{_escape(r["verdict"])}</span> <small>({r["seconds"]} s)</small></h2>'
            f'<div class="links">{"".join(links)}</div>'
            + (f'<p class="error">{_escape(r["error"])}</p>' if r.get("error") else "")
            + _key_figures(stem, summary) + (_figures(folder) if folder.exists() else ""))
        parts += _tables(run, stem)
    path = run / "report.html"
    write_text(path, safe_links(
        "<!doctype html><html lang='en'><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>pilot report: {_escape(task)}</title><style>{STYLE}</style><body>"
        + "".join(parts) + "</body></html>"))
    return path


def _tables(run: Path, stem: str) -> list[str]:
    """The tables a decision rests on, as the notebook's registry entry declares them."""
    folder, parts = run / stem, []
    for part in registry.entry(stem).report:
        if isinstance(part, registry.ReportNote):
            value = ((_summary(folder) or {}).get("figures") or {}).get(part.figure)
            if isinstance(value, dict) and value.get(part.key):
                parts += [f"<h3>{_escape(part.heading)}</h3>",
                          f"<p>{_escape(str(value[part.key]))}</p>"]
        elif not part.optional or (folder / part.file).exists():
            parts += [f"<h3>{_escape(part.heading)}</h3>",
                      _table(_csv(folder / part.file), list(part.columns) if part.columns
                             else None)]
    return parts
