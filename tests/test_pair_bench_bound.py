"""The real-pair benchmark's bandwidth bound (``benchmarks/pair_bench.py``): the run-wide bound is the
best read of the run, so a run that starts in a slow minute of a VM whose bandwidth swings is not
judged against it, and every bound derived from the bandwidth follows it."""

from __future__ import annotations

from specd.benchmarks.pair_bench import _raise_bound


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
