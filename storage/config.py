"""The base of every component's config section, `ConfigError`, and the storage section.

Each component owns its config class, with a description per field and its checks beside it
(torchtitan's configurable style): the engines' sections in `engines/config/` (one module per
section), the storage section in this module; `flows/config/run.py` only composes them into the
run config and checks what spans sections. They sit at the bottom of the layer they belong
to, so no layer imports the one above it, not even for a type.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from storage.secrets import redact_options, redact_url


class Section(BaseModel):
    """A config section: unknown keys and invalid values (also on assignment) fail."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config problem, with the dotted key(s) at fault in the message."""


RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


class StorageRetryConfig(Section):
    """How each S3 request rides out a store that is briefly down (503 SlowDown, a timeout,
    a refused or dropped connection): botocore's own retry modes, with exponential backoff
    and jitter, retry it before anything fails. A request that still fails raises
    `StorageError` naming the file and the store; the step's task is then retried (twice),
    and a step that still fails keeps every committed step: run the same command again
    once the store is back. Local paths ignore this section."""

    max_attempts: int = Field(
        10, ge=1, le=100,
        description="Attempts per S3 request, the first included (botocore `max_attempts`). "
        "In standard mode the n-th retry waits a random 0..2^(n-1) s, at most 20 s: the "
        "default rides out an outage of about a minute per request.",
    )
    mode: Literal["standard", "adaptive"] = Field(
        "standard",
        description="botocore retry mode: `standard`, or `adaptive` (standard plus a "
        "client-side rate limit that backs off further while the store answers SlowDown).",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Seconds to open a connection.")
    read_timeout_s: float = Field(
        60.0, gt=0, description="Seconds to wait for a response before retrying the request."
    )

    def config_kwargs(self) -> dict[str, Any]:
        """botocore `Config` arguments (s3fs `config_kwargs`)."""
        return {"retries": {"max_attempts": self.max_attempts, "mode": self.mode},
                "connect_timeout": self.connect_timeout_s, "read_timeout": self.read_timeout_s}


class StorageConfig(Section):
    uri: str = Field("./runs", description="Root of all runs: a path or s3://bucket/prefix.")
    run_name: str = Field(
        "run",
        description="Run directory under the root: letters, digits, '.', '_' and '-', starting "
        "with a letter or digit (so it stays inside the root and names actors and artifacts).",
    )
    endpoint_url: str | None = Field(
        None, repr=False, description="S3-compatible endpoint (MinIO, moto)."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        repr=False,
        description="fsspec/s3fs options, e.g. {key, secret} or {profile}. They travel with "
        "the config to every actor; config.yaml, the Prefect UI and logs show every string "
        "value except harmless settings (profile, region_name, ...) as REDACTED, so a replay or "
        "a UI retry needs them again (prefer credentials_block, AWS_* env vars or instance "
        "credentials on every Ray node).",
    )
    credentials_block: str | None = Field(
        None,
        description="Name of a Prefect Secret block holding a JSON object of storage options "
        "(e.g. {key, secret}), read by each flow when it starts and merged under "
        "storage_options (whose own keys win). Only the name is in config.yaml and the UI, so "
        "a replay, a resume or a UI retry finds the credentials again.",
    )
    compression: Literal["zstd", "lz4"] | None = "zstd"
    retries: StorageRetryConfig = Field(
        default_factory=StorageRetryConfig,
        description="Retries of S3 requests while the store is briefly unavailable.",
    )

    def store_options(self) -> dict[str, Any]:
        """`storage_options` as the run's store opens with them (`options_for(uri)`)."""
        return self.options_for(self.uri)

    def options_for(self, uri: str) -> dict[str, Any]:
        """`storage_options` for a store at `uri` (the run's, or prompt data's): on S3 with
        the retry settings under s3fs's `config_kwargs` (keys given there in
        storage_options win)."""
        options = dict(self.storage_options)
        if uri.startswith("s3://"):
            options["config_kwargs"] = {**self.retries.config_kwargs(),
                                        **options.get("config_kwargs", {})}
        return options

    @field_validator("run_name")
    @classmethod
    def _safe_run_name(cls, name: str) -> str:
        if not re.fullmatch(RUN_NAME_PATTERN, name):
            raise ValueError(
                f"{name!r} must be 1-100 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit (it names a directory under storage.uri, actors and artifacts)"
            )
        return name

    @field_serializer("storage_options")
    def _redact(self, options: dict[str, Any]) -> dict[str, Any]:
        """Pickling (Ray) keeps the values; every dump (config.yaml, Prefect) hides them."""
        return redact_options(options)

    @field_serializer("endpoint_url")
    def _redact_endpoint(self, url: str | None) -> str | None:
        return redact_url(url)
