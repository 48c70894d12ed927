"""The testbed's datasets, from offline sources, with fixed train/test splits (``gradpress data``).

Three workloads in the spirit of GRACE's Section 5 (Xu et al.: image classification, recommendation,
language modelling), each read from a package the machine can install without the open internet:

* ``fashion-mnist`` — Xiao, Rasul & Vollgraf 2017, 28×28 grey images in 10 classes, from Debian's
  ``dataset-fashion-mnist`` (IDX files, LeCun's MNIST format). The split is the official one: 60 000
  training and 10 000 test images.
* ``movielens-100k`` — Harper & Konstan 2015, 100 000 ratings of 1 682 movies by 943 users, read from
  inside the PyPI wheel ``recbole==1.2.1`` (RecBole's atomic ``.inter`` file; the wheel is downloaded
  into the cache, never installed). As in NCF (He et al. 2017, Section 4.1) ratings become implicit
  feedback, each user's latest interaction is held out (leave-one-out) and ranked against 99 items the
  user never rated, drawn with a fixed seed.
* ``fortunes`` — English text from Debian's ``fortunes`` (``/usr/share/games/fortunes``, entries
  separated by ``%`` lines): word-level tokens, a capped vocabulary with ``<unk>`` and ``<eos>``, a fixed
  split by a hash of each entry, and the contiguous token stream cut into BPTT windows (Zaremba et al.
  2014's setting for word-level language models).

Every loader returns a :class:`Dataset` of tensors ready for training; ``dataset.shard(rank, n)`` gives
rank ``rank`` of ``n`` workers a disjoint training shard of the same size as every other rank's. The
cache directory is ``$GRADPRESS_DATA`` (default ``~/.cache/gradpress``). Missing data raises
:class:`DataUnavailable` saying how to get it.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import hashlib
import io
import itertools
import os
import re
import shutil
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterator, TypeVar

import numpy as np
import torch

CACHE_ENV = "GRADPRESS_DATA"
Say = Callable[[str], None]
D = TypeVar("D", bound="Dataset")


class DataUnavailable(RuntimeError):
    """A dataset's source is not on this machine (the message says how to get it)."""


def cache_dir() -> Path:
    """``$GRADPRESS_DATA``, or ``~/.cache/gradpress``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gradpress")


def _quiet(_: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------------
# Samples, shards, datasets
# ---------------------------------------------------------------------------------------------------
def shard_indices(n: int, rank: int, world_size: int, seed: int | None = 0) -> torch.Tensor:
    """Indices of rank ``rank``'s shard of ``n`` samples split over ``world_size`` workers.

    The samples are permuted with a generator seeded by ``seed`` (the same on every rank; ``None``
    keeps their order) and cut into ``world_size`` contiguous pieces of ``n // world_size``: the shards
    are disjoint and equally large, so every rank takes the same number of steps per epoch; the
    ``n % world_size`` samples left over are dropped.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} workers")
    per_rank = n // world_size
    if per_rank == 0:
        raise ValueError(f"cannot give each of {world_size} workers a sample: there are only {n}")
    if seed is None:
        order = torch.arange(n)
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[rank * per_rank:(rank + 1) * per_rank].clone()


@dataclass
class Split:
    """``len(x)`` samples: inputs ``x[i]`` with targets ``y[i]``."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} inputs but {len(self.y)} targets")

    def __len__(self) -> int:
        return len(self.x)

    def subset(self, index: torch.Tensor) -> Split:
        return Split(self.x[index], self.y[index])

    def shard(self, rank: int, world_size: int, seed: int | None = 0) -> Split:
        """Rank ``rank``'s disjoint, equally large shard (:func:`shard_indices`)."""
        return self.subset(shard_indices(len(self), rank, world_size, seed))

    def batches(self, batch_size: int, generator: torch.Generator | None = None,
                drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Mini-batches ``(x, y)``, shuffled by ``generator`` (in order when it is None)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        n = len(self)
        order = torch.arange(n) if generator is None else torch.randperm(n, generator=generator)
        stop = n - n % batch_size if drop_last else n
        for start in range(0, stop, batch_size):
            index = order[start:start + batch_size]
            yield self.x[index], self.y[index]


@dataclass
class Dataset:
    """A training and a test :class:`Split` of one task; subclasses add what their models need."""

    name: str
    train: Split
    test: Split
    task: ClassVar[str] = ""

    def shard(self: D, rank: int, world_size: int, seed: int | None = 0) -> D:
        """The same dataset with rank ``rank``'s shard of the training set (the test set is whole)."""
        return dataclasses.replace(self, train=self.train.shard(rank, world_size, seed))

    def training_set(self, generator: torch.Generator) -> Split:
        """The samples of one training epoch (recommendation draws fresh negatives each epoch)."""
        return self.train

    def model_kwargs(self) -> dict[str, int]:
        """Sizes a model of this task takes from the data (``make_model(name, data=...)``)."""
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError


@dataclass
class ImageData(Dataset):
    """Images ``x`` (N, C, H, W) float32, labels ``y`` (N,) int64 in ``range(len(classes))``."""

    classes: tuple[str, ...] = ()
    task: ClassVar[str] = "classification"

    def model_kwargs(self) -> dict[str, int]:
        _, channels, height, width = self.train.x.shape
        if height != width:
            raise ValueError(f"{self.name}: the models take square images, got {height}×{width}")
        return {"in_channels": channels, "image_size": height, "num_classes": len(self.classes)}

    def summary(self) -> str:
        shape = "×".join(map(str, self.train.x.shape[1:]))
        return (f"train {len(self.train)} images of {shape}, test {len(self.test)}, "
                f"{len(self.classes)} classes ({', '.join(self.classes)})")


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


@dataclass
class RecData(Dataset):
    """Implicit-feedback recommendation in NCF's protocol (He et al. 2017, Section 4.1).

    ``train``: the observed (user, item) pairs ``x`` (N, 2) int64 with ``y`` = 1.0.
    ``test``: per held-out user, ``x`` (U, 1 + negatives, 2) — the held-out item first, then items the
    user never interacted with — and ``y`` (U, 1 + negatives) = 1.0 for the held-out item, else 0.0.
    ``observed`` (users, items) bool marks the training interactions of the whole training set (also on
    a shard), so that sampled negatives never hit a known positive.
    """

    num_users: int = 0
    num_items: int = 0
    observed: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool))
    negatives: int = 4
    task: ClassVar[str] = "recommendation"

    def __post_init__(self) -> None:
        if self.observed.shape != (self.num_users, self.num_items):
            raise ValueError(f"observed is {tuple(self.observed.shape)}, "
                             f"expected ({self.num_users}, {self.num_items})")
        if self.negatives > 0 and bool(self.observed.all(dim=1).any()):
            raise ValueError("a user has interacted with every item: no negative can be sampled for them")

    def training_set(self, generator: torch.Generator) -> Split:
        """The positives plus ``negatives`` unobserved items per positive, drawn afresh (NCF Section 3.1.1).

        As in the NCF authors' protocol, a negative is any item not in the user's training
        interactions; the rejected draws are redrawn until none is left.
        """
        users, items = self.train.x[:, 0], self.train.x[:, 1]
        neg_users = users.repeat_interleave(self.negatives)
        neg_items = sample_unobserved(neg_users, self.observed, generator)
        x = torch.cat([torch.stack([users, items], 1), torch.stack([neg_users, neg_items], 1)])
        y = torch.cat([torch.ones(len(users)), torch.zeros(len(neg_users))])
        return Split(x, y)

    def model_kwargs(self) -> dict[str, int]:
        return {"num_users": self.num_users, "num_items": self.num_items}

    def summary(self) -> str:
        candidates = self.test.x.shape[1] if len(self.test) else 0
        return (f"{self.num_users} users, {self.num_items} items, train {len(self.train)} interactions "
                f"(+{self.negatives} sampled negatives each per epoch), test {len(self.test)} users × "
                f"{candidates} candidates (1 held out + {candidates - 1} never seen)")


def sample_unobserved(users: torch.Tensor, observed: torch.Tensor,
                      generator: torch.Generator) -> torch.Tensor:
    """For each entry of ``users``, a uniformly drawn item ``i`` with ``observed[user, i]`` False."""
    items = torch.randint(observed.shape[1], users.shape, generator=generator)
    redo = observed[users, items].nonzero().squeeze(1)
    while len(redo):
        items[redo] = torch.randint(observed.shape[1], redo.shape, generator=generator)
        redo = redo[observed[users[redo], items[redo]]]
    return items


# ---------------------------------------------------------------------------------------------------
# Fetching: Debian packages and the RecBole wheel
# ---------------------------------------------------------------------------------------------------
def ensure_debian_package(package: str, path: Path, install: bool = True, say: Say = _quiet) -> None:
    """Make ``path`` exist by installing Debian's ``package`` with apt-get (only as root)."""
    if path.exists():
        return
    how = f"install it with `sudo apt-get install -y {package}` (or run `gradpress data` as root)"
    if not install:
        raise DataUnavailable(f"{path} is missing: it comes with Debian's {package!r} package; {how}")
    if os.geteuid() != 0:
        raise DataUnavailable(f"{path} is missing and only root can install Debian's {package!r} package: "
                              f"{how}")
    if shutil.which("apt-get") is None:
        raise DataUnavailable(f"{path} is missing and this machine has no apt-get to install "
                              f"{package!r} with")
    say(f"installing Debian package {package} (apt-get install -y {package})")
    done = _apt("install", "-y", package)
    if done.returncode != 0:
        say("apt-get could not install it; running apt-get update and trying again")
        _apt("update")
        done = _apt("install", "-y", package)
    if done.returncode != 0 or not path.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise DataUnavailable(f"apt-get install -y {package} did not provide {path}:\n{tail}")


def _apt(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["apt-get", *args], capture_output=True, text=True, env=env, check=False)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_sha256(data: bytes, expected: str, where: str) -> None:
    if sha256(data) != expected:
        raise DataUnavailable(f"{where} has sha256 {sha256(data)}, expected {expected}: the file is not the "
                              "dataset gradpress was built for (corrupt or a different version)")


# ---------------------------------------------------------------------------------------------------
# Fashion-MNIST (IDX files)
# ---------------------------------------------------------------------------------------------------
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
#: file stem -> sha256 of the decompressed IDX file (the same bytes as Zalando's release)
FASHION_MNIST_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
_IDX_TYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
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


def _fashion_mnist_paths(root: Path) -> dict[str, Path]:
    paths = {stem: root / f"{stem}.gz" for stem in FASHION_MNIST_SHA256}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        raise DataUnavailable(f"Fashion-MNIST is missing ({', '.join(missing)}): it comes with Debian's "
                              f"{FASHION_MNIST_PACKAGE!r} package; run `gradpress data` as root or "
                              f"`sudo apt-get install -y {FASHION_MNIST_PACKAGE}`")
    return paths


def fetch_fashion_mnist(install: bool = True, say: Say = _quiet, root: Path = FASHION_MNIST_DIR) -> str:
    """Install Debian's ``dataset-fashion-mnist`` if needed and check the decompressed files' sha256."""
    ensure_debian_package(FASHION_MNIST_PACKAGE, root, install, say)
    for stem, path in _fashion_mnist_paths(root).items():
        _check_sha256(read_idx_bytes(path), FASHION_MNIST_SHA256[stem], str(path))
    return f"{root} (4 IDX files, sha256 checked)"


def load_fashion_mnist(root: Path | str = FASHION_MNIST_DIR, normalize: bool = True) -> ImageData:
    """Fashion-MNIST's official split; pixels scaled to [0, 1], then (``normalize``) standardized by the
    training set's mean and standard deviation."""
    paths = _fashion_mnist_paths(Path(root))
    arrays = {stem: parse_idx(read_idx_bytes(path), str(path)) for stem, path in paths.items()}
    splits = []
    for part in ("train", "t10k"):
        images, labels = arrays[f"{part}-images-idx3-ubyte"], arrays[f"{part}-labels-idx1-ubyte"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(f"{root}: {part} images {images.shape} do not match labels {labels.shape}")
        if labels.size and labels.max() >= len(FASHION_MNIST_CLASSES):
            raise ValueError(f"{root}: {part} label {labels.max()} is not a Fashion-MNIST class")
        x = torch.from_numpy(images).unsqueeze(1).float().div_(255.0)
        splits.append(Split(x, torch.from_numpy(labels).long()))
    train, test = splits
    if normalize:
        mean, std = train.x.mean(), train.x.std()
        train.x.sub_(mean).div_(std)
        test.x.sub_(mean).div_(std)
    return ImageData("fashion-mnist", train, test, FASHION_MNIST_CLASSES)


# ---------------------------------------------------------------------------------------------------
# MovieLens-100k (RecBole's atomic .inter file, inside the recbole wheel)
# ---------------------------------------------------------------------------------------------------
RECBOLE_REQUIREMENT = "recbole==1.2.1"
RECBOLE_WHEEL = "recbole-1.2.1-py3-none-any.whl"
ML100K_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
ML100K_SHA256 = "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff"


@dataclass
class Interactions:
    """The rows of a RecBole ``.inter`` file: ``users[k]`` rated ``items[k]`` with ``ratings[k]`` at
    ``timestamps[k]``; users and items are indices into ``user_tokens`` / ``item_tokens`` (sorted)."""

    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray
    timestamps: np.ndarray
    user_tokens: np.ndarray
    item_tokens: np.ndarray


def recbole_wheel() -> Path:
    return cache_dir() / "wheels" / RECBOLE_WHEEL


def fetch_movielens(install: bool = True, say: Say = _quiet) -> str:
    """``pip download --no-deps recbole==1.2.1`` into the cache (never installed) and check the
    ``.inter`` file's sha256."""
    wheel = recbole_wheel()
    if not wheel.exists():
        if not install:
            raise DataUnavailable(f"{wheel} is missing; run `gradpress data` to download it from PyPI")
        say(f"downloading {RECBOLE_REQUIREMENT} from PyPI into {wheel.parent} (not installed)")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   RECBOLE_REQUIREMENT, "-d", str(wheel.parent)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not wheel.exists():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            raise DataUnavailable(f"`{' '.join(command)}` did not provide {wheel}:\n{tail}")
    _check_sha256(_read_member(wheel), ML100K_SHA256, f"{wheel}:{ML100K_MEMBER}")
    return f"{wheel} ({ML100K_MEMBER}, sha256 checked)"


def _read_member(wheel: Path) -> bytes:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(ML100K_MEMBER)
    except (zipfile.BadZipFile, KeyError) as error:
        raise ValueError(f"{wheel}: cannot read {ML100K_MEMBER}: {error}") from None


def parse_inter(text: str, where: str = ".inter file") -> Interactions:
    """Parse RecBole's atomic ``.inter`` format: a tab-separated header of typed fields
    (``user_id:token  item_id:token  rating:float  timestamp:float``), then one row per interaction."""
    header, _, body = text.partition("\n")
    fields = [f.partition(":")[0] for f in header.rstrip("\r").split("\t")]
    required = ("user_id", "item_id", "rating", "timestamp")
    if any(f not in fields for f in required):
        raise ValueError(f"{where}: header {header!r} lacks one of the fields {', '.join(required)}")
    if not body.strip():
        raise ValueError(f"{where}: no interactions after the header")
    try:
        table = np.loadtxt(io.StringIO(body), dtype=str, delimiter="\t", ndmin=2, comments=None)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if table.shape[1] != len(fields):
        raise ValueError(f"{where}: rows have {table.shape[1]} fields, the header names {len(fields)}")
    column = {name: table[:, fields.index(name)] for name in required}
    user_tokens, users = np.unique(column["user_id"], return_inverse=True)
    item_tokens, items = np.unique(column["item_id"], return_inverse=True)
    try:
        ratings, timestamps = column["rating"].astype(np.float64), column["timestamp"].astype(np.float64)
    except ValueError as error:
        raise ValueError(f"{where}: a rating or timestamp is not a number: {error}") from None
    return Interactions(users.astype(np.int64), items.astype(np.int64), ratings, timestamps,
                        user_tokens, item_tokens)


def leave_last_out(inter: Interactions, test_negatives: int = 99, seed: int = 0,
                   name: str = "movielens-100k") -> RecData:
    """NCF's split (He et al. 2017, Section 4.1): every rating is an implicit interaction; each user's latest
    one (by timestamp, ties by file order) is held out for test, to be ranked among ``test_negatives`` items
    the user never interacted with, drawn without replacement by a generator seeded with ``seed``.
    Users with a single interaction stay in training only; repeated (user, item) pairs count once (latest)."""
    num_users, num_items = len(inter.user_tokens), len(inter.item_tokens)
    order = np.lexsort((np.arange(len(inter.users)), inter.timestamps, inter.users))
    users, items = inter.users[order], inter.items[order]
    latest = len(users) - 1 - np.unique((users * num_items + items)[::-1], return_index=True)[1]
    keep = np.zeros(len(users), dtype=bool)
    keep[latest] = True  # the latest row of each (user, item) pair
    users, items = users[keep], items[keep]
    last = np.append(users[1:] != users[:-1], True)
    first = np.insert(users[1:] != users[:-1], 0, True)
    held = last & ~first
    observed_all = torch.zeros(num_users, num_items, dtype=torch.bool)
    observed_all[torch.from_numpy(users), torch.from_numpy(items)] = True
    train_pairs = torch.from_numpy(np.stack([users[~held], items[~held]], 1))
    observed = torch.zeros_like(observed_all)
    observed[train_pairs[:, 0], train_pairs[:, 1]] = True
    test_users, test_items = torch.from_numpy(users[held]), torch.from_numpy(items[held])
    negatives = _draw_test_negatives(observed_all[test_users], test_negatives, seed)
    candidates = torch.cat([test_items[:, None], negatives], 1)
    test_x = torch.stack([test_users[:, None].expand_as(candidates), candidates], 2)
    test_y = torch.zeros(candidates.shape)
    test_y[:, 0] = 1.0
    return RecData(name, Split(train_pairs, torch.ones(len(train_pairs))), Split(test_x, test_y),
                   num_users=num_users, num_items=num_items, observed=observed)


def _draw_test_negatives(observed: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """Per row, ``k`` distinct columns where ``observed`` is False, uniformly at random (fixed seed)."""
    unobserved = (~observed).sum(1)
    if len(unobserved) and int(unobserved.min()) < k:
        raise ValueError(f"a held-out user has only {int(unobserved.min())} items they never rated; "
                         f"{k} test negatives were asked for")
    keys = torch.rand(observed.shape, generator=torch.Generator().manual_seed(seed))
    keys[observed] = 2.0  # above every uniform draw: never among the k smallest
    return keys.topk(k, dim=1, largest=False).indices


def load_movielens(wheel: Path | str | None = None, test_negatives: int = 99, seed: int = 0) -> RecData:
    """MovieLens-100k from the recbole wheel in the cache (``gradpress data`` fetches it), NCF's split."""
    wheel = Path(wheel) if wheel is not None else recbole_wheel()
    if not wheel.exists():
        raise DataUnavailable(f"MovieLens-100k: {wheel} is missing; run `gradpress data` to download "
                              f"{RECBOLE_REQUIREMENT} from PyPI (it is read, never installed)")
    where = f"{wheel}:{ML100K_MEMBER}"
    return leave_last_out(parse_inter(_read_member(wheel).decode("utf-8"), where), test_negatives, seed)


# ---------------------------------------------------------------------------------------------------
# English text (Debian's fortunes)
# ---------------------------------------------------------------------------------------------------
FORTUNES_PACKAGE = "fortunes"
FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNES_MARKER = "computers"  # a file of the ``fortunes`` package (``fortunes-min`` has the directory too)
UNK, EOS = 0, 1
SPECIALS = ("<unk>", "<eos>")
_SEPARATOR = re.compile(r"^%[ \t]*$", re.MULTILINE)
_OVERSTRIKE = re.compile(r"[^\x08]\x08", re.DOTALL)  # a character struck over by the next one
_TOKEN = re.compile(r"[^\W_]+(?:'[^\W_]+)*|[^\w\s]|_")  # words (with inner apostrophes) or one symbol


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


def fetch_fortunes(install: bool = True, say: Say = _quiet, root: Path = FORTUNES_DIR) -> str:
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


# ---------------------------------------------------------------------------------------------------
# The registry and the ``gradpress data`` command
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    fetch: Callable[..., str]
    load: Callable[..., Dataset]


DATASETS: dict[str, Source] = {
    "fashion-mnist": Source(fetch_fashion_mnist, load_fashion_mnist),
    "movielens-100k": Source(fetch_movielens, load_movielens),
    "fortunes": Source(fetch_fortunes, load_fortunes),
}


def dataset_names() -> list[str]:
    return list(DATASETS)


def _source(name: str) -> Source:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return DATASETS[name]


def fetch(name: str, install: bool = True, say: Say = _quiet) -> str:
    """Get dataset ``name`` onto this machine (apt-get as root, pip download) and check it; returns
    where it is and what was checked."""
    return _source(name).fetch(install=install, say=say)


def load(name: str, **kwargs) -> Dataset:
    """Load dataset ``name`` (it must have been fetched; :class:`DataUnavailable` otherwise)."""
    return _source(name).load(**kwargs)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="fetch and check the testbed's datasets (offline sources)",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"datasets (default: all of {', '.join(DATASETS)})")
    parser.add_argument("--no-install", action="store_true", help="only check: never run apt-get or pip")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from gradpress.cli import UsageError

    names = args.names or dataset_names()
    unknown = [name for name in names if name not in DATASETS]
    if unknown:
        raise UsageError(f"unknown dataset {', '.join(unknown)}; known: {', '.join(DATASETS)}")
    print(f"cache: {cache_dir()}  (${CACHE_ENV})")
    failed = 0
    for name in names:
        try:
            where = fetch(name, install=not args.no_install, say=lambda text: print(f"  {text}"))
            data = load(name)
        except (DataUnavailable, ValueError) as error:
            failed += 1
            print(f"{name}: NOT AVAILABLE: {error}")
            continue
        print(f"{name}: {where}\n  {data.summary()}")
    return 1 if failed else 0
