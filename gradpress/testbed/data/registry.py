"""The testbed's datasets by name (see :mod:`gradpress.testbed.data`): each one's fetch and load."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gradpress.testbed.data.dataset import Dataset, Say, quiet
from gradpress.testbed.data.images import fetch_fashion_mnist, load_fashion_mnist
from gradpress.testbed.data.recommendation import fetch_movielens, load_movielens
from gradpress.testbed.data.text import fetch_fortunes, load_fortunes


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
        from gradpress.core.registry import did_you_mean

        raise ValueError(f"unknown dataset {name!r}{did_you_mean(name, DATASETS)}; known: {', '.join(DATASETS)}")
    return DATASETS[name]


def fetch(name: str, install: bool = True, say: Say = quiet) -> str:
    """Get dataset ``name`` onto this machine (apt-get as root, pip download) and check it; returns
    where it is and what was checked."""
    return _source(name).fetch(install=install, say=say)


def load(name: str, **kwargs) -> Dataset:
    """Load dataset ``name`` (it must have been fetched; :class:`DataUnavailable` otherwise)."""
    return _source(name).load(**kwargs)
