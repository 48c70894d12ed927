"""Word-level language modelling on English text from Debian's ``fortunes`` (Zaremba et al. 2014's
setting; see :mod:`gradpress.testbed.data`)."""
from __future__ import annotations

import collections
import itertools
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from gradpress.testbed.data.dataset import DataUnavailable, Dataset, Say, Split, quiet
from gradpress.testbed.data.fetching import ensure_debian_package

FORTUNES_PACKAGE = "fortunes"
FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNES_MARKER = "computers"  # a file of the ``fortunes`` package (``fortunes-min`` has the directory too)
UNK, EOS = 0, 1
SPECIALS = ("<unk>", "<eos>")
_SEPARATOR = re.compile(r"^%[ \t]*$", re.MULTILINE)
_OVERSTRIKE = re.compile(r"[^\x08]\x08", re.DOTALL)  # a character struck over by the next one
_TOKEN = re.compile(r"[^\W_]+(?:'[^\W_]+)*|[^\w\s]|_")  # words (with inner apostrophes) or one symbol


@dataclass
class TextData(Dataset):
    """Language modelling: ``x`` (N, bptt) int64 windows of a contiguous token stream, ``y`` = ``x`` shifted
    by one token."""

    vocab: tuple[str, ...] = ()
    task: ClassVar[str] = "language-model"

    def model_kwargs(self) -> dict[str, int]:
        return {"vocab_size": len(self.vocab)}

    def summary(self) -> str:
        unk = float((self.test.y == UNK).float().mean()) if len(self.test) else 0.0
        bptt = self.train.x.shape[1]
        return (f"train {self.train.y.numel()} tokens ({len(self.train)} windows of {bptt}), "
                f"test {self.test.y.numel()} tokens, vocabulary {len(self.vocab)} "
                f"(<unk> {unk:.1%} of test tokens)")



def fortune_files(root: Path) -> list[Path]:
    """The fortune files of ``root``: regular files except the ``.dat`` indexes and ``.u8`` links."""
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix not in (".dat", ".u8"))


def read_fortunes(root: Path | str = FORTUNES_DIR) -> list[str]:
    """Every entry of every fortune file, in file order (entries are separated by lines holding ``%``)."""
    root = Path(root)
    files = fortune_files(root) if root.is_dir() else []
    if not files:
        raise DataUnavailable(f"no fortune files in {root}: they come with Debian's {FORTUNES_PACKAGE!r} "
                              "package; run `gradpress data` as root or "
                              f"`sudo apt-get install -y {FORTUNES_PACKAGE}`")
    entries = []
    for path in files:
        text = strip_overstrike(path.read_bytes().decode("utf-8", errors="replace"))
        entries += [e.strip() for e in _SEPARATOR.split(text) if e.strip()]
    return entries


def strip_overstrike(text: str) -> str:
    """What a terminal shows of typewriter overstrike: ``"x\\bx"`` (bold), ``"_\\bx"`` and
    ``"___\\b\\b\\bcan"`` (underline) print as ``x`` and ``can``. Each pass removes the innermost
    character-backspace pairs."""
    removed = 1
    while removed:
        text, removed = _OVERSTRIKE.subn("", text)
    return text.replace("\x08", "")


def tokenize(text: str) -> list[str]:
    """Lower-cased words (letters and digits, inner apostrophes kept: ``don't``) and single symbols."""
    return _TOKEN.findall(text.lower())


def is_test_entry(entry: str, test_percent: int = 10) -> bool:
    """The fixed split: an entry is a test entry when the CRC-32 of its text mod 100 is below ``test_percent``
    (independent of file order and of other entries; equal texts fall on the same side)."""
    return zlib.crc32(entry.encode("utf-8")) % 100 < test_percent


def build_vocab(tokens: list[str], size: int) -> tuple[str, ...]:
    """``<unk>``, ``<eos>``, then the ``size - 2`` most frequent tokens (ties in alphabetical order)."""
    if size < 3:
        raise ValueError(f"vocabulary size must be at least 3 (<unk>, <eos> and a word), got {size}")
    counts = collections.Counter(tokens)
    for special in SPECIALS:
        counts.pop(special, None)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: size - len(SPECIALS)]
    return SPECIALS + tuple(word for word, _ in ranked)


def encode(tokens: list[str], vocab: tuple[str, ...]) -> torch.Tensor:
    """Token ids (``<unk>`` for words outside ``vocab``)."""
    index = {word: i for i, word in enumerate(vocab)}
    ids = np.fromiter(map(index.get, tokens, itertools.repeat(UNK)), dtype=np.int64, count=len(tokens))
    return torch.from_numpy(ids)


def bptt_windows(stream: torch.Tensor, bptt: int) -> Split:
    """Cut a contiguous token stream into non-overlapping windows: ``x[i] = stream[i*bptt:(i+1)*bptt]``,
    ``y[i]`` the same window shifted by one token (the next-word targets)."""
    if bptt < 1:
        raise ValueError(f"bptt must be at least 1, got {bptt}")
    n = (len(stream) - 1) // bptt
    if n < 1:
        raise ValueError(f"{len(stream)} tokens cannot fill one window of {bptt} plus a target")
    return Split(stream[: n * bptt].view(n, bptt).clone(), stream[1: n * bptt + 1].view(n, bptt).clone())


def text_dataset(entries: list[str], vocab_size: int = 10_000, bptt: int = 35, test_percent: int = 10,
                 name: str = "fortunes") -> TextData:
    """Entries -> tokens with ``<eos>`` after each entry, split by :func:`is_test_entry`; the vocabulary
    comes from the training entries only."""
    parts: dict[bool, list[str]] = {False: [], True: []}
    for entry in entries:
        parts[is_test_entry(entry, test_percent)] += tokenize(entry) + ["<eos>"]
    train_tokens, test_tokens = parts[False], parts[True]
    vocab = build_vocab(train_tokens, vocab_size)
    return TextData(name, bptt_windows(encode(train_tokens, vocab), bptt),
                    bptt_windows(encode(test_tokens, vocab), bptt), vocab)


def fetch_fortunes(install: bool = True, say: Say = quiet, root: Path = FORTUNES_DIR) -> str:
    """Install Debian's ``fortunes`` if needed and check there are fortune files."""
    ensure_debian_package(FORTUNES_PACKAGE, root / FORTUNES_MARKER, install, say)
    files = fortune_files(root)
    if not files:
        raise DataUnavailable(f"{root} holds no fortune files")
    return f"{root} ({len(files)} fortune files)"


def load_fortunes(root: Path | str = FORTUNES_DIR, vocab_size: int = 10_000, bptt: int = 35,
                  test_percent: int = 10) -> TextData:
    """Word-level language modelling on Debian's fortunes (see :func:`text_dataset`)."""
    return text_dataset(read_fortunes(root), vocab_size, bptt, test_percent)
