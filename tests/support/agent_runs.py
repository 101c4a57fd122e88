"""What the agent and environment flow tests check of a run trained through the gateway
(test_openai_agent_flow, test_verifiers_env_flow, test_openenv_env_flow): its trained samples,
each sample's model turns, that every model turn is the engine's own, and that a kill -9 of
the driver after step 0 and the same command train the same samples."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.inference.engine_actor import EngineActor
from engines.rollout.agent_gateway import SEED_STRIDE
from flows.config.loader import dump_config
from flows.config.run import EngineConfig
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from storage.sample import Sample
from tests.support.configs import arithmetic_config
from tests.support.procs import start_driver, wait_until_committed


def environment_config(name: str, uri: str, model: str, tmp_path: Path, ray_address: str,
                       max_response_len: int) -> Any:
    """A 3-step run of the environment `uri` (its tasks the prompts, its reward the reward),
    2 groups a step, on the embedded engine and torch trainer."""
    return arithmetic_config(
        run_name=f"{name}-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
        data={"train": uri}, model_dir=model, ray_address=ray_address, backend="embedded",
        overrides=[f"rollout.environment={uri}", "rollout.rm_type=null",
                   f"rollout.max_response_len={max_response_len}",
                   "rollout.rollout_batch_size=2", "rollout.num_rollout=3",
                   "rollout.use_router=false", "cluster.keep_actors=true"],
    )


def trained(layout: RunLayout) -> list[Sample]:
    """Every committed step's trained samples, in step order."""
    return [s for k in layout.committed_steps()
            for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow")]


def train_three_steps(cfg: Any) -> tuple[RunLayout, list[Sample]]:
    """`cfg` trained in this process (its 3 steps all committed): its layout and the samples
    it trained, 2 groups a step."""
    from flows.train import train

    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0, 1, 2]
    samples = trained(layout)
    assert len(samples) == 3 * 2 * cfg.rollout.n_samples_per_prompt
    return layout, samples


def assert_every_step_without_drift(layout: RunLayout) -> None:
    """Each of the 3 steps: no call rewrote its history, every sample made a model call, and
    the trainer moved one version."""
    for k in range(3):
        metrics = layout.step_metrics(k)
        assert metrics["rollout/token_drift_turns"] == 0.0
        assert metrics["rollout/agent_turns_mean"] >= 1.0
        assert metrics["train/weight_version"] == k + 1


def model_turns(s: Sample) -> list[tuple[int, int]]:
    """[start, end) token positions of each run of loss-mask 1: the model's turns."""
    runs, start = [], None
    for i, m in enumerate([*s.loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((s.prompt_length + start, s.prompt_length + i))
            start = None
    return runs


def assert_step_0_turns_are_the_engines(layout: RunLayout, model: str, seed: int) -> None:
    """Each model turn of step 0 is what the untrained model gives for the tokens before it,
    with that turn's seed (regenerated on an engine of our own), with its log-probs; every
    other token has log-prob 0."""
    engine = EngineActor(EngineConfig(backend="embedded", model_path=model), 0, num_threads=1)
    try:
        for s in read_samples(layout.store, "steps/000000", "train.arrow"):
            logprobs = dict(enumerate(s.rollout_log_probs, start=s.prompt_length))
            for turn, (start, end) in enumerate(model_turns(s)):
                body = {"input_ids": s.tokens[:start], "return_logprob": True,
                        "sampling_params": {"temperature": 1.0, "max_new_tokens": end - start,
                                            "sampling_seed": seed + s.index + SEED_STRIDE * turn}}
                native = httpx.post(engine.url() + "/generate", json=body, timeout=60).json()
                assert native["output_ids"] == s.tokens[start:end]
                assert [x[0] for x in native["meta_info"]["output_token_logprobs"]] == \
                    pytest.approx([logprobs[i] for i in range(start, end)], abs=1e-4)
            masked = [lp for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if not m]
            assert masked == [0.0] * len(masked)
    finally:
        engine.shutdown()


def assert_kill_and_rerun_trains_the_same(cfg: Any, tmp_path: Path, prefect_api: str,
                                          samples: list[Sample]) -> None:
    """`rollflow train` of `cfg` killed -9 once step 0 committed, then the same command: it
    trains the same samples (index, tokens, loss masks, rewards) as `samples`, an
    uninterrupted run of 3 steps."""
    path = tmp_path / "kill.yaml"
    path.write_text(dump_config(cfg))
    killed = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    driver = start_driver(str(path), prefect_api)
    wait_until_committed(driver, killed, 0, timeout_s=240)
    driver.kill()
    driver.communicate(timeout=120)
    assert killed.committed_steps()[-1] < 2, "the driver finished before it was killed"
    rerun = start_driver(str(path), prefect_api)
    out, _ = rerun.communicate(timeout=400)
    assert rerun.returncode == 0, out
    assert killed.committed_steps() == [0, 1, 2]
    again = trained(killed)
    assert [(s.index, s.tokens, s.loss_mask, s.reward) for s in again] == [
        (s.index, s.tokens, s.loss_mask, s.reward) for s in samples]
