"""Evaluate one weight version of a run on its `eval.datasets`, as its own flow run.

For deployments: a scheduled or on-demand evaluation of a run that is still training (or
finished) without touching its driver. The trainer is brought to the version from storage
(checkpoint + replay of committed batches, the same rebuild path as a resume), the engines
receive its weights, and the result lands in `eval/{version:06d}.json` like the train flow's.
Its actors live in their own namespace (`<cluster.namespace>-eval`), so evaluating a run
that is training never attaches to, rebuilds or kills that run's trainer and engines.
"""

from __future__ import annotations

from typing import Any

import ray
from prefect import flow

from engines.cluster.actors import get_or_create_actors, kill_run_actors
from engines.cluster.head import connect
from flows.config.history import warn_if_replayed_under_changed_config
from flows.config.paths import resolve_paths
from flows.config.run import ConfigError, RollflowConfig
from flows.config.storage_credentials import with_storage_credentials
from flows.rollout_step import open_layout
from tasks.step_context import StepContext
from tasks.step_tasks import evaluate_version


def eval_config(config: RollflowConfig) -> RollflowConfig:
    cluster = config.cluster.model_copy(update={"namespace": f"{config.cluster.namespace}-eval"})
    return config.model_copy(update={"cluster": cluster})


@flow(name="evaluate", flow_run_name="evaluate-{config.storage.run_name}", persist_result=False)
def evaluate(config: RollflowConfig, weight_version: int | None = None) -> dict[str, Any]:
    """`weight_version` None: the newest committed one (the weights after the last step)."""
    if not config.eval.enabled:
        raise ConfigError("eval.datasets is empty and eval.eval_function_path unset: nothing "
                          "to evaluate")
    config = with_storage_credentials(resolve_paths(config))
    connect(config.cluster)
    layout = open_layout(config)
    newest = layout.next_rollout_id()
    version = newest if weight_version is None else weight_version
    if not 0 <= version <= newest:
        raise ConfigError(
            f"weight_version {version}: run {config.storage.run_name!r} has versions 0..{newest}"
        )
    config = eval_config(config)
    ctx = StepContext(config, layout, get_or_create_actors(config))
    restored = ray.get(ctx.actors.trainer.ensure_version.remote(version))
    warn_if_replayed_under_changed_config(restored, layout, config)
    ctx.pool.sync_weights()
    metrics = evaluate_version(ctx, version)
    if not config.cluster.keep_actors:
        kill_run_actors(config)
    return {"run_dir": layout.uri, "weight_version": version, "restored": restored,
            "metrics": metrics}
