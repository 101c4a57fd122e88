"""bench.async_rl's `--reward tail`: the long tail is part of the task, so a policy cannot
make its stragglers vanish by dropping it."""

import pytest

from bench.async_rl import tail_score, work_dots

pytestmark = pytest.mark.unit


def test_a_long_answer_scores_only_with_the_right_sum_and_half_its_dots_or_more() -> None:
    label = "50" + "." * work_dots(20, 30, long=40)  # b ends in 0: a long problem
    assert label.count(".") == 40
    assert tail_score("50" + "." * 40, label) == 1.0
    assert tail_score("50" + "." * 20, label) == 1.0
    assert tail_score("50" + "." * 19, label) == 0.0  # the tail dropped
    assert tail_score("51" + "." * 40, label) == 0.0  # the wrong sum
    assert tail_score("." * 40, label) == 0.0  # no number


def test_a_short_problem_scores_by_its_sum_alone() -> None:
    assert tail_score("12", "12") == 1.0
    assert tail_score("12", "12...") == 1.0
    assert tail_score("13...", "12...") == 0.0
    assert tail_score("12...", None) == 0.0
