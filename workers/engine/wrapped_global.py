"""A function that transformers' modeling code calls by its global name, wrapped in place once per module."""

from __future__ import annotations

import functools
from typing import Any, Callable


class WrappedGlobal:
    """Base of a wrapper of a modeling module's global function: subclasses define `__call__` and call the
    original as `self.function`."""

    def __init__(self, function: Callable) -> None:
        self.function = function
        functools.update_wrapper(self, function)

    @classmethod
    def install(cls, namespace: dict[str, Any], name: str) -> None:
        """Replace `namespace[name]` (a modeling module's globals) by this wrapper of it, unless it is one."""
        if not isinstance(namespace[name], cls):
            namespace[name] = cls(namespace[name])
