"""bench/ci_cost.py: which kind of process a title marks, and the sums by kind (the sampler
itself: tests/integration/test_ci_cost_sampler.py)."""

from __future__ import annotations

from bench.ci_cost import Seen, better_title, cpu_by_kind, kind_of


def test_titles_name_their_kind() -> None:
    assert kind_of("ray::TrainActor") == "train actors"
    assert kind_of("ray::EngineActo") == "engine actors"  # /proc/<pid>/comm's 15 characters
    assert kind_of("ray::flow-1a2b:rollout@step0") == "rollout actors"
    assert kind_of("ray::Rank.push_weights") == "other Ray actors and tasks"
    assert kind_of("/x/.venv/bin/python -m flows.cli train --config "
                   "/tmp/pytest-of-root/pytest-3/popen-gw0/t0/kill.yaml") == "drivers (CLI)"
    assert kind_of("[pytest-xdist running] tests/unit/test_cli.py::test_x") == "pytest workers"
    assert kind_of("python -m uvicorn --factory prefect.server.api.server:create_app") \
        == "Prefect servers of the test harness"
    assert kind_of("python -c import os\nwhile os.getppid() == 5962: pass") \
        == "CPU burners of the load tests"
    assert kind_of("kdamond.0") == "other"


def test_an_actor_keeps_its_class_title() -> None:
    plain = "/x/.venv/bin/python -u /x/ray/_private/workers/default_worker.py --node-ip=1"
    assert better_title(plain, "ray::TrainActor") == "ray::TrainActor"
    assert better_title("ray::TrainActor", "ray::TrainActor.train_step") == "ray::TrainActor"
    assert cpu_by_kind([Seen("ray::TrainActor", 1.0, 4.0), Seen("ray::EngineActor", 0, 1.5),
                        Seen("ray::TrainActor", 0, 2.0), Seen("idle", 3.0, 3.0)]) == {
        "train actors": (5.0, 2), "engine actors": (1.5, 1)}
