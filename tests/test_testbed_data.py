"""The testbed's data loaders: exact parses of tiny fixtures (tests/fixtures, see make_fixtures.py), fixed
splits, equal disjoint shards, clear errors; and the real datasets when this machine has them."""
from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from gradpress.cli import main as cli_main
from gradpress.testbed import data as D
from gradpress.testbed.data.recommendation import _read_member
from numerics import eps, log2ceil


def normalization_error(raw: torch.Tensor) -> float:
    """How far from 0 the float64 mean (and from 1 the float64 standard deviation) of ``raw``'s values
    normalized with float32 statistics may lie: torch sums float32 pairwise (cascade; ⌈log2 n⌉ roundings
    of each term, Higham §4.2), so the mean is within about ⌈log2 n⌉·u of mean|x| (and the deviation,
    accumulated in float64, a few u); normalizing rounds each value twice more. In units of the deviation:
    (⌈log2 n⌉ + 3)·eps · mean|x| / σ, with eps = 2u for the blocks of the cascade."""
    x = raw.double()
    return (log2ceil(x.numel()) + 3) * eps() * float(x.abs().mean()) / float(x.std())

FIXTURES = Path(__file__).parent / "fixtures"
FMNIST = FIXTURES / "fashion-mnist"
WHEEL = FIXTURES / "recbole-fixture.whl"
FORTUNES = FIXTURES / "fortunes"


def fixture_images(count: int, first: int = 0) -> np.ndarray:
    """The pixel formula of make_fixtures.py, written out again."""
    k = np.arange(first, first + count)[:, None, None]
    return ((37 * k + 3 * np.arange(28)[:, None] + 5 * np.arange(28)[None, :]) % 256).astype(np.uint8)


# ------------------------------------------------------------------------------ Fashion-MNIST (IDX)
def test_parse_idx_reads_fixture_exactly():
    images = D.parse_idx(D.read_idx_bytes(FMNIST / "train-images-idx3-ubyte.gz"))
    labels = D.parse_idx(D.read_idx_bytes(FMNIST / "t10k-labels-idx1-ubyte.gz"))
    assert images.shape == (6, 28, 28) and images.dtype == np.uint8
    np.testing.assert_array_equal(images, fixture_images(6))
    np.testing.assert_array_equal(labels, [2, 6, 5, 3])


def test_parse_idx_big_endian_types():
    values = np.array([[1, -2, 300], [70000, 5, -6]], dtype=">i4")
    raw = struct.pack(">BBBBII", 0, 0, 0x0C, 2, 2, 3) + values.tobytes()
    parsed = D.parse_idx(raw)
    assert parsed.dtype == np.int32 and parsed.dtype.isnative
    np.testing.assert_array_equal(parsed, values)


@pytest.mark.parametrize("raw, message", [
    (b"\x01\x00\x08\x01" + struct.pack(">I", 1) + b"\x00", "not an IDX file"),
    (b"\x00\x00\x07\x01" + struct.pack(">I", 1) + b"\x00", "not an IDX file"),
    (b"", "not an IDX file"),
    (b"\x00\x00\x08\x03" + struct.pack(">I", 2), "truncated header"),
    (b"\x00\x00\x08\x02" + struct.pack(">II", 2, 3) + bytes(5), "2, 3"),
    (b"\x00\x00\x08\x01" + struct.pack(">I", 2) + bytes(3), "holds 3"),
])
def test_parse_idx_rejects_malformed(raw, message):
    with pytest.raises(ValueError, match=message):
        D.parse_idx(raw, "x.idx")


def test_read_idx_rejects_broken_gzip(tmp_path):
    path = tmp_path / "broken.gz"
    path.write_bytes(gzip.compress(bytes(100))[:-10])
    with pytest.raises(ValueError, match="cannot decompress"):
        D.read_idx_bytes(path)


def test_load_fashion_mnist_fixture_exact():
    data = D.load_fashion_mnist(FMNIST, normalize=False)
    assert isinstance(data, D.ImageData) and data.task == "classification"
    assert data.train.x.shape == (6, 1, 28, 28) and data.test.x.shape == (4, 1, 28, 28)
    assert data.train.x.dtype == torch.float32 and data.train.y.dtype == torch.int64
    expected = torch.from_numpy(fixture_images(6)).float().div(255).unsqueeze(1)
    assert torch.equal(data.train.x, expected)
    expected = torch.from_numpy(fixture_images(4, first=6)).float().div(255).unsqueeze(1)
    assert torch.equal(data.test.x, expected)
    assert data.train.y.tolist() == [3, 1, 4, 1, 5, 9] and data.test.y.tolist() == [2, 6, 5, 3]
    assert data.model_kwargs() == {"in_channels": 1, "image_size": 28, "num_classes": 10}


def test_load_fashion_mnist_normalizes_with_training_statistics():
    raw, data = D.load_fashion_mnist(FMNIST, normalize=False), D.load_fashion_mnist(FMNIST)
    mean, std = raw.train.x.mean(), raw.train.x.std()
    tol = normalization_error(raw.train.x)
    assert abs(float(data.train.x.double().mean())) <= tol and abs(float(data.train.x.double().std()) - 1) <= tol
    torch.testing.assert_close(data.test.x, (raw.test.x - mean) / std)


def test_fashion_mnist_missing_says_how_to_install(tmp_path):
    with pytest.raises(D.DataUnavailable, match="apt-get install -y dataset-fashion-mnist"):
        D.load_fashion_mnist(tmp_path)


def test_fashion_mnist_bad_label_rejected(tmp_path):
    for path in FMNIST.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    labels = np.array([3, 1, 4, 1, 5, 10], dtype=np.uint8)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(struct.pack(">BBBBI", 0, 0, 8, 1, 6) + labels.tobytes()))
    with pytest.raises(ValueError, match="label 10"):
        D.load_fashion_mnist(tmp_path)


def test_fetch_checks_checksums(tmp_path):
    for path in FMNIST.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    with pytest.raises(D.DataUnavailable, match="sha256"):
        D.fetch_fashion_mnist(install=False, root=tmp_path)


def test_ensure_debian_package_without_root_says_how(tmp_path, monkeypatch):
    missing = tmp_path / "nothing-here"
    with pytest.raises(D.DataUnavailable, match="sudo apt-get install -y some-package"):
        D.ensure_debian_package("some-package", missing, install=False)
    monkeypatch.setattr(D.fetching.os, "geteuid", lambda: 1000)
    with pytest.raises(D.DataUnavailable, match="only root can install"):
        D.ensure_debian_package("some-package", missing, install=True)
    D.ensure_debian_package("some-package", tmp_path, install=False)  # present: nothing to do


# ------------------------------------------------------------------------------ MovieLens (.inter)
def read_fixture_inter() -> D.Interactions:
    return D.parse_inter(_read_member(WHEEL).decode(), "fixture")


def test_parse_inter_fixture_exact():
    inter = read_fixture_inter()
    assert inter.user_tokens.tolist() == ["10", "2", "33", "7"]  # tokens, in sorted order
    assert inter.item_tokens.tolist() == [str(i) for i in range(101, 109)]
    assert inter.users.tolist() == [1, 2, 0, 3, 1, 0, 2, 1, 0, 2]
    assert inter.items.tolist() == [1, 6, 3, 5, 2, 0, 7, 0, 4, 6]
    assert inter.ratings.tolist() == [3, 3, 1, 4, 4, 2, 4, 5, 5, 5]
    assert inter.timestamps.tolist() == [200, 5, 50, 10, 300, 60, 7, 100, 60, 9]


@pytest.mark.parametrize("text, message", [
    ("user_id:token\titem_id:token\trating:float\n1\t2\t3\n", "lacks one of the fields"),
    ("user_id:token\titem_id:token\trating:float\ttimestamp:float\n", "no interactions"),
    ("user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t2\t3\t4\n1\t2\t3\n", "fixture"),
    ("user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t2\tgood\t4\n", "not a number"),
])
def test_parse_inter_rejects_malformed(text, message):
    with pytest.raises(ValueError, match=message):
        D.parse_inter(text, "fixture")


def test_leave_last_out_fixture_exact():
    data = D.leave_last_out(read_fixture_inter(), test_negatives=3, seed=0)
    assert (data.num_users, data.num_items) == (4, 8)
    # user 10 (index 0): 104 then 101 and 105 tied at t=60 -> file order holds out 105;
    # user 2 (1): holds out 103; user 33 (2): 107 twice, the later one (t=9) is held out, 108 stays;
    # user 7 (3): a single interaction stays in training
    assert data.train.x.tolist() == [[0, 3], [0, 0], [1, 0], [1, 1], [2, 7], [3, 5]]
    assert torch.equal(data.train.y, torch.ones(6))
    assert data.test.x.shape == (3, 4, 2)
    assert data.test.x[:, :, 0].tolist() == [[0] * 4, [1] * 4, [2] * 4]
    assert data.test.x[:, 0, 1].tolist() == [4, 2, 6]
    assert data.test.y.tolist() == [[1, 0, 0, 0]] * 3
    seen = {0: {3, 0, 4}, 1: {0, 1, 2}, 2: {6, 7}}
    for user, row in enumerate(data.test.x[:, 1:, 1].tolist()):
        assert len(set(row)) == 3 and not set(row) & seen[user]
    expected = torch.zeros(4, 8, dtype=torch.bool)
    expected[data.train.x[:, 0], data.train.x[:, 1]] = True
    assert torch.equal(data.observed, expected)


def test_leave_last_out_negatives_fixed_by_seed():
    inter = read_fixture_inter()
    a, b = D.leave_last_out(inter, 3, seed=0), D.leave_last_out(inter, 3, seed=0)
    assert torch.equal(a.test.x, b.test.x)
    others = [D.leave_last_out(inter, 3, seed=s).test.x for s in range(1, 6)]
    assert any(not torch.equal(a.test.x, o) for o in others)


def test_leave_last_out_needs_enough_unseen_items():
    with pytest.raises(ValueError, match="only 5 items"):
        D.leave_last_out(read_fixture_inter(), test_negatives=6)


def test_training_set_draws_unobserved_negatives():
    data = D.load_movielens(WHEEL, test_negatives=3)
    epoch = data.training_set(torch.Generator().manual_seed(1))
    assert len(epoch) == 6 * 5 and torch.equal(epoch.x[:6], data.train.x)
    assert epoch.y.tolist() == [1.0] * 6 + [0.0] * 24
    neg = epoch.x[6:]
    assert torch.equal(neg[:, 0], data.train.x[:, 0].repeat_interleave(4))
    assert not data.observed[neg[:, 0], neg[:, 1]].any()
    again = data.training_set(torch.Generator().manual_seed(1))
    assert torch.equal(epoch.x, again.x)


def test_sample_unobserved_finds_the_only_free_item():
    observed = torch.ones(3, 50, dtype=torch.bool)
    observed[:, 17] = False
    users = torch.tensor([0, 1, 2] * 20)
    items = D.sample_unobserved(users, observed, torch.Generator().manual_seed(0))
    assert items.tolist() == [17] * 60


def test_movielens_missing_wheel_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv(D.CACHE_ENV, str(tmp_path))
    assert D.recbole_wheel() == tmp_path / "wheels" / D.RECBOLE_WHEEL
    with pytest.raises(D.DataUnavailable, match="gradpress data"):
        D.load_movielens()


# ------------------------------------------------------------------------------ fortunes (text)
def test_read_fortunes_skips_indexes_and_overstrike():
    # beta.dat and beta.u8 are skipped; "_\bb" and "___\b\b\bcan" print as "b" and "can"; empty entries go
    entries = ["the cat sat on the mat.", "Don't panic!\n\t-- the Guide", "bold and can"]
    assert D.read_fortunes(FORTUNES) == entries


def test_tokenize():
    tokens = ["don't", "panic", "!", "-", "-", "the", "_", "end", ",", "42"]
    assert D.tokenize("Don't PANIC!\n\t-- the_end, 42") == tokens


def test_split_by_entry_hash():
    for entry in ["the cat sat on the mat.", "Don't panic!\n\t-- the Guide", "bold and can"]:
        assert D.is_test_entry(entry) == (zlib.crc32(entry.encode()) % 100 < 10)
    assert D.is_test_entry("Don't panic!\n\t-- the Guide") and not D.is_test_entry("bold and can")


def test_text_dataset_fixture_exact():
    data = D.load_fortunes(FORTUNES, vocab_size=6, bptt=3)
    # train: "the cat sat on the mat . <eos> bold and can <eos>"; test: "don't panic ! - - the guide <eos>"
    assert data.vocab == ("<unk>", "<eos>", "the", ".", "and", "bold")
    assert data.train.x.tolist() == [[2, 0, 0], [0, 2, 0], [3, 1, 5]]
    assert data.train.y.tolist() == [[0, 0, 0], [2, 0, 3], [1, 5, 4]]
    assert data.test.x.tolist() == [[0, 0, 0], [0, 0, 2]]
    assert data.test.y.tolist() == [[0, 0, 0], [0, 2, 0]]
    assert data.model_kwargs() == {"vocab_size": 6}
    assert len(D.load_fortunes(FORTUNES, vocab_size=100, bptt=3).vocab) == 11  # every training token fits


def test_bptt_windows_shift_by_one():
    stream = torch.arange(23)
    split = D.bptt_windows(stream, 5)
    assert split.x.shape == (4, 5) and torch.equal(split.y, split.x + 1)
    assert torch.equal(split.x.reshape(-1), stream[:20])
    with pytest.raises(ValueError, match="cannot fill"):
        D.bptt_windows(torch.arange(5), 5)


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="at least 3"):
        D.build_vocab(["a"], 2)


def test_fortunes_missing_says_how(tmp_path):
    with pytest.raises(D.DataUnavailable, match="apt-get install -y fortunes"):
        D.load_fortunes(tmp_path)


# ------------------------------------------------------------------------------ shards and batches
@pytest.mark.parametrize("n, world", [(10, 3), (12, 4), (7, 7), (1000, 8)])
def test_shards_disjoint_and_equal(n, world):
    shards = [D.shard_indices(n, rank, world) for rank in range(world)]
    assert {len(s) for s in shards} == {n // world}
    union = torch.cat(shards)
    assert len(set(union.tolist())) == len(union) == n - n % world
    assert torch.equal(D.shard_indices(n, 1 % world, world), shards[1 % world])  # the same on every call


def test_shard_errors():
    with pytest.raises(ValueError, match="rank 3"):
        D.shard_indices(10, 3, 3)
    with pytest.raises(ValueError, match="only 2"):
        D.shard_indices(2, 0, 3)


def test_dataset_shard_keeps_test_and_observed():
    data = D.load_movielens(WHEEL, test_negatives=3)
    shards = [data.shard(rank, 2) for rank in range(2)]
    pairs = [set(map(tuple, s.train.x.tolist())) for s in shards]
    assert len(pairs[0]) == len(pairs[1]) == 3 and not pairs[0] & pairs[1]
    for s in shards:
        assert torch.equal(s.test.x, data.test.x) and torch.equal(s.observed, data.observed)
    images = D.load_fashion_mnist(FMNIST)
    a, b = images.shard(0, 2), images.shard(1, 2)
    assert len(a.train) == len(b.train) == 3 and a.test is images.test
    assert sorted(a.train.y.tolist() + b.train.y.tolist()) == sorted(images.train.y.tolist())


def test_batches_cover_each_sample_once():
    split = D.Split(torch.arange(10), torch.arange(10) * 2)
    seen = [x for x, y in split.batches(3, torch.Generator().manual_seed(0)) if torch.equal(y, x * 2)]
    assert sorted(torch.cat(seen).tolist()) == list(range(10)) and [len(s) for s in seen] == [3, 3, 3, 1]
    assert [len(x) for x, _ in split.batches(3, drop_last=True)] == [3, 3, 3]
    assert torch.cat([x for x, _ in split.batches(4)]).tolist() == list(range(10))
    with pytest.raises(ValueError, match="targets"):
        D.Split(torch.zeros(3), torch.zeros(4))


# ------------------------------------------------------------------------------ the command
def test_cli_reports_missing_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(D.CACHE_ENV, str(tmp_path))
    assert cli_main(["data", "--no-install", "movielens-100k"]) == 1
    out = capsys.readouterr().out
    assert f"cache: {tmp_path}" in out and "movielens-100k: NOT AVAILABLE" in out
    assert cli_main(["data", "no-such-data"]) == 2
    assert "unknown dataset 'no-such-data'" in capsys.readouterr().err


def test_load_unknown_name():
    with pytest.raises(ValueError, match="known: fashion-mnist"):
        D.load("mnist")


# ------------------------------------------------------------------------------ the real datasets
def _real(check) -> None:
    try:
        check()
    except D.DataUnavailable as error:
        pytest.skip(f"real data absent (run `gradpress data`): {error}")


def test_real_fashion_mnist():
    _real(lambda: D.fetch_fashion_mnist(install=False))  # checks the sha256 of the decompressed files
    data = D.load("fashion-mnist")
    assert data.train.x.shape == (60000, 1, 28, 28) and data.test.x.shape == (10000, 1, 28, 28)
    assert torch.bincount(data.train.y).tolist() == [6000] * 10
    assert torch.bincount(data.test.y).tolist() == [1000] * 10
    raw = D.load_fashion_mnist(normalize=False)
    assert abs(float(data.train.x.double().mean())) <= normalization_error(raw.train.x)


def test_real_movielens():
    _real(lambda: D.fetch_movielens(install=False))  # checks the sha256 of ml-100k.inter
    inter = D.parse_inter(_read_member(D.recbole_wheel()).decode())
    assert len(inter.users) == 100_000 and set(np.unique(inter.ratings)) == {1, 2, 3, 4, 5}
    data = D.load("movielens-100k")
    assert (data.num_users, data.num_items) == (943, 1682)
    assert len(data.train) == 100_000 - 943 and data.test.x.shape == (943, 100, 2)
    assert not data.observed[data.test.x[:, 0, 0], data.test.x[:, 0, 1]].any()  # held out: not in training
    negatives = data.test.x[:, 1:]
    all_seen = data.observed.clone()
    all_seen[data.test.x[:, 0, 0], data.test.x[:, 0, 1]] = True
    assert not all_seen[negatives[..., 0], negatives[..., 1]].any()
    assert torch.equal(data.test.x, D.load("movielens-100k").test.x)  # the split is fixed


def test_real_fortunes():
    _real(lambda: D.fetch_fortunes(install=False))
    data = D.load("fortunes")
    assert len(data.vocab) == 10_000 and data.vocab[:2] == ("<unk>", "<eos>")
    assert data.train.x.shape[1] == 35 and data.train.y.numel() > 300_000 > data.test.y.numel() > 20_000
    assert int(data.train.x.max()) < 10_000
    train_entries = [e for e in D.read_fortunes() if not D.is_test_entry(e)]
    assert 0.85 < len(train_entries) / len(D.read_fortunes()) < 0.95
