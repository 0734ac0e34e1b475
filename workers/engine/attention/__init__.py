"""Paged attention registered with transformers' `AttentionInterface`.

The model runner installs one backend per step (`set_backend`); every attention layer of the Hugging
Face model then calls `paged_attention_forward`, which hands its packed q/k/v to that backend.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from workers.engine.attention.base import AttentionBackend, AttentionMetadata
from workers.engine.latent import absorb_query, expand_output

ATTN_IMPLEMENTATION = "rollout_paged"

# Keyword arguments transformers passes along that carry nothing our attention must act on.
_IGNORED_KWARGS = {"position_ids", "use_cache", "output_attentions", "is_causal", "cache_position",
                   "past_key_values", "position_embeddings", "layer_idx", "dropout"}

_backend: AttentionBackend | None = None


def set_backend(backend: AttentionBackend | None) -> None:
    """Make `backend` the one every layer's attention goes through (per process)."""
    global _backend
    _backend = backend


def current_metadata() -> AttentionMetadata | None:
    """The metadata of the step running now (None outside a step, and in the shape probe)."""
    return None if _backend is None else _backend.meta


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, s_aux: torch.Tensor | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """q `[1, Hq, T, D]`, k/v `[1, Hkv, T, D]` -> `[1, T, Hq, D]`, through the installed backend (a latent
    attention layer's k and v are its latent, workers/engine/latent.py)."""
    unsupported = sorted(k for k, v in kwargs.items()
                         if v is not None and v is not False and k not in _IGNORED_KWARGS)
    if unsupported:
        raise NotImplementedError(f"paged attention does not support the arguments {unsupported}")
    if kwargs.get("is_causal") is False:
        raise NotImplementedError("bidirectional attention (is_causal=False): paged attention is causal")
    if attention_mask is not None:
        raise NotImplementedError("an attention mask or bias computed by the model itself (paged attention "
                                  "applies only causal masks and sliding windows)")
    if _backend is None:
        raise RuntimeError("paged attention called outside an engine step: a model loaded with "
                           f"attn_implementation={ATTN_IMPLEMENTATION!r} only runs inside ModelRunner.forward")
    if query.shape[0] != 1:
        raise ValueError(f"paged attention expects one packed sequence, got batch {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    if getattr(module, "attends_latent", False):
        out = _backend.forward(module.layer_idx, absorb_query(module, q), k, v[..., :module.kv_lora_rank], scale,
                               sliding_window, softcap, s_aux)
        return expand_output(module, out)[None], None
    out = _backend.forward(module.layer_idx, *_same_head_size(q, k, v), scale, sliding_window, softcap, s_aux)
    return out[None, ..., :value.shape[-1]], None


def _same_head_size(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q/k and v zero-padded to one head size, when they differ (multi-head latent attention: K is
    wider than V): zeros add nothing to the scores, and the output's extra columns are cut off."""
    size = max(k.shape[-1], v.shape[-1])
    return tuple(x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1])) for x in (q, k, v))


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)

__all__ = ["ATTN_IMPLEMENTATION", "AttentionBackend", "AttentionMetadata", "current_metadata", "set_backend"]
