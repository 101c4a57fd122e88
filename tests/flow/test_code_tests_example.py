"""The code example's GRPO config (examples/code_tests/grpo.yaml), shortened, through the
train flow: embedded engine, torch trainer, real Ray and Prefect, and every sample's program
run in bubblewrap against its row's tests (`rm_type: code_tests`).

An untrained tiny model writes a passing expression too rarely to test the reward with, so
the run uses a test copy of it rewired into a bigram model (tests/support/bigram_model.py,
as tests/flow/test_tool_agent_flow does): its logits depend only on the last token; after
`=` (the prompt's end) or `*` it writes `x`, after `x` either `*` or EOS, one chance in two.
Its answers are `x`, `x*x`, `x*x*x`, ... and a truncated `x*x*x*x*` (a syntax error), whose
passes this test counts itself: `x` to the power of the count of x's, against each assert of
the label. The functions are the example's rows (make_data.make_row) for
`x`, `x*x`, `2*x` and `x+5`, so the rewards spread from 0 to 1.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from typing import Any

import pytest
from transformers import AutoTokenizer

from examples.code_tests.make_data import make_row
from flows.config.loader import load_config
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from storage.sample import Sample
from tests.support import REPO_ROOT
from tests.support.bigram_model import save_bigram_model

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (scripts/test.sh installs it)")

FUNCTIONS = [("linear", 1, 0), ("square", 1, 0), ("linear", 2, 0), ("linear", 1, 5)]
ASSERT = re.compile(r"assert f\((-?\d+)\) == (-?\d+)")


@pytest.fixture(scope="module")
def power_model(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token
    return save_bigram_model(tiny_model_dir, str(tmp_path_factory.mktemp("model") / "power-bigram"),
                             marked=["x"], after_unmarked=["x"], after_marked=["*", eos])


def expected_passes(s: Sample) -> int:
    """The asserts of the label that `s.response` passes, counted here, not in a sandbox."""
    response = s.response.strip()
    assert re.fullmatch(r"x(\*x)*\*?", response), response  # the bigram's only answers
    if response.endswith("*"):
        return 0  # truncated: the program does not compile
    power = response.count("x")
    tests = [ASSERT.fullmatch(t) for t in json.loads(s.label or "")]
    return sum(int(m.group(1)) ** power == int(m.group(2)) for m in tests if m)


def test_the_code_example_trains_with_sandboxed_rewards(
    prefect_api: str, ray_address: str, power_model: str, tmp_path: Any
) -> None:
    from flows.train import train

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(make_row(fn)) + "\n" for fn in FUNCTIONS))
    cfg = load_config(REPO_ROOT / "examples" / "code_tests" / "grpo.yaml", [
        f"cluster.address={ray_address}", "cluster.namespace=rollflow-tests",
        "cluster.actor_num_threads=1", f"data.prompt_data={data}",
        f"train.model_path={power_model}", f"storage.uri={tmp_path / 'runs'}",
        f"storage.run_name=code-{uuid.uuid4().hex[:6]}", "rollout.num_rollout=2",
        "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=16", "eval.before_train=false", "eval.datasets=[]",
        "logging.progress=false",
    ])
    assert cfg.rollout.rm_type == "code_tests" and cfg.rollout.sandbox.reward == "pass_fraction"
    train(cfg)

    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0, 1]
    rewards: list[float] = []
    for k in (0, 1):
        samples = read_samples(layout.store, f"steps/{k:06d}", "rollout.arrow")
        assert len(samples) == 16
        for s in samples:
            verdict = s.metadata["sandbox"]
            assert verdict["verdict"] == "exited" and verdict["total"] == 5
            assert verdict["passed"] == expected_passes(s), (s.response, verdict)
            assert s.reward == verdict["passed"] / verdict["total"]
            if verdict["passed"] < 5:  # the first failure, or why the program failed
                assert re.match(r"test \d: |the program raised SyntaxError", verdict["reason"])
            assert isinstance(s.reward, float)
            rewards.append(s.reward)
        assert layout.step_metrics(k)["train/weight_version"] == k + 1  # the policy took a step
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert 1.0 in rewards and any(0.0 < r < 1.0 for r in rewards)  # the groups have a spread
