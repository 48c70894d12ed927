"""The command line answers bad arguments in one line, before any worker starts.

Every bad invocation ends with exit status 2 and exactly one line on stderr, ``gradpress: error: …``
(argparse's status for usage errors, without its usage text), no traceback, nothing on stdout, no file
written, and nothing started: no worker process, no simulation, no benchmark. Errors found while
parsing (one argument's value) exit through argparse (``SystemExit(2)``); those found after it (a model
for another task than the data, a batch larger than a shard, options that do not fit the compressor)
make :func:`gradpress.cli.main` return 2. Most cases run in this process; a few run ``python -m gradpress``
for real, to see what a user sees.
"""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gradpress.bench.ddp_overhead
import gradpress.bench.ops
import gradpress.bench.powersgd
import gradpress.bench.sketch_embedding
import gradpress.bench.thc_nmse
import gradpress.testbed.compare
import gradpress.testbed.sim.command
import gradpress.testbed.train
from gradpress.cli import main
from gradpress.testbed import data
from gradpress.testbed.train import TrainConfig, TrainFailed

needs_data = pytest.mark.skipif(not data.FASHION_MNIST_DIR.exists(),
                                reason="Fashion-MNIST is not installed (gradpress data fashion-mnist, as root)")


COMPARE = gradpress.testbed.compare.compare


class Started(Exception):
    """Something that runs (a worker, a training, a benchmark) was reached."""


def _started(*args, **kwargs):
    raise Started(args[0] if args else "")


#: what a command runs once its arguments are checked; reaching any of them fails the test
RUNNERS = [
    (subprocess, "Popen"), (multiprocessing.process.BaseProcess, "start"),
    (gradpress.testbed.train, "train"), (gradpress.testbed.compare, "compare"),
    (gradpress.testbed.compare, "train"), (gradpress.testbed.sim.command, "nmse_vs_workers"),
    (gradpress.testbed.sim.command, "train_simulated"), (gradpress.bench.ops, "run"),
    (gradpress.bench.ddp_overhead, "run"), (gradpress.bench.powersgd, "run"),
    (gradpress.bench.sketch_embedding, "run"), (gradpress.bench.thc_nmse, "nmse_vs_granularity"),
]


@pytest.fixture(scope="module", autouse=True)
def _fashion_mnist_fetched_and_loaded_once():
    """The commands checked here fetch Fashion-MNIST (which checks its files' sha256) and load it before
    anything runs; the same files give the same dataset: it is fetched and loaded once for the module
    (seconds of gunzipping and scaling in each test otherwise; no command checked here changes it)."""
    import functools

    source = data.DATASETS["fashion-mnist"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(data.DATASETS, "fashion-mnist",
                      data.Source(fetch=functools.cache(source.fetch), load=functools.cache(source.load)))
        yield


@pytest.fixture
def nothing_runs(tmp_path, monkeypatch):
    """Run in an empty directory with every runner replaced by one raising :class:`Started`."""
    for owner, name in RUNNERS:
        monkeypatch.setattr(owner, name, _started)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``gradpress ARGV`` in this process."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, expected: str) -> None:
    assert code == 2, (code, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradpress: error: "), err
    assert expected in lines[0], (expected, lines[0])


_SPEC_OUT_OF_RANGE = "ratio must be in (0, 1]"

# (arguments, what the one line must say)
BAD = [
    # train: the list
    ("train --data nonexistent", "invalid choice: 'nonexistent' (choose from 'fashion-mnist'"),
    ("train --workers 0", "argument --workers: expected a positive integer, got '0'"),
    ("train --seconds -5", "argument --seconds: expected a positive finite number, got '-5'"),
    ("train --bandwidth 100potatoes", "expected a number and a unit, e.g. 100mbit"),
    ("train --compressor bogus", "unknown compressor 'bogus'; known: "),
    ("train --compressor topk:ratio=abc", "cannot read 'abc' as float"),
    ("train --option nokey", "argument --option: expected KEY=VALUE, got 'nokey'"),
    ("train --json /etc/passwd/run.json", "argument --json: cannot create /etc/passwd/run.json: /etc/passwd is not"),
    ("train --model unknownmodel", "unknown model 'unknownmodel'; known: "),
    ("train --steps 0", "argument --steps: expected a positive integer"),
    ("train --steps -1", "argument --steps: expected a positive integer"),
    ("train --epochs -1", "argument --epochs: expected a positive integer"),
    ("train --lr nan", "argument --lr: expected a positive finite number, got 'nan'"),
    ("train --timeout 0", "argument --timeout: expected a positive finite number"),
    ("train --batch-size 0", "argument --batch-size: expected a positive integer"),
    # train: more values
    ("train --workers abc", "expected a positive integer, got 'abc'"),
    ("train --seconds nan", "expected a positive finite number"),
    ("train --bandwidth 0mbit", "expected a positive rate"),
    ("train --compressor topk:ratio=2", _SPEC_OUT_OF_RANGE),
    ("train --option bogus=1", "unknown option 'bogus'; the options are: feedback, "),
    ("train --option min_numel=abc", "option min_numel='abc': expected an integer"),
    ("train --option exclude=5", "option exclude=5: expected a string"),
    ("train --option measure_with=topk", "option measure_with: an option of --compressor auto, not of 'none'"),
    ("train --compressor auto --option settle_steps=abc", "option settle_steps='abc': expected an integer"),
    ("train --compressor auto --option measure_with=bogus", "unknown compressor 'bogus'"),
    ("train --json /tmp", "/tmp is a directory"),
    ("train --model mlp:bogus=1", "has no parameter 'bogus'"),
    ("train --model mlp:hidden=0", "hidden must be at least 1"),
    ("train --epochs 1 --steps 2", "not allowed with argument"),
    ("train --lr 0", "argument --lr: expected a positive finite number"),
    ("train --threads 0", "argument --threads"),
    ("train --eval-every 0", "argument --eval-every"),
    ("train --seed -1", "argument --seed: expected an integer in 0..4294967295"),
    ("train --frobnicate", "unrecognized arguments: --frobnicate"),
    # compare
    ("compare --compressors topk:ratio=2", "argument --compressors: topk:ratio=2: topk"),
    ("compare --compressors noop,bogus", "argument --compressors: bogus: unknown compressor 'bogus'"),
    ("compare --compressors noop --out /etc/passwd", "argument --out: /etc/passwd is not a directory"),
    ("compare --compressors noop --out /etc/passwd/x", "cannot create /etc/passwd/x"),
    ("compare --workers 0", "argument --workers"),
    ("train --nodes 0", "argument --nodes: expected a positive integer, got '0'"),
    ("compare --nodes -1", "argument --nodes: expected a positive integer, got '-1'"),
    ("compare --compressors topk@rack", "argument --compressors: topk@rack: expected SPEC@node"),
    ("compare --compressors torch-allreduce@node", "torch-allreduce is PyTorch's own hook, which has no"),
    ("compare --compressors demo@node", "argument --compressors: demo@node: @node follows a spec, not a"),
    ("compare --compressors topk:ratio=2@node", _SPEC_OUT_OF_RANGE),
    ("advise --local-workers 0", "argument --local-workers"),
    ("advise --nodes 1025", "argument --nodes: expected an integer in 1..1024, got '1025'"),
    # bench
    ("bench ops --compressors bogus", "argument --compressors: bogus: unknown compressor"),
    ("bench ops --sizes abc", "argument --sizes: 'abc': expected a positive integer (2^k allowed)"),
    ("bench ops --sizes 2^20,0", "got '0'"),
    ("bench ops --workers 0", "argument --workers"),
    ("bench ops --json /etc/passwd/ops.json", "argument --json: cannot create"),
    ("bench ddp --specs topk:ratio=2", _SPEC_OUT_OF_RANGE),
    ("bench ddp --workers 0", "argument --workers"),
    ("bench ddp --model mlp-9m", "argument --model: invalid choice: 'mlp-9m'"),
    ("bench sketch --workers 2,x", "argument --workers: '2,x'"),
    ("bench sketch --lam -1", "argument --lam"),
    ("bench thc --p 0", "argument --p: expected a positive finite number"),
    ("bench thc --specs thc,bogus", "argument --specs: bogus: unknown compressor"),
    ("bench powersgd --start 1", "argument --start: expected an integer >= 2"),
    ("bench powersgd --matrix 10xabc", "argument --matrix: expected ROWSxCOLS"),
    ("bench powersgd --model bogus", "unknown model 'bogus'"),
    ("bench bogus", "argument bench: invalid choice: 'bogus'"),
    ("bench", "the following arguments are required: bench"),
    # sim
    ("sim nmse --compressors none,bogus", "argument --compressors: bogus: unknown compressor"),
    ("sim nmse --numel 0", "argument --numel"),
    ("sim nmse --spread inf", "argument --spread: expected a non-negative finite number"),
    ("sim nmse --plot /etc/passwd/nmse.png", "argument --plot: cannot create"),
    ("sim quality --steps 0", "argument --steps"),
    ("sim quality --option nokey", "argument --option: expected KEY=VALUE"),
    ("sim cost --results . --latency -1", "argument --latency"),
    ("sim cost --results . --nodes 1025", "argument --nodes: '1025': expected numbers of nodes in 1..1024"),
    # the rest
    ("bogus", "argument command: invalid choice: 'bogus'"),
    ("", "the following arguments are required: command"),
]

# found after parsing, from the arguments together
BAD_TOGETHER = [
    ("train --option min_numel=-1", "--option: option min_numel must be an integer >= 0, got -1"),
    ("train --option mode=ps --option partial=2", "--option: partial"),
    ("compare --option min_numel=-1", "--option: option min_numel must be an integer >= 0, got -1"),
    ("bench sketch --rows-touched 100 --vocab 10", "--rows-touched 100: more rows than --vocab 10"),
    ("bench ddp --model mlp-1m --width 512", "give either --model or --width/--depth"),
    ("bench thc --bits 9", "bits must be an integer"),
    ("bench thc --p 2", "p must be in (0, 1)"),
    ("bench powersgd --matrix 4x4 --rank 4 --no-training", "--matrix 4x4: not compressed at --rank 4"),
    ("bench powersgd --start 10 --steps 5", "--start 10: no compressed step in --steps 5"),
    ("bench powersgd --dataset synthetic --model ncf", "--model ncf: model 'ncf' is for recommendation data"),
    ("sim cost --results nonexistent", "sim cost: nonexistent: no such file or directory"),
    ("sim cost --results . --workers 4 --nodes 2", "give --workers n (a link per worker) or --nodes N"),
    ("advise --nodes 2 --local-size 2 --workers 8", "--workers 8 contradicts --nodes 2 × --local-size 2 = 4 ranks"),
    ("data no-such-data", "unknown dataset 'no-such-data'; known: fashion-mnist"),
    # sizes no machine holds: refused before anything is allocated
    ("sim nmse --numel 2^40", "--numel 1099511627776 with 1024 workers: needs at least 4.0 PiB of memory; "),
    ("bench ops --sizes 2^62", "--sizes 4611686018427387904: needs at least 48.0 EiB of memory"),
    # an option given twice, or beside its own flag: which value runs would be a guess
    ("train --option mode=ps --option mode=switch", "--option mode is given twice ('mode=ps', 'mode=switch')"),
    ("train --option timeout=5 --timeout 10", "--option timeout=5: give --timeout instead"),
    ("train --option seed=3", "--option seed=3: give --seed instead"),
    ("compare --option min_numel=1 --option min_numel=1", "--option min_numel is given twice"),
    ("sim quality --option seed=3", "--option seed=3: give --seed instead"),
]

# found after parsing, with the data (Fashion-MNIST, fortunes)
BAD_WITH_DATA = [
    ("train --compressor topk --option mode=switch", "--compressor topk: switch mode adds integers only"),
    ("train --compressor topk --option mode=ps --option root=5", "root 5 is not a rank of a world of 2"),
    ("train --model ncf", "--model ncf: model 'ncf' is for recommendation data; 'fashion-mnist' is classification"),
    ("train --batch-size 40000", "--batch-size 40000: a worker's shard of fashion-mnist holds 30000 samples"),
    ("compare --compressors noop,topk --option mode=switch", "--compressors: topk: switch mode adds integers only"),
    ("train --nodes 2 --option hierarchy=node --option local_size=3",
     "--compressor none: hierarchy='node': a node of 3 ranks does not divide the world of 4 ranks"),
    ("compare --nodes 2 --compressors noop,auto@hsdp",
     "--compressors: auto@hsdp: gradpress.fsdp does not run 'auto': name a method"),
    ("compare --compressors noop,qsgd@fsdp",
     "--compressors: qsgd@fsdp: @fsdp compresses FSDP's reduce-scatter, whose summands must add element-wise"),
    ("sim quality --model ncf --data fashion-mnist", "--model ncf: model 'ncf' is for recommendation"),
    ("sim quality --compressor topk --option mode=switch", "--compressors topk with 1 worker: switch mode"),
    ("sim quality --workers 1024", "a shard of fashion-mnist for 1024 workers holds 58 samples"),
]


@pytest.mark.parametrize("argv, expected", BAD, ids=[a or "(nothing)" for a, _ in BAD])
def test_a_bad_argument_is_one_line_and_starts_nothing(argv, expected, nothing_runs, capsys):
    code, out, err = run_cli(argv.split(), capsys)
    assert_one_line_error(code, out, err, expected)
    assert list(nothing_runs.iterdir()) == []


@pytest.mark.parametrize("argv, expected", BAD_TOGETHER, ids=[a for a, _ in BAD_TOGETHER])
def test_bad_arguments_together_are_one_line_and_start_nothing(argv, expected, nothing_runs, capsys):
    code, out, err = run_cli(argv.split(), capsys)
    assert_one_line_error(code, out, err, expected)
    assert list(nothing_runs.iterdir()) == []


@needs_data
@pytest.mark.parametrize("argv, expected", BAD_WITH_DATA, ids=[a for a, _ in BAD_WITH_DATA])
def test_bad_arguments_for_the_data_are_one_line_and_start_nothing(argv, expected, nothing_runs, capsys):
    code, out, err = run_cli(argv.split(), capsys)
    assert_one_line_error(code, out, err, expected)
    assert list(nothing_runs.iterdir()) == []


@needs_data
@pytest.mark.parametrize("argv", [
    "train --steps 1 --compressor topk:ratio=0.1 --option min_numel=1024 --json out/run.json",
    "compare --compressors noop,topk:ratio=0.1,qsgd:levels=16,bucket=512 --steps 1 --out out/compare",
    "compare --nodes 2 --compressors topk:ratio=0.1,topk:ratio=0.1@node,qsgd:bucket=512@node --out out/c",
    "compare --nodes 2 --compressors noop,auto@node --out out/c",  # auto picks among two-level methods
    "train --option hierarchy=node --compressor topk --steps 1",  # one node: one level
    "bench ops --compressors topk:ratio=0.1 --sizes 2^10,1000 --json out/ops.json",
    "sim nmse --compressors none,qsgd --numel 2^10 --workers 2,4 --json out/nmse.json",
])
def test_good_arguments_get_past_the_checks(argv, nothing_runs, capsys):
    """No false alarm: valid commands reach what they run."""
    with pytest.raises(Started):
        run_cli(argv.split(), capsys)
    assert "error" not in capsys.readouterr().err


def test_compare_refuses_an_out_that_holds_files_unless_told_to_overwrite(nothing_runs, capsys):
    """Two runs into one --out would leave a mix of both runs' files under the second's report."""
    out = nothing_runs / "out"
    out.mkdir()
    (out / "report.md").write_text("an earlier run's report")
    code, stdout, err = run_cli(["compare", "--compressors", "noop", "--out", "out"], capsys)
    assert_one_line_error(code, stdout, err, "--out out is not empty (report.md): give a new directory, "
                                             "or --overwrite")
    assert (out / "report.md").read_text() == "an earlier run's report"


def test_compare_overwrite_removes_an_earlier_runs_files_and_keeps_the_others(tmp_path):
    """``compare(…, overwrite=True)`` (``--overwrite``) clears what a compare run writes when it starts; a
    file of the user's stays. Here no run can start (a spec out of range), so what is left shows it."""
    out = tmp_path / "out"
    out.mkdir()
    earlier = ["report.md", "results.json", "throughput.png", "run-topk_ratio_0.1.json"]
    for name in [*earlier, "notes.txt"]:
        (out / name).write_text("earlier")
    base = TrainConfig(model="mlp:hidden=8,depth=1", steps=1)
    with pytest.raises(ValueError, match="is not empty"):
        COMPARE(base, ["topk:ratio=2"], out, say=lambda _: None)
    assert sorted(p.name for p in out.iterdir()) == sorted([*earlier, "notes.txt"])
    with pytest.raises(TrainFailed, match="every run failed"):
        COMPARE(base, ["topk:ratio=2"], out, say=lambda _: None, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_an_allocation_that_fails_is_one_line(capsys):
    """What the size checks cannot foresee: the allocator's own failure is reported in one line, status 2."""
    import torch

    from gradpress.cli import Parser, run

    parser = Parser(prog="gradpress")
    parser.set_defaults(func=lambda args: torch.empty(2**62, dtype=torch.uint8))
    code = run(parser, [])
    out, err = capsys.readouterr()
    assert_one_line_error(code, out, err, "out of memory: an allocation of 4.0 EiB failed (")
    assert "try smaller sizes" in err
    parser.set_defaults(func=lambda args: [][1])  # any other error is the program's own: a traceback
    with pytest.raises(IndexError):
        run(parser, [])


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    """SIGINT to a running ``gradpress`` (what Ctrl-C sends): ``interrupted``, exit status 130, no traceback.
    The run is seen to have started by its progress line (rich draws it when told the stream is a
    terminal)."""
    import signal
    import threading
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "gradpress", "sim", "nmse", "--compressors", "none",
                                "--numel", "2^16", "--workers", "64", "--trials", "100000"],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = bytearray()

    def pump() -> None:
        while chunk := os.read(process.stderr.fileno(), 4096):
            err.extend(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while b"simulating" not in err and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"simulating" in err, bytes(err)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=120)  # (its stdout stays empty: nothing can fill the pipe)
        out = process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(10)
    text = err.decode(errors="replace")
    assert code == 130, text
    assert "Traceback" not in text and text.rstrip().endswith("interrupted"), text
    assert out == b""


HALF_BUILT = """
import sys
from gradpress import cli

class HalfBuilt:  # as llvmlite's objects are when Ctrl-C lands inside their constructor
    def __del__(self):
        raise AttributeError("object has no attribute '_as_parameter_'")

def leave_a_cycle():
    left = HalfBuilt()
    left.cycle = left

leave_a_cycle()
kept = HalfBuilt()
sys.exit(cli.interrupted())
"""


#: places where Python drops a KeyboardInterrupt: by name, definitions and a trigger that sends the process
#: SIGINT from inside such a place
DROPPED = {
    # Python drops a KeyboardInterrupt raised inside ``__del__`` ("Exception ignored")
    "finalizer": (textwrap.dedent("""
        class Finalized:
            def __del__(self):  # Ctrl-C arrives while the garbage collector runs this
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)
        """), "Finalized()"),
    # ctypes drops an exception raised in a callback ("Exception ignored on calling ctypes callback
    # function"): here a function of llvmlite's that LLVM calls back through ctypes, as numba compiles a
    # kernel
    "ctypes callback": (textwrap.dedent("""
        source = "def notify(a, b):\\n    os.kill(os.getpid(), signal.SIGINT)\\n    time.sleep(0.01)\\n    return 0\\n"
        space = {"os": os, "signal": signal, "time": time}
        exec(compile(source, os.path.join("site-packages", "llvmlite", "binding", "executionengine.py"),
                     "exec"), space)
        compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(space["notify"])
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        values = (ctypes.c_int * 2)(2, 1)
        """), "libc.qsort(values, 2, ctypes.sizeof(ctypes.c_int), compare)"),
}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[int, dict[str, str], dict[str, str]]:
    """One fresh interpreter for the three tests below (one start-up): each case of :data:`DROPPED` in
    turn under the CLI's Ctrl-C handling (its definitions, then its trigger), then :data:`HALF_BUILT`,
    which ends the process. Between cases, a moment outside the handling: an interrupt left over from
    one would end the process there, and the next would print nothing. Returns the exit status and what
    came on stdout and on stderr by part (``start``, each case's name, ``half built``: :func:`_parts`); a
    case prints ``interrupted`` if the interrupt reached the code that follows."""
    def start(part: str) -> str:
        return f"print('== ' + {part!r}); print('== ' + {part!r}, file=sys.stderr, flush=True)"

    lines = ["import sys", start("start"), "import ctypes, ctypes.util, os, signal, time",
             "from gradpress import cli"]
    for name, (where, trigger) in DROPPED.items():
        lines += [
            start(name),
            where,
            "with cli._ctrl_c_outside_finalizers():",
            "    try:",
            textwrap.indent(trigger, "        "),
            "        deadline = time.monotonic() + 30",
            "        while time.monotonic() < deadline:",
            "            time.sleep(0.01)",
            "        print('not interrupted')",
            "    except KeyboardInterrupt:",
            "        print('interrupted')",
            "time.sleep(0.5)",
        ]
    lines += [start("half built"), HALF_BUILT]
    done = subprocess.run([sys.executable, "-c", "\n".join(lines)], cwd=tmp_path_factory.mktemp("ctrl-c"),
                          capture_output=True, text=True, timeout=180)
    return done.returncode, _parts(done.stdout), _parts(done.stderr)


def _parts(text: str) -> dict[str, str]:
    """``text`` cut at the lines ``== PART`` that start each part: by part, its lines up to the next one
    (the last part's up to the process's end)."""
    parts: dict[str, str] = {}
    part = None
    for line in text.splitlines(keepends=True):
        if line.startswith("== "):
            part = line[3:].rstrip("\n")
            parts[part] = ""
        elif part is not None:
            parts[part] += line
    return parts


def _still_interrupted(interrupted: tuple[int, dict[str, str], dict[str, str]], case: str) -> None:
    """The interrupt of ``case`` reached the code that follows, and no "Exception ignored" report was
    printed."""
    _, out, err = interrupted
    assert out.get(case) == "interrupted\n", (out, err)
    assert "Exception ignored" not in err[case], err


def test_ctrl_c_during_a_finalizer_still_interrupts(interrupted):
    """Python drops a KeyboardInterrupt raised inside ``__del__`` ("Exception ignored"): the command
    would run on after Ctrl-C. The CLI delivers it again outside the finalizer."""
    _still_interrupted(interrupted, "finalizer")


def test_ctrl_c_during_a_ctypes_callback_of_the_compiler_still_interrupts(interrupted):
    """ctypes drops an exception raised in a callback ("Exception ignored on calling ctypes callback
    function"): a Ctrl-C while LLVM calls back into llvmlite would be lost. The CLI delivers it again."""
    _still_interrupted(interrupted, "ctypes callback")


def test_ctrl_c_is_one_line_even_when_it_left_an_object_half_built(interrupted):
    """An interrupt that lands inside a constructor (numba compiling at set-up) leaves an object whose
    finalizer fails at exit; the user still sees the one line ``interrupted``, no "Exception ignored"
    traceback, and status 130 (what the process printed before the cases counted in)."""
    code, out, err = interrupted
    assert code == 130, err
    assert err["start"] + err.get("half built", "") == "interrupted\n", err
    assert out["start"] + out.get("half built", "") == ""


def test_missing_data_says_how_to_get_it(nothing_runs, monkeypatch, capsys):
    def unavailable(**_):
        raise data.DataUnavailable("Fashion-MNIST is missing: run `gradpress data` as root")

    monkeypatch.setitem(data.DATASETS, "fashion-mnist", data.Source(fetch=unavailable, load=unavailable))
    code, out, err = run_cli(["train", "--steps", "1"], capsys)
    assert_one_line_error(code, out, err, "--data fashion-mnist: Fashion-MNIST is missing: run `gradpress data`")
    code, out, err = run_cli(["sim", "quality"], capsys)
    assert_one_line_error(code, out, err, "--data fashion-mnist is not available: Fashion-MNIST is missing")


def test_from_the_shell(tmp_path):
    """``python -m gradpress``, for real: status 2, one line on stderr, nothing on stdout or on disk."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cases = {
        "train --workers 0": "argument --workers: expected a positive integer, got '0'",
        "compare --compressors noop,topk:ratio=2 --out out": "topk:ratio=2: topk",
        "sim nmse --numel 2^40": "--numel 1099511627776 with 1024 workers: needs at least 4.0 PiB of memory",
        "bench ops --sizes 2^62": "--sizes 4611686018427387904: needs at least 48.0 EiB of memory",
    }
    running = {argv: subprocess.Popen([sys.executable, "-m", "gradpress", *argv.split()], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for argv in cases}
    for argv, process in running.items():
        out, err = process.communicate(timeout=240)
        assert_one_line_error(process.returncode, out, err, cases[argv])
    assert list(tmp_path.iterdir()) == []


# -- a run that fails names why -----------------------------------------------------------------------------
def test_compare_reports_each_failed_run_with_its_reason(tmp_path, monkeypatch):
    """A spec out of range fails before its workers would start, a run whose worker fails says why; with
    no run left, TrainFailed names every reason."""
    def failing(config, json_path=None, progress=True):
        raise TrainFailed(f"worker 1 exited with status 1: RuntimeError: {config.compressor} broke\ntail")

    monkeypatch.setattr(gradpress.testbed.compare, "train", failing)
    said = []
    base = TrainConfig(model="mlp:hidden=8,depth=1", steps=1)
    with pytest.raises(TrainFailed) as caught:
        gradpress.testbed.compare.compare(base, ["topk:ratio=2", "noop"], tmp_path / "out", say=said.append)
    message = str(caught.value)
    assert message.startswith("every run failed: topk:ratio=2: ")
    assert _SPEC_OUT_OF_RANGE in message
    assert "noop: worker 1 exited with status 1: RuntimeError: noop broke" in message and "tail" not in message
    assert said[0] == "== topk:ratio=2" and _SPEC_OUT_OF_RANGE in said[1] and said[1].startswith("   failed: ")
    assert said[3] == "   failed: worker 1 exited with status 1: RuntimeError: noop broke"
    with pytest.raises(ValueError, match="no compressor"):
        gradpress.testbed.compare.compare(base, [], tmp_path / "out", say=said.append)


@needs_data
def test_compare_command_names_skipped_and_failed_runs(nothing_runs, monkeypatch, capsys):
    """``--compressors demo``: the methods that cannot run with these options are skipped, each with its
    reason; runs that fail are named with theirs (exit status 1: the arguments were fine)."""
    def failing(config, json_path=None, progress=True):
        raise TrainFailed(f"worker 0 exited with status 1: RuntimeError: {config.compressor} broke")

    monkeypatch.setattr(gradpress.testbed.compare, "compare", COMPARE)
    monkeypatch.setattr(gradpress.testbed.compare, "train", failing)
    code, out, err = run_cli(["compare", "--option", "mode=switch", "--steps", "1", "--out", "out"], capsys)
    assert code == 1 and "Traceback" not in err
    assert "skipped topk:ratio=0.01: switch mode adds integers only; topk is not summable" in err.splitlines()
    last = err.splitlines()[-1]
    assert last.startswith("gradpress: error: every run failed: ")
    assert "thc: worker 0 exited with status 1: RuntimeError: thc broke" in last
    assert "noop: worker 0 exited with status 1: RuntimeError: noop broke" in last


def test_a_failed_worker_is_named_with_its_recorded_error(tmp_path):
    """The launcher reads why a worker failed from what it recorded beside the result, and names the
    earliest recorded failure (the one the others followed) on TrainFailed's first line."""
    train = gradpress.testbed.train
    result = tmp_path / "run.json"
    first, later = train._failure_path(result, 1), train._failure_path(result, 0)
    train._record_failure(result, 1, ValueError("a shard of 10 samples\nholds no batch of 64"))
    train._record_failure(result, 0, RuntimeError("Connection closed by peer"))
    os.utime(later, ns=(first.stat().st_mtime_ns + 10**9,) * 2)
    processes = [subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"]) for code in (1, 3)]
    for process in processes:
        process.wait()
    with pytest.raises(TrainFailed) as caught:
        train._wait(processes, deadline=float("inf"), result=result)
    assert str(caught.value) == "worker 1 exited with status 3: ValueError: a shard of 10 samples; holds no batch of 64"
    with pytest.raises(TrainFailed, match=r"^worker 0 exited with status 1$"):
        train._wait(processes, deadline=float("inf"), result=tmp_path / "elsewhere" / "run.json")


def test_output_checks_create_nothing(tmp_path):
    from gradpress.testbed.arguments import check_writable

    check_writable(tmp_path / "a" / "b" / "run.json")
    check_writable(tmp_path / "report", directory=True)
    (tmp_path / "file").write_text("x")
    check_writable(tmp_path / "file")
    with pytest.raises(ValueError, match="is not a directory"):
        check_writable(tmp_path / "file", directory=True)
    with pytest.raises(ValueError, match="is not a directory"):
        check_writable(tmp_path / "file" / "run.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and Path(tmp_path / "file").read_text() == "x"
