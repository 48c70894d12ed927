"""The CLI without the ``[testbed]`` extra: the library's own commands work, the testbed's say which
extra to install (exit status 2, one line), and ``--version`` prints the package's version."""
from __future__ import annotations

import subprocess
import sys

import gradpress

# a fresh interpreter in which the testbed's libraries cannot be imported (as in an install without the
# extra): a None entry in sys.modules makes their import raise ModuleNotFoundError
WITHOUT_TESTBED = ("import sys\n"
                   "for name in ('matplotlib', 'rich', 'tqdm'):\n"
                   "    sys.modules[name] = None\n"
                   "from gradpress.cli import main\n"
                   "sys.exit(main(sys.argv[1:]))\n")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TESTBED, *args], capture_output=True, text=True,
                          timeout=300)


def test_testbed_commands_name_the_extra_to_install():
    for command in (["compare", "--help"], ["advise"], ["train", "--model", "mlp"]):
        done = _cli(*command)
        assert done.returncode == 2, done
        assert "pip install 'gradpress[testbed]'" in done.stderr and "Traceback" not in done.stderr
        assert f"'gradpress {command[0]}'" in done.stderr


def test_library_commands_work_without_the_extra():
    done = _cli("list")
    assert done.returncode == 0, done.stderr
    assert all(name in done.stdout for name in gradpress.compressor_names())


def test_version():
    done = subprocess.run([sys.executable, "-m", "gradpress", "--version"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == f"gradpress {gradpress.__version__}"
