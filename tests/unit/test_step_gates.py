"""The async-mode gates (tasks/step_gates.py) through `task.fn(...)`: what each waits for, and
that a failed upstream step releases it with an error instead of a hang."""

from __future__ import annotations

import threading

import pytest

from tasks import step_gates as gates
from tests.support.fakes import step_context

ASYNC = ("rollout.num_rollout=4", "rollout.mode=one_step", "rollout.max_staleness=0")


def later(action, delay_s: float = 0.1) -> threading.Timer:
    timer = threading.Timer(delay_s, action)
    timer.start()
    return timer


def test_generation_waits_for_the_commit_that_brings_its_weights(tmp_path):
    ctx = step_context(tmp_path, *ASYNC)
    assert gates.weights_ready_step(ctx.cfg, 0) == -1
    assert gates.wait_for_weights.fn(ctx.layout, ctx.cfg, 0) == 0.0  # initial weights
    assert gates.weights_ready_step(ctx.cfg, 2) == 1
    later(lambda: ctx.layout.mark_committed(1))
    assert gates.wait_for_weights.fn(ctx.layout, ctx.cfg, 2) > 0.05


def test_staleness_lets_generation_run_ahead(tmp_path):
    ctx = step_context(tmp_path, *ASYNC[:2], "rollout.max_staleness=1")
    assert [gates.weights_ready_step(ctx.cfg, k) for k in range(4)] == [-1, -1, 0, 1]


def test_training_waits_for_the_previous_commit(tmp_path):
    ctx = step_context(tmp_path, *ASYNC)
    assert gates.wait_for_previous_commit.fn(ctx.layout, 0) == 0.0
    ctx.layout.mark_committed(0)
    assert gates.wait_for_previous_commit.fn(ctx.layout, 1) < 0.05


def test_broadcast_waits_for_the_next_generation(tmp_path):
    ctx = step_context(tmp_path, *ASYNC[:2], "rollout.max_staleness=1")
    assert gates.wait_for_next_generate.fn(ctx.layout, ctx.cfg, 3) == 0.0  # the last step
    later(lambda: ctx.layout.save_task_record(2, "generate", {"uri": "u", "groups": 1}))
    assert gates.wait_for_next_generate.fn(ctx.layout, ctx.cfg, 1) > 0.05


def test_on_policy_broadcast_does_not_wait_for_a_generation_that_needs_its_weights(tmp_path):
    """max_staleness 0: generation k+1 waits for commit k, so broadcast k must not wait for
    generation k+1 (both would wait forever)."""
    ctx = step_context(tmp_path, *ASYNC)
    assert gates.weights_ready_step(ctx.cfg, 2) == 1
    assert gates.wait_for_next_generate.fn(ctx.layout, ctx.cfg, 1) == 0.0


def test_broadcast_does_not_wait_on_steps_that_push_no_weights(tmp_path):
    ctx = step_context(tmp_path, *ASYNC, "train.update_weights_interval=2")
    assert gates.wait_for_next_generate.fn(ctx.layout, ctx.cfg, 0) == 0.0


def test_a_failed_upstream_step_releases_the_gate(tmp_path):
    ctx = step_context(tmp_path, *ASYNC)
    later(lambda: ctx.layout.mark_failed(0, "RuntimeError('boom')"))
    with pytest.raises(gates.UpstreamStepFailed, match="step 0 failed"):
        gates.wait_for_previous_commit.fn(ctx.layout, 1)
    stale = step_context(tmp_path / "stale", *ASYNC[:2], "rollout.max_staleness=1")
    stale.layout.mark_failed(2, "RuntimeError('boom')")
    with pytest.raises(gates.UpstreamStepFailed, match="step 2 failed"):
        gates.wait_for_next_generate.fn(stale.layout, stale.cfg, 1)


def test_wait_until_gives_up_after_its_timeout(tmp_path):
    ctx = step_context(tmp_path)
    with pytest.raises(TimeoutError, match="waited"):
        gates.wait_until(ctx.layout, lambda: False, 0, "nothing", timeout_s=0.05)
