"""User hooks by import string ("pkg.mod:fn" or "pkg.mod.fn"), checked at start-up.

A hook that does not import, or whose signature does not fit its protocol
(`engines.hooks.protocols`), fails immediately with the config key that named it, not at
step 37. `validate_hooks(cfg)` checks every hook a config names in one go.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import reprlib
from collections.abc import Callable
from typing import Any, NoReturn

from engines.hooks import protocols
from storage.sample import Group, Sample


class HookError(ValueError):
    """A hook that cannot be loaded, or user code that raised inside one: either fails the
    same way on every retry, so the step task reports it at once (`DETERMINISTIC`)."""


# Config key -> the protocol its hook must satisfy. Keys whose field a config lacks are skipped.
HOOKS: dict[str, type] = {
    "rollout.function_path": protocols.RolloutFn,
    "rollout.custom_generate_function_path": protocols.GenerateFn,
    "rollout.agent_path": protocols.AgentFn,
    "rollout.custom_rm_path": protocols.RewardFn,
    "rollout.dynamic_sampling_filter_path": protocols.DynamicFilterFn,
    "rollout.over_sampling_filter_path": protocols.OverSamplingFilterFn,
    "rollout.buffer_filter_path": protocols.BufferFilterFn,
    "rollout.sample_filter_path": protocols.SampleFilterFn,
    "algorithm.custom_loss_function_path": protocols.CustomLossFn,
    "algorithm.custom_advantage_function_path": protocols.CustomAdvantageFn,
    "eval.eval_function_path": protocols.EvalFn,
}


# Keys that also accept a built-in by bare name: where that key's registry lives (imported
# lazily, since the registries import this module).
BUILTIN_REGISTRIES: dict[str, str] = {
    "rollout.dynamic_sampling_filter_path": "engines.rollout.filters:DYNAMIC_FILTERS",
    "rollout.over_sampling_filter_path": "engines.rollout.filters:OVER_SAMPLING_FILTERS",
}


def builtin(config_key: str, name: str) -> Callable[..., Any] | None:
    """The built-in called `name` for `config_key`, None if `name` is an import string."""
    if "." in name or ":" in name:
        return None
    registry: dict[str, Callable[..., Any]] = (
        import_object(BUILTIN_REGISTRIES[config_key]) if config_key in BUILTIN_REGISTRIES else {}
    )
    if name not in registry:
        raise HookError(
            f"{config_key}: {name!r} is neither an import string like 'pkg.mod:fn' nor a "
            f"built-in (built-ins: {sorted(registry)})"
        )
    return registry[name]


def import_object(path: str, config_key: str = "hook") -> Any:
    """`pkg.mod:name` or `pkg.mod.name` -> the object (None if the module lacks it)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise HookError(f"{config_key}: {path!r} is not an import string like 'pkg.mod:fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise HookError(f"{config_key}: cannot import {module_name!r}: {e}") from e
    return getattr(module, attr, None)


def load_function(path: str, config_key: str = "hook") -> Callable[..., Any]:
    fn = import_object(path, config_key)
    if fn is None or not callable(fn):
        raise HookError(f"{config_key}: {path!r} does not name a callable in its module")
    return fn  # type: ignore[no-any-return]


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or fn)


def _qualified(fn: Callable[..., Any]) -> str:
    """`module:function`, as a user would write the hook's import string."""
    return f"{getattr(fn, '__module__', None) or '?'}:{_name(fn)}"


def bad_return(
    fn: Callable[..., Any], config_key: str, value: Any, expected: str, part: str = ""
) -> HookError:
    """A hook's result of the wrong shape: it comes back the same on every retry, so a
    `HookError` (reported at once) naming the hook, what it returned (`part`: which part of
    the result, e.g. "for metric 'acc'") and what was expected, instead of a TypeError a few
    lines later that the step task would retry."""
    return HookError(f"{config_key}: {_qualified(fn)} returned {type(value).__name__} "
                     f"{reprlib.repr(value)}{' ' + part if part else ''}, expected {expected}")


def checked_returns(
    fn: Callable[..., Any], config_key: str, ok: Callable[[Any], bool], expected: str
) -> Callable[..., Any]:
    """`fn` (a synchronous hook) whose every result must pass `ok`; any other result is the
    `bad_return` HookError. Checked where the hook is loaded, so the callers stay as they
    are for built-ins."""

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if not ok(result):
            raise bad_return(fn, config_key, result, expected)
        return result

    return checked


def check_arity(fn: Callable[..., Any], n_args: int, config_key: str) -> None:
    """Raise unless `fn` accepts `n_args` positional arguments."""
    try:
        inspect.signature(fn).bind(*([None] * n_args))
    except TypeError as e:
        raise HookError(
            f"{config_key}: {_name(fn)} cannot take {n_args} positional arguments: {e}"
        ) from None


def is_async(fn: Callable[..., Any]) -> bool:
    """`async def` functions, and objects or partials whose call is one."""
    target = getattr(fn, "func", fn)  # functools.partial
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - callable objects, not callability
    )


def protocol_arity(protocol: type) -> int:
    """Positional arguments a call site of `protocol` passes (all of them, defaults too)."""
    params = list(inspect.signature(protocol.__call__).parameters.values())[1:]  # type: ignore[operator]
    return sum(x.kind in (x.POSITIONAL_ONLY, x.POSITIONAL_OR_KEYWORD) for x in params)


def check_protocol(fn: Callable[..., Any], protocol: type, config_key: str) -> None:
    """Raise a `HookError` naming `config_key` unless `fn` fits `protocol`."""
    check_arity(fn, protocol_arity(protocol), config_key)
    wants_async = inspect.iscoroutinefunction(protocol.__call__)  # type: ignore[operator]
    if wants_async and not is_async(fn):
        raise HookError(
            f"{config_key}: {_name(fn)} must be an `async def` function ({protocol.__name__})"
        )
    if not wants_async and is_async(fn):
        raise HookError(
            f"{config_key}: {_name(fn)} must be a plain `def`, not `async def` "
            f"({protocol.__name__})"
        )


def load_hook(
    path: str, config_key: str, spec: type | int, must_be_async: bool = False
) -> Any:
    """Import `path` and check it: against a protocol (preferred) or a bare arity."""
    fn = load_function(path, config_key)
    if isinstance(spec, int):
        check_arity(fn, spec, config_key)
        if must_be_async and not is_async(fn):
            raise HookError(f"{config_key}: {path!r} must be an `async def` function")
    else:
        check_protocol(fn, spec, config_key)
    return fn


def returned_groups(fn: Callable[..., Any], config_key: str, value: Any) -> list[Group]:
    """`value` as a list if it is a list (or tuple) of non-empty groups of `Sample`s, else
    the `bad_return` HookError: what a buffer filter, an over-sampling filter or a rollout
    function must give back."""
    if isinstance(value, list | tuple) and all(
        isinstance(g, list | tuple) and g and all(isinstance(s, Sample) for s in g)
        for g in value
    ):
        return list(value)
    raise bad_return(fn, config_key, value, "a list of groups (non-empty lists of Sample)")


# Errors that pass through a guarded hook unwrapped: I/O that may work on a retry (an
# unreachable service, a timeout) and errors that already say what they are (rollflow's own,
# e.g. RewardError, raised by a built-in the hook calls; Ray's, an actor that died under it).
_OWN_PACKAGES = frozenset({"engines", "storage", "ray", "httpx", "httpcore", "aiohttp"})


def _passes_through(e: Exception) -> bool:
    return isinstance(e, OSError | HookError) or (
        type(e).__module__.partition(".")[0] in _OWN_PACKAGES
    )


def _argument(name: str, value: Any) -> str | None:
    """How an error names one argument of the failed call: samples by index and prompt line."""
    if isinstance(value, Sample):
        return value.describe()
    if isinstance(value, list) and value and isinstance(value[0], Sample):
        return f"the group of {value[0].describe()}"
    if isinstance(value, list) and value and isinstance(value[0], list):
        return f"{len(value)} groups"
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        return f"{name}={value!r}"
    return None


def _call_site(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    """'sample 3 (prompt line 4 of train.jsonl)' for the arguments after the run config."""
    try:
        bound = inspect.signature(fn).bind_partial(*args).arguments
    except (TypeError, ValueError):
        bound = {f"arg{i}": a for i, a in enumerate(args)}
    named = [_argument(k, v) for k, v in list(bound.items())[1:]]
    return ", ".join(n for n in named if n)


def hook_failure(
    e: Exception, fn: Callable[..., Any], config_key: str, args: tuple[Any, ...]
) -> Exception:
    """`e` as the HookError the step reports (or `e` itself if it passes through): the hook
    as `module:function`, the samples it was called on, and the original error."""
    if _passes_through(e):
        return e
    where = _call_site(fn, args)
    return HookError(f"{config_key}: {_qualified(fn)} failed" + (f" on {where}" if where else "")
                     + f": {type(e).__name__}: {e}")


def _raise_as_hook_failure(
    e: Exception, fn: Callable[..., Any], config_key: str, args: tuple[Any, ...]
) -> NoReturn:
    """Raise `hook_failure(e, ...)` from `e`, or `e` itself where it passes through."""
    failure = hook_failure(e, fn, config_key, args)
    if failure is e:
        raise e
    raise failure from e


def guard(fn: Callable[..., Any], config_key: str) -> Callable[..., Any]:
    """`fn`, but an exception from the user's code in it comes out as a `HookError` with the
    original as `__cause__`: a bug in a reward or filter fails the same way on every retry,
    so the step stops at once, naming the hook and sample, instead of retrying twice.
    rollflow's own functions named by import string are returned as they are."""
    if str(getattr(fn, "__module__", "")).partition(".")[0] in _OWN_PACKAGES:
        return fn
    if is_async(fn):
        @functools.wraps(fn)
        async def guarded_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except Exception as e:
                _raise_as_hook_failure(e, fn, config_key, args)

        return guarded_async

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            _raise_as_hook_failure(e, fn, config_key, args)

    return guarded


def load_user_hook(
    path: str, config_key: str, spec: type | int, must_be_async: bool = False
) -> Any:
    """`load_hook`, guarded: for hooks that compute on samples (rewards, filters, losses,
    eval), whose exceptions are bugs in them, not an engine that went away."""
    return guard(load_hook(path, config_key, spec, must_be_async), config_key)


def configured_hooks(cfg: Any) -> dict[str, tuple[str, type]]:
    """Config key -> (import string, protocol) for every hook `cfg` sets."""
    found: dict[str, tuple[str, type]] = {}
    for key, protocol in HOOKS.items():
        section, _, field = key.partition(".")
        path = getattr(getattr(cfg, section, None), field, None)
        if not path:
            continue
        if key == "rollout.custom_rm_path" and getattr(cfg.rollout, "group_rm", False):
            protocol = protocols.GroupRewardFn
        found[key] = (str(path), protocol)
    return found


def validate_hooks(cfg: Any) -> dict[str, Callable[..., Any]]:
    """Load and check every hook the config names (call at start-up); key -> function."""
    loaded: dict[str, Callable[..., Any]] = {}
    for key, (path, protocol) in configured_hooks(cfg).items():
        fn = builtin(key, path)
        if fn is None:
            fn = load_hook(path, key, protocol)
        else:
            check_protocol(fn, protocol, key)
        loaded[key] = fn
    return loaded
