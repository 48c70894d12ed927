"""The on-disk cache of gradpress's numba kernels (``gradpress.kernels.jit.kernel``): kept between processes while
the package's sources stay the same, compiled again when any of them changes — also a module other than
the kernel's own, whose intrinsics or helpers the cached machine code contains. Real processes, a real
copy of the package, real cache files."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import gradpress
from gradpress.kernels.jit import sources_digest
from gradpress.compressors.sign import _decode_signs

#: run in a child process against the copy of the package: decode 4096 packed signs with the sign
#: decoder's kernel, report its cache statistics and whether the result is right
_CHILD = textwrap.dedent("""
    import json
    import numpy as np
    from gradpress.compressors.sign import _decode_signs
    packed = np.arange(512, dtype=np.uint8)
    out = np.empty(4096, np.float32)
    _decode_signs(packed, -1.0, 1.0, out)
    expected = np.where(np.unpackbits(packed, bitorder="little").astype(bool), 1.0, -1.0)
    stats = _decode_signs.stats
    print(json.dumps({"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values()),
                      "right": bool((out == expected).all())}))
""")


def _decode_in_a_process(root: Path) -> dict:
    environment = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"}
    environment.update(PYTHONPATH=str(root), GRADPRESS_NUMBA="1")
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=root, env=environment, capture_output=True,
                          text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_change_to_any_module_compiles_the_kernels_again(tmp_path):
    package = Path(gradpress.__file__).parent
    copy = tmp_path / "gradpress"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    first = _decode_in_a_process(tmp_path)
    assert first == {"hits": 0, "misses": 1, "right": True}
    assert list((copy / "compressors" / "__pycache__").glob("sign._decode_signs-*.nbc")), "nothing cached"
    assert _decode_in_a_process(tmp_path) == {"hits": 1, "misses": 0, "right": True}
    # a module the kernel does not live in, whose intrinsics it inlines: numba's own key misses this
    simd = copy / "_simd.py"
    simd.write_text(simd.read_text() + "\n# changed\n")
    assert _decode_in_a_process(tmp_path) == {"hits": 0, "misses": 1, "right": True}
    assert _decode_in_a_process(tmp_path) == {"hits": 1, "misses": 0, "right": True}


def test_the_digest_follows_every_source_file_and_nothing_else(tmp_path):
    """A change to any module, nested ones included, changes the digest; the caches and bytecode written
    beside the sources (numba's own index and data files) do not, or every compilation would invalidate
    the others."""
    copy = tmp_path / "gradpress"
    shutil.copytree(Path(gradpress.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = sources_digest(copy)
    assert before == sources_digest(copy) and len(before) == 64
    (copy / "compressors" / "__pycache__").mkdir()
    (copy / "compressors" / "__pycache__" / "sign._decode_signs-1.py311.nbi").write_bytes(b"index")
    (copy / "compressors" / "__pycache__" / "sign.cpython-311.pyc").write_bytes(b"bytecode")
    sources_digest.cache_clear()
    assert sources_digest(copy) == before
    sign = copy / "compressors" / "sign.py"
    sign.write_text(sign.read_text() + "\n")
    sources_digest.cache_clear()
    assert sources_digest(copy) != before


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
