"""A dead or hung engine does not fail the step: the rollout's health probes take it out,
its requests go to the other engine, and the generate task replaces it before the step
trains. Each run trains exactly the samples of an uninterrupted run (tokens, loss masks,
rewards), the generate of each step with a fault ran once and names the engine it lost, and
the run ends with two engines again, each replaced one a new process at the final weights.
One run loses an engine twice: killed in step 1, the other one stopped in step 2 (one run
for both costs a step, not a run). Through the real
sglang-router too: the lost engine leaves its worker set, only its own requests are sent
again through it (at most the half round-robin gave it; the survivor's go on), and the
replacement joins it (its workers are the two engines at the end).

The engines are mock ones whose tokens take wall time (`engine.mock_token_seconds`): what is
under test is the pool (probes, resends, replacement), and a killed or stopped process is the
same fault whatever it was decoding. An embedded engine killed mid-generate is
tests/flow/test_faults.py's; here its decoding only burned CPU to keep requests in flight
(this module 217 CPU-s with a wider embedded model on the EPYC, bench/RESULTS.md "CI cost")."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import httpx
import pytest
import ray

from engines.cluster.actors import kill_run_actors
from engines.cluster.registry import get_run_actor
from storage.batch_io import read_samples
from storage.group_journal import GroupJournal
from storage.run_layout import RunLayout, step_dir
from tests.support.faults import run_with_faults

# a step sends PROMPTS x SAMPLES_PER_PROMPT requests: 16 an engine, one at a time, each of
# 20 tokens at 12.5 ms: 4 s of generation per engine, on an idle machine or a busy one
PROMPTS, SAMPLES_PER_PROMPT = 8, 4
STEPS = ("rollout.num_rollout=4",)  # faults in steps 1 and 2
TWO_ENGINES = ("engine.num_engines=2", "rollout.use_router=false",
               f"rollout.rollout_batch_size={PROMPTS}",
               f"rollout.n_samples_per_prompt={SAMPLES_PER_PROMPT}", "rollout.max_response_len=20",
               # one request at a time per engine, each 0.25 s: a step generates for seconds,
               # long enough to lose an engine in the middle
               "engine.max_batch_size=1", "rollout.ignore_eos=true",
               "engine.mock_token_seconds=0.0125",
               # a request per group, so both engines have requests in flight
               "rollout.max_request_samples=1",
               "rollout.engine_health_interval_s=0.5", "rollout.engine_hang_timeout_s=10",
               "cluster.keep_actors=true")  # the engines are inspected after the run


def trained(cfg: Any) -> list[tuple[Any, ...]]:
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    return [(s.index, s.tokens, s.loss_mask, s.reward) for k in layout.committed_steps()
            for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow")]


def generating(step: int) -> Any:
    """True once step `step`'s first group is in its group journal: its generate is under way,
    and with each request a quarter of a second (see TWO_ENGINES) the other groups are still
    in flight on both engines, however busy the machine is."""
    def when(layout: RunLayout) -> bool:
        journal = GroupJournal(layout.store, step_dir(step))
        return any(e.record["kind"] == "groups" for e in journal.entries())
    return when


def engine(cfg: Any, i: int) -> Any:
    return get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, f"engine-{i}")


_REFERENCE: list[list[tuple[Any, ...]]] = []  # one uninterrupted run serves both tests


def reference(make_config: Any) -> list[tuple[Any, ...]]:
    from flows.train import train

    if not _REFERENCE:
        cfg = make_config("pool-ref", *STEPS, *TWO_ENGINES)
        train(cfg)
        kill_run_actors(cfg)
        _REFERENCE.append(trained(cfg))
    return _REFERENCE[0]


# The first test also trains the shared reference run: in CI, beside two busy workers, that
# and its own run took over the flow tier's 300 s (its worker was ended, and xdist hung).
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("faults", "router"), [
    # (signal, what the probe finds) per step from step 1: engine 0 killed, then engine 1
    # stopped (the one that was never replaced: its pid is known from the start)
    ([(signal.SIGKILL, "dead"), (signal.SIGSTOP, "hung")], False),
    # the router does not say which engine serves a request; the killed engine's requests
    # fail at the router, and only they are sent again
    ([(signal.SIGKILL, "dead")], True),
], ids=["kill-9-then-sigstop", "router-kill-9"])
def test_a_lost_engine_is_replaced_without_failing_the_step(
    prefect_api: str, make_config: Any, fault_matrix: Any,
    faults: list[tuple[signal.Signals, str]], router: bool,
) -> None:
    expected = reference(make_config)  # (round-robin: the route changes no sample)
    routed = ["rollout.use_router=true", "rollout.router_policy=round_robin"] if router else []
    cfg = make_config("pool", *STEPS, *TWO_ENGINES, *routed)
    victims: list[dict[str, Any]] = []  # step i + 1's: engine i, its pid and URL

    def looked_up(layout: RunLayout) -> bool:
        """The victims' pids and URLs, looked up in step 0 (the lookup lists the cluster's
        actors, which can take seconds)."""
        if not victims and layout.task_record(0, "sample_prompts") is not None:
            victims.extend({"pid": ray.get(engine(cfg, i).pid.remote()),
                            "url": ray.get(engine(cfg, i).url.remote())}
                           for i in range(len(faults)))
        return bool(victims)

    def fault(step: int, sig: signal.Signals) -> tuple[Any, Any]:
        mid_generate = generating(step)
        return (lambda layout: looked_up(layout) and mid_generate(layout),
                lambda: os.kill(victims[step - 1]["pid"], sig))

    try:
        run_with_faults(cfg, [fault(step, sig) for step, (sig, _) in enumerate(faults, 1)])
        check_run(cfg, victims, expected, fault_matrix, [why for _, why in faults], router)
    finally:
        for victim, (sig, _) in zip(victims, faults, strict=False):
            if sig == signal.SIGSTOP:  # never leave a stopped process behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim["pid"], signal.SIGCONT)
        kill_run_actors(cfg)


def check_run(cfg: Any, victims: list[dict[str, Any]], expected: list[tuple[Any, ...]],
              fault_matrix: Any, whys: list[str], router: bool) -> None:
    """Step i + 1 lost victim i, `whys[i]` (dead, hung)."""
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0, 1, 2, 3]
    resent: list[float] = []
    for step, victim in enumerate(victims, 1):
        generate = layout.task_record(step, "generate")
        assert generate is not None and generate["lost_engines"] == [victim["url"]], step
        assert generate["rollout/engines_lost"] == 1.0
        resent.append(generate["rollout/resent_samples"] + generate.get("rollout/router_retries", 0))
        assert resent[-1] > 0  # it had requests in flight, sent again (by the router, or the rollout)
        if router:  # only the victim's: round-robin gave it half of the step's requests
            assert resent[-1] <= PROMPTS * SAMPLES_PER_PROMPT // 2
        else:
            assert generate["rollout/tokens_regenerated"] > 0  # generated again from their prompt
    same = trained(cfg) == expected
    assert same
    pids = [ray.get(engine(cfg, i).pid.remote()) for i in (0, 1)]
    assert not {v["pid"] for v in victims} & set(pids) and len(set(pids)) == 2
    versions = [ray.get(engine(cfg, i).weight_version.remote()) for i in (0, 1)]
    assert versions == [4, 4]
    if router:
        urls = {ray.get(engine(cfg, i).url.remote()) for i in (0, 1)}
        rollout = get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, "rollout")
        workers = httpx.get(f"{ray.get(rollout.router_url.remote())}/workers").json()
        assert {w["url"].rstrip("/") for w in workers["workers"]} == urls
    via = " behind the sglang-router" if router else ""
    for why, n in zip(whys, resent, strict=True):
        fault_matrix.add(f"one of two engines{via} {'killed' if why == 'dead' else 'SIGSTOPped'} "
                         "mid-generate", f"health probe finds it {why}",
                         f"its requests ({n:.0f} of the step's {PROMPTS * SAMPLES_PER_PROMPT}) "
                         "go to the other engine, the step goes on, the engine is replaced",
                         same)
