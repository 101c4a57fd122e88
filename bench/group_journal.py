"""What a crash in the middle of `generate` costs, with and without the step's group journal,
and what the journal costs a step that does not crash.

One step of the arithmetic example's generation (examples/arithmetic/grpo.yaml's rollout
section: groups, samples per prompt, response length, temperature; `--groups` and
`--max-response-len` override it) on the embedded engine, in this process, over its HTTP
API, with the exact-match reward:

  plain       the step uninterrupted, no journal
  journaled   the step uninterrupted, each group committed as it finishes (the write cost)
  crashed     the step, stopped after `--crash-at` of its groups finished (a crash there)
  before      the rerun without a journal: the whole step again
  after       the rerun replaying the crashed attempt's journal: only what was in flight

and checks that the rerun's kept samples equal the uninterrupted step's. Figures go to
bench/RESULTS.md, "Group journal".
Usage:
  python -m bench.group_journal [--groups 128] [--max-response-len 4] [--request-samples 8]
                                [--crash-at 0.5]
The crash comes at the first commit of the journal with `--crash-at` of the groups done, or
with `--crash-at-time F` at F times the uninterrupted journaled step's seconds (a kill -9 at
a moment: what had been committed by then is what the rerun restores; the engine's requests
still running are aborted before the reruns).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when OpenMP starts

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import yaml  # noqa: E402

from engines.config.engine import EngineConfig  # noqa: E402
from engines.config.rollout import RolloutConfig  # noqa: E402
from engines.data.data_source import RolloutDataSourceWithBuffer  # noqa: E402
from engines.inference.engine_actor import EngineActor  # noqa: E402
from engines.rollout.generation import RolloutResult, build_generation_loop  # noqa: E402
from engines.rollout.restore import JournalLog, Outcome, StepLog, replay  # noqa: E402
from engines.rollout.rewards.hub import RewardHub  # noqa: E402
from engines.rollout.rollout_manager import StepDataSource  # noqa: E402
from engines.rollout.sglang_client import SGLangClient  # noqa: E402
from storage.group_journal import GroupJournal  # noqa: E402
from storage.object_store import ObjectStore  # noqa: E402
from storage.sample import Group, Sample  # noqa: E402

FINGERPRINT = "bench"


class Crash(Exception):
    pass


class CrashAfter:
    """A StepLog that commits like `inner` and raises once `groups` groups are committed."""

    def __init__(self, inner: JournalLog, groups: int) -> None:
        self.inner, self.left = inner, groups

    def drawn(self, num_groups: int, groups: Sequence[Group], cursor: dict[str, Any]) -> None:
        self.inner.drawn(num_groups, groups, cursor)

    def finished(self, group: Group, outcome: Outcome, phase: str) -> None:
        self.inner.finished(group, outcome, phase)
        self.left -= 1

    def commit(self) -> None:
        self.inner.commit()
        if self.left <= 0:
            raise Crash

    async def flush(self) -> None:
        await self.inner.flush()

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()


def prompts(path: str, tokenizer: Any) -> list[Sample]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [Sample(index=-1, group_index=-1, prompt=r["prompt"], label=r["label"],
                   tokens=tokenizer.encode(r["prompt"])) for r in rows]


def run(cfg: RolloutConfig, url: str, data: list[Sample], journal_dir: str | None,
        crash_after: int | None = None, replay_journal: bool = False,
        crash_at_s: float | None = None) -> tuple[RolloutResult | None, float]:
    """One step from the state sample_prompts leaves; (result, seconds) and None if it crashed
    (after `crash_after` committed groups, or at `crash_at_s` seconds). The seconds of a
    replay include reading the journal."""
    start = time.perf_counter()
    source_data = RolloutDataSourceWithBuffer(data, cfg.n_samples_per_prompt, seed=3)
    source = StepDataSource(source_data.get_samples(cfg.submit_batch_size), source_data, 0)
    journal = GroupJournal(ObjectStore(journal_dir), "steps/000000") if journal_dir else None
    restored = replay(journal.entries(), source, FINGERPRINT) if journal and replay_journal else None
    log: StepLog | None = None
    if journal is not None:
        log = JournalLog(journal, FINGERPRINT, restored.next_seq if restored else 0)
        if crash_after is not None:
            log = CrashAfter(log, crash_after)

    async def go() -> RolloutResult:
        client = SGLangClient(url)
        try:
            loop = build_generation_loop(cfg, [client], RewardHub.from_config(cfg),
                                         target=cfg.rollout_batch_size)
            step = loop.run_dynamic(source, log, restored)
            if crash_at_s is None:
                return await step
            try:
                return await asyncio.wait_for(step, crash_at_s)
            except TimeoutError:
                await client.abort_all()  # the engine's rows of the dead attempt
                raise Crash from None
        finally:
            await client.aclose()

    try:
        result = asyncio.run(go())
    except Crash:
        return None, time.perf_counter() - start
    return result, time.perf_counter() - start


def kept_samples(result: RolloutResult) -> list[tuple[int, list[int], Any]]:
    """What the step trains on, by sample: the engine's log-probs are left out, as they
    depend on which requests shared a decode batch (bench/RESULTS.md, "The main job")."""
    return [(s.index, s.tokens, s.reward) for g in result.kept for s in g]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/arithmetic/grpo.yaml")
    p.add_argument("--groups", type=int, default=None)
    p.add_argument("--max-response-len", type=int, default=None)
    p.add_argument("--request-samples", type=int, default=None,
                   help="rollout.max_request_samples: n_samples_per_prompt sends a request "
                   "per group, so groups finish one by one rather than all at once")
    p.add_argument("--concurrency", type=int, default=None,
                   help="rollout.sglang_server_concurrency: groups in flight at once, so a "
                   "step finishes in waves")
    p.add_argument("--crash-at", type=float, default=0.5,
                   help="crash once this share of the groups is committed")
    p.add_argument("--crash-at-time", type=float, default=None,
                   help="crash at this share of the uninterrupted journaled step's seconds")
    args = p.parse_args()

    from examples.arithmetic.build_model import save_tiny_model
    from examples.arithmetic.make_data import write_datasets

    tmp = tempfile.mkdtemp(prefix="bench-journal-")
    model = save_tiny_model(os.path.join(tmp, "tiny-llama"))
    data_files = write_datasets(os.path.join(tmp, "data"), n_train=2000, n_test=10, n_sft=10)
    with open(args.config) as f:
        raw = yaml.safe_load(f)["rollout"]
    raw = {k: v for k, v in raw.items() if k in RolloutConfig.model_fields}
    if args.groups:
        raw["rollout_batch_size"] = args.groups
    if args.max_response_len:
        raw["max_response_len"] = args.max_response_len
    if args.request_samples:
        raw["max_request_samples"] = args.request_samples
    if args.concurrency:
        raw["sglang_server_concurrency"] = args.concurrency
    cfg = RolloutConfig(**raw)
    engine = EngineActor(EngineConfig(backend="embedded", model_path=model))
    try:
        from transformers import AutoTokenizer

        data = prompts(data_files["train"], AutoTokenizer.from_pretrained(model))
        url = engine.url()
        # warm-up: first forwards, compiled paths, the first Arrow encode (a one-off per
        # process that a long-lived rollout actor pays once)
        run(cfg, url, data, os.path.join(tmp, "warm-up"))
        plain, plain_s = run(cfg, url, data, None)
        journaled, journaled_s = run(cfg, url, data, os.path.join(tmp, "full"))
        crash_dir = os.path.join(tmp, "crash")
        crash_after = max(1, int(cfg.rollout_batch_size * args.crash_at))
        if args.crash_at_time is None:
            _, crashed_s = run(cfg, url, data, crash_dir, crash_after)
            crash = f"crash once {crash_after} groups are committed"
        else:
            _, crashed_s = run(cfg, url, data, crash_dir,
                               crash_at_s=args.crash_at_time * journaled_s)
            crash = f"crash at {args.crash_at_time:.0%} of the journaled step's {journaled_s:.1f} s"
        before, before_s = run(cfg, url, data, None)
        after, after_s = run(cfg, url, data, crash_dir, replay_journal=True)
    finally:
        engine.shutdown()
    assert plain and journaled and before and after
    same = kept_samples(after) == kept_samples(before)
    m = journaled.metrics()
    a = after.metrics()
    print(f"step: {cfg.rollout_batch_size} groups x {cfg.n_samples_per_prompt} samples, "
          f"max_response_len {cfg.max_response_len}, max_request_samples "
          f"{cfg.max_request_samples}; {crash}")
    print("| run | seconds | tokens generated | groups restored | tokens regenerated |")
    print("|---|---|---|---|---|")
    print(f"| uninterrupted, no journal | {plain_s:.2f} | {plain.stats.generated_tokens} | | |")
    print(f"| uninterrupted, journal | {journaled_s:.2f} | {journaled.stats.generated_tokens} | | |")
    print(f"| crashed attempt | {crashed_s:.2f} | | | |")
    print(f"| rerun before (no journal) | {before_s:.2f} | {before.stats.generated_tokens} | 0 | "
          f"{before.stats.generated_tokens} (every token of the step) |")
    print(f"| rerun after (journal) | {after_s:.2f} | {after.stats.generated_tokens} | "
          f"{int(a['rollout/groups_restored'])} | {int(a['rollout/tokens_regenerated'])} |")
    print(f"tokens restored: {int(a['rollout/tokens_restored'])} of "
          f"{journaled.stats.generated_tokens}")
    print(f"journal: {int(m['rollout/journal_entries'])} entries, "
          f"{m['rollout/journal_bytes'] / 1024:.0f} KiB, "
          f"{m['rollout/journal_write_seconds']:.3f} s of encode + write, of which encode "
          f"(in the event loop) {m['rollout/journal_encode_seconds']:.3f} s; "
          f"rerun's kept samples equal the uninterrupted step's: {same}")
    if not same:
        raise SystemExit("the rerun's samples differ from the uninterrupted step's")


if __name__ == "__main__":
    main()
