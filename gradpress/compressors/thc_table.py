"""THC's optimal lookup table T_{b,g,p} (THC paper, Section 5.2 and Appendix B).

After the randomized Hadamard transform and truncation, THC quantizes coordinates distributed like a
standard normal truncated to [−t_p, t_p], t_p = Φ⁻¹(1 − p/2), onto the grid ``−t_p + 2·t_p·i/g``,
i ∈ {0..g} (the *Granularity* constraint), and sends b-bit indices z into a table of 2^b grid points.
The table minimizes the expected squared error of unbiased stochastic quantization (Section 5.2's
optimization problem); WLOG ``0 = T(0) < T(1) < … < T(2^b − 1) = g`` (App. B).

Given the table, stochastic quantization between the two nearest table values is optimal (App. B,
citing [7]), so the objective splits over the gaps of the table: a ∈ [lo, hi] costs the variance of
rounding it to lo or hi, (a − lo)(hi − a), and

    error(T) = Σ_z  ∫_{x(T(z))}^{x(T(z+1))} (a − x(T(z))) · (x(T(z+1)) − a) · φ(a) da,

with x(i) the grid value of index i. Each gap's integral has a closed form in Φ and φ
(:func:`gap_costs`), so a candidate table costs 2^b − 1 lookups.

The paper's solver enumerates the candidate tables by stars and bars (App. B, Algorithm 4) and keeps
the best. Its symmetry reduction (for odd g) is stated in words as a *reflection* — "T(z) is in the
optimal table iff g − T(z) is" — while its displayed formula, T(z) = T(z + 2^{b−1}) − (g+1)/2, is a
translation that does not follow from φ(a) = φ(−a); its counts also drop two balls (the increasing
tables number C(g−1, 2^b−2), not C(g−3, 2^b−2), and its 100 947 for b = 4, g = 51 is C(23, 6), where
the reflection leaves C(25, 7) = 480 700 tables, evaluated here in about 0.1 s). We implement the
reflection, T(2^b − 1 − z) = g − T(z), for every g: it reproduces both tables the authors published
for b = 4, g = 30 — an even g, for which the text claims no symmetry and the translation is not even
defined, yet both tables are reflections of themselves — so it is what their solver did.

The reflection is a restriction, not a theorem: :func:`thc_table` with ``symmetric=False`` finds the
global optimum over all increasing tables (an exact shortest path over the gaps, since full
enumeration is out of reach: C(g−1, 2^b−2) ≈ 4.5·10^11 tables for b = 4, g = 51), and that optimum is
sometimes asymmetric and better — e.g. b = 4, g = 30, p = 1/32 gives error 0.013063 against the
published table's 0.013075 (it keeps the midpoint 15), p = 1/512 gives 0.022906 against 0.023513,
and g = 35, p = 1/32 gives 0.012177 against 0.012620.

Tables are cached in memory and in a JSON file, ``$GRADPRESS_CACHE/thc_tables.json`` (default
``~/.cache/gradpress``; an empty ``GRADPRESS_CACHE`` disables the file). A missing, unreadable or
corrupt cache is ignored and rewritten; writes go through a temporary file and an atomic rename, so
concurrent writers can lose each other's entries but never corrupt the file.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import TypeGuard

import numpy as np

MAX_CANDIDATES = 20_000_000
"""Largest number of symmetric candidates the enumeration takes on (b = 4, g = 51: 480 700)."""

_CHUNK = 1 << 16
_CACHE_FILE = "thc_tables.json"
_CACHE_VERSION = "v1"


def thc_table(bits: int, granularity: int, p: float, *, symmetric: bool = True) -> tuple[int, ...]:
    """The optimal lookup table ``T_{b,g,p}``: 2^b increasing integers from 0 to ``granularity``.

    Args:
        bits: b, bits per coordinate on the wire (1..8).
        granularity: g, the number of grid steps across [−t_p, t_p].
        p: the expected fraction of coordinates outside [−t_p, t_p], t_p = Φ⁻¹(1 − p/2), in (0, 1).
        symmetric: search the tables symmetric under T ↦ g − T as the paper's solver does (App. B; this
            reproduces the authors' published tables); False finds the global optimum, which is
            sometimes asymmetric and slightly better (see the module docstring).

    Example: ``thc_table(4, 30, 1/32) == (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)``.
    """
    bits, granularity, p = _check(bits, granularity, p, symmetric)
    return _table_cached(bits, granularity, p, bool(symmetric))


def gap_costs(granularity: int, p: float) -> np.ndarray:
    """``C[u, v]`` = ∫ (a − x_u)(x_v − a) φ(a) da over [x_u, x_v]: the expected squared error that
    unbiased stochastic quantization between grid points u < v adds (``inf`` where v ≤ u).

    With F0 = ∫φ, F1 = ∫aφ = φ(x_u) − φ(x_v) and F2 = ∫a²φ = F0 + x_u φ(x_u) − x_v φ(x_v), the integral
    is −F2 + (x_u + x_v)·F1 − x_u·x_v·F0. The truncated normal's normalization 1/(1 − p) is left out:
    it scales every table's error alike.
    """
    from scipy.stats import norm  # (on first use: a table read from the cache file needs no scipy)

    t = norm.isf(p / 2)
    x = -t + 2.0 * t * np.arange(granularity + 1) / granularity
    lo, hi = x[:, None], x[None, :]
    f0 = norm.cdf(hi) - norm.cdf(lo)
    f1 = norm.pdf(lo) - norm.pdf(hi)
    f2 = f0 + lo * norm.pdf(lo) - hi * norm.pdf(hi)
    costs = -f2 + (lo + hi) * f1 - lo * hi * f0
    costs[np.tril_indices(granularity + 1)] = np.inf
    return costs


def table_error(table: tuple[int, ...] | np.ndarray, granularity: int, p: float) -> float:
    """The objective of Section 5.2 (without the constant 1/(1 − p)) for one table."""
    t = np.asarray(table)
    return float(gap_costs(granularity, p)[t[:-1], t[1:]].sum())


# -- the solvers ------------------------------------------------------------------------------------
def _solve(bits: int, granularity: int, p: float, symmetric: bool) -> tuple[int, ...]:
    costs = gap_costs(granularity, p)
    if symmetric:
        return _best_symmetric(costs, bits, granularity)
    return _best_any(costs, bits, granularity)


def _best_symmetric(costs: np.ndarray, bits: int, granularity: int) -> tuple[int, ...]:
    """App. B: enumerate the first halves 0 = T(0) < … < T(2^{b−1} − 1) < g/2 (stars and bars over the
    gaps), complete each by reflection, and keep the table of least error (the first in lexicographic
    order on ties). Vectorized over candidates, in chunks."""
    half = 1 << (bits - 1)
    top = (granularity - 1) // 2  # the largest value below g/2
    firsts = _increasing_tuples(top, half - 1)
    best_error, best = np.inf, None
    for start in range(0, len(firsts), _CHUNK):
        chunk = firsts[start : start + _CHUNK]
        first = np.concatenate([np.zeros((len(chunk), 1), dtype=chunk.dtype), chunk], axis=1)
        tables = np.concatenate([first, granularity - first[:, ::-1]], axis=1)
        errors = costs[tables[:, :-1], tables[:, 1:]].sum(axis=1)
        i = int(np.argmin(errors))
        if errors[i] < best_error:
            best_error, best = errors[i], tables[i]
    assert best is not None
    return tuple(int(v) for v in best)


def _increasing_tuples(top: int, k: int) -> np.ndarray:
    """Every strictly increasing k-tuple from {1..top}, in lexicographic order, as rows of an array.

    This is the stars-and-bars set of App. B in another coordinate: the gaps between successive
    entries are the bins, each holding at least one ball. Built one column at a time with numpy
    (no Python loop over candidates).
    """
    rows = np.zeros((1, 0), dtype=np.int16)
    for column in range(k):
        last = rows[:, -1].astype(np.int64) if column else np.zeros(len(rows), dtype=np.int64)
        counts = (top - (k - column - 1)) - last  # choices for this column after each row
        parent = np.repeat(np.arange(len(rows)), counts)
        offsets = np.arange(len(parent)) - np.repeat(np.cumsum(counts) - counts, counts)
        values = (last[parent] + 1 + offsets).astype(np.int16)
        rows = np.concatenate([rows[parent], values[:, None]], axis=1)
    return rows


def _best_any(costs: np.ndarray, bits: int, granularity: int) -> tuple[int, ...]:
    """The global optimum over all increasing tables: the objective is a sum over gaps, so the best
    table is a shortest path from grid point 0 to g with exactly 2^b − 1 edges (dynamic programming,
    O(2^b · g²)). Of an optimum and its mirror image (equal error), the lexicographically smaller."""
    n = 1 << bits
    best = np.full(granularity + 1, np.inf)
    best[0] = 0.0
    choices = []
    for _ in range(n - 1):
        total = best[:, None] + costs
        choices.append(np.argmin(total, axis=0))
        best = total.min(axis=0)
    table = [granularity]
    for choice in reversed(choices):
        table.append(int(choice[table[-1]]))
    table = table[::-1]
    mirror = [granularity - v for v in reversed(table)]
    found, mirrored = (costs[np.array(t[:-1]), np.array(t[1:])].sum() for t in (table, mirror))
    if math.isclose(found, mirrored, rel_tol=1e-12) and mirror < table:
        table = mirror
    return tuple(table)


# -- validation ------------------------------------------------------------------------------------
def _check(bits: object, granularity: object, p: object, symmetric: bool) -> tuple[int, int, float]:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"thc_table: bits must be an integer in 1..8, got {bits!r}")
    if isinstance(granularity, bool) or not isinstance(granularity, (int, np.integer)):
        raise ValueError(f"thc_table: granularity must be an integer, got {granularity!r}")
    try:
        p = float(p)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"thc_table: p must be a number in (0, 1), got {p!r}") from None
    if not 0.0 < p < 1.0:
        raise ValueError(f"thc_table: p must be in (0, 1), got {p}")
    bits, granularity = int(bits), int(granularity)
    n = 1 << bits
    if granularity < n - 1:
        raise ValueError(
            f"thc_table: a table of {n} strictly increasing integers from 0 to g needs g >= {n - 1}, "
            f"got g = {granularity}"
        )
    if symmetric:
        candidates = math.comb((granularity - 1) // 2, n // 2 - 1)
        if candidates > MAX_CANDIDATES:
            raise ValueError(
                f"thc_table: bits={bits}, granularity={granularity} has {candidates:.3g} symmetric "
                f"candidates (more than {MAX_CANDIDATES:.3g}); use symmetric=False, which does not enumerate"
            )
    return bits, granularity, p


# -- caching ---------------------------------------------------------------------------------------
@functools.cache
def _table_cached(bits: int, granularity: int, p: float, symmetric: bool) -> tuple[int, ...]:
    key = f"{_CACHE_VERSION} bits={bits} g={granularity} p={p!r} symmetric={int(symmetric)}"
    path = _cache_path()
    if path is not None:
        stored = _read_cache(path).get(key)
        if _is_table(stored, bits, granularity):
            return tuple(stored)
    table = _solve(bits, granularity, p, symmetric)
    if path is not None:
        _write_cache(path, key, table)
    return table


def _cache_path() -> Path | None:
    root = os.environ.get("GRADPRESS_CACHE")
    if root is None:
        root = str(Path.home() / ".cache" / "gradpress")
    return Path(root) / _CACHE_FILE if root else None


def _read_cache(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _is_table(stored: object, bits: int, granularity: int) -> TypeGuard[list[int]]:
    return (
        isinstance(stored, list)
        and len(stored) == 1 << bits
        and all(isinstance(v, int) and not isinstance(v, bool) for v in stored)
        and stored[0] == 0
        and stored[-1] == granularity
        and all(a < b for a, b in itertools.pairwise(stored))
    )


def _write_cache(path: Path, key: str, table: tuple[int, ...]) -> None:
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = list(table)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, suffix=".tmp", delete=False, encoding="utf-8"
        ) as f:
            temporary = f.name
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
        warnings.warn(f"thc_table: cannot write the table cache {path}: {error}", RuntimeWarning,
                      stacklevel=3)
