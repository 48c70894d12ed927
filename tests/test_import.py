"""``import gradpress`` stays light: it loads no method's module, no numba, no scipy, and nothing of the
lab (testbed, benchmarks, plotting, progress bars); a method's module loads when the method is first made.
Fresh processes, ``sys.modules`` checked (timings: ``gradpress bench import``, docs/performance.md)."""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import gradpress
import gradpress.compressors
from gradpress.core.compressor import registry
from gradpress.core.feedback import feedback_registry

#: what importing gradpress must not load (beyond what importing torch loads: torch.hub imports tqdm)
HEAVY = ("numba", "llvmlite", "scipy", "matplotlib", "tqdm", "rich", "gradpress.testbed", "gradpress.bench",
         "gradpress.cli", "gradpress.compressors.", "gradpress.kernels.jit")


def _fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter (this checkout's gradpress; THC's tables not kept in a file);
    the JSON it prints last."""
    root = os.path.dirname(os.path.dirname(gradpress.__file__))
    env = {**os.environ, "PYTHONPATH": root, "GRADPRESS_CACHE": ""}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _heavy(modules: list[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h if h.endswith(".") else h + ".")
                                            for h in HEAVY))


@pytest.fixture(scope="module")
def first_imports() -> dict:
    """What a new interpreter loads: importing gradpress after torch, then making a method (its module
    loads), then THC's table and ``gradpress.pack_bits`` (loaded on first access). One process for
    both tests below: each step's modules are told apart by ``sys.modules`` before and after it."""
    return _fresh("""
        import json, sys
        import torch
        before = set(sys.modules)
        import gradpress
        after_import = set(sys.modules)
        names = gradpress.compressor_names()
        topk = gradpress.make("topk:ratio=0.5")
        after_make = set(sys.modules)
        table = gradpress.thc_table(2, 3, 0.5)
        print(json.dumps({"new": sorted(after_import - before), "names": names,
                          "make": sorted(after_make - after_import), "spec": topk.spec,
                          "thc_table": sorted(set(sys.modules) - after_make), "table": table,
                          "pack_bits": gradpress.pack_bits.__module__}))
    """)


def test_importing_gradpress_loads_nothing_heavy(first_imports):
    got = first_imports
    assert _heavy(got["new"]) == []
    assert "gradpress.communicator" in got["new"] and "gradpress.ddp" in got["new"]  # the API is there
    assert got["names"] == sorted(gradpress.compressors.declared()[0])


def test_a_method_loads_its_module_when_first_made(first_imports):
    got = first_imports  # ("make": all that is loaded after import gradpress, up to the method made)
    assert "gradpress.compressors.sparsify" in got["make"] and "numba" in got["make"]
    assert "gradpress.compressors.thc" not in got["make"] and "scipy.stats" not in got["make"]
    assert "gradpress.compressors.thc_table" in got["thc_table"]
    assert got["spec"] == "topk:ratio=0.5" and got["table"] == [0, 1, 2, 3]
    assert got["pack_bits"] == "gradpress.kernels.bits"


def test_the_declared_names_are_what_the_modules_register():
    """The names read from the modules' register decorators (what lists the methods before their modules
    load) are each registered method with the module that registers it, and nothing else."""
    package = gradpress.compressors
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    for table, reg in zip(package.declared(), (registry, feedback_registry), strict=True):
        registered = {name: cls.__module__ for name, cls in reg._types.items()
                      if cls.__module__.startswith(package.__name__ + ".")}
        assert registered == table


def test_the_import_benchmark_reports_what_gradpress_loads(tmp_path):
    """``gradpress bench import`` (the timings of docs/performance.md) runs, and the modules it reports
    gradpress loading beyond torch's own are none of the heavy ones."""
    from gradpress import cli

    out = tmp_path / "import.json"
    assert cli.main(["bench", "import", "--runs", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["runs"] == 1 and result["gradpress"]["loaded"] == []
    assert {"import_s", "wall_s", "cpu_s", "beyond_torch_s"} <= result["gradpress"].keys()
    assert result["gradpress"]["beyond_torch_s"] > 0 and any(
        name.startswith("gradpress.") for _, name in result["gradpress"]["slowest"])
