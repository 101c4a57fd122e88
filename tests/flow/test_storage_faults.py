"""The object store failing mid-run (moto's server behind tests/support/s3_faults.py's proxy):
a store answering 503 SlowDown or dropping connections for a few seconds is ridden out by
botocore's retries (`storage.retries`) and the run goes on as if nothing happened; one that
stays down fails the step with an error naming the file and the store, keeps every committed
step, and the same command resumes the run once the store is back. Either way every step's
samples are those of an uninterrupted run."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from storage.config import StorageConfig
from storage.object_store import ObjectStore, StorageError, open_store
from storage.run_layout import RunLayout
from tests.support.faults import reference_run
from tests.support.prefect_ui import settled_task_runs
from tests.support.s3_faults import FaultyS3Proxy
from tests.support.server_faults import trained_samples


@pytest.fixture
def proxy(s3_server):
    with FaultyS3Proxy(s3_server.endpoint_url) as p:
        yield p


def proxied_store(s3_server, proxy: FaultyS3Proxy, root: str, **retries) -> ObjectStore:
    storage = StorageConfig(uri=root, endpoint_url=proxy.endpoint_url,
                            storage_options=dict(s3_server.storage_options),
                            retries=retries)
    # a client of its own (fsspec caches one per set of options)
    return open_store(root, storage.endpoint_url, skip_instance_cache=True,
                      **storage.store_options())


def test_store_rides_out_slowdown_and_dropped_connections(s3_server, proxy):
    root = s3_server.bucket(f"flaky-{uuid.uuid4().hex[:8]}") + "/runs"
    store = proxied_store(s3_server, proxy, root)
    proxy.fail("slowdown", requests=3)
    store.write_json({"v": 1}, "a", "x.json")
    assert proxy.failed["slowdown"] == 3
    proxy.fail("drop", requests=2)
    assert store.read_json("a", "x.json") == {"v": 1}
    assert proxy.failed["drop"] == 2
    proxy.fail("slowdown", seconds=2.0)
    started = time.monotonic()
    assert store.list("a") == ["x.json"]
    assert time.monotonic() - started >= 1.0 and proxy.failed["slowdown"] > 3
    # a store that answers nothing: botocore's read timeout, then a retry
    patient = proxied_store(s3_server, proxy, root, read_timeout_s=1.0)
    proxy.fail("stall", requests=1)
    assert patient.read_json("a", "x.json") == {"v": 1}
    assert proxy.failed["stall"] == 1


def test_store_down_for_good_names_the_file_and_the_store(s3_server, proxy):
    root = s3_server.bucket(f"down-{uuid.uuid4().hex[:8]}") + "/runs"
    store = proxied_store(s3_server, proxy, root, max_attempts=2)
    store.write_json({"v": 1}, "a", "x.json")
    for how in ("slowdown", "drop"):
        proxy.fail(how)
        before = proxy.failed[how]
        with pytest.raises(StorageError) as failed:
            store.read_json("a", "x.json")
        assert str(failed.value).startswith(
            f"{root}/a/x.json: read failed on s3 at {proxy.endpoint_url}: ")
        assert proxy.failed[how] - before >= 2  # botocore's attempts (s3fs may add its own)
        with pytest.raises(StorageError, match=f"{root}/a/y.json: write failed"):
            store.write_text("y", "a", "y.txt".replace("txt", "json"))
        proxy.heal()
        assert store.read_json("a", "x.json") == {"v": 1}
    assert not store.exists("a", "y.json")


# -- a run whose store fails mid-step ------------------------------------------------------
STEPS = ("rollout.num_rollout=3",)  # the fault fires in step 1


def retried_task_runs(run_name: str) -> list[str]:
    """The Prefect task runs of run `run_name` that ran more than once, once the server has
    recorded them all (`settled_task_runs`: a retry it has not recorded yet would pass)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(like_=run_name)))
    api = str(PREFECT_API_URL.value())
    task_runs = [t for r in flow_runs for t in settled_task_runs(api, str(r.id))]
    assert flow_runs and task_runs
    return [t["name"] for t in task_runs if t["run_count"] > 1]


@pytest.fixture
def s3_run(prefect_api, make_config, s3_server, proxy):
    """`s3_run(name, *overrides, faulty=False)`: a run config on a fresh bucket of moto's
    server, through the proxy if `faulty`."""
    root = s3_server.bucket(f"runs-{uuid.uuid4().hex[:8]}") + "/prefix"

    def make(name: str, *overrides: str, faulty: bool = False):
        cfg = make_config(name, *STEPS, *overrides, runs_root=root)
        cfg.storage.endpoint_url = proxy.endpoint_url if faulty else s3_server.endpoint_url
        cfg.storage.storage_options = dict(s3_server.storage_options)
        return cfg

    return make


def layout_of(cfg) -> RunLayout:
    return RunLayout.open(cfg.storage.uri, cfg.storage.run_name)


def direct(cfg, s3_server) -> RunLayout:
    """`cfg`'s run read from moto itself, not through the faulty proxy it writes through."""
    return RunLayout.open(cfg.storage.uri, cfg.storage.run_name, s3_server.endpoint_url,
                          dict(s3_server.storage_options))


def train_in_thread(cfg, fault_when, fault) -> tuple[dict, BaseException | None]:
    """Run the train flow in a thread; call `fault()` once `fault_when()` holds."""
    from flows.train import train

    result: dict = {}
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.update(train(cfg))
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    fired = False
    while thread.is_alive():
        if not fired and fault_when():
            fault()
            fired = True
        time.sleep(0.02)
    thread.join()
    assert fired, "the fault never fired"
    return result, (error[0] if error else None)


def test_store_down_for_seconds_mid_step_is_ridden_out(make_config, s3_run, s3_server, proxy,
                                                       fault_matrix):
    reference = reference_run(make_config, *STEPS)  # on local disk: the store changes no sample
    cfg = s3_run("slowdown", faulty=True)
    # read through moto directly: the test's own polling must not meet the fault
    watch = direct(cfg, s3_server)
    result, error = train_in_thread(
        cfg, lambda: watch.task_record(1, "sample_prompts") is not None,
        lambda: proxy.fail("slowdown", seconds=3.0))
    assert error is None, error
    assert result["resumed_at"] == 0
    assert proxy.failed["slowdown"] > 0, "no request met the outage"
    assert watch.committed_steps() == [0, 1, 2]
    expected, got = trained_samples(layout_of(reference)), trained_samples(watch)
    # botocore's retries alone rode it out: no task of the run ran twice
    retried = retried_task_runs(cfg.storage.run_name)
    assert retried == [], retried
    fault_matrix.add("S3 answers 503 SlowDown for 3 s mid-step", "S3 requests (botocore)",
                     f"requests retried with backoff ({proxy.failed['slowdown']} answered "
                     "503), no task retry, run completes", got == expected)
    assert got == expected


def test_store_down_for_good_fails_the_step_and_the_rerun_resumes(make_config, s3_run, s3_server,
                                                                  proxy, fault_matrix):
    from flows.bookkeeping.root_cause import summarize
    from flows.train import train

    reference = reference_run(make_config, *STEPS)
    cfg = s3_run("down", "storage.retries.max_attempts=2", faulty=True)
    watch = direct(cfg, s3_server)
    _, error = train_in_thread(
        cfg, lambda: watch.task_record(1, "sample_prompts") is not None,
        lambda: proxy.fail("slowdown"))
    assert error is not None, "the run went on with its store down"
    line = summarize(error)
    assert line.startswith(f"StorageError: {cfg.storage.uri}/{cfg.storage.run_name}/"), line
    assert f"failed on s3 at {proxy.endpoint_url}: " in line, line
    assert watch.committed_steps() == [0]
    step0 = {name: watch.store.fs.info(watch.store.path("steps/000000", name))["ETag"]
             for name in watch.store.list("steps/000000") if name != "tasks"}

    proxy.heal()
    result = train(cfg)  # the same command once the store is back
    assert result["resumed_at"] == 1
    assert watch.committed_steps() == [0, 1, 2]
    assert step0 == {name: watch.store.fs.info(watch.store.path("steps/000000", name))["ETag"]
                     for name in step0}
    expected, got = trained_samples(layout_of(reference)), trained_samples(watch)
    fault_matrix.add("S3 down (503 SlowDown) from mid-step on", "step fails: StorageError "
                     "naming the file and the store", "committed steps kept; same command "
                     "resumes at the failed step once S3 is back", got == expected)
    assert got == expected


# -- a full disk under a local run directory -----------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs of the test's own (root only), unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def fill(path) -> None:
    """Write `path` until the disk under it is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


def test_full_disk_mid_step_fails_the_step_and_the_rerun_resumes(prefect_api, make_config,
                                                                  small_disk, fault_matrix):
    from flows.bookkeeping.root_cause import summarize
    from flows.train import train

    reference = reference_run(make_config, *STEPS)
    cfg = make_config("full", *STEPS, runs_root=str(small_disk / "runs"))
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    filler = small_disk / "filler"
    _, error = train_in_thread(cfg, lambda: layout.task_record(1, "sample_prompts") is not None,
                               lambda: fill(filler))
    assert error is not None, "the run went on with its disk full"
    line = summarize(error)
    assert line.startswith(f"StorageError: {layout.uri}/"), line
    assert "failed on local disk: OSError: [Errno 28] No space left on device" in line, line
    assert layout.committed_steps() == [0]
    step0 = {p.name: p.stat().st_mtime_ns for p in Path(layout.uri, "steps/000000").iterdir()}
    assert not [p for p in Path(layout.uri).rglob("*.tmp-*")], "temporaries left behind"

    filler.unlink()
    result = train(cfg)  # the same command once there is room again
    assert result["resumed_at"] == 1
    assert layout.committed_steps() == [0, 1, 2]
    assert step0 == {name: Path(layout.uri, "steps/000000", name).stat().st_mtime_ns
                     for name in step0}
    same = trained_samples(layout) == trained_samples(RunLayout.open(
        reference.storage.uri, reference.storage.run_name))
    fault_matrix.add("local disk under the run directory full mid-step", "step fails: "
                     "StorageError naming the file, 'No space left on device'", "committed "
                     "steps kept; same command resumes once there is room", same)
    assert same
