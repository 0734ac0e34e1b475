"""Rotary embeddings that recompute their frequencies in every forward (PhiMoE's calls
`self.rope_init_fn(self.config)` each time) build a CPU tensor and copy it to the device: a host copy
per step, and a launch a CUDA graph cannot capture. `cache_rope_init` makes them reuse tensors made
once, on the model's device, with the same values. `freeze_dynamic_rope` does the same for dynamic-NTK
RoPE, whose check of the batch's largest position waits on the host in every forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import transformers


def cache_rope_init(model: transformers.PreTrainedModel) -> None:
    """Give every rotary embedding of `model` that keeps a `rope_init_fn` a cached one; the others are
    left untouched. A call with other arguments than the module's config (a `seq_len`) still computes."""
    for module in model.modules():
        init = getattr(module, "rope_init_fn", None)
        buffer = getattr(module, "inv_freq", None)
        if init is None or not isinstance(buffer, torch.Tensor):
            continue
        inv_freq, scaling = init(module.config)
        cached = inv_freq.to(buffer.device, torch.float32), scaling
        module.rope_init_fn = functools.partial(_cached_init, init, module.config, cached)


def _cached_init(init: Callable, config: transformers.PretrainedConfig, cached: tuple[torch.Tensor, float],
                 called_with: transformers.PretrainedConfig, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, float]:
    """`cached` for the module's own config and no other argument, else `init`'s result."""
    return cached if called_with is config and not args and not kwargs else init(called_with, *args, **kwargs)


def freeze_dynamic_rope(model: transformers.PreTrainedModel) -> None:
    """Let every dynamic-NTK rotary embedding keep its frequencies. transformers changes them only for a
    sequence longer than `max_position_embeddings`, which `max_model_len` never exceeds, but reads the
    batch's largest position on the host in every forward to find that out."""
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if isinstance(rope_type, str) and "dynamic" in rope_type:
            module.rope_type = "default"
        elif isinstance(rope_type, dict):
            module.rope_type = {key: "default" if "dynamic" in kind else kind for key, kind in rope_type.items()}
