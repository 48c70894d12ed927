"""The README's and the docs pages' examples marked ``<!-- run -->`` run as written; the README's marked
``<!-- run: 2 processes -->`` (DDP, custom loops, FSDP2) run as written in 2 Gloo
processes (``frameworks_harness.py``): each must finish on both ranks, send compressed bytes through
gradpress and leave the ranks' models bit-identical."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from frameworks_harness import needs, readme_blocks, result, shared_run

README = Path(__file__).resolve().parents[1] / "README.md"
RUN = r"<!-- run -->\s*```python\n(.*?)```"
BLOCKS = re.findall(RUN, README.read_text(), flags=re.S)
#: the docs pages' single-process examples, run the same way (docs/integrations.md's are multi-process)
DOCS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
DOC_BLOCKS = [(page.name, i, block) for page in DOCS
              for i, block in enumerate(re.findall(RUN, page.read_text(), flags=re.S))]


def test_readme_has_runnable_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    exec(compile(BLOCKS[index], f"README block {index}", "exec"), {"__name__": "readme"})


def test_docs_have_runnable_examples():
    assert any(name == "methods.md" for name, _, _ in DOC_BLOCKS)  # error feedback on its own


@pytest.mark.parametrize("page,index,block", DOC_BLOCKS, ids=[f"{n}-{i}" for n, i, _ in DOC_BLOCKS])
def test_docs_example_runs(page, index, block):
    exec(compile(block, f"docs/{page} block {index}", "exec"), {"__name__": "readme"})


MULTI = readme_blocks()


def test_readme_has_multiprocess_examples():
    assert len(MULTI) >= 3  # DDP, custom loop, FSDP2 (Lightning's and Accelerate's: docs/integrations.md)


@pytest.mark.parametrize("index", range(len(MULTI)))
def test_readme_example_runs_in_2_processes(index):
    for module in ("lightning", "accelerate"):
        if re.search(rf"^\s*(import|from) {module}\b", MULTI[index], re.M):
            needs(module)
    rank0, rank1 = result(shared_run(), f"readme{index}")
    for found in (rank0, rank1):
        assert found.get("sent_bytes", 0) > 0, "the example's gradpress state sent nothing: no hook ran"
    assert "parameters" in rank0, "the example leaves no `model` (or Lightning `trainer`) to compare"
    assert all(torch.equal(rank0["parameters"][k], rank1["parameters"][k]) for k in rank0["parameters"])


def test_readme_compressor_table_is_generated_from_the_registry():
    """The README holds ``gradpress list --markdown`` as printed: every registered method, its first
    docstring sentence whole, its measured bits per value and its facts (regenerate with that command)."""
    from gradpress.core.table import markdown_table

    text = README.read_text()
    assert markdown_table() in text, "README's compressor table differs from `gradpress list --markdown`"
