"""Token versions and staleness: spans from the engine become per-token versions, unknown
versions count as the oldest, and the step's staleness metrics match a count by hand."""

from __future__ import annotations

import pytest

from engines.rollout.staleness import staleness_metrics, trained_token_staleness
from storage.sample import UNKNOWN_VERSION, Sample, versions_from_spans


def answered(versions: list[int], mask: list[int], start: int | None = None) -> Sample:
    s = Sample(index=0, group_index=0, tokens=[9, 9] + [1] * len(versions))
    s.tokens, s.response_length = [9, 9] + [1] * len(versions), len(versions)
    s.loss_mask, s.rollout_log_probs = list(mask), [0.0] * len(versions)
    s.token_versions, s.weight_version = list(versions), max(versions)
    if start is not None:
        s.metadata["start_weight_version"] = start
    return s


def span(version: str, start: int, end: int) -> dict[str, object]:
    return {"version": version, "start": start, "end": end}


def test_sglang_weight_version_spans_give_each_token_its_version() -> None:
    assert versions_from_spans(None, 3, 5) == [5, 5, 5]
    assert versions_from_spans([span("2", 0, 3), span("4", 3, 5)], 5, 4) == [2, 2, 2, 4, 4]
    assert versions_from_spans([span("default", 0, 2), span("3", 2, 4), span("5", 4, 5)],
                               5, 5) == [0, 0, 3, 3, 5]


def test_append_response_records_versions_and_marks_unknown_ones() -> None:
    s = Sample(index=0, group_index=0, tokens=[7])
    s.append_response([1, 2], [-0.1, -0.2], "ab", [4, 5])
    s.append_response([3], [-0.3], "c")  # a custom generate function that did not say
    s.metadata["start_weight_version"], s.weight_version = 4, 5
    assert s.token_versions == [4, 5, UNKNOWN_VERSION]
    assert s.response_versions() == [4, 5, 4]
    s.token_versions = [5]  # does not line up with the response: all count as the oldest
    assert s.response_versions() == [4, 4, 4]


def test_staleness_counts_trained_tokens_only_by_hand() -> None:
    a = answered([3, 3, 4, 5], [1, 1, 1, 0], start=3)  # the version-5 token is a tool's
    b = answered([5, 5], [1, 1])
    assert trained_token_staleness([a, b], trained_version=5) == {2: 2, 1: 1, 0: 2}
    m = staleness_metrics([a, b], trained_version=5)
    assert m["rollout/staleness_mean"] == pytest.approx((2 * 2 + 1 * 1 + 0 * 2) / 5)
    assert m["rollout/staleness_max"] == 2.0
    assert (m["rollout/token_version_min"], m["rollout/token_version_max"]) == (3.0, 5.0)
    assert m["rollout/staleness_tokens_2"] == 2.0 and m["rollout/staleness_tokens_0"] == 2.0
    assert staleness_metrics([], trained_version=5) == {}
