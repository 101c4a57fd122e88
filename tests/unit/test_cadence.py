"""Every N steps, or the last: the one rule behind checkpoints, weight pushes, evaluations
and curves."""

from __future__ import annotations

import pytest

from engines.cadence import every_n_steps_or_last


@pytest.mark.parametrize(("interval", "num_rollout", "steps"), [
    (1, 5, [0, 1, 2, 3, 4]),
    (2, 5, [1, 3, 4]),
    (3, 5, [2, 4]),
    (5, 5, [4]),
    (10, 5, [4]),
    (None, 5, [4]),  # no interval: the last step only
    (2, None, [1, 3]),  # no last step: the interval only
    (None, None, []),
])
def test_every_n_steps_and_the_last(interval, num_rollout, steps):
    assert [k for k in range(5) if every_n_steps_or_last(k, interval, num_rollout)] == steps


def test_a_step_past_the_last_counts_as_the_last():
    assert every_n_steps_or_last(7, 4, 5)
