"""The CLI without the ``[testbed]`` extra: the library's own commands work, the testbed's say which
extra to install (exit status 2, one line), and ``--version`` prints the package's version."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gradpress

# a fresh interpreter in which the testbed's libraries cannot be imported (as in an install without the
# extra): a None entry in sys.modules makes their import raise ModuleNotFoundError. It runs ``python -m
# gradpress ARGS`` for each command line it is given (runpy, as ``-m`` does; each command's output and
# exit status its own, an uncaught exception its traceback on stderr), so that one interpreter's start
# serves every command: a failed import is not cached, and each command meets the missing libraries anew
WITHOUT_TESTBED = """
import contextlib, io, json, runpy, sys, traceback

for name in ('matplotlib', 'rich', 'tqdm'):
    sys.modules[name] = None
done = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ['gradpress', *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module('gradpress', run_name='__main__', alter_sys=True)
            code = 0
        except SystemExit as exit_:  # as the interpreter ends on it: None is 0, a message 1 (said on stderr)
            code = exit_.code
            if not isinstance(code, int):
                if code is not None:
                    print(code, file=sys.stderr)
                code = 0 if code is None else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    done.append({'returncode': code, 'stdout': out.getvalue(), 'stderr': err.getvalue()})
print(json.dumps(done), file=sys.__stdout__)
"""

TESTBED_COMMANDS = (["compare", "--help"], ["advise"], ["train", "--model", "mlp"])
COMMANDS = (*TESTBED_COMMANDS, ["list"], ["--version"])


@pytest.fixture(scope="module")
def done() -> dict[str, dict]:
    """Each of :data:`COMMANDS`' returncode, stdout and stderr, by its command line."""
    child = subprocess.run([sys.executable, "-c", WITHOUT_TESTBED, json.dumps(COMMANDS)], capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    return {" ".join(argv): result for argv, result in zip(COMMANDS, json.loads(child.stdout), strict=True)}


def test_testbed_commands_name_the_extra_to_install(done):
    for command in TESTBED_COMMANDS:
        result = done[" ".join(command)]
        assert result["returncode"] == 2, result
        assert "pip install 'gradpress[testbed]'" in result["stderr"] and "Traceback" not in result["stderr"]
        assert f"'gradpress {command[0]}'" in result["stderr"]


def test_library_commands_work_without_the_extra(done):
    result = done["list"]
    assert result["returncode"] == 0, result["stderr"]
    assert all(name in result["stdout"] for name in gradpress.compressor_names())


def test_version(done):
    result = done["--version"]
    assert result["returncode"] == 0 and result["stdout"].strip() == f"gradpress {gradpress.__version__}"
