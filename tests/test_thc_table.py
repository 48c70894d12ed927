"""THC's optimal lookup table (THC paper, Section 5.2, App. B)."""
from __future__ import annotations

import importlib
import itertools
import json
import threading

import numpy as np
import pytest
from scipy import integrate
from scipy.stats import norm

import gradpress
from gradpress.compressors.thc_table import gap_costs, table_error, thc_table

#: the module (gradpress.thc_table is the function)
solver = importlib.import_module("gradpress.compressors.thc_table")

PUBLISHED = {  # the authors' tables (shared/seeds/README.md)
    (4, 30, 1 / 32): (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30),
    (4, 30, 1 / 512): (0, 4, 7, 9, 11, 12, 13, 14, 16, 17, 18, 19, 21, 23, 26, 30),
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADPRESS_CACHE", str(tmp_path / "cache"))
    solver._table_cached.cache_clear()
    yield
    solver._table_cached.cache_clear()


@pytest.mark.parametrize(("args", "table"), PUBLISHED.items(), ids=str)
def test_published_tables(args, table):
    assert thc_table(*args) == table
    assert gradpress.thc_table(*args) == table


def _quad_costs(g: int, p: float) -> np.ndarray:
    """Gap costs by numerical integration, independent of the closed form."""
    t = norm.isf(p / 2)
    x = -t + 2 * t * np.arange(g + 1) / g
    costs = np.full((g + 1, g + 1), np.inf)
    for u, v in itertools.combinations(range(g + 1), 2):
        lo, hi = x[u], x[v]
        costs[u, v] = integrate.quad(
            lambda a, lo=lo, hi=hi: (a - lo) * (hi - a) * norm.pdf(a), lo, hi, epsabs=1e-14
        )[0]
    return costs


def _brute_force(bits: int, g: int, p: float, symmetric: bool) -> tuple[int, ...]:
    costs = _quad_costs(g, p)
    best, best_error = None, np.inf
    for inner in itertools.combinations(range(1, g), (1 << bits) - 2):
        table = (0, *inner, g)
        if symmetric and table != tuple(g - v for v in reversed(table)):
            continue
        error = sum(costs[a, b] for a, b in itertools.pairwise(table))
        if error < best_error - 1e-13:
            best, best_error = table, error
    assert best is not None
    return best


CASES = [(1, 4, 0.1), (2, 3, 0.2), (2, 7, 1 / 32), (2, 10, 0.05), (3, 8, 1 / 32), (3, 11, 0.01), (3, 14, 0.3)]


@pytest.mark.parametrize(("bits", "g", "p"), CASES, ids=str)
@pytest.mark.parametrize("symmetric", [True, False])
def test_matches_brute_force(bits, g, p, symmetric):
    assert thc_table(bits, g, p, symmetric=symmetric) == _brute_force(bits, g, p, symmetric)


def test_closed_form_gap_costs_match_quadrature():
    np.testing.assert_allclose(gap_costs(12, 1 / 32), _quad_costs(12, 1 / 32), rtol=1e-9, atol=1e-15)


def test_symmetric_tables_are_symmetric_and_never_beat_the_global_optimum():
    for g in (16, 23, 30, 35, 51):
        sym, free = thc_table(4, g, 1 / 32), thc_table(4, g, 1 / 32, symmetric=False)
        assert sym == tuple(g - v for v in reversed(sym))
        assert table_error(free, g, 1 / 32) <= table_error(sym, g, 1 / 32) + 1e-15
    # the published table is not the global optimum: the best table keeps the midpoint 15 (value 0)
    free = thc_table(4, 30, 1 / 32, symmetric=False)
    assert 15 in free and table_error(free, 30, 1 / 32) < table_error(PUBLISHED[(4, 30, 1 / 32)], 30, 1 / 32)


def test_granularity_2b_minus_1_is_the_uniform_table():
    assert thc_table(4, 15, 0.1) == tuple(range(16))
    assert thc_table(4, 15, 0.1, symmetric=False) == tuple(range(16))


def test_large_granularity_is_practical():
    table = thc_table(4, 51, 1 / 32)
    assert len(table) == 16 and table[0] == 0 and table[-1] == 51


@pytest.mark.parametrize(
    "args",
    [
        (0, 30, 0.1), (9, 600, 0.1), (2.5, 30, 0.1), (True, 30, 0.1), (4, 14, 0.1), (4, 15.0, 0.1),
        (4, 30, 0.0), (4, 30, 1.0), (4, 30, -0.5), (4, 30, "x"), (4, 30, float("nan")),
    ],
    ids=str,
)
def test_bad_arguments_raise(args):
    with pytest.raises(ValueError, match="thc_table"):
        thc_table(*args)


def test_too_many_candidates_points_to_the_exact_solver():
    with pytest.raises(ValueError, match="symmetric=False"):
        thc_table(6, 201, 0.1)
    assert len(thc_table(6, 201, 0.1, symmetric=False)) == 64


# -- the disk cache -------------------------------------------------------------------------------
def _cache_file(tmp_path):
    return tmp_path / "cache" / "thc_tables.json"


def test_results_are_written_to_and_read_from_the_disk_cache(tmp_path):
    table = thc_table(3, 9, 0.1)
    data = json.loads(_cache_file(tmp_path).read_text())
    assert list(table) in data.values()
    # a (valid) entry planted in the file is what a fresh process would get
    (key,) = data
    planted = [0, 1, 2, 4, 5, 7, 8, 9]
    _cache_file(tmp_path).write_text(json.dumps({key: planted}))
    solver._table_cached.cache_clear()
    assert thc_table(3, 9, 0.1) == tuple(planted)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "", '{"k": 1}'])
def test_corrupt_cache_is_ignored_and_rewritten(tmp_path, content):
    _cache_file(tmp_path).parent.mkdir(parents=True)
    _cache_file(tmp_path).write_text(content)
    assert thc_table(2, 7, 1 / 32) == _brute_force(2, 7, 1 / 32, True)
    assert list(thc_table(2, 7, 1 / 32)) in json.loads(_cache_file(tmp_path).read_text()).values()


def test_invalid_cached_entry_is_recomputed(tmp_path):
    thc_table(2, 7, 1 / 32)
    (key,) = json.loads(_cache_file(tmp_path).read_text())
    _cache_file(tmp_path).write_text(json.dumps({key: [0, 5, 3, 7]}))  # not increasing
    solver._table_cached.cache_clear()
    assert thc_table(2, 7, 1 / 32) == _brute_force(2, 7, 1 / 32, True)


def test_unwritable_cache_warns_and_still_answers(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("GRADPRESS_CACHE", str(blocker))
    with pytest.warns(RuntimeWarning, match="cannot write"):
        assert thc_table(2, 7, 1 / 32) == _brute_force(2, 7, 1 / 32, True)


def test_empty_cache_variable_disables_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADPRESS_CACHE", "")
    monkeypatch.chdir(tmp_path)
    thc_table(2, 7, 1 / 32)
    assert not any(tmp_path.rglob("*.json"))


def test_concurrent_writers_leave_valid_json(tmp_path):
    path = _cache_file(tmp_path)

    def write(worker: int) -> None:
        for i in range(20):
            solver._write_cache(path, f"key {worker} {i}", (0, worker, i + 100))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    data = json.loads(path.read_text())
    assert data and all(isinstance(v, list) for v in data.values())
    assert not list(path.parent.glob("*.tmp"))
