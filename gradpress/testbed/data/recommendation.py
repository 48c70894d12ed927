"""Implicit-feedback recommendation on MovieLens-100k (Harper & Konstan 2015) in NCF's protocol (He et al.
2017, Section 4.1), read from RecBole's atomic ``.inter`` file inside the ``recbole==1.2.1`` wheel (see
:mod:`gradpress.testbed.data`)."""
from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from gradpress.testbed.data.dataset import DataUnavailable, Dataset, Say, Split, cache_dir, quiet
from gradpress.testbed.data.fetching import check_sha256

RECBOLE_REQUIREMENT = "recbole==1.2.1"
RECBOLE_WHEEL = "recbole-1.2.1-py3-none-any.whl"
ML100K_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
ML100K_SHA256 = "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff"


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


def fetch_movielens(install: bool = True, say: Say = quiet) -> str:
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
    check_sha256(_read_member(wheel), ML100K_SHA256, f"{wheel}:{ML100K_MEMBER}")
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
