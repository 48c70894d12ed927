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

The package holds one idea a module: :mod:`~gradpress.testbed.data.dataset` (samples, shards, the cache
directory), :mod:`~gradpress.testbed.data.fetching` (Debian packages, checksums),
:mod:`~gradpress.testbed.data.idx` (the IDX reader); one module per family,
:mod:`~gradpress.testbed.data.images` (Fashion-MNIST), :mod:`~gradpress.testbed.data.recommendation`
(MovieLens-100k) and :mod:`~gradpress.testbed.data.text` (fortunes); the datasets by name in
:mod:`~gradpress.testbed.data.registry` and the command in :mod:`~gradpress.testbed.data.command`. Every
name is importable from the package.
"""
from __future__ import annotations

from gradpress.testbed.data.command import add_parser
from gradpress.testbed.data.dataset import (
    CACHE_ENV,
    DataUnavailable,
    Dataset,
    Say,
    Split,
    cache_dir,
    shard_indices,
)
from gradpress.testbed.data.fetching import ensure_debian_package, sha256
from gradpress.testbed.data.idx import parse_idx, read_idx_bytes
from gradpress.testbed.data.images import (
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_DIR,
    FASHION_MNIST_PACKAGE,
    FASHION_MNIST_SHA256,
    ImageData,
    fetch_fashion_mnist,
    load_fashion_mnist,
)
from gradpress.testbed.data.recommendation import (
    ML100K_MEMBER,
    ML100K_SHA256,
    RECBOLE_REQUIREMENT,
    RECBOLE_WHEEL,
    Interactions,
    RecData,
    fetch_movielens,
    leave_last_out,
    load_movielens,
    parse_inter,
    recbole_wheel,
    sample_unobserved,
)
from gradpress.testbed.data.registry import DATASETS, Source, dataset_names, fetch, load
from gradpress.testbed.data.text import (
    EOS,
    FORTUNES_DIR,
    FORTUNES_MARKER,
    FORTUNES_PACKAGE,
    SPECIALS,
    UNK,
    TextData,
    bptt_windows,
    build_vocab,
    encode,
    fetch_fortunes,
    fortune_files,
    is_test_entry,
    load_fortunes,
    read_fortunes,
    strip_overstrike,
    text_dataset,
    tokenize,
)

__all__ = ["CACHE_ENV", "DATASETS", "DataUnavailable", "Dataset", "EOS", "FASHION_MNIST_CLASSES",
           "FASHION_MNIST_DIR", "FASHION_MNIST_PACKAGE", "FASHION_MNIST_SHA256", "FORTUNES_DIR",
           "FORTUNES_MARKER", "FORTUNES_PACKAGE", "ImageData", "Interactions", "ML100K_MEMBER",
           "ML100K_SHA256", "RECBOLE_REQUIREMENT", "RECBOLE_WHEEL", "RecData", "SPECIALS", "Say", "Source",
           "Split", "TextData", "UNK", "add_parser", "bptt_windows", "build_vocab", "cache_dir",
           "dataset_names", "encode", "ensure_debian_package", "fetch", "fetch_fashion_mnist",
           "fetch_fortunes", "fetch_movielens", "fortune_files", "is_test_entry", "leave_last_out", "load",
           "load_fashion_mnist", "load_fortunes", "load_movielens", "parse_idx", "parse_inter",
           "read_fortunes", "read_idx_bytes", "recbole_wheel", "sample_unobserved", "sha256", "shard_indices",
           "strip_overstrike", "text_dataset", "tokenize"]
