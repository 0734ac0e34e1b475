"""The single-process engine: paged KV cache, continuous batching, fork, sampling. Never imports Ray."""

from rollout.config import EngineConfig
from workers.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
