"""Plugin contracts (after slime's tests/plugin_contracts): every built-in fits the protocol
of the config key it can be named by, and a hook with a bad path or a wrong signature fails
at start-up with that key in the message."""

from __future__ import annotations

from typing import Any

import pytest

from engines.algorithms.losses import actor_loss
from engines.algorithms.registry import ADVANTAGE_ESTIMATORS
from engines.data.data_source import pop_first
from engines.hooks import protocols
from engines.hooks.loader import HOOKS, HookError, check_protocol, load_hook, validate_hooks
from engines.rollout.filters import DYNAMIC_FILTERS, OVER_SAMPLING_FILTERS
from engines.rollout.rewards import REWARD_FUNCTIONS, RemoteRewardModel, builtin_reward
from engines.rollout.sft_rollout import sft_rollout
from examples.tool_agent.agent import generate as tool_agent_generate
from flows.config.run import RollflowConfig

BUILTINS: list[tuple[str, Any, type]] = [
    ("sft_rollout", sft_rollout, protocols.RolloutFn),
    ("tool_agent.generate", tool_agent_generate, protocols.GenerateFn),
    ("remote_rm", RemoteRewardModel("http://x").score, protocols.RewardFn),
    ("boxed_math", builtin_reward("boxed_math", "t"), protocols.RewardFn),
    ("pop_first", pop_first, protocols.BufferFilterFn),
    ("actor_loss", actor_loss, protocols.CustomLossFn),
    *[(n, f, protocols.RewardFn) for n, f in REWARD_FUNCTIONS.items()],
    *[(n, f, protocols.DynamicFilterFn) for n, f in DYNAMIC_FILTERS.items()],
    *[(n, f, protocols.OverSamplingFilterFn) for n, f in OVER_SAMPLING_FILTERS.items()],
    *[(n, f, protocols.CustomAdvantageFn) for n, f in ADVANTAGE_ESTIMATORS.items()],
]


@pytest.mark.parametrize(("name", "fn", "protocol"), BUILTINS, ids=[b[0] for b in BUILTINS])
def test_builtin_satisfies_its_protocol(name: str, fn: Any, protocol: type) -> None:
    check_protocol(fn, protocol, f"builtin {name}")


# One user hook per protocol with the right shape, and one with a wrong shape each.
def rollout_ok(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list:
    return []


async def generate_ok(args: Any, sample: Any, sampling_params: dict) -> Any:
    return sample


async def reward_ok(args: Any, sample: Any) -> float:
    return 0.0


async def group_reward_ok(args: Any, samples: list) -> list[float]:
    return [0.0] * len(samples)


def two_args_ok(args: Any, x: Any) -> Any:
    return x


def three_args_ok(args: Any, x: Any, denominator: float) -> Any:
    return x


def buffer_ok(args: Any, rollout_id: int, buffer: list, num_samples: int) -> list:
    return buffer[:num_samples]


async def eval_ok(args: Any, weight_version: int) -> dict[str, float]:
    return {"eval/mine": float(weight_version)}


def one_arg(args: Any) -> None:
    return None


def sync_any(*args: Any) -> None:
    return None


async def async_any(*args: Any) -> None:
    return None


async def agent_ok(base_url: str, sample: Any, api_key: str = "", **kwargs: Any) -> float:
    return 0.0


GOOD: dict[type, str] = {
    protocols.RolloutFn: "rollout_ok",
    protocols.GenerateFn: "generate_ok",
    protocols.AgentFn: "agent_ok",
    protocols.RewardFn: "reward_ok",
    protocols.GroupRewardFn: "group_reward_ok",
    protocols.DynamicFilterFn: "two_args_ok",
    protocols.OverSamplingFilterFn: "two_args_ok",
    protocols.BufferFilterFn: "buffer_ok",
    protocols.SampleFilterFn: "two_args_ok",
    protocols.CustomLossFn: "three_args_ok",
    protocols.CustomAdvantageFn: "two_args_ok",
    protocols.EvalFn: "eval_ok",
}
KEYS = [(k, proto) for k, proto in HOOKS.items()] + [("rollout.custom_rm_path", protocols.GroupRewardFn)]


@pytest.mark.parametrize(("key", "protocol"), KEYS, ids=[f"{k}-{v.__name__}" for k, v in KEYS])
def test_user_hooks_are_checked_with_the_key_named(key: str, protocol: type) -> None:
    mod = __name__
    assert load_hook(f"{mod}:{GOOD[protocol]}", key, protocol) is globals()[GOOD[protocol]]
    assert load_hook(f"{mod}.{GOOD[protocol]}", key, protocol) is globals()[GOOD[protocol]]
    with pytest.raises(HookError, match=rf"^{key}: cannot import 'no_such_pkg.mod'"):
        load_hook("no_such_pkg.mod:fn", key, protocol)
    with pytest.raises(HookError, match=rf"^{key}: .*missing_fn.* does not name a callable"):
        load_hook(f"{mod}:missing_fn", key, protocol)
    with pytest.raises(HookError, match=rf"^{key}: one_arg cannot take \d positional arguments"):
        load_hook(f"{mod}:one_arg", key, protocol)
    wants_async = protocol in (protocols.GenerateFn, protocols.AgentFn, protocols.RewardFn,
                               protocols.GroupRewardFn, protocols.EvalFn)
    wrong_kind = "sync_any" if wants_async else "async_any"
    with pytest.raises(HookError, match=rf"^{key}: {wrong_kind} must be"):
        load_hook(f"{mod}:{wrong_kind}", key, protocol)


def config(**rollout: Any) -> RollflowConfig:
    return RollflowConfig.model_validate(
        {
            "data": {"prompt_data": "x.jsonl"},
            "rollout": {"num_rollout": 1, "rollout_batch_size": 1, "n_samples_per_prompt": 2,
                        **rollout},
            "engine": {"backend": "mock"},
            "train": {"backend": "mock"},
        }
    )


def test_validate_hooks_checks_every_configured_key_at_startup() -> None:
    mod = __name__
    loaded = validate_hooks(
        config(
            function_path=f"{mod}:rollout_ok",
            custom_generate_function_path=f"{mod}:generate_ok",
            custom_rm_path=f"{mod}:group_reward_ok",
            group_rm=True,
            dynamic_sampling_filter_path="check_reward_nonzero_std",  # a built-in by name
            buffer_filter_path="engines.data.data_source.pop_first",
        )
    )
    assert set(loaded) == {
        "rollout.function_path",
        "rollout.custom_generate_function_path",
        "rollout.custom_rm_path",
        "rollout.dynamic_sampling_filter_path",
        "rollout.buffer_filter_path",
    }
    assert loaded["rollout.dynamic_sampling_filter_path"] is DYNAMIC_FILTERS["check_reward_nonzero_std"]
    with pytest.raises(HookError, match="^rollout.custom_rm_path: reward_ok cannot take|^rollout.custom_rm_path: two_args_ok must be"):
        validate_hooks(config(custom_rm_path=f"{mod}:two_args_ok", group_rm=True))
    with pytest.raises(HookError, match=r"^rollout.over_sampling_filter_path: 'sort_by_std' is neither"):
        validate_hooks(config(over_sampling_filter_path="sort_by_std"))
    with pytest.raises(HookError, match="^rollout.custom_generate_function_path: reward_ok cannot take"):
        validate_hooks(config(custom_generate_function_path=f"{mod}:reward_ok"))


def test_the_eval_function_is_checked_at_startup_and_its_metrics_named() -> None:
    import asyncio

    from engines.rollout.evaluation import custom_eval_metrics

    mod = __name__
    cfg = config()
    cfg.eval.eval_function_path = f"{mod}:eval_ok"
    assert validate_hooks(cfg) == {"eval.eval_function_path": eval_ok}
    cfg.eval.eval_function_path = f"{mod}:buffer_ok"
    with pytest.raises(HookError, match=r"^eval.eval_function_path: buffer_ok cannot take 2"):
        validate_hooks(cfg)
    cfg.eval.eval_function_path = f"{mod}:two_args_ok"
    with pytest.raises(HookError, match=r"^eval.eval_function_path: two_args_ok must be an `async"):
        validate_hooks(cfg)

    async def plain(args: Any, version: int) -> dict[str, Any]:
        return {"score": version, "eval/already": 0.5}

    assert asyncio.run(custom_eval_metrics(plain, None, 3)) == {"eval/score": 3.0,
                                                                 "eval/already": 0.5}

    async def text(args: Any, version: int) -> dict[str, Any]:
        return {"score": "high"}

    # A bad result is the same on every retry: a HookError (not retried) naming the hook.
    with pytest.raises(HookError, match=rf"^eval.eval_function_path: {mod}:.*text returned "
                       r"str 'high' for metric 'score', expected a number$"):
        asyncio.run(custom_eval_metrics(text, None, 3))

    async def not_a_mapping(args: Any, version: int) -> list[float]:
        return [1.0]

    with pytest.raises(HookError, match=rf"^eval.eval_function_path: {mod}:.*not_a_mapping "
                       r"returned list \[1.0\], expected a mapping of metric name -> number$"):
        asyncio.run(custom_eval_metrics(not_a_mapping, None, 3))


def test_hooks_that_return_groups_are_checked_and_named() -> None:
    """A buffer filter, over-sampling filter or rollout function that returns something other
    than groups fails as a HookError (not retried) naming it, not as a TypeError later."""
    from engines.hooks.loader import returned_groups
    from storage.sample import Sample

    group = [Sample(index=0, group_index=0, prompt="p")]
    assert returned_groups(rollout_ok, "rollout.function_path", ([*group],)) == [group]
    for bad, shown in ((None, "NoneType None"), (group, "list \\[Sample"),
                       ([[]], "list \\[\\[\\]\\]"), ({0: group}, "dict")):
        with pytest.raises(HookError, match=rf"^rollout.over_sampling_filter_path: {__name__}:"
                           rf"rollout_ok returned {shown}.*, expected a list of groups"):
            returned_groups(rollout_ok, "rollout.over_sampling_filter_path", bad)
