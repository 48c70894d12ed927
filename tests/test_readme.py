"""The README's examples marked ``<!-- run -->`` run as written."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"<!-- run -->\s*```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_runnable_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    exec(compile(BLOCKS[index], f"README block {index}", "exec"), {"__name__": "readme"})


def test_readme_lists_every_compressor():
    import gradpress

    text = README.read_text()
    missing = [name for name in gradpress.compressor_names() if f"| `{name}` |" not in text]
    assert not missing, f"README's compressor table lacks {missing}"
