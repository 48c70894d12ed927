"""A script that trains through gradpress and returns without ``destroy_process_group()`` exits cleanly.

A collective's future runs gradpress's callbacks on the backend's thread (Gloo's workers), and that thread
takes the GIL again after the main thread waiting on the future has woken. If the main thread meanwhile
returns from the script and the interpreter finalizes, CPython ends the backend thread inside a C++
destructor: "terminate called without an active exception", SIGABRT, and ``torchrun`` reports the job
failed. gradpress waits at exit until the backends have let its callbacks go, and destroys the groups it
made (:mod:`gradpress.exchange.distributed`).

* The README's DDP and custom-loop scripts, returning right after training, run under real ``torchrun``
  (Gloo processes; 4 of them, each exiting on its own): the run exits 0 with no "terminate called" in
  its output, and no traceback (an error in an exit handler is printed, and the exit code stays 0).
  Each script sets a switch interval of a second, so that a thread wanting the GIL waits until the main
  thread blocks instead of taking it within 5 ms whenever the main thread is slow (which a loaded
  machine's main thread mostly is: without it the race is rare here and frequent on a quiet machine).
  Without gradpress's exit handling 3 of 4 runs of 2 processes of either script aborted so on a quiet
  machine; the same DDP loop with PyTorch's own ``allreduce_hook`` aborted in 2 of 4. On a loaded one, 5
  of 12 processes of the custom loop aborted and 2 of 12 of the DDP script: a run of 4 processes of
  each, as many exits as two runs of 2 side by side (with one launcher less), aborted in 3 of 3 runs
  (custom loop) and 2 of 3 (DDP).
* The exit handler's parts, in this process: a callback whose error is kept is still let go (an error's
  traceback keeps frames, and their locals, alive), and the groups gradpress made are destroyed and
  their executors closed.

The methods run their torch kernels (``GRADPRESS_NUMBA=0``): what is tested is the exit, and a fresh
checkout compiles nothing for it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

#: per script, in one run (a process is mostly imports: torch, gradpress, and DDP's torch._dynamo): each
#: exits on its own, and one that aborts fails the run
PROCESSES = 4
LIMIT_S = 300.0  # for the run of a script

PROLOGUE = """
import sys
sys.setswitchinterval(1.0)
import torch, torch.distributed as dist
import gradpress

dist.init_process_group("gloo")
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
"""

SCRIPTS = {
    # the README's custom loop: the last exchange is of a key new at the end (the ranks' agreement first)
    "communicator": """
comm = gradpress.Communicator("qsgd", seed=0)
optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
for step in range(8):
    x = torch.randn(32, 20) + dist.get_rank()
    optimizer.zero_grad(); torch.nn.functional.mse_loss(net(x), x[:, :4]).backward()
    comm.reduce_gradients(net)
    optimizer.step()
comm.reduce(torch.tensor([float(dist.get_rank())]), key="rank")
""",
    # the README's DDP loop: the hook talks on a group of gradpress's own (timeout), and exclude splits
    # the bucket in two exchanges whose futures are collected
    "ddp": """
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(net)
state = gradpress.register(model, "topk:ratio=0.1", exclude=["0.*"], seed=0, timeout=60)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(8):
    x = torch.randn(32, 20)
    optimizer.zero_grad(); torch.nn.functional.mse_loss(model(x), x[:, :4]).backward()
    optimizer.step()
""",
}


def _torchrun(script: Path) -> subprocess.Popen:
    root = Path(__file__).resolve().parents[1]
    paths = [str(root)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", GRADPRESS_NUMBA="0", PYTHONPATH=os.pathsep.join(paths))
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(PROCESSES),
                             "--standalone", str(script)], cwd=script.parent, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_script_that_returns_after_training_exits_cleanly_under_torchrun(name, tmp_path):
    script = tmp_path / f"{name}.py"
    script.write_text(PROLOGUE + textwrap.dedent(SCRIPTS[name]))
    run = _torchrun(script)
    try:
        output, _ = run.communicate(timeout=LIMIT_S)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, 9)  # the session this test started: the launcher and its workers
            run.communicate()
    clean = run.returncode == 0 and "terminate called" not in output and "Traceback" not in output
    assert clean, f"the {name} script's {PROCESSES} processes did not exit cleanly: exit code " \
        f"{run.returncode}\n{output[-3000:]}"


def test_the_groups_gradpress_made_are_destroyed_and_their_executors_closed(tmp_path):
    """What the exit handler does once the backends have let its callbacks go (here in this process, a
    group of one): the group a ``timeout`` made is destroyed and nothing of gradpress's holds it (its
    backend's threads end with it), an exchange on it then raises saying so, and the default group, the
    user's, is left as it was."""
    import gc

    import torch.distributed as dist

    import gradpress
    from gradpress.exchange.distributed import _EXIT
    from gradpress.kernels.jit import numba_disabled

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with numba_disabled():  # (the torch kernels: no numba compilation for this)
            before = len(_EXIT.groups)
            net = torch.nn.Linear(4, 2)
            comm = gradpress.Communicator("topk:ratio=0.5", seed=0, timeout=30)  # on a group gradpress makes
            net(torch.ones(1, 4)).sum().backward()
            comm.reduce_gradients(net)
            made = _EXIT.groups[-1][0]
            assert len(_EXIT.groups) == before + 1 and made in dist.distributed_c10d._world.pg_map
            _EXIT.destroy_groups()
            assert made not in dist.distributed_c10d._world.pg_map and not _EXIT.groups
            assert not [r for r in gc.get_referrers(made) if r is not sys._getframe()], gc.get_referrers(made)
            with pytest.raises(RuntimeError, match="gradpress destroyed its process group"):
                comm.reduce_gradients(net)
            assert dist.is_initialized()
            assert gradpress.Communicator("none").reduce(torch.ones(2), key="x").tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_a_callback_run_at_once_that_raised_is_let_go_although_its_error_is_kept():
    """``chain`` on a future complete already runs the callback on the calling thread; its error, kept
    (as the driver keeps a failure), holds the frames it passed through and their locals: the callback
    is still let go (else the exit would wait its bound out)."""
    from gradpress.exchange.distributed import _EXIT, chain

    done = torch.futures.Future()
    done.set_result(1)
    kept = []

    def fails(future: torch.futures.Future) -> None:
        try:
            raise ValueError("a failed exchange")
        except ValueError as error:
            kept.append(error)
            raise

    with pytest.raises(RuntimeError, match="a failed exchange"):
        chain(done, fails).wait()
    assert kept and _EXIT.settle(5.0), list(_EXIT.pending.values())
