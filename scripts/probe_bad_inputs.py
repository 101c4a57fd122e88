"""Probe `rollflow train` with one bad input at a time, the way a user meets them.

It makes a table of bad inputs, reproducibly: when each fails (seconds; before or after
step 0) and the first line it prints. In a fresh temp
directory outside the repository it writes a small valid task (a tiny 2-layer Llama, 64
two-digit additions), then for each case a config and data with exactly one mistake, runs
`rollflow train --config <file>` there as a subprocess with relative paths, as a user does,
and records: wall seconds until exit, the exit code, how far the run got (what exists under
`runs/<run>/`: config.yaml, steps/*, steps/*/COMMITTED), the raw first line of stderr, and
the first line that is not Ray/Prefect/tqdm/library-warning noise.

Most cases run the mock engine and trainer (fast); those that need a real model (prompts
longer than its context, a NaN reward, a model directory without weights) run embedded +
torch. The local Ray head is the user's default: the first case starts it on demand
(ROLLFLOW_HOME is the temp directory's, so it is this probe's own head) and the others attach
to it; a run that failed after its actors started is stopped with `rollflow runs stop`. At the
end `rollflow cluster down` stops the head and the temp directory is removed.

    .venv/bin/python scripts/probe_bad_inputs.py                   # every case (minutes)
    .venv/bin/python scripts/probe_bad_inputs.py --only empty_prompt --only yaml_invalid
    .venv/bin/python scripts/probe_bad_inputs.py --list            # the cases, what each expects

Each case says what it expects, and the last column judges the outcome against it:
`early` (fails before Prefect and the actors start, the first line naming the key, file or
line at fault), `loud` (fails, possibly mid-step, naming the cause), `succeed`, `drop` (runs,
prompts over the context dropped and counted) or `report` (no rule: shown as it is).
The workspace and valid task are in `bad_inputs/workspace.py`, the cases in
`bad_inputs/cases.py`; this file runs them, judges each and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bad_inputs.cases import CASES, Case
from bad_inputs.workspace import NOISE, REPO, Workspace, first_line, stderr_lines


@dataclass
class Outcome:
    case: str
    what: str
    expect: str
    seconds: float
    exit_code: int | None  # None: killed at the timeout
    phase: str
    committed: list[int]
    first_line: str
    raw_first_line: str
    verdict: str
    log_lines: list[str] = field(default_factory=list)  # meaningful stderr, for the record


def progress(run_dir: Path, rc: int | None, err: str) -> tuple[str, list[int]]:
    """How far the run got, from what it left in storage (and whether it reached Ray)."""
    steps = run_dir / "steps"
    committed = sorted(int(p.parent.name) for p in steps.glob("*/COMMITTED"))
    started = sorted(int(p.name) for p in steps.glob("[0-9]*") if p.is_dir())
    if rc == 0:
        return f"finished ({len(committed)} steps)", committed
    if not (run_dir / "config.yaml").exists():
        if "Connecting to existing Ray cluster" in err:
            return "before step 0 (connecting to Ray)", committed
        return "before step 0 (preflight)", committed
    if not started:
        return "before step 0 (actor start)", committed
    current = max(started)
    if current in committed:
        return f"after step {current} (between steps)", committed
    after = f", after step {max(committed)}" if committed else ""
    return f"in step {current}{after}", committed


def judge(c: Case, rc: int | None, phase: str, line: str, out: str, err: str) -> str:
    if rc is None:
        return "TIMEOUT"
    missing = [m for m in c.mentions if m.lower() not in line.lower()]
    if c.expect == "succeed":
        return "ok" if rc == 0 else "FAILED (should run)"
    if c.expect == "report":
        return "report"
    if c.expect == "drop":
        dropped = re.search(r'"prompts_dropped_too_long": (\d+)', out)
        if rc != 0:
            return "FAILED (should run, dropping)"
        if not dropped or dropped.group(1) == "0":
            return "NOT DROPPED"
        return "ok" if "dropped" in err else "ok (silent: no warning)"
    if rc == 0:
        return "NO FAILURE"
    late = c.expect == "early" and "preflight" not in phase
    verdict = [f"LATE ({phase})"] if late else []
    if missing:
        verdict.append(f"UNCLEAR (no {', '.join(repr(m) for m in missing)})")
    return "; ".join(verdict) or "ok"


def run_case(ws: Workspace, c: Case, timeout: float) -> Outcome:
    run = c.run_name or c.name
    args = ["train", *c.build(ws, run)]
    rc, seconds, out, err = ws.run(args, timeout)
    (ws.root / "logs").mkdir(exist_ok=True)
    (ws.root / "logs" / f"{c.name}.stderr").write_text(err)
    (ws.root / "logs" / f"{c.name}.stdout").write_text(out)
    raw, line = first_line(err)
    phase, committed = progress(ws.root / "runs" / run, rc, err)
    if rc != 0 and "preflight" not in phase:
        ws.run(["runs", "stop", run], 120)  # a run failed mid-step keeps its actors
    meaningful = [ln for ln in stderr_lines(err) if not any(p.search(ln) for p in NOISE)]
    return Outcome(c.name, c.what, c.expect, round(seconds, 1), rc, phase, committed, line,
                   raw, judge(c, rc, phase, line, out, err), meaningful[:5])


def auth_workaround(ws: Workspace, outcome: Outcome) -> bool:
    """rollflow's CLI cannot attach to the token-auth head it starts when Ray read its auth
    mode (at import) before flows.cluster set it: every run then fails in ray.init. Record
    that, and go on with the token handed in through the environment, so the other cases
    still say something."""
    if "AuthenticationError" not in outcome.first_line:
        return False
    ws.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(ws.home / "ray_token"))
    ws.notes.append(
        f"`{outcome.case}` failed with the plain environment ({outcome.first_line[:90]}...) "
        f"after {outcome.seconds} s: the rest ran with RAY_AUTH_MODE=token and "
        "RAY_AUTH_TOKEN_PATH=$ROLLFLOW_HOME/ray_token set by the probe."
    )
    return True


def cell(text: str, width: int = 220) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[: width - 3] + "..."


def table(outcomes: list[Outcome]) -> str:
    rows = ["| case | fails after (s) | before/after step 0 | exit code | first line | verdict |",
            "|---|---|---|---|---|---|"]
    for o in outcomes:
        seconds = f"{o.seconds:.1f}" if o.exit_code != 0 else f"(ran {o.seconds:.1f})"
        rc = "timeout" if o.exit_code is None else str(o.exit_code)
        line = f"`{cell(o.first_line)}`" if o.first_line else "(nothing)"
        rows.append(f"| {o.case} | {seconds} | {o.phase} | {rc} | {line} | {o.verdict} |")
    raw = [o for o in outcomes if o.raw_first_line != o.first_line]
    if raw:
        rows += ["", "Raw first line of stderr, where it differs:", "",
                 "| case | raw first stderr line |", "|---|---|"]
        rows += [f"| {o.case} | `{cell(o.raw_first_line, 160)}` |" for o in raw]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="CASE",
                        help="run only these cases (repeatable; baseline_ok always runs first)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per case")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temp directory (logs/<case>.stderr) and the Ray head")
    parser.add_argument("--json", metavar="PATH", help="also write the outcomes as JSON")
    parser.add_argument("--logs", metavar="DIR",
                        help="copy each case's stdout/stderr here before the cleanup")
    args = parser.parse_args()
    # `kill PID` (and SIGINT, which a background job ignores) still cleans up below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.list:
        for c in CASES:
            print(f"{c.name:34} {c.expect:8} {c.what}")
        return 0
    unknown = set(args.only) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown cases: {sorted(unknown)} (see --list)")
    cases = [c for c in CASES if not args.only or c.name in args.only or c.name == "baseline_ok"]

    ws = Workspace(Path(tempfile.mkdtemp(prefix="rfprobe-", dir="/tmp")))  # short: Ray sockets
    if ws.root.resolve().is_relative_to(REPO):
        raise SystemExit("the probe's directory must be outside the repository")
    print(f"probe directory: {ws.root} ({len(cases)} cases)", file=sys.stderr)
    start = time.perf_counter()
    outcomes: list[Outcome] = []
    try:
        ws.setup()
        for c in cases:
            outcome = run_case(ws, c, args.timeout)
            if c.name == "baseline_ok" and auth_workaround(ws, outcome):
                outcomes.append(outcome)
                outcome = run_case(ws, Case("baseline_ok_with_token", c.what, c.expect,
                                            c.build, run_name="baseline-token"), args.timeout)
            outcomes.append(outcome)
            o = outcome
            print(f"  {o.case}: rc={o.exit_code} {o.seconds:.1f}s {o.phase}: "
                  f"{o.first_line[:100]} [{o.verdict}]", file=sys.stderr)
    finally:
        total = time.perf_counter() - start
        if args.logs and (ws.root / "logs").is_dir():
            shutil.copytree(ws.root / "logs", args.logs, dirs_exist_ok=True)
        if not args.keep:
            ws.run(["cluster", "down", "--force"], 120)
            shutil.rmtree(ws.root, ignore_errors=True)
        report(outcomes, ws.notes, total, args.json)  # interrupted too: what ran so far
    return 0


def report(outcomes: list[Outcome], notes: list[str], total: float, json_path: str | None
           ) -> None:
    print(table(outcomes))
    for note in notes:
        print(f"\nNote: {note}")
    print(f"\n{len(outcomes)} cases in {total:.0f} s")
    if json_path:
        Path(json_path).write_text(json.dumps(
            {"seconds": round(total, 1), "notes": notes,
             "outcomes": [asdict(o) for o in outcomes]}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
