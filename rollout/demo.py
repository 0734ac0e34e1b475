"""What `rollout demo` samples: a cached tiny random-weight model and a few built-in prompts."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

DEMO_MODEL = Path("~/.cache/rollout/tiny-qwen3").expanduser()  # also configs/local.toml's default model

DEMO_PROMPTS = [
    "The capital of France is",
    "Two plus two equals",
    "Write a short poem about the sea and the sky.",
    "Explain why the sky is blue in one sentence.",
    "Solve for x: 3x + 5 = 20.",
    "def add(a, b):",
    "Reinforcement learning from human feedback",
    "The quick brown fox",
]


def demo_model(path: Path = DEMO_MODEL) -> Path:
    """The demo's tiny Qwen3-style model with random weights and a small tokenizer, built on first use."""
    if (path / "config.json").is_file():
        return path
    from workers.engine.tiny_models import build_tiny_model  # torch and transformers: only when building

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    build_tiny_model(staging, "qwen3")
    try:
        staging.rename(path)  # atomic: a concurrent demo either finds the whole model or builds its own
    except OSError:
        shutil.rmtree(staging)  # another demo got there first
    return path
