"""The extension points of rollflow, one `typing.Protocol` each.

User hooks arrive as import strings and are checked against these at start-up
(`engines.hooks.loader.load_hook`): the number of positional arguments the call site passes, and
`async def` versus `def`. Parameters are positional-only because call sites pass them by
position, so a hook may name its parameters as it likes. `args` is the whole run config
(`RollflowConfig`) for rollout-side hooks, as slime passes its namespace, and the algorithm
section for the loss and advantage hooks.

| protocol              | config key                               | called                        |
|-----------------------|------------------------------------------|-------------------------------|
| RolloutFn             | rollout.function_path                    | once per step (or eval)       |
| GenerateFn            | rollout.custom_generate_function_path    | once per sample               |
| RewardFn              | rollout.custom_rm_path                   | once per sample               |
| GroupRewardFn         | rollout.custom_rm_path + rollout.group_rm| once per group                |
| DynamicFilterFn       | rollout.dynamic_sampling_filter_path     | per finished group: keep it?  |
| OverSamplingFilterFn  | rollout.over_sampling_filter_path        | on all kept groups            |
| BufferFilterFn        | rollout.buffer_filter_path               | when drawing from the buffer  |
| SampleFilterFn        | rollout.sample_filter_path               | per sample: train on it?      |
| CustomLossFn          | algorithm.custom_loss_function_path      | per micro-batch               |
| CustomAdvantageFn     | algorithm.custom_advantage_function_path | per rollout batch             |
| EvalFn                | eval.eval_function_path                  | per evaluated weight version  |

A custom generate function finds the engine through `engine_url(args, sample)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from storage.sample import Group, Sample

if TYPE_CHECKING:
    from torch import Tensor

Reward = float | dict[str, float]


class RolloutFn(Protocol):
    def __call__(
        self, args: Any, rollout_id: int, data_source: Any, evaluation: bool = False, /
    ) -> list[Group]: ...


class GenerateFn(Protocol):
    async def __call__(
        self, args: Any, sample: Sample, sampling_params: dict[str, Any], /
    ) -> Sample: ...


class AgentFn(Protocol):
    """`rollout.agent_path`: an agent written against an OpenAI client. It gets the base URL
    of its sample's gateway session (also usable as the API key: `api_key`), and may take
    `sampling_params` and `args` keywords. Returns the reward (number or dict), the sample,
    or None to let the rollout's reward function score it."""

    async def __call__(self, base_url: str, sample: Sample, /, **kwargs: Any) -> Any: ...


class RewardFn(Protocol):
    async def __call__(self, args: Any, sample: Sample, /) -> Reward: ...


class GroupRewardFn(Protocol):
    async def __call__(self, args: Any, samples: list[Sample], /) -> Sequence[Reward]: ...


class DynamicFilterFn(Protocol):
    def __call__(self, args: Any, group: Group, /) -> bool: ...


class OverSamplingFilterFn(Protocol):
    def __call__(self, args: Any, groups: list[Group], /) -> list[Group]: ...


class BufferFilterFn(Protocol):
    def __call__(
        self, args: Any, rollout_id: int, buffer: list[Group], num_samples: int, /
    ) -> list[Group]: ...


class SampleFilterFn(Protocol):
    def __call__(self, args: Any, sample: Sample, /) -> bool: ...


class CustomLossFn(Protocol):
    """`(algo_cfg, LossInputs, denominator) -> (loss, metrics)`, like `actor_loss`."""

    def __call__(
        self, args: Any, inputs: Any, denominator: float, /
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


class CustomAdvantageFn(Protocol):
    """`(algo_cfg, AdvantageInputs) -> (advantages, returns)`, like the built-in estimators."""

    def __call__(self, args: Any, inputs: Any, /) -> Any: ...


class EvalFn(Protocol):
    """`async (args, weight_version) -> {metric: value}`, slime's `--eval-function-path`:
    runs in the rollout actor while the engines hold `weight_version`, after the built-in
    evaluation of `eval.datasets`; `args` is the generation loop's `HookArgs` (the run
    config, `engine_url`, `engine_urls`, `tokenizer`), so it can generate through the router
    (`engine_url(args, sample)`) or call `engines.rollout.evaluation.evaluate_datasets`."""

    async def __call__(self, args: Any, weight_version: int, /) -> Mapping[str, float]: ...


class EngineUrlError(ValueError):
    pass


def engine_url(args: Any, sample: Sample) -> str:
    """Where a custom generate function sends `/generate`.

    In order: `sample.metadata["engine_url"]` (sticky routing: the loop may pin a multi-turn
    session to one engine), `args.engine_url` (the router, or first engine, that the
    generation loop's `HookArgs` carries), then `args.engine.urls[0]` (external SGLang
    servers, for a hook called with the bare run config).
    """
    url = sample.metadata.get("engine_url") or getattr(args, "engine_url", None)
    if not url:
        urls = getattr(getattr(args, "engine", None), "urls", None) or []
        url = urls[0] if urls else None
    if not url:
        raise EngineUrlError(
            f"sample {sample.index}: no engine URL for the custom generate function (set "
            "sample.metadata['engine_url'], args.engine_url or engine.urls)"
        )
    return str(url)
