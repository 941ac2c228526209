"""The registry is every other layer's one view of a notebook: each entry matches its .ipynb,
smoke YAML and module, and each explains its verdicts - an error in an explanation is raised,
never swallowed into a bare 'verdict: pass'."""

import dataclasses
import json
from pathlib import Path

import pytest

import workbook
from workbook.commands.params import NOTEBOOK_DIR, SMOKE_DIR
from workbook.commands.params import stems as notebook_files
from workbook.notebooks import registry
from workbook.storage import runs

# One summary.json per notebook and verdict from real pilot runs, with the line it gave then.
RECORDED = json.loads((Path(__file__).parent / "recorded_summaries.json").read_text())


def _folder(tmp_path, stem, summary, name="20261201-101010-{}"):
    folder = tmp_path / name.format(stem)
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_every_notebook_has_one_entry_that_names_its_files_and_module():
    assert registry.stems() == notebook_files(), "a notebooks/NN_name.ipynb without an entry, " \
        "or an entry without its notebook"
    for entry in registry.ENTRIES:
        source = (NOTEBOOK_DIR / f"{entry.stem}.ipynb").read_text()
        assert f"wb.{entry.module}.run(" in source and f"wb.{entry.module}.save(" in source
        assert "wb.registry.verdict_line(out)" in source  # the verdict and why
        assert callable(entry.run) and callable(entry.save)
        assert (SMOKE_DIR / f"{entry.stem}.yaml").exists()
        # `wb.<module>` reaches it through the entry alone
        assert entry.module not in workbook._MODULES
        assert getattr(workbook, entry.module) is entry.code
        assert entry.title.startswith(entry.stem[:2] + " ") and entry.key_figures
        assert registry.entry(entry.stem) is entry


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_every_recorded_verdict_is_explained_as_before(name, tmp_path):
    stem, recorded = name.split()[0], RECORDED[name]
    folder = _folder(tmp_path, stem, recorded["summary"])
    assert registry.verdict_line(folder) == recorded["line"]
    assert runs.verdict_line(folder, registry.explain) == recorded["line"]
    assert registry.verdict_line(_folder(tmp_path, stem, recorded["summary"], "{}")) \
        == recorded["line"]  # a pilot's <run>/NN_name


@pytest.mark.parametrize("stem", registry.stems())
def test_every_explanation_gives_a_sentence_for_either_verdict_and_any_figures(stem):
    """Each branch of each `why` over every recorded summary of that notebook and over a
    summary without figures (a notebook that stopped early): a sentence, never an error."""
    entry = registry.entry(stem)
    summaries = [r["summary"] for n, r in RECORDED.items() if n.startswith(stem)] + [{}]
    for summary in summaries:
        for ok in (True, False):
            why = entry.why(ok, summary.get("figures") or {}, summary)
            assert isinstance(why, str) and why and "{" not in why, (ok, why)


def test_an_error_in_an_explanation_is_raised_not_swallowed(tmp_path, monkeypatch):
    name = "03_phase_gates pass"
    folder = _folder(tmp_path, name.split()[0], RECORDED[name]["summary"])

    def broken(ok, figures, summary):
        return f"{figures['no such figure']}"

    monkeypatch.setattr(registry, "ENTRIES", tuple(
        dataclasses.replace(e, why=broken) if e is registry.GATES else e
        for e in registry.ENTRIES))
    with pytest.raises(KeyError, match="no such figure"):
        runs.verdict_line(folder, registry.explain)
    with pytest.raises(KeyError, match="no such figure"):
        registry.verdict_line(folder)
    clean = _folder(tmp_path, "02_overfit", RECORDED["02_overfit pass"]["summary"])
    assert registry.verdict_line(clean) == RECORDED["02_overfit pass"]["line"]


def test_a_folder_no_notebook_wrote_has_a_verdict_without_a_reason(tmp_path):
    folder = _folder(tmp_path, "my_own_check", {"verdict": "pass", "figures": {"x": 1}})
    assert registry.verdict_line(folder) == "verdict: pass"
    assert registry.verdict_line(tmp_path / "nothing").startswith("verdict: unknown")
    with pytest.raises(workbook.WorkbookError, match="unknown notebook '10_new'"):
        registry.entry("10_new")


def test_every_report_table_is_a_file_its_notebook_writes():
    """The report shows what an entry declares: a table the notebook's code never writes (a
    typo, a renamed CSV) would be 'not produced in this run' on every report."""
    source = "\n".join(p.read_text() for p in
                       Path(registry.__file__).parent.rglob("*.py"))
    declared = [(e.stem, part) for e in registry.ENTRIES for part in e.report]
    assert declared, "the report shows 03's, 08's and 09's tables"
    for stem, part in declared:
        name = part.file if isinstance(part, registry.ReportTable) else f'"{part.key}"'
        assert name in source, (stem, name)
