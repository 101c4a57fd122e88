"""Secrets in a run config: the actors get them, nothing a person or a file sees shows them.

A run config travels pickled to the actors (which need the real credentials) and is dumped
to config.yaml, the Prefect UI and logs (which must not show them). Matching key names
(`secret`, `token`) missed a token stored under another name and the password in
`http://user:pass@host`, so redaction here works by value:

* every string in `storage.storage_options` is a secret, except a few options known to be
  harmless (`profile`, `region_name`, ...);
* the password (and secret-looking query parameters) of every URL field;
* each such value, once the driver has seen the config, is scrubbed from log records and
  error logs wherever it appears (`register` + `ScrubFilter`).

Prefer credentials the config does not carry: `AWS_*` environment variables, instance or
profile credentials on every Ray node.
"""

from __future__ import annotations

import logging
import threading
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "REDACTED"
# storage_options whose values are settings, never credentials
VISIBLE_OPTIONS = frozenset({
    "anon", "profile", "region_name", "use_ssl", "requester_pays", "endpoint_url",
    "default_block_size", "default_cache_type", "version_aware", "asynchronous",
    "skip_instance_cache", "use_listings_cache", "signature_version", "addressing_style",
    "client_kwargs", "config_kwargs", "s3_additional_kwargs",
})
_SECRET_QUERY_WORDS = ("key", "secret", "token", "password", "credential", "signature", "sig")
_MIN_SECRET_LEN = 4  # shorter values would scrub ordinary text


def redact_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with every credential-like value (any string not under a visible key)
    replaced by REDACTED, nested dicts and lists included."""
    return {name: _redact_value(name, value) for name, value in options.items()}


def _redact_value(name: str, value: Any) -> Any:
    if isinstance(value, dict):
        return redact_options(value)
    if isinstance(value, list):
        return [_redact_value(name, v) for v in value]
    if isinstance(value, str) and value and name not in VISIBLE_OPTIONS:
        return REDACTED
    return value


def drop_redacted(options: dict[str, Any]) -> dict[str, Any]:
    """Inverse use: a config read back from config.yaml forgets the REDACTED placeholders,
    so the credentials come from the environment (or `--set`) instead."""
    return {k: drop_redacted(v) if isinstance(v, dict) else v
            for k, v in options.items() if v != REDACTED}


def redact_url(url: str | None) -> str | None:
    """`url` with its password and secret-looking query values replaced by REDACTED."""
    if not url or "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password:
        netloc = netloc.replace(f":{parts.password}@", f":{REDACTED}@", 1)
    query = urlencode([(k, REDACTED if _secret_word(k) else v)
                       for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe=REDACTED)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _secret_word(name: str) -> bool:
    return any(word in name.lower() for word in _SECRET_QUERY_WORDS)


def url_secrets(url: str | None) -> set[str]:
    if not url or "://" not in url:
        return set()
    parts = urlsplit(url)
    found = {parts.password} if parts.password else set()
    found |= {v for k, v in parse_qsl(parts.query) if _secret_word(k)}
    return found


def option_secrets(options: dict[str, Any]) -> set[str]:
    """The values `redact_options` hides."""
    found: set[str] = set()
    for name, value in options.items():
        if isinstance(value, dict):
            found |= option_secrets(value)
        elif isinstance(value, list):
            for item in value:
                found |= option_secrets({name: item})
        elif isinstance(value, str) and value and name not in VISIBLE_OPTIONS:
            found.add(value)
    return found


class SecretRegistry:
    """The secret values this process has seen, to scrub from any text."""

    def __init__(self) -> None:
        self._values: set[str] = set()
        self._lock = threading.Lock()

    def add(self, values: set[str]) -> None:
        with self._lock:
            self._values |= {v for v in values if len(v) >= _MIN_SECRET_LEN}

    def scrub(self, text: str) -> str:
        for value in sorted(self._values, key=len, reverse=True):
            text = text.replace(value, REDACTED)
        return text


REGISTRY = SecretRegistry()


def register(values: set[str]) -> None:
    """Remember secret values so logs and error logs of this process never show them."""
    REGISTRY.add(values)
    install_scrubbing()


def scrub(text: str) -> str:
    return REGISTRY.scrub(text)


class ScrubFilter(logging.Filter):
    """Rewrites a record whose message contains a registered secret."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


_FILTER = ScrubFilter()


def install_scrubbing() -> None:
    """Put the scrub filter on every handler of the root, `prefect` and rollflow loggers
    (idempotent; handlers Prefect adds later are covered on the next call)."""
    names = ("prefect", "prefect.flow_runs", "prefect.task_runs", "flows", "tasks", "engines",
             "storage")
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in names)]
    for logger in loggers:
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
