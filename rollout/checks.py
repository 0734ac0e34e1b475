"""Field type checks for msgspec structs built by keyword: msgspec checks types only when it decodes,
so `SamplingParams(n=2.0)` would otherwise fail late, inside an engine step."""

from __future__ import annotations

import sys
from functools import cache

import msgspec
from msgspec import inspect as mi

_PYTHON_TYPES = {mi.NoneType: type(None), mi.BoolType: bool, mi.StrType: str, mi.IntType: int}
_NAMES = {mi.NoneType: "None", mi.BoolType: "bool", mi.StrType: "str", mi.IntType: "int",
          mi.FloatType: "float (finite)"}


def check_types(struct: msgspec.Struct) -> None:
    """ValueError naming the first field whose value is not of its declared type (a bool is not an
    int; an int is a float, unless too large for one; nan and infinities are not)."""
    for field in _fields(type(struct)):
        value = getattr(struct, field.name)
        if not _matches(value, field.type):
            raise ValueError(f"{type(struct).__name__}.{field.name}={value!r} is not of type "
                             f"{_describe(field.type)}")


@cache
def _fields(cls: type) -> tuple[mi.Field, ...]:
    return mi.type_info(cls).fields


def _matches(value: object, kind: mi.Type) -> bool:
    if isinstance(kind, mi.UnionType):
        return any(_matches(value, each) for each in kind.types)
    if isinstance(kind, mi.ListType):
        return isinstance(value, list) and all(_matches(v, kind.item_type) for v in value)
    if isinstance(kind, mi.StructType):
        return isinstance(value, kind.cls)
    if isinstance(kind, mi.FloatType):
        # (an int too large for a float is no float either: math.isfinite would raise OverflowError)
        return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= sys.float_info.max
    expected = _PYTHON_TYPES.get(type(kind))
    if expected is int and isinstance(value, bool):
        return False
    return expected is None or isinstance(value, expected)


def _describe(kind: mi.Type) -> str:
    if isinstance(kind, mi.UnionType):
        return " | ".join(_describe(each) for each in kind.types)
    if isinstance(kind, mi.ListType):
        return f"list[{_describe(kind.item_type)}]"
    if isinstance(kind, mi.StructType):
        return kind.cls.__name__
    return _NAMES.get(type(kind), type(kind).__name__)
