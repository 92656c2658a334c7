"""benchmarks/search_check.py's arithmetic: ranks with ties, Spearman's rho, the pick against the fastest measured
configuration, the jobs' groups and the table (the measuring itself is a benchmark, run by hand)."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
spec = importlib.util.spec_from_file_location("search_check", os.path.join(ROOT, "benchmarks", "search_check.py"))
sc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)


def test_ranks_average_ties():
    assert sc.ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert sc.ranks([5.0, 5.0, 5.0]) == [2.0, 2.0, 2.0]


def test_spearman_matches_the_textbook_formula_without_ties():
    """Without ties rho = 1 - 6 sum(d^2) / (n (n^2 - 1)), d the rank differences: an independent formula."""
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(3, 15)
        xs, ys = rng.sample(range(100), n), rng.sample(range(100), n)
        rx, ry = sc.ranks(xs), sc.ranks(ys)
        d2 = sum((a - b) ** 2 for a, b in zip(rx, ry))
        assert sc.spearman(xs, ys) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)), abs=1e-12)
    assert sc.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert sc.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_spearman_with_ties_is_pearson_of_average_ranks():
    # ys ranks: [1, 2, 3.5, 5, 3.5]; Pearson of [1..5] with them, worked by hand: cov 8, var 10 and 9.5
    assert sc.spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / (10 * 9.5) ** 0.5)
    assert sc.spearman([1, 1, 1], [1, 2, 3]) is None  # undefined, not a crash
    with pytest.raises(ValueError, match="same length"):
        sc.spearman([1, 2], [1, 2, 3])


def test_compare_and_table_name_the_pick_and_the_fastest():
    rows = [
        dict(name="anchor", predicted_s=3.0, measured=1.00),
        dict(name="a", predicted_s=2.0, measured=0.90),  # the pick (least predicted)
        dict(name="b", predicted_s=2.5, measured=0.85),  # the fastest measured
        dict(name="c", predicted_s=2.0, measured=0.95),  # ties the pick; the first one wins, as the search's sort
    ]
    got = sc.compare(rows)
    assert (got["pick"], got["fastest"]) == (1, 2)
    assert got["gap_pct"] == pytest.approx((0.90 / 0.85 - 1) * 100)
    assert got["rho"] == pytest.approx(sc.spearman([3.0, 2.0, 2.5, 2.0], [1.0, 0.9, 0.85, 0.95]))
    text = sc.table(rows)
    lines = text.splitlines()
    assert lines[2].startswith("| anchor | 3.000 s | 1.000 | 1.000 | 4 | 4 |")
    assert lines[3].startswith("| a * | 2.000 s | 0.667 | 0.900 | 1.5 | 2 |")
    assert lines[4].startswith("| b + | 2.500 s | 0.833 | 0.850 | 3 | 1 |")
    assert f"pick (a) +{got['gap_pct']:.1f}% vs the fastest measured (b)" in text
    assert got["runs_rho"] is None and "runs' rankings" not in text  # one run: nothing to compare


def test_runs_rho_compares_the_first_two_runs():
    runs = [[1.0, 1.0], [0.9, 0.97], [0.95, 0.93], [0.97, 0.9]]  # run 2 ranks the three rows backwards
    rows = [dict(name=f"r{i}", predicted_s=3.0 - i, measured=sum(m) / 2, measured_runs=m) for i, m in enumerate(runs)]
    got = sc.compare(rows)
    assert got["runs_rho"] == pytest.approx(sc.spearman([m[0] for m in runs], [m[1] for m in runs]))
    assert f"agree with each other at rho {got['runs_rho']:.2f}" in sc.table(rows)


def test_the_grid_has_twelve_distinct_configurations_the_anchor_first():
    configs = sc.grid(sc.FULL)
    assert len(configs) >= 12 and len({sc.name(c) for c in configs}) == len(configs)
    assert configs[0] == dict(reshard=None, prefetch=2, keep=None, budget=None)  # FSDP2's defaults


def test_job_groups_put_the_anchor_beside_at_most_k_minus_1_rows():
    assert sc.job_groups(12, 4) == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11]]
    assert sc.job_groups(5, 0) == [[1, 2, 3, 4]] == sc.job_groups(5, 1)
    assert sc.job_groups(1, 4) == [[]]
