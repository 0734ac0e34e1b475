"""The single-process engine: paged KV cache, continuous batching, fork, sampling. Never imports Ray.

`Engine` and `EngineConfig` load on first use, so that a module of the engine's that the trainer side shares
(`checkpoint_files`, through workers/weight_format.py) loads without the engine and transformers' models."""

from __future__ import annotations

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str) -> object:
    if name == "Engine":
        from workers.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from rollout.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
