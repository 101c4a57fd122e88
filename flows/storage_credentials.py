"""Storage credentials from a Prefect Secret block, read when a flow starts.

Credentials written into `storage.storage_options` are redacted from config.yaml and the
Prefect UI, so a replay, a `rollflow train` resume from config.yaml or a retry from the UI
had to be given them again. With `storage.credentials_block: NAME`, the config carries only
the block's name: the flow reads the block (a JSON object of storage options, e.g.
`{"key": ..., "secret": ...}` for S3) from the Prefect server it reports to, every time it
starts, and the actors get the options with the config, as before. Keys set in
`storage_options` itself win over the block's, so one setting can be overridden per run.

    prefect block create secret   # or, in Python:
    Secret(value={"key": "AKIA...", "secret": "..."}).save("rollflow-s3")
"""

from __future__ import annotations

from typing import Any, cast

from flows.config import ConfigError, RollflowConfig
from storage.secrets import register


def _block_value(name: str) -> Any:
    from prefect.blocks.system import Secret
    from prefect.exceptions import ObjectNotFound

    try:
        block = cast(Secret, Secret.load(name, _sync=True))  # type: ignore[call-arg]
        return block.get()
    except (ObjectNotFound, ValueError) as exc:
        raise ConfigError(
            f"storage.credentials_block={name!r}: no Secret block of that name on this Prefect "
            f"server ({exc}); create it with Secret(value={{...}}).save({name!r})"
        ) from None


def with_block_credentials(config: RollflowConfig) -> RollflowConfig:
    """`config` with its credentials block's options under `storage.storage_options`
    (unchanged without a block). The values are registered for scrubbing from logs."""
    storage = config.storage
    name = storage.credentials_block
    if not name:
        return config
    value = _block_value(name)
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"storage.credentials_block={name!r}: the Secret holds a {type(value).__name__}; "
            "expected a JSON object of storage options, e.g. {\"key\": ..., \"secret\": ...}"
        )
    options = {**value, **storage.storage_options}
    merged = config.model_copy(
        update={"storage": storage.model_copy(update={"storage_options": options})}
    )
    register(merged.secret_values())
    return merged
