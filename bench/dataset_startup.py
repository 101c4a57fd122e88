"""Start-up cost of a large prompt set: time and peak memory before step 0.

A run reads its prompts twice before the first step: preflight checks every row in the
driver, and the rollout actor opens the set, builds its data source and draws the first
prompts. Each phase runs here in a fresh Python process (so its peak RSS is its own), on a
1M-row (by default) jsonl and parquet file shaped like the arithmetic example's rows, with the
example's tokenizer:

  preflight  - the driver's dataset check (flows/bookkeeping/preflight.py)
  actor      - the rollout actor's dataset + data source, then one step's draw
  per step   - restoring the data source from the previous step's saved state and drawing
               (what every later step pays)

`--before REV` runs the same phases on the code of git revision REV too (exported with
`git archive` into a temp dir), so one command prints both sides. Usage:
  python -m bench.dataset_startup --rows 1000000 --before 5b24a89
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DRAW = 256  # groups drawn per step (rollout_batch_size x over-sampling of a large run)

# The phase code per API generation; each prints one JSON line {"wall", "cpu", "rss_mb", ...}.
COMMON = """
import json, os, resource, sys, time
def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[2])
path, phase = sys.argv[1], sys.argv[3]
from engines.data.data_source import RolloutDataSourceWithBuffer
from storage.run_layout import RunLayout
from storage.object_store import open_store
import engines.data.prompt_dataset as pd
base = rss_mb()
t0, c0 = time.perf_counter(), time.process_time()
"""
BODY = """
spec = pd.DatasetSpec(path=path)
if phase == "preflight":
    n = %(check)s
else:
    ds = RolloutDataSourceWithBuffer(%(open)s, 1, seed=1)
    if phase == "per step":
        layout = RunLayout(open_store(sys.argv[4]))
        ds.get_samples(%(draw)d, 0); ds.save(layout, 0)
        t0, c0 = time.perf_counter(), time.process_time()
        ds.load(layout, 0)
    n = len(ds.get_samples(%(draw)d, 1))
"""
# before: every row loaded as a tokenized Sample, in preflight and again in the actor
OLD = COMMON + BODY % {"check": "len(pd.load_prompt_samples(spec, tok).samples)",
                       "open": "pd.load_prompt_samples(spec, tok).samples", "draw": DRAW}
# after: fields checked over all rows, 100k rows tokenized (the default
# data.preflight_token_rows); the actor opens the set lazily
NEW = COMMON + BODY % {"check": "pd.check_prompt_dataset(spec, tok, 100_000).rows",
                       "open": "pd.open_prompt_dataset(spec, tok)", "draw": DRAW}
TAIL = """
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                  "rss_mb": rss_mb() - base, "n": n}))
"""
PHASES = ("preflight", "actor", "per step")


def write_files(out: Path, rows: int, seed: int = 0) -> dict[str, str]:
    """`rows` arithmetic-style rows as jsonl and parquet (written once per size)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    jsonl, parquet = out / f"prompts-{rows}.jsonl", out / f"prompts-{rows}.parquet"
    if not (jsonl.exists() and parquet.exists()):
        rng = random.Random(seed)
        pairs = [(rng.randrange(10**5), rng.randrange(10**5)) for _ in range(rows)]
        data = [{"prompt": f"What is {a}+{b}? Answer:", "label": str(a + b),
                 "metadata": {"a": a, "b": b}} for a, b in pairs]
        with open(jsonl, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in data)
        pq.write_table(pa.Table.from_pylist(data), parquet)
    return {"jsonl": str(jsonl), "parquet": str(parquet)}


def tokenizer_dir(out: Path) -> str:
    from examples.arithmetic.build_model import build_tokenizer

    path = out / "tokenizer"
    if not path.exists():
        build_tokenizer().save_pretrained(str(path))
    return str(path)


def export_revision(rev: str, dest: Path) -> Path:
    """The tree of `rev` (engines, storage) under `dest`, for the 'before' side."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "engines", "storage"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def run_phase(code: str, root: Path, path: str, tok: str, phase: str, scratch: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false"}
    run_dir = tempfile.mkdtemp(dir=scratch)
    done = subprocess.run([sys.executable, "-c", code + TAIL, path, tok, phase, run_dir],
                          cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{phase} on {path} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--before", help="git revision to measure as 'before' (e.g. HEAD~3)")
    parser.add_argument("--only", choices=("before", "after"), help="measure one side only")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "rollflow-bench-data"))
    args = parser.parse_args()
    out = Path(args.dir)
    files, tok = write_files(out, args.rows), tokenizer_dir(out)
    sides: list[tuple[str, str, Path]] = []
    if args.before and args.only != "after":
        sides.append(("before", OLD, export_revision(args.before, out / f"rev-{args.before}")))
    if args.only != "before":
        sides.append(("after", NEW, REPO))
    print(f"rows: {args.rows:,}  draw: {DRAW} groups  load: {os.getloadavg()[0]:.2f}")
    print("| format | phase | code | wall s | CPU s | peak RSS MB |\n|---|---|---|---|---|---|")
    for fmt, path in files.items():
        for phase in PHASES:
            for side, code, root in sides:
                r = run_phase(code, root, path, tok, phase, out)
                print(f"| {fmt} | {phase} | {side} | {r['wall']:.2f} | {r['cpu']:.2f} | "
                      f"{r['rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
