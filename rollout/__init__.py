"""Rollout service for RL post-training.

The contract (`SamplingParams`, the Arrow schema, config structs) imports without Ray; the service
functions (`init`, `sample`, `update_weights`, `init_weight_sync`, `shutdown`) are loaded on first use.
"""

from rollout.params import SamplingParams
from rollout.schema import SAMPLE_SCHEMA

__all__ = ["SamplingParams", "SAMPLE_SCHEMA", "init", "sample", "update_weights", "init_weight_sync", "shutdown"]

_SERVICE_NAMES = {"init", "sample", "update_weights", "init_weight_sync", "shutdown", "RolloutStream"}


def __getattr__(name: str):
    if name in _SERVICE_NAMES:
        from rollout import api

        return getattr(api, name)
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
