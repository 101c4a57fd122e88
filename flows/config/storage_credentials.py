"""Storage credentials the actors need, gathered by the driver when a flow starts.

Credentials written into `storage.storage_options` are redacted from config.yaml and the
Prefect UI, so a replay, a `rollflow train` resume from config.yaml or a retry from the UI
had to be given them again. With `storage.credentials_block: NAME`, the config carries only
the block's name: the flow reads the block (a JSON object of storage options, e.g.
`{"key": ..., "secret": ...}` for S3) from the Prefect server it reports to, every time it
starts, and the actors get the options with the config. Keys set in
`storage_options` itself win over the block's, so one setting can be overridden per run.

    prefect block create secret   # or, in Python:
    Secret(value={"key": "AKIA...", "secret": "..."}).save("rollflow-s3")

The driver's `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN` go the same
way for an s3:// root: actors run in worker processes of a Ray head that may have started
before they were exported (the run would fail in the first actor to touch the bucket,
after the driver's own storage check had passed).
"""

from __future__ import annotations

import os
from typing import Any, cast

from flows.config.run import ConfigError, RollflowConfig
from storage.config import StorageConfig
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


# s3fs option <- the driver's environment variable
AWS_ENV_OPTIONS = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY",
                   "token": "AWS_SESSION_TOKEN"}


def _env_options(uri: str) -> dict[str, str]:
    if not uri.startswith("s3://"):
        return {}
    return {opt: os.environ[var] for opt, var in AWS_ENV_OPTIONS.items() if os.environ.get(var)}


def _block_options(name: str | None) -> dict[str, Any]:
    if not name:
        return {}
    value = _block_value(name)
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"storage.credentials_block={name!r}: the Secret holds a {type(value).__name__}; "
            "expected a JSON object of storage options, e.g. {\"key\": ..., \"secret\": ...}"
        )
    return value


def storage_options(storage: StorageConfig) -> dict[str, Any]:
    """The section's own options first, then its credentials block's, then the driver's
    `AWS_*` keys (those only when neither names credentials)."""
    given = {**_block_options(storage.credentials_block), **storage.storage_options}
    named = any(k in given for k in ("key", "profile", "anon"))
    return {**({} if named else _env_options(storage.uri)), **given}


def with_storage_credentials(config: RollflowConfig) -> RollflowConfig:
    """`config` with all of its storage credentials under `storage.storage_options`
    (`storage_options` above). Every secret of the result is registered for scrubbing from
    logs (a deployment's or the UI's flow run gets its config without the CLI)."""
    options = storage_options(config.storage)
    if options != config.storage.storage_options:
        storage = config.storage.model_copy(update={"storage_options": options})
        config = config.model_copy(update={"storage": storage})
    register(config.secret_values())
    return config
