"""bench/ci_cost.py: which kind of process a title marks, and the sums by kind (the sampler
itself: tests/integration/test_ci_cost_sampler.py)."""

from __future__ import annotations

from bench.ci_cost import (
    RUNNING,
    Seen,
    better_title,
    charge_to_tests,
    cpu_by_kind,
    kind_of,
    worker_spans,
    xdist_worker,
)


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


def test_cpu_goes_to_the_test_its_worker_was_running() -> None:
    timelines = {"gw0": worker_spans([("start", "a.py::one", 10.0), ("end", "a.py::one", 20.0),
                                    ("start", "a.py::two", 20.5), ("end", "a.py::two", 30.0)]),
                 "gw1": worker_spans([("start", "b.py::x", 12.0)])}
    charges = [(9.0, "gw0", 1.0),  # before gw0's first test: its collection
               (15.0, "gw0", 2.0), (20.2, "gw0", 0.5),  # one, then its teardown
               (25.0, "gw0", 3.0), (31.0, "gw0", 0.25),  # two, and after it ended
               (13.0, "gw1", 4.0), (14.0, RUNNING + "b.py::x ", 1.5),  # the worker itself
               (16.0, "gw9", 0.75)]  # a worker without a timeline
    assert charge_to_tests(charges, timelines) == {
        "b.py::x": 5.5, "a.py::two": 3.25, "a.py::one": 2.5, "(collection on gw0)": 1.0,
        "(collection on gw9)": 0.75}


def test_a_process_names_the_worker_it_was_started_under(tmp_path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "environ").write_bytes(b"HOME=/root\0PYTEST_XDIST_WORKER=gw2\0X=1\0")
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "environ").write_bytes(b"HOME=/root\0")
    assert xdist_worker(7, str(tmp_path)) == "gw2"
    assert xdist_worker(8, str(tmp_path)) is None
    assert xdist_worker(9, str(tmp_path)) is None  # gone
