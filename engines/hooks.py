"""User hooks by import string ("pkg.mod:fn" or "pkg.mod.fn"), checked at start-up.

A hook that does not import, or whose signature cannot take the documented arguments, fails
immediately with the config key that named it, not at step 37.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any


class HookError(ValueError):
    pass


def load_function(path: str, config_key: str = "hook") -> Callable[..., Any]:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise HookError(f"{config_key}: {path!r} is not an import string like 'pkg.mod:fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise HookError(f"{config_key}: cannot import {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise HookError(f"{config_key}: {module_name!r} has no callable {attr!r}")
    return fn


def check_arity(fn: Callable[..., Any], n_args: int, config_key: str) -> None:
    """Raise unless `fn` accepts `n_args` positional arguments."""
    try:
        inspect.signature(fn).bind(*([None] * n_args))
    except TypeError as e:
        raise HookError(
            f"{config_key}: {getattr(fn, '__qualname__', fn)} cannot take {n_args} "
            f"positional arguments: {e}"
        ) from None


def load_hook(
    path: str, config_key: str, n_args: int, must_be_async: bool = False
) -> Callable[..., Any]:
    fn = load_function(path, config_key)
    check_arity(fn, n_args, config_key)
    if must_be_async and not inspect.iscoroutinefunction(fn):
        raise HookError(f"{config_key}: {path!r} must be an `async def` function")
    return fn
