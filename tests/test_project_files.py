"""Project files: pyproject.toml is the single source of dependencies (environment.yml names the
same), and the README stays a newcomer's page whose links resolve."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}  # conda's name -> pip's name


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0].lower()


def test_environment_yml_lists_the_pyproject_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_names = {_name(d) for d in project["dependencies"]}
    pip_names |= {_name(d) for d in project["optional-dependencies"]["test"]}
    conda = []
    text = (ROOT / "environment.yml").read_text()
    for line in text.split("dependencies:", 1)[1].splitlines():
        m = re.match(r"^  - ([A-Za-z][\w.-]*)", line)
        if m and m.group(1) not in ("python", "pip"):
            conda.append(CONDA_NAMES.get(_name(m.group(1)), _name(m.group(1))))
    assert sorted(conda) == sorted(pip_names)
    assert "-e ." in text, "conda users install the package itself"


def test_tokenizer_round_trip():
    from workbook.samples import tokenizer as tok

    text = "upper: déjà\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.BOS, *tok.encode("a"), tok.EOS], keep_special=True) == "<s>a</s>"


def test_the_readme_stays_a_newcomers_page_and_its_links_resolve():
    """The README keeps the two commands, what the pilot answers and the five-minute path; the
    reference lives in docs/ (built by `make docs --strict`), and every link it makes exists."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for part in ("make pilot", "make test", "## What the pilot answers",
                 "## Your own code in five minutes", "from_lightning", "from_hf"):
        assert part in text, part
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links and all((ROOT / link).is_file() for link in links), links
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(page.name in nav for page in (ROOT / "docs").glob("*.md"))
