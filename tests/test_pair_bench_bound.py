"""The real-pair benchmark's bandwidth bound (``benchmarks/pair_bench.py``): the run-wide bound is the
best read of the run, so a run that starts in a slow minute of a VM whose bandwidth swings is not
judged against it, and every bound derived from the bandwidth follows it; short target-only rounds
count only where the readings around them agree (a round that straddled a swing says nothing)."""

from __future__ import annotations

from specd.benchmarks.pair_bench import _raise_bound, bound_round, summarize_bound_rounds


def _bound() -> dict:
    return {
        "bandwidth_gb_s": 36.0,
        "bandwidth_start_gb_s": 36.0,
        "specd_bf16_bytes_per_token": 3_000_000_000,
        "specd_bf16_bound_tokens_per_second": 12.0,
        "q4_k_m_bytes_per_token": 1_000_000_000,
        "q4_k_m_bound_tokens_per_second": 36.0,
        "specd_int8_bytes_per_token": 1_500_000_000,
        "specd_int8_bound_tokens_per_second": 24.0,
    }


def test_a_higher_reading_raises_every_bound() -> None:
    bound = _bound()
    _raise_bound(bound, 72.0)
    assert bound["bandwidth_gb_s"] == 72.0
    assert bound["bandwidth_start_gb_s"] == 36.0
    assert bound["specd_bf16_bound_tokens_per_second"] == 24.0
    assert bound["q4_k_m_bound_tokens_per_second"] == 72.0
    assert bound["specd_int8_bound_tokens_per_second"] == 48.0


def test_a_lower_reading_changes_nothing() -> None:
    bound = _bound()
    _raise_bound(bound, 30.0)
    assert bound == _bound()


def test_a_round_is_judged_against_the_faster_reading_and_steady_only_where_they_agree() -> None:
    r = bound_round(60.0, 57.0, 18.0, 3_000_000_000)  # 54 GB/s of weights
    assert r["share_of_bound"] == 0.9 and r["steady"]
    swing = bound_round(34.0, 60.0, 14.0, 3_000_000_000)
    assert swing["share_of_bound"] == 0.7 and not swing["steady"]
    assert bound_round(60.0, 53.9, 18.0, 3_000_000_000)["steady"] is False  # 10.2% apart
    assert bound_round(60.0, 54.1, 18.0, 3_000_000_000)["steady"] is True


def test_the_summary_keeps_steady_rounds_and_splits_off_the_fast_minutes() -> None:
    b = 3_000_000_000
    rounds = [
        bound_round(60.0, 60.0, 17.0, b),  # fast, 0.85
        bound_round(62.0, 61.0, 18.6, b),  # fast, 0.9
        bound_round(34.0, 34.0, 10.6, b),  # slow, 0.935
        bound_round(34.0, 62.0, 12.0, b),  # a swing: left out
    ]
    summary = summarize_bound_rounds(rounds, best_gb_s=62.0)
    assert summary["rounds"] == 4
    assert summary["steady"] == {"rounds": 3, "median": 0.9, "min": 0.85, "max": 0.935}
    assert summary["steady_fast"] == {"rounds": 2, "median": 0.875, "min": 0.85, "max": 0.9}
    empty = summarize_bound_rounds([rounds[-1]], best_gb_s=62.0)
    assert empty["steady"]["rounds"] == 0 and empty["steady"]["median"] is None
