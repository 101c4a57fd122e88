"""The probe's temp directory outside the repository: a small valid task (a tiny Llama,
two-digit additions), `rollflow` run there with relative paths, and the first line of its
stderr that is not Ray/Prefect/tqdm/library noise."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # scripts/bad_inputs/ -> the repository
ROLLFLOW = str(Path(sys.executable).with_name("rollflow"))
N_TRAIN = 64

# Lines that are not rollflow talking: Ray's Python and C++ logs, Ray worker prefixes,
# Prefect's console logs and temporary-server notices, tqdm bars, library warnings.
NOISE = [re.compile(p) for p in (
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(DEBUG|INFO|WARNING)\s+\S+\.py:\d+ -- ",
    r"^\[\d{4}-\d\d-\d\d [\d:,.]+ [DIWE] \d+ \d+\] \S+\.(cc|h):\d+",
    r"^\((raylet|pid=\d+|\w+ pid=\d+)",
    r"^\d\d:\d\d:\d\d\.\d+ \| \w+ *\| (prefect[\w.]*|Flow run|Task run) ",
    r"(Starting|Stopping) temporary server|docs\.prefect\.io",
    r"\d+%\|.*\|",
    r"/(site|dist)-packages/.*\w+Warning: ",
    r"^\s+warnings\.warn\(",
)]
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def stderr_lines(text: str) -> list[str]:
    """Non-empty lines, tqdm's carriage-return redraws split apart, colours removed."""
    return [ln.strip() for ln in re.split(r"[\r\n]+", _ANSI.sub("", text)) if ln.strip()]


def first_line(text: str) -> tuple[str, str]:
    """(raw first line, first line that is not noise) of a stderr text."""
    lines = stderr_lines(text)
    meaningful = [ln for ln in lines if not any(p.search(ln) for p in NOISE)]
    return (lines[0] if lines else ""), (meaningful[0] if meaningful else "")


# ---------------------------------------------------------------------------- the workspace


class Workspace:
    """The temp directory the user works in: model, data, hooks, configs; runs under ./runs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "home"  # ROLLFLOW_HOME: this probe's own Ray head, token and logs
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("RAY_", "PREFECT_API", "ROLLFLOW_"))}
        self.env.update(ROLLFLOW_HOME=str(self.home), PREFECT_HOME=str(root / "prefect"),
                        TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        # Prefect gives its ephemeral server 20 s (counted in 0.1 s sleeps, so longer in
        # fact) to start; on a loaded machine it times out, which is not what a case probes.
        self.env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        self.notes: list[str] = []

    def path(self, rel: str) -> Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write(self, rel: str, content: str | bytes) -> str:
        p = self.path(rel)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
        return rel

    def jsonl(self, rel: str, rows: list[Any]) -> str:
        return self.write(rel, "".join(json.dumps(r) + "\n" for r in rows))

    def parquet(self, rel: str, rows: list[dict[str, Any]]) -> str:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), self.path(rel))
        return rel

    def rows(self) -> list[dict[str, Any]]:
        text = (self.root / "data/train.jsonl").read_text()
        return [json.loads(ln) for ln in text.splitlines()]

    def setup(self) -> None:
        """The valid task every case starts from (built in this process, from the repo)."""
        from examples.arithmetic.build_model import save_tiny_model
        from examples.arithmetic.make_data import write_datasets

        here = os.getcwd()
        os.chdir(self.root)
        try:
            save_tiny_model("model", num_layers=2, hidden_size=64)  # 128-token context
            write_datasets("data", n_train=N_TRAIN, n_test=16)
        finally:
            os.chdir(here)

    def run(self, args: list[str], timeout: float) -> tuple[int | None, float, str, str]:
        """`rollflow *args` from the workspace: (exit code or None on timeout, seconds,
        stdout, stderr). Its own session, so a timeout stops the driver and its children."""
        start = time.perf_counter()
        proc = subprocess.Popen([ROLLFLOW, *args], cwd=self.root, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            rc = None
        except BaseException:  # interrupted: the driver must not outlive the probe
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        return rc, time.perf_counter() - start, out, err


def base_config(run: str, backend: str = "mock") -> dict[str, Any]:
    """A valid config for the workspace task: mock engine and trainer (the model directory
    gives the tokenizer and context), or embedded engine + torch trainer (the engine takes
    train.model_path, as a user would leave it)."""
    torch = backend == "torch"
    engine = {"backend": "embedded"} if torch else {"backend": "mock", "model_path": "model"}
    return {
        "cluster": {"actor_num_threads": 1},
        "data": {"prompt_data": "data/train.jsonl"},
        "rollout": {"num_rollout": 2, "rollout_batch_size": 4, "n_samples_per_prompt": 2,
                    "max_response_len": 4, "rm_type": "exact_match", "use_router": False},
        "engine": engine,
        "train": {"backend": "torch" if torch else "mock", "model_path": "model", "lr": 1e-4},
        "storage": {"uri": "./runs", "run_name": run},
        "eval": {"before_train": False},
    }


def setting(cfg: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of `cfg` with `a.b.c` set (None deletes the key)."""
    cfg = copy.deepcopy(cfg)
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return cfg
