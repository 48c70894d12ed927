"""A method's kernels are compiled when a front end is set up, on every rank before its first exchange,
with one INFO line on the ``gradpress`` logger (gradpress.warm_up; the README's "Compiled kernels"): the
training steps that follow compile nothing and load nothing more. Real Gloo processes; ``gradpress
compile`` in a real process."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import gradpress
from dist_utils import run_workers
from gradpress import cli

SPEC = "qsgd"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _set_up_then_train(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradpress.kernels.jit import compile_counts

    logger = logging.getLogger("gradpress")
    lines = _Lines()
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    out: dict = {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 300), nn.ReLU(), nn.Linear(300, 1))
    ddp = DDP(model)
    gradpress.register(ddp, SPEC)
    out["register"], lines.lines = lines.lines, []
    comm = gradpress.Communicator(SPEC)  # any float dtype: the float32 ones are warm already
    out["communicator"], lines.lines = lines.lines, []
    gradpress.Communicator(SPEC)  # the same again: nothing left to do, nothing said
    torch.manual_seed(1)
    gradpress.Simulator(SPEC, 3)  # another world size
    drawn = torch.rand(4)
    torch.manual_seed(1)
    out["random state kept"] = bool(torch.equal(drawn, torch.rand(4)))
    out["simulator"], lines.lines = lines.lines, []
    ready = compile_counts()
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ddp(torch.randn(64, 40, generator=generator)).square().mean().backward()
        comm.reduce_many({"w": torch.randn(300, 70, generator=generator).bfloat16(),
                          "h": torch.randn(3000, generator=generator).half(),
                          "b": torch.randn(50, generator=generator)})
    gradpress.Simulator(SPEC, 3, warm_up=False).step(
        [{"w": torch.randn(500, 600, generator=generator)} for _ in range(3)])
    out["compiled or loaded in training"] = [now - then
                                             for now, then in zip(compile_counts(), ready, strict=True)]
    out["training"] = lines.lines
    return out


def test_front_ends_compile_when_set_up_and_training_compiles_nothing():
    for rank, got in enumerate(run_workers(_set_up_then_train, 2, timeout=900, group_timeout=600)):
        assert [line.split(" ready in ")[0] for line in got["register"]] == [
            f"INFO gradpress: kernels for {SPEC} (float32; 2 workers)"], rank
        assert [line.split(" ready in ")[0] for line in got["communicator"]] == [
            f"INFO gradpress: kernels for {SPEC} (float16, bfloat16; 2 workers)"], rank
        assert [line.split(" ready in ")[0] for line in got["simulator"]] == [
            f"INFO gradpress: kernels for {SPEC} (float32; 3 workers)"], rank
        assert got["random state kept"], rank
        assert got["compiled or loaded in training"] == [0, 0], rank
        assert got["training"] == [], rank


def test_gradpress_compile(capsys):
    """``gradpress compile`` in this process (the real process's is the test below, of ``--jobs 2``)."""
    assert cli.main(["compile", "none", "topk:ratio=0.5", "--dtypes", "bfloat16", "--workers", "3"]) == 0
    first, kept = capsys.readouterr().out.strip().splitlines()
    assert first.startswith("gradpress: kernels for none, topk:ratio=0.5 (bfloat16; 3 workers) ready in ")
    assert kept.startswith("kernels kept in ")


def test_gradpress_compile_shares_the_specs_among_processes(tmp_path):
    """``--jobs 2``: two processes, each compiling (or loading) its share and saying so."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(gradpress.__file__))}
    done = subprocess.run([sys.executable, "-m", "gradpress", "compile", "none", "fp16", "--jobs", "2",
                           "--dtypes", "float32"], env=env, capture_output=True, text=True, timeout=900,
                          check=True)
    ready = sorted(line for line in done.stdout.splitlines() if line.startswith("gradpress: kernels for "))
    assert [line.split(" (")[0] for line in ready] == ["gradpress: kernels for fp16",
                                                       "gradpress: kernels for none"], done.stdout


@pytest.mark.parametrize("argv", [["compile"], ["compile", "nosuch"], ["compile", "none", "--dtypes", "int8"],
                                  ["compile", "none", "--workers", "0"], ["compile", "all", "--jobs", "0"],
                                  ["compile", "auto", "--dtypes", "bfloat16", "--option", "candidates=[3]"],
                                  ["compile", "none", "--option", "bogus=1"]])
def test_gradpress_compile_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("gradpress: error: ") and len(err.strip().splitlines()) == 1


def test_gradpress_compile_takes_autos_options_for_auto_alone(capsys):
    assert cli.main(["compile", "none", "--option", "measure_with=none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradpress: error: unknown option(s) measure_with") and len(err.strip().splitlines()) == 1


def test_warm_up_checks_its_arguments():
    with pytest.raises(ValueError, match="unknown compressor"):
        gradpress.warm_up("nosuch")
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        gradpress.warm_up("none", dtypes=[torch.int8])
    with pytest.raises(TypeError, match="unknown option"):
        gradpress.warm_up("none", nosuch=1)
    with pytest.raises(ValueError, match="at least one spec"):
        gradpress.warm_up()
