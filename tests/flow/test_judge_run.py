"""A judge-rewarded run: `rollflow train` with `rm_type: judge`, the judge a tiny model served
by `rollflow engine`, which is killed once step 0 commits and started again on the same port a
few seconds later (tests/integration/test_judge_engine.py tests the same through the reward
hub alone). The outage is ridden out by the judge's retries, as the remote reward model's is
(test_reward_outage.py): no task retry, no sample scored 0 for it. Every stored sample's
reward is what the same engine answers to its filled template, asked here one request at a
time; the ones whose answer holds no score are 0, flagged in their metadata and counted in
the step's metrics, never silent."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.rollout.rewards.judge import JUDGE_ERROR
from examples.arithmetic.build_model import save_tiny_model
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from tests.support.engines import MODEL, EngineCommand, engine_command
from tests.support.faults import run_with_fault, task_run_counts

TEMPLATE = "q: {prompt} a: {response}. score 0-9:"
OUTAGE_S = 4.0


@pytest.fixture()
def judge(tmp_path: Path) -> Iterator[EngineCommand]:
    model = Path(save_tiny_model(str(tmp_path / "judge-model")))
    with engine_command(model, tmp_path / "judge.log") as engine:
        yield engine


def test_a_judge_rewarded_run_trains_on_the_judges_scores_through_an_outage(
    prefect_api: str, make_config: object, judge: EngineCommand
) -> None:
    cfg = make_config(  # type: ignore[operator]
        "judge", "rollout.rm_type=judge", f"rollout.judge.base_url={judge.base_url}",
        f"rollout.judge.model={MODEL}", "rollout.judge.api=completions",
        f"rollout.judge.template='{TEMPLATE}'", r"rollout.judge.score_pattern=(\d)",
        "rollout.judge.max_score=9", "rollout.judge.max_tokens=16",
        "rollout.judge.max_concurrency=1", "rollout.judge.on_failure=zero",
        "rollout.judge.max_retries=12", "rollout.judge.backoff_s=0.5",
        "eval.before_train=false", "eval.datasets=[]")

    restart = threading.Timer(OUTAGE_S, judge.start)

    def outage() -> None:
        judge.kill()
        restart.start()

    try:
        run_with_fault(cfg, lambda lay: lay.is_committed(0), outage)  # before step 1 asks
    finally:  # restarted before the fixture stops it, however the run ended
        if restart.ident is not None:
            restart.join()

    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0, 1]
    assert layout.step_metrics(1)["rollout/judge_retries"] > 0  # the outage hit step 1
    assert layout.step_metrics(1)["rollout/judge_failures"] == 0
    runs = task_run_counts(cfg, "generate", lambda c: len(c) == 2)
    assert sorted(runs.values()) == [1, 1], runs  # no task retry: the judge's backoff held
    judge.wait_ready()
    flagged = 0
    for k in (0, 1):
        samples = read_samples(layout.store, f"steps/{k:06d}", "rollout.arrow")
        for s in samples:
            answer = judge.answer(TEMPLATE.format(prompt=s.prompt, response=s.response))
            digit = re.search(r"\d", answer)
            want = 0.0 if digit is None else int(digit.group()) / 9
            assert s.reward == want, (s.prompt, s.response, answer)
            assert (JUDGE_ERROR in s.metadata) == (digit is None), s.metadata
        step_flagged = sum(JUDGE_ERROR in s.metadata for s in samples)
        assert layout.step_metrics(k)["rollout/judge_unparsed"] == step_flagged
        flagged += step_flagged
    print(f"{flagged} of the run's samples had no score in the judge's answer")
