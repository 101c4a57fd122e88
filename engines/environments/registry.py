"""`rollout.environment` URIs to opened environments, once per process.

- `verifiers://<env_id>?<arg>=<value>`: a verifiers environment (engines/environments/verifiers_env.py);
- `openenv://<module:Class or URL>?...`: an OpenEnv environment server (engines/environments/openenv_env.py);
- `pkg.module:factory?<arg>=<value>`: an environment a user wrote; `factory(uri=..., **args)`
  returns an object with `engines.environments.base.Environment`'s methods.

Opening may be slow (an environment's dataset, a server's start), and every sample of a run
uses the same environment, so an open one is kept per process until `close_environments`.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from engines.config.rollout import is_environment_uri
from engines.environments.base import Environment, EnvironmentError

SCHEMES = {
    "verifiers://": "engines.environments.verifiers_env:open_verifiers_environment",
    "openenv://": "engines.environments.openenv_env:open_openenv_environment",
}
_open: dict[str, Environment] = {}
_lock = threading.Lock()


def query_args(uri: str) -> dict[str, str]:
    """The `?a=1&b=x` part as strings (an environment types its own arguments)."""
    return dict(parse_qsl(urlsplit(uri).query, keep_blank_values=True))


def open_environment(uri: str) -> Environment:
    """The environment `uri` names, opened on first use in this process."""
    with _lock:
        if uri not in _open:
            _open[uri] = _opener(uri)(uri)
        return _open[uri]


def close_environments() -> None:
    with _lock:
        opened = list(_open.values())
        _open.clear()
    for env in opened:
        env.close()


def _opener(uri: str) -> Any:
    for scheme, target in SCHEMES.items():
        if uri.startswith(scheme):
            module, name = target.split(":")
            return getattr(importlib.import_module(module), name)
    if not is_environment_uri(uri):
        raise EnvironmentError(uri, "expected verifiers://<env_id>, openenv://<module:Class or "
                               "URL>, or an import string pkg.module:factory")
    module, name = uri.split("?", 1)[0].split(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise EnvironmentError(uri, f"cannot import {module}:{name}: {e}") from None
    return lambda u: factory(uri=u, **query_args(u))
