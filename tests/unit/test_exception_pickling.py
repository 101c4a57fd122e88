"""Every rollflow exception survives pickling, so Ray shows it (not `UnserializableException`).

Classes are found by walking the packages, so a new exception class is covered without
editing this file; its constructor arguments are made up from their type hints.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import typing
from typing import Any

import pytest

PACKAGES = ("storage", "engines", "tasks", "flows")
SAMPLE_VALUES: dict[Any, Any] = {str: "some-text", int: 7, float: 0.5, bool: True}


def rollflow_exceptions() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (inspect.isclass(obj) and issubclass(obj, BaseException)
                        and obj.__module__ == info.name):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


def has_own_init(cls: type[BaseException]) -> bool:
    return any("__init__" in vars(c) for c in cls.__mro__ if c.__module__.split(".")[0] in PACKAGES)


def sample_args(cls: type[BaseException]) -> list[Any]:
    """Distinct made-up values for the constructor's parameters, by their type hints."""
    if not has_own_init(cls):
        return ["something went wrong"]
    hints = typing.get_type_hints(cls.__init__)
    args = []
    for i, name in enumerate(list(inspect.signature(cls.__init__).parameters)[1:]):
        hint = hints.get(name, str)
        options = typing.get_args(hint) or (hint,)
        kind = next((t for t in options if t in SAMPLE_VALUES), None)
        assert kind is not None, f"{cls.__name__}({name}: {hint}): give the test a sample value"
        value = SAMPLE_VALUES[kind]
        args.append(f"{value}-{i}" if kind is str else value + i if kind is int else value)
    return args


EXCEPTIONS = rollflow_exceptions()


def test_the_walk_finds_the_known_exceptions():
    names = {cls.__name__ for cls in EXCEPTIONS}
    assert {"ConfigError", "DatasetError", "SGLangError", "HookError", "RewardConfigError"} <= names


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_exception_round_trips_through_pickle(cls):
    err = cls(*sample_args(cls))
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
    assert back.args == err.args
    assert vars(back) == vars(err)
