"""Run the README's quick-start from an installed gradpress (``make wheel-check``), not the checkout.

Usage: ``python installed_quickstart.py README.md`` with the interpreter of a fresh virtualenv holding the
wheel. Runs every ``<!-- run -->`` block of the README, then checks that the import came from that
environment, that the testbed's libraries are neither installed nor loaded, and that the CLI answers
``--version`` and names the extra to install for a testbed command.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

readme = Path(sys.argv[1]).read_text()
blocks = re.findall(r"<!-- run -->\s*```python\n(.*?)```", readme, flags=re.S)
assert blocks, "the README has no <!-- run --> block"
for index, block in enumerate(blocks):
    exec(compile(block, f"README block {index}", "exec"), {"__name__": "readme"})

import gradpress  # noqa: E402  (after the blocks: they import it themselves)

sources = Path(sys.argv[1]).resolve().parent / "gradpress"  # (the virtualenv itself may lie in the checkout)
assert sources not in Path(gradpress.__file__).resolve().parents, f"imported from the checkout: {gradpress.__file__}"
assert Path(sys.prefix) in Path(gradpress.__file__).resolve().parents, gradpress.__file__
for library in ("matplotlib", "rich", "tqdm"):
    assert importlib.util.find_spec(library) is None, f"{library} was installed without the [testbed] extra"
assert not any(name.startswith(("gradpress.testbed", "gradpress.bench")) for name in sys.modules)

cli = [sys.executable, "-m", "gradpress"]
version = subprocess.run([*cli, "--version"], capture_output=True, text=True, check=True).stdout
assert gradpress.__version__ in version, version
missing = subprocess.run([*cli, "compare", "--help"], capture_output=True, text=True)
assert missing.returncode != 0 and "gradpress[testbed]" in missing.stderr, missing.stderr
print(f"installed quick-start: {len(blocks)} README blocks ran from {Path(gradpress.__file__).parent}")
