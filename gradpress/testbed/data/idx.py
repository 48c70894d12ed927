"""The IDX format of LeCun et al.'s MNIST files (Fashion-MNIST's too), read into numpy arrays (see
:mod:`gradpress.testbed.data`)."""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

_IDX_TYPES: dict[int, np.dtype] = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
              0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def parse_idx(raw: bytes, where: str = "IDX data") -> np.ndarray:
    """Decode an IDX file (LeCun et al.'s MNIST format): magic ``0 0 type ndim``, big-endian int32
    sizes, then the data (big-endian), returned in native byte order."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{where}: not an IDX file (magic bytes {raw[:4].hex() or 'missing'})")
    dtype, ndim = _IDX_TYPES[raw[2]], raw[3]
    start = 4 + 4 * ndim
    if len(raw) < start:
        raise ValueError(f"{where}: truncated header ({len(raw)} bytes for {ndim} dimensions)")
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - start != expected:
        raise ValueError(f"{where}: the header announces {shape} = {expected} bytes of data, "
                         f"the file holds {len(raw) - start}")
    return np.frombuffer(raw, dtype=dtype, offset=start).reshape(shape).astype(dtype.newbyteorder("="))


def read_idx_bytes(path: Path) -> bytes:
    """The bytes of an IDX file, gunzipped when its name ends in ``.gz``."""
    try:
        return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as error:
        raise ValueError(f"{path}: cannot decompress: {error}") from None
