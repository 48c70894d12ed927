"""The on-disk cache of gradpress's numba kernels (``gradpress.kernels.jit.kernel``): kept between processes
while the sources a kernel depends on stay the same — its module and every module of gradpress it
imports, directly or not, whose intrinsics or helpers the cached machine code contains —, compiled again
when one of them changes and not when another module does; written beside the modules, else where
``GRADPRESS_CACHE`` or the user's cache folder says. Real processes, a real copy of the package, real
cache files: each run is a new process that imports numba and the copy of gradpress for the first time
(forked from one that imported torch and numpy only: :mod:`forked`)."""
from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import gradpress
from forked import fork_server
from gradpress.compressors.sign import _decode_signs
from gradpress.kernels.jit import dependencies, sources_digest

#: run in a child process against the copy of the package: decode 4096 packed signs with the sign
#: decoder's kernel, report its cache statistics and whether the result is right; with an argument,
#: also cast to fp16 with a kernel that a factory made (a closure over another kernel) and report its
#: statistics
_CHILD = textwrap.dedent("""
    import json
    import sys
    import numpy as np
    from gradpress.compressors.sign import _decode_signs
    packed = np.arange(512, dtype=np.uint8)
    out = np.empty(4096, np.float32)
    _decode_signs(packed, -1.0, 1.0, out)
    expected = np.where(np.unpackbits(packed, bitorder="little").astype(bool), 1.0, -1.0)
    stats = _decode_signs.stats
    report = {"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values()),
              "right": bool((out == expected).all())}
    if sys.argv[1:]:
        from gradpress.compressors.identity import _to_f16
        x = np.linspace(-3, 3, 5000, dtype=np.float32)
        bits = np.empty(5000, np.int16)
        _to_f16(x, bits)
        stats = _to_f16.stats
        report["closure"] = {"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values()),
                             "right": bool((bits.view(np.float16) == x.astype(np.float16)).all())}
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def new_process():
    """``run(code, *argv, cwd, path, env)`` (:func:`forked.fork_server`): a new process that imports
    numba and gradpress for the first time, in an environment that names no cache folder."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("NUMBA_CACHE_DIR", "GRADPRESS_CACHE", "XDG_CACHE_HOME", "PYTHONPATH")}
    # (no Python bytecode either: a __pycache__ folder is what these tests make or block for numba's files)
    environment.update({"GRADPRESS_NUMBA": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    with fork_server(["numpy", "torch"], environment, unloaded=["gradpress", "numba", "llvmlite"]) as run:
        yield run


@pytest.fixture
def decode(new_process):
    """``decode(root, *argv, **env)``: the report of :data:`_CHILD` run in a new process against the copy
    of the package in ``root`` (its working folder, on its ``PYTHONPATH``), the user's cache folder
    ``root/xdg`` unless ``env`` says otherwise."""
    def decode_in_a_process(root: Path, *argv: str, **env: str) -> dict:
        done = new_process(_CHILD, *argv, cwd=root, path=[str(root)],
                           env={"PYTHONPATH": str(root), "XDG_CACHE_HOME": str(root / "xdg"), **env})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    return decode_in_a_process


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "gradpress"
    shutil.copytree(Path(gradpress.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _touch(path: Path) -> None:
    path.write_text(path.read_text() + "\n# changed\n")


MISS, HIT = {"hits": 0, "misses": 1, "right": True}, {"hits": 1, "misses": 0, "right": True}


def test_a_change_to_a_module_the_kernel_depends_on_compiles_it_again(tmp_path, decode):
    copy = _copy(tmp_path)
    beside = copy / "compressors" / "__pycache__"
    assert decode(tmp_path, "closure") == {**MISS, "closure": MISS}
    assert list(beside.glob("sign._decode_signs-*.nbc")), "nothing cached beside the module"
    # modules neither kernel's module imports: no effect (both are kept through these changes, so kept
    # without them too)
    for other in ("cli.py", "testbed/report.py", "ddp.py", "exchange/pipeline.py"):
        _touch(copy / other)
    # a kernel made by a factory is kept too (numba keyed it by a process-random id of the kernel it
    # closes over: compiled in every process, one more entry on disk each time)
    assert decode(tmp_path, "closure") == {**HIT, "closure": HIT}
    assert len(list(beside.glob("identity._blocked_cast*.nbc"))) == 1
    # a module the kernel does not live in, whose intrinsics it inlines: numba's own key misses this
    _touch(copy / "kernels" / "simd.py")
    assert decode(tmp_path) == MISS
    # compiled again, kept again beside the module; read from there also when GRADPRESS_CACHE names a
    # folder, where nothing is written then
    chosen = tmp_path / "chosen"
    assert decode(tmp_path, GRADPRESS_CACHE=str(chosen)) == HIT
    assert not list(chosen.rglob("*.nbc")) and not list((tmp_path / "xdg").rglob("*.nbc"))


def test_the_digest_follows_the_kernels_dependencies_and_nothing_else(tmp_path):
    """A kernel's digest changes with its own module and every module it imports (nested packages, and
    modules imported through another, included), not with the others; nor with the caches and bytecode
    written beside the sources (numba's own index and data files), or every compilation would invalidate
    the others."""
    copy = _copy(tmp_path)
    sign = copy / "compressors" / "sign.py"
    names = {str(path.relative_to(copy)) for path in dependencies(sign, copy)}
    assert {"compressors/sign.py", "kernels/jit.py", "kernels/simd.py", "core/compressor.py",
            "compressors/onebit.py"} <= names
    assert not names & {"cli.py", "ddp.py", "__init__.py", "simulation.py"}
    assert not any(name.startswith(("testbed/", "bench/", "exchange/")) for name in names)

    def digest() -> str:
        sources_digest.cache_clear()
        return sources_digest(sign, copy)

    before = digest()
    assert before == digest() and len(before) == 64
    (copy / "compressors" / "__pycache__").mkdir()
    (copy / "compressors" / "__pycache__" / "sign._decode_signs-1.py311.nbi").write_bytes(b"index")
    (copy / "compressors" / "__pycache__" / "sign.cpython-311.pyc").write_bytes(b"bytecode")
    assert digest() == before
    for unrelated in ("cli.py", "testbed/report.py", "compressors/thc.py", "ddp.py"):
        _touch(copy / unrelated)
    assert digest() == before
    for dependency in ("compressors/sign.py", "core/packet.py", "kernels/simd.py"):
        _touch(copy / dependency)
        assert digest() != before
        before = digest()


def test_where_kernels_are_kept(tmp_path, decode):
    """Beside the module when that is writable (and read from there when ``GRADPRESS_CACHE`` is set: the
    test above); in ``$GRADPRESS_CACHE/numba`` when set, shared by copies of the same sources at other
    places; in ``$XDG_CACHE_HOME/gradpress/numba`` when the module's folder cannot hold a
    ``__pycache__``."""
    copy = _copy(tmp_path)
    beside = copy / "compressors" / "__pycache__"
    chosen, xdg = tmp_path / "chosen", tmp_path / "xdg"
    assert decode(tmp_path, GRADPRESS_CACHE=str(chosen)) == MISS
    assert list((chosen / "numba").glob(f"gradpress-{gradpress.__version__}/compressors/sign._decode_signs-*.nbc"))
    assert not list(beside.glob("*.nbc"))
    elsewhere = tmp_path / "elsewhere"  # the same sources at another place (a virtualenv, say): shared
    _copy(elsewhere)
    assert decode(elsewhere, GRADPRESS_CACHE=str(chosen)) == HIT
    beside.write_bytes(b"")  # a file where the folder would be: nothing can be written beside the module
    assert decode(tmp_path) == MISS
    assert list((xdg / "gradpress" / "numba").glob(f"gradpress-{gradpress.__version__}/compressors/"
                                                   "sign._decode_signs-*.nbc"))
    assert decode(tmp_path) == HIT


def test_kernels_run_where_no_cache_folder_can_be_written(tmp_path, decode):
    """A checkout (or an installed package) where no folder can hold a kernel — beside the module, the
    user's cache (``XDG_CACHE_HOME``), ``GRADPRESS_CACHE`` —: the kernel is compiled in each process, gives
    the right result, and nothing fails nor is written. A file stands where each folder would be (what
    a read-only folder is for a user other than root, whose writes no permission stops)."""
    copy = _copy(tmp_path)
    (copy / "compressors" / "__pycache__").write_bytes(b"")
    blocked = tmp_path / "blocked"
    blocked.write_bytes(b"")
    for env in ({"XDG_CACHE_HOME": str(blocked / "xdg")},
                {"XDG_CACHE_HOME": str(blocked / "xdg"), "GRADPRESS_CACHE": str(blocked / "chosen")}):
        assert decode(tmp_path, **env) == MISS
    assert not list(tmp_path.rglob("*.nbc")) and not list(tmp_path.rglob("*.nbi"))  # (the next one compiles)


@pytest.mark.parametrize("offset", [0, 1, 3, 16])
def test_decoding_writes_outputs_at_any_alignment(offset):
    """A kernel's stores make no assumption on its output's alignment (a cached kernel with aligned
    non-temporal stores once crashed on a view that starts mid-cache-line)."""
    generator = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (8192 // 8,), dtype=torch.uint8, generator=generator)
    storage = torch.empty(8192 + 16)
    out = storage[offset:offset + 8192].numpy()
    _decode_signs(packed.numpy(), -1.0, 1.0, out)
    expected = np.where(np.unpackbits(packed.numpy(), bitorder="little").astype(bool), 1.0, -1.0)
    assert np.array_equal(out, expected)
