"""bench.cpu_meter: the run's CPU seconds from cheap polls, interpolated between them."""

from __future__ import annotations

from bench.cpu_meter import CpuMeter


def test_reading_is_linear_between_polls_and_holds_after_the_last() -> None:
    series = [(10.0, 1.0), (12.0, 3.0), (14.0, 3.5)]
    assert CpuMeter._reading(series, 9.0) == 0.0
    assert CpuMeter._reading(series, 11.0) == 2.0
    assert CpuMeter._reading(series, 13.0) == 3.25
    assert CpuMeter._reading(series, 20.0) == 3.5


