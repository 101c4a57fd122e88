"""Two rollout steps under real Prefect and real Ray, with the mock engine and trainer."""

from __future__ import annotations

import os
import uuid

import pytest
import ray

from engines.cluster.registry import get_run_actor
from flows.bookkeeping.reporting import artifact_key
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from tests.support.configs import arithmetic_config
from tests.support.prefect_ui import settled_task_runs

STEP_FILES = ["prompts.arrow", "rollout.arrow", "train.arrow", "metrics.json", "COMMITTED"]
TASKS = ["sample_prompts", "generate", "filter", "reward", "train", "broadcast_weights", "commit"]


@pytest.fixture
def mock_config(prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path):
    def make(run_name: str | None = None, overrides: list[str] | None = None):
        return arithmetic_config(
            run_name=run_name or f"flow-{uuid.uuid4().hex[:8]}", runs_root=str(tmp_path / "runs"),
            data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
            overrides=overrides,
        )
    return make


def actor(cfg, role):
    return get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, role)


def read_artifacts(key):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def read_flow_runs(names):
    """The flow runs named `names`, and each one's task run names once the server has
    recorded them all (`settled_task_runs`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names)))
    api = str(PREFECT_API_URL.value())
    tasks = {r.id: sorted({t["name"] for t in settled_task_runs(api, str(r.id))}) for r in runs}
    return runs, tasks


def test_two_rollout_steps_with_mock_engines(mock_config):
    from flows.train import train

    cfg = mock_config(overrides=["cluster.keep_actors=true"])
    result = train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert result["resumed_at"] == 0
    assert layout.committed_steps() == [0, 1]
    per_step = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    for k in (0, 1):
        names = layout.store.list(f"steps/{k:06d}")
        assert all(f in names for f in STEP_FILES), names
        trained = read_samples(layout.store, f"steps/{k:06d}", "train.arrow")
        assert [s.index for s in trained] == list(range(k * per_step, (k + 1) * per_step))
        sizes = {g: sum(s.group_index == g for s in trained) for g in {s.group_index for s in trained}}
        assert set(sizes.values()) == {cfg.rollout.n_samples_per_prompt}
        assert all(s.reward in (0.0, 1.0) and s.response_length > 0 for s in trained)
        metrics = layout.step_metrics(k)
        assert metrics["rollout_id"] == k and "reward/mean" in metrics and "time/generate" in metrics
    state = layout.store.read_json("datasource", "000001.json")
    assert state["sample_index"] == 2 * per_step
    assert os.path.exists(os.path.join(layout.uri, "config.yaml"))

    assert ray.get(actor(cfg, "trainer").version.remote()) == 2
    assert ray.get(actor(cfg, "engine-0").weight_version.remote()) == 2
    assert ray.get(actor(cfg, "trainer").trained_indices.remote()) == list(range(2 * per_step))

    run = cfg.storage.run_name
    names = [f"train-{run}", f"{run}/rollout-0", f"{run}/rollout-1", f"{run}/rollout-2"]
    mine, tasks = read_flow_runs(names)
    by_name = {r.name: r for r in mine}
    assert set(by_name) == set(names[:3])  # one flow run per step, none created past the last
    assert all(r.state.is_completed() for r in mine)
    labels = {f"run:{run}", "algo:grpo", "engine:mock", "train:mock"}
    assert all(labels <= set(r.tags) for r in mine)
    train_run = by_name[f"train-{run}"]
    for k in (0, 1):  # children of the train run, each with its step's tasks (no random suffix)
        step = by_name[f"{run}/rollout-{k}"]
        assert step.parent_task_run_id is not None
        assert tasks[step.id] == sorted(f"rollout-{k}/{name}" for name in TASKS)
    assert tasks[train_run.id] == ["rollout_step-0", "rollout_step-1"]  # the steps' stand-ins
    assert layout.store.read_json("steps/000001", "generate.progress.json") == {
        "kept": cfg.rollout.rollout_batch_size, "target": cfg.rollout.rollout_batch_size}
    progress = read_artifacts(artifact_key(cfg.storage.run_name, "generation"))
    assert progress and all(a.type == "progress" for a in progress)
    assert max(float(a.data) for a in progress) == 100.0


def test_actors_are_released_after_a_successful_run(mock_config):
    from flows.train import train

    cfg = mock_config()
    train(cfg)
    with pytest.raises(ValueError):
        actor(cfg, "trainer")


def test_rerun_continues_without_redoing_committed_steps(mock_config):
    from flows.train import train

    cfg = mock_config(overrides=["cluster.keep_actors=true"])
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    step0 = os.path.join(layout.uri, "steps/000000/rollout.arrow")
    mtime = os.stat(step0).st_mtime_ns

    longer = mock_config(cfg.storage.run_name, ["rollout.num_rollout=3", "cluster.keep_actors=true"])
    result = train(longer)
    assert result["resumed_at"] == 2
    assert layout.committed_steps() == [0, 1, 2]
    assert os.stat(step0).st_mtime_ns == mtime
    per_step = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    assert ray.get(actor(cfg, "trainer").trained_indices.remote()) == list(range(3 * per_step))


def test_trainer_rebuilt_from_checkpoint_and_replay(mock_config):
    from engines.cluster.actors import kill_run_actors
    from flows.train import train

    cfg = mock_config(overrides=["train.save_interval=1", "cluster.keep_actors=true"])
    train(cfg)
    assert kill_run_actors(cfg) == 3  # rollout, trainer, engine-0
    longer = mock_config(cfg.storage.run_name, [
        "rollout.num_rollout=3", "train.save_interval=1", "cluster.keep_actors=true"])
    result = train(longer)
    assert result["restored"]["rebuilt"] is True
    # LATEST points at step 1, so nothing needs replaying: weights come from the checkpoint.
    assert result["restored"]["replayed"] == []
    per_step = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    assert ray.get(actor(cfg, "trainer").trained_indices.remote()) == list(range(2 * per_step, 3 * per_step))



def test_a_finished_rerun_without_keep_actors_frees_the_kept_ones(mock_config):
    """keep_actors leaves the run's actors warm after it ends; rerunning the finished run
    with keep_actors off frees them, though it has no step to run."""
    from flows.train import ACTORS_KEPT, train

    kept = mock_config(overrides=["cluster.keep_actors=true"])
    run, namespace = kept.storage.run_name, kept.cluster.namespace
    train(kept)
    layout = RunLayout.open(kept.storage.uri, run)
    assert layout.store.exists(ACTORS_KEPT)
    assert get_run_actor(namespace, run, "trainer") is not None

    again = train(mock_config(run_name=run, overrides=["cluster.keep_actors=false"]))
    assert again["resumed_at"] == 2 and again["restored"] is None  # nothing was rerun
    with pytest.raises(ValueError, match="0 live 'trainer' actors"):
        get_run_actor(namespace, run, "trainer")
    assert not layout.store.exists(ACTORS_KEPT)


def test_rerun_of_a_finished_run_starts_no_actors(mock_config, arithmetic_data, monkeypatch):
    """All steps committed and the last version evaluated: a rerun returns the run's report
    without starting (and loading models into) any actor. With that evaluation gone, the
    rerun starts the actors again and evaluates."""
    import flows.train as train_module
    from flows.train import train

    test_set = f"eval.datasets=[{{name: test, path: {arithmetic_data['test']}, temperature: 0.0}}]"
    cfg = mock_config(overrides=[test_set])
    first = train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    evaluated = layout.evals()[2]

    def no_actors(*args, **kwargs):
        raise AssertionError("a finished run started its actors")

    with monkeypatch.context() as patched:
        patched.setattr(train_module, "start_run", no_actors)
        again = train(cfg)
    assert again["resumed_at"] == 2 and again["restored"] is None
    assert again["evals"] == first["evals"] and again["steps"] == first["steps"] == 2

    layout.store.delete("eval", "000002.json")
    third = train(cfg)
    assert third["restored"] is not None
    def scores(metrics):
        return {k: v for k, v in metrics.items() if not k.endswith("/seconds")}

    assert scores(layout.evals()[2]) == scores(evaluated)
