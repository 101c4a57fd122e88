"""The data-parallel train group on CPU: two gloo ranks of the tiny model train one step to
the same weights as one rank (DDP math, see `engines/train/distributed.py`), answer through
one handle like a single trainer, and a killed rank takes the whole group down, which the
next attach rebuilds at the run's weight version."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from engines.cluster.train_group import TrainGroup, TrainGroupError, get_or_create_group
from engines.train.train_actor import TrainActor
from engines.weights.sync import decode_named_tensors
from storage.batch_io import write_samples
from storage.run_layout import RunLayout, step_dir
from tests.support.fakes import ExportingBackend, RecordingEngine
from tests.support.samples import make_samples

NAMESPACE = "rollflow-tests"


@pytest.fixture
def torch_config(make_config):
    cfg = make_config("group", "train.lr=1e-3", "train.global_batch_size=4", backend="embedded")
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    for k in range(2):
        samples = make_samples(8, seed=k)
        for s in samples[4:]:  # one group of one reward: its step trains a lone stand-in, so
            s.reward = 1.0     # rank 1 has no sample of it and must still join the collectives
        write_samples(layout.store, samples, step_dir(k), "train.arrow")
    return cfg


def _rank(cfg, name: str, rank: int, world: int):
    return ray.remote(TrainActor).options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=0, num_cpus=0,
    ).remote(cfg, rank, world)


def _group(cfg, world: int = 2) -> tuple[TrainGroup, list[str]]:
    names = [f"{cfg.storage.run_name}:rank{i}" for i in range(world)]
    group = get_or_create_group(
        names, NAMESPACE, lambda rank, n: _rank(cfg, names[rank], rank, n))
    return group, names


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_gloo_ranks_match_one_rank_and_store_one_checkpoint(torch_config):
    cfg = torch_config
    single = ray.remote(TrainActor).options(num_cpus=0).remote(cfg)
    initial = ray.get(single.weights.remote())
    one = ray.get(single.train_step.remote(0))
    start = time.perf_counter()
    group, names = _group(cfg)
    created_s = time.perf_counter() - start
    try:
        two = ray.get(group.train_step.remote(0))
        assert ray.get(group.version.remote()) == 1
        w1, w2 = ray.get(single.weights.remote()), ray.get(group.weights.remote())
        w2_rank1 = ray.get(group.ranks[1].weights.remote())
        assert _max_diff(initial, w1) > 1e-4  # the step moved the weights
        assert _max_diff(w1, w2) < 1e-5
        assert _max_diff(w2, w2_rank1) == 0.0  # DDP keeps the ranks identical
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
        assert one["zero_gradient_samples"] == two["zero_gradient_samples"] == 3.0
        # every rank saves (one staging path, stored once: the ranks share a disk); rank 0
        # moves LATEST and answers
        uri = ray.get(group.save_checkpoint.remote(0))
        assert uri and RunLayout.open(cfg.storage.uri, cfg.storage.run_name).latest_checkpoint() == 0
    finally:
        group.kill()
        ray.kill(single)
    print(f"2-rank group created in {created_s:.1f}s")


def test_a_killed_rank_fails_the_call_and_the_group_is_rebuilt(torch_config):
    cfg = torch_config
    group, names = _group(cfg)
    try:
        ray.get(group.train_step.remote(0))
        ray.kill(group.ranks[1])
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(group.train_step.remote(1))
        assert isinstance(err.value.as_instanceof_cause(), TrainGroupError)
        assert not any(_exists(n) for n in names)  # survivors killed, names free
        rebuilt, _ = _group(cfg)
        restored = ray.get(rebuilt.ensure_version.remote(1))
        assert restored == {"rebuilt": True, "version": 1, "replayed": [0], "unrecorded": [0],
                            "inexact": []}
        trained = ray.get(rebuilt.train_step.remote(1))
        assert "loss" in trained
        # idempotent: the step is not trained again, and a retry records that training
        assert ray.get(rebuilt.train_step.remote(1)) == pytest.approx(trained, nan_ok=True)
        assert ray.get(rebuilt.version.remote()) == 2
    finally:
        _group_kill(names)


def _exists(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def _group_kill(names: list[str]) -> None:
    from engines.cluster.train_group import kill_group

    kill_group(names, NAMESPACE)


def test_a_collective_export_runs_on_every_rank(torch_config, tmp_path):
    """megatron's export gathers TP shards / PP stages from every rank: a group with
    `collective_export` calls `weights` and `push_weights` on all ranks, each rank other
    than 0 joins the export once and hands nothing back; rank 0 answers."""
    cfg = torch_config.model_copy(update={"train": torch_config.train.model_copy(
        update={"backend": "megatron", "weight_sync": "disk"})})

    @ray.remote(num_cpus=0)
    class Rank(TrainActor):
        def install(self) -> None:
            self.backend = ExportingBackend()

        def exports(self) -> int:
            return int(self.backend.exports)

    ranks = [Rank.remote(cfg, r, 2) for r in range(2)]
    ray.get([r.install.remote() for r in ranks])
    group = TrainGroup(ranks, ["r0", "r1"], NAMESPACE, collective_export=True)
    try:
        assert set(ray.get(group.weights.remote())) == {"w"}  # rank 0's state
        assert ray.get([r.exports.remote() for r in ranks]) == [1, 1]
        assert ray.get(ranks[1].push_weights.remote(["http://unused"])) == []
        assert ray.get(ranks[1].exports.remote()) == 2  # joined rank 0's export
        plain = TrainGroup(ranks, ["r0", "r1"], NAMESPACE)
        ray.get(plain.weights.remote())
        assert ray.get([r.exports.remote() for r in ranks]) == [2, 2]  # rank 0 only
    finally:
        for r in ranks:
            ray.kill(r)


def test_colocated_tensor_sync_pushes_from_every_rank(make_config):
    """`collective_push` (a colocated run with tensor sync) calls `push_weights` on every
    rank; with one rank per engine GPU each rank's entry reaches its TP rank (the ranks'
    exports are marked with their rank here; tests/integration/test_rank_weight_push.py has
    the layouts)."""
    cfg = make_config("push", "cluster.colocate=true", "cluster.rollout_num_gpus_per_engine=2")

    @ray.remote(num_cpus=0)
    class Rank(TrainActor):
        def install(self, fill: float) -> None:
            self.backend = ExportingBackend(fill=fill)

        def has_sender(self) -> bool:
            return self._sender is not None

    ranks = [Rank.remote(cfg, r, 2) for r in range(2)]
    engine = RecordingEngine()
    try:
        addr, port = ray.get(ranks[0].master_address.remote())
        ray.get([r.join_group.remote(addr, port) for r in ranks])
        ray.get([r.install.remote(float(i)) for i, r in enumerate(ranks)])
        group = TrainGroup(ranks, ["r0", "r1"], NAMESPACE, collective_push=True)
        assert ray.get(group.push_weights.remote([engine.url])) == [3]
        [update] = engine.tensor_updates
        markers = [decode_named_tensors(e)[0][1][0].item() for e in update["serialized_named_tensors"]]
        assert markers == [0.0, 1.0]
        assert "gather_s" in ray.get(group.push_timings.remote())
        assert ray.get([r.has_sender.remote() for r in ranks]) == [True, True]
        ray.get(group.close_weight_sender.remote())  # every rank's HTTP client and threads
        assert ray.get([r.has_sender.remote() for r in ranks]) == [False, False]
    finally:
        engine.close()
        for r in ranks:
            ray.kill(r)
