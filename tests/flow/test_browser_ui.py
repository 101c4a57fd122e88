"""The Prefect UI as a person sees it, in a real browser (Chromium from Debian, driven by
Playwright): a real Prefect server on a free loopback port, two short trainings with the
mock backend reported to it through the CLI, then the train run's and a step run's pages
(each step is a flow run of its own by default, so each step has a page of its own).

Checked in the browser: the tags and names that tell the two trainings apart (runs list,
run pages), the step's logs (a retried task's line included), the curves image decoded
(naturalWidth > 0), the held-out accuracy table. The task graph is a canvas (no DOM nodes
to inspect), so its edges are checked through the endpoint it is drawn from
(`/flow_runs/{id}/graph-v2`); the screenshot shows the drawing. A failing third training
then shows the failure notice and, through examples/failure_alerts.py's automation, sends
it to a webhook. Screenshots go to $ROLLFLOW_SCREENSHOTS or a pytest temp dir.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.process import free_port
from flows.servers.prefect_server import PrefectServer, start_server
from tests.support import REPO_ROOT
from tests.support.prefect_ui import artifacts, chain_edges, flow_runs, graph_edges

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no browser at {CHROMIUM}"),
    # the first test also trains the module's two runs: about 3 minutes in CI, and past 5 on
    # a machine busy with more than CI
    pytest.mark.timeout(480),
]
WAIT_MS = 90_000  # a page's data arrives in seconds, slower on a loaded 2-core machine


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    home = tmp_path_factory.mktemp("prefect-ui-home")
    srv = start_server("127.0.0.1", free_port(), str(home), wait_s=240,
                       log_path=str(home / "server.log"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("ROLLFLOW_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Trainer:
    """`rollflow train` as a user runs it, from their own directory, reporting to `server`."""

    def __init__(self, server: PrefectServer, ray_address: str, data: dict[str, str],
                 model: str, workdir: Path) -> None:
        self.server, self.workdir = server, workdir
        self.base = ["--set", f"cluster.address={ray_address}",
                     "--set", "cluster.namespace=rollflow-tests",
                     "--set", f"data.prompt_data={data['train']}",
                     "--set", f"engine.model_path={model}", "--set", f"train.model_path={model}",
                     "--set", f"eval.datasets=[{{name: test, path: {data['test']}, "
                              "max_prompts: 8}]"]
        (workdir / "mock.yaml").write_text(
            "rollout: {num_rollout: 2, rollout_batch_size: 4, n_samples_per_prompt: 4,\n"
            "          max_response_len: 4, rm_type: exact_match}\n"
            "engine: {backend: mock}\ntrain: {backend: mock}\n"
            "storage: {uri: runs}\neval: {before_train: true, eval_interval: 1}\n"
            "logging: {progress: false, plot_interval: 1}\n")

    def run(self, name: str, *overrides: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PREFECT_API_URL": self.server.api_url,
               "PYTHONPATH": str(REPO_ROOT)}
        env.pop("PREFECT_LOGGING_LEVEL", None)  # the CLI's own defaults: INFO to the API
        sets = [a for o in overrides for a in ("--set", o)]
        return subprocess.run(
            [sys.executable, "-m", "flows.cli", "train", "--config", "mock.yaml", *self.base,
             "--set", f"storage.run_name={name}", *sets],
            cwd=self.workdir, env=env, capture_output=True, text=True, timeout=900,
        )


@pytest.fixture(scope="module")
def trainings(server, ray_address, arithmetic_data, tiny_model_dir,
              tmp_path_factory) -> tuple[Trainer, str, str]:
    """Two finished trainings: `alpha` (GRPO; its reward raises once, so a task retries)
    and `beta` (RLOO)."""
    trainer = Trainer(server, ray_address, arithmetic_data, tiny_model_dir,
                      tmp_path_factory.mktemp("user-dir"))
    tag = uuid.uuid4().hex[:4]
    alpha, beta = f"alpha-{tag}", f"beta-{tag}"
    for name, extra in ((alpha, ["rollout.rm_type=null",
                                 "rollout.custom_rm_path=tests.support.hooks:reward_failing_once"]),
                        (beta, ["algorithm.advantage_estimator=rloo"])):
        done = trainer.run(name, *extra)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return trainer, alpha, beta


@pytest.fixture(scope="module")
def page(shots: Path) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile, \
            sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context.new_page()
        finally:
            context.close()


def open_tab(page: Any, name: str) -> None:
    page.get_by_text(name, exact=True).first.click()


def test_train_and_step_pages_tell_the_story(server, trainings, page, shots):
    _, alpha, beta = trainings
    url, api = server.url, server.api_url
    runs = flow_runs(api, [f"train-{alpha}", f"{alpha}/rollout-1", f"{beta}/rollout-1"])
    assert len(runs) == 3, sorted(runs)

    # Runs list: the two trainings' step runs by name, each tagged with its run.
    page.goto(f"{url}/runs")
    for name in (f"{alpha}/rollout-1", f"{beta}/rollout-1", f"{alpha}/rollout-0"):
        page.get_by_text(name, exact=True).first.wait_for(timeout=WAIT_MS)
    page.get_by_text(f"run:{beta}", exact=True).first.wait_for(timeout=WAIT_MS)
    page.get_by_text("algo:rloo", exact=True).first.wait_for(timeout=WAIT_MS)
    page.screenshot(path=str(shots / "1-runs-list.png"))

    # A step run: its name and tags, its logs (the retry says what failed), the graph.
    step = runs[f"{alpha}/rollout-1"]
    page.goto(f"{url}/runs/flow-run/{step['id']}")
    for text in (f"{alpha}/rollout-1", f"run:{alpha}", "algo:grpo", "engine:mock"):
        page.get_by_text(text, exact=True).first.wait_for(timeout=WAIT_MS)
    page.get_by_text("generate attempt 1 failed with ConnectionError: injected transient "
                     "fault; retrying (attempt 2 of 3)").wait_for(timeout=WAIT_MS)
    page.get_by_text("Finished in state Completed()").first.wait_for(timeout=WAIT_MS)
    page.wait_for_timeout(2000)  # the canvas draws the graph after the data arrives
    page.screenshot(path=str(shots / "2-step-run.png"))
    assert graph_edges(api, step["id"]) == chain_edges(1)
    beta_step = runs[f"{beta}/rollout-1"]
    assert graph_edges(api, beta_step["id"]) == chain_edges(1)
    assert f"run:{alpha}" in step["tags"] and f"run:{beta}" in beta_step["tags"]

    # The train run: tags, its artifacts, the curves image decoded by the browser.
    train = runs[f"train-{alpha}"]
    page.goto(f"{url}/runs/flow-run/{train['id']}")
    page.get_by_text(f"train-{alpha}", exact=True).first.wait_for(timeout=WAIT_MS)
    open_tab(page, "Artifacts")
    for key in ("run-metrics", "eval-history", "reward-curves"):
        page.get_by_text(f"{alpha}-{key}", exact=True).first.wait_for(timeout=WAIT_MS)
    page.screenshot(path=str(shots / "3-train-run-artifacts.png"), full_page=True)

    page.get_by_text(f"{alpha}-reward-curves", exact=True).first.click()
    image = page.locator("img[src^='data:image/png']").first
    image.wait_for(timeout=WAIT_MS)
    page.wait_for_function(
        "() => [...document.images].some(i => i.src.startsWith('data:image/png') && i.complete)",
        timeout=WAIT_MS)
    width = image.evaluate("img => img.naturalWidth")
    assert width > 0
    page.screenshot(path=str(shots / "4-curves.png"))

    # Held-out accuracy: the eval table of the train run, one row per weight version.
    evals = artifacts(api, train["id"])[f"{alpha}-eval-history"]
    page.goto(f"{url}/artifacts/artifact/{evals['id']}")
    page.get_by_role("columnheader", name="eval/test", exact=True).wait_for(timeout=WAIT_MS)
    table = page.locator("table").first
    rows = table.locator("tbody tr")
    assert rows.count() == 3  # weight versions 0 (before training), 1, 2
    first_cells = [rows.nth(i).locator("td").first.inner_text().strip() for i in range(3)]
    assert first_cells == ["0", "1", "2"]
    page.screenshot(path=str(shots / "5-eval-accuracy.png"))


class Webhook(http.server.BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []
    arrived = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        Webhook.received.append(json.loads(body or b"{}"))
        Webhook.arrived.set()
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[str]:
    Webhook.received = []
    Webhook.arrived.clear()
    hook = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Webhook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{hook.server_address[1]}/rollflow"
    finally:
        hook.shutdown()


def test_a_failed_training_is_reported_and_notified(server, trainings, page, shots, webhook):
    trainer, _, _ = trainings
    env = {**os.environ, "PREFECT_API_URL": server.api_url, "PYTHONPATH": str(REPO_ROOT)}
    made = subprocess.run(  # as the README says a user makes it
        [sys.executable, "-m", "examples.failure_alerts", "--webhook", webhook,
         "--allow-private-urls"], env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0 and "automation rollflow-training-failed" in made.stdout, \
        made.stderr[-3000:]
    run = f"broken-{uuid.uuid4().hex[:4]}"
    failed = trainer.run(run, "rollout.rm_type=null",
                         "rollout.custom_rm_path=tests.support.hooks:reward_nan_after_step_0")
    assert failed.returncode == 1 and "RewardError" in failed.stderr, failed.stderr[-3000:]

    train = flow_runs(server.api_url, [f"train-{run}"])[f"train-{run}"]
    notice = artifacts(server.api_url, train["id"])[f"{run}-failure"]
    page.goto(f"{server.url}/artifacts/artifact/{notice['id']}")
    page.get_by_text(f"Training {run} failed").first.wait_for(timeout=WAIT_MS)
    page.get_by_text("step 1, task generate", exact=False).first.wait_for(timeout=WAIT_MS)
    page.screenshot(path=str(shots / "6-failure-notice.png"))

    # events -> trigger -> action run as server services
    assert Webhook.arrived.wait(timeout=120), "no notification within 120 s"
    sent = Webhook.received[0]
    assert sent["subject"] == f"rollflow: training {run} failed"
    assert "step 1, task `generate`" in sent["body"] and "RewardError" in sent["body"]
    assert f"/runs/flow-run/{train['id']}" in sent["body"]  # the link to the run's page
