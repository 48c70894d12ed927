"""The pages match the repository: docs/design.md's picture of the package names every module and folder
the package has, and nothing it does not have; every link between the README, docs/ and the changelog
leads to a file that exists and, with a ``#section``, to a heading of that page."""
from __future__ import annotations

import re
from pathlib import Path

import gradpress

ROOT = Path(gradpress.__file__).resolve().parent
DESIGN = ROOT.parent / "docs" / "design.md"
PAGES = [ROOT.parent / "README.md", *sorted((ROOT.parent / "docs").glob("*.md")), ROOT.parent / "CHANGELOG.md"]
#: folders whose modules the picture names one by one (the others it describes as a whole)
DETAILED = ("core", "kernels", "exchange")


def _picture() -> str:
    text = DESIGN.read_text()
    start = text.index("```\ngradpress/\n")
    return text[start:text.index("```", start + 3)]


def _named(picture: str) -> set[str]:
    return set(re.findall(r"[\w.]+\.py|\w+/(?=[\s,])", picture))  # (not "NaN/Inf")


def test_the_pictured_tree_is_the_packages():
    named = _named(_picture())
    here = {path.name for path in ROOT.glob("*.py")} | {f"{path.name}/" for path in ROOT.iterdir()
                                                          if (path / "__init__.py").exists()}
    for folder in DETAILED:
        here |= {path.name for path in (ROOT / folder).glob("*.py") if path.name != "__init__.py"}
        here |= {f"{path.name}/" for path in (ROOT / folder).iterdir() if (path / "__init__.py").exists()}
    here -= {"__main__.py"}  # (python -m gradpress: the command line's, named with cli.py)
    assert here - named == set(), f"modules docs/design.md does not picture: {sorted(here - named)}"
    every = {path.name for path in ROOT.rglob("*.py")} | {f"{path.name}/" for path in ROOT.rglob("*")
                                                          if (path / "__init__.py").exists()}
    pictured_only = named - every - {"gradpress/"}
    assert pictured_only == set(), f"docs/design.md pictures what the package lacks: {sorted(pictured_only)}"


def _prose(page: Path) -> str:
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # (a link in a code block is code)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_leads_somewhere():
    anchors = {page.resolve(): {_slug(h) for h in re.findall(r"^#+ (.*)$", _prose(page), re.M)}
               for page in PAGES}
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
            if re.match(r"[a-z]+:", target):
                continue  # (https:, mailto:)
            path, _, anchor = target.partition("#")
            destination = (page.parent / path).resolve() if path else page.resolve()
            if not destination.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in anchors.get(destination, set()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []
