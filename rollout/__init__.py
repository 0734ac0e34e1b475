"""Rollout service for RL post-training.

The contract (`SamplingParams`, the Arrow schema, config structs) imports without Ray; the service
functions (`init`, `sample`, `update_weights`, `init_weight_sync`, `shutdown`) are loaded on first use.
"""

from typing import Any

from rollout.params import SamplingParams
from rollout.schema import SAMPLE_SCHEMA

__all__ = ["SamplingParams", "SAMPLE_SCHEMA", "init", "sample", "update_weights", "init_weight_sync", "shutdown"]

_SERVICE_NAMES = {"init", "sample", "update_weights", "init_weight_sync", "shutdown", "RolloutStream"}


def __getattr__(name: str) -> Any:
    """The service functions, imported from `rollout.api` (and with it Ray) on first use."""
    if name in _SERVICE_NAMES:
        from rollout import api

        return getattr(api, name)
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
