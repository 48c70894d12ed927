"""New Python processes that skip the imports they would share: each is forked from a server process that
made those imports once (``import torch`` alone costs seconds of CPU), and then runs ``python -c CODE
ARGV`` as a new interpreter would, in its own folder, with its own path and environment. What the server
did not import, each process imports for the first time. A process whose code ran to its end exits at
once (``os._exit``: what it wrote is written, but its interpreter's shutdown, a second or so of CPU with
torch loaded, is skipped); one whose code raised ends with its traceback and status 1."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

#: the server: imports the modules it is given, checks that those it must not load are not, then, for
#: each line it reads (a JSON run), forks a process that runs the run's code and prints its exit status
_SERVER = textwrap.dedent("""
    import importlib
    import json
    import os
    import signal
    import sys

    preload, unloaded = json.loads(sys.argv[1])
    for name in preload:
        importlib.import_module(name)
    loaded = sorted(name for name in sys.modules if name.partition(".")[0] in unloaded)
    assert not loaded, f"the server must not import {loaded}"
    for line in sys.stdin:
        run = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.alarm(run["timeout"])  # (a process that hangs ends: SIGALRM's default action)
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(run[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            os.chdir(run["cwd"])
            sys.path[:0] = run["path"]
            os.environ.update(run["env"])
            sys.argv = ["-c", *run["argv"]]
            exec(compile(run["code"], "<string>", "exec"), {"__name__": "__main__"})
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
""")

#: ``run(code, *argv, cwd, path=(), env=None, timeout=600)``: the process's exit status and output
Run = Callable[..., subprocess.CompletedProcess]


@contextlib.contextmanager
def fork_server(preload: Sequence[str], env: Mapping[str, str], unloaded: Sequence[str] = ()) -> Iterator[Run]:
    """A server that imported ``preload`` (and none of the packages ``unloaded``) in environment ``env``;
    yields ``run``, which runs ``code`` with ``argv`` in a process forked from it, in folder ``cwd``, with
    ``path`` ahead of ``sys.path`` and ``env`` added to its environment, and returns what it printed
    and its exit status once it ended (killed after ``timeout`` seconds)."""
    with tempfile.TemporaryDirectory() as folder:
        server = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps([list(preload), list(unloaded)])],
                                  cwd=folder, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"

        def run(code: str, *argv: str, cwd: Path, path: Sequence[str] = (), env: Mapping[str, str] | None = None,
                timeout: int = 600) -> subprocess.CompletedProcess:
            request = {"code": code, "argv": list(argv), "cwd": str(cwd), "path": list(path), "env": dict(env or {}),
                       "timeout": timeout, "stdout": str(out), "stderr": str(err)}
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            status = server.stdout.readline()
            assert status, f"the server of forked processes has ended (status {server.wait()})"
            return subprocess.CompletedProcess(["python", "-c", code, *argv], int(status), out.read_text(),
                                               err.read_text())

        try:
            yield run
        finally:
            if server.stdin is not None:
                server.stdin.close()
            server.wait(timeout=60)
