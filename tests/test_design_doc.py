"""docs/design.md's picture of the package names every module and folder the package has, and nothing
it does not have: the tree a newcomer reads is the tree in the repository."""
from __future__ import annotations

import re
from pathlib import Path

import gradpress

ROOT = Path(gradpress.__file__).resolve().parent
DESIGN = ROOT.parent / "docs" / "design.md"
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
