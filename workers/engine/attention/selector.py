"""Pick an attention backend by name for a KV cache. Backends are imported lazily: Triton and
flash-attn are optional, and importing this module must not import either."""

from __future__ import annotations

import logging
import os

from rollout.config import ATTENTION_BACKENDS
from workers.engine.attention.base import AttentionBackend
from workers.engine.attention.torch_backend import TorchBackend
from workers.engine.kv_cache import KvCache

logger = logging.getLogger(__name__)


def create_backend(name: str, kv_cache: KvCache) -> AttentionBackend:
    """The backend `name` ("auto", "torch", "triton" or "flash_attn") over `kv_cache`.

    "auto": flash-attn on CUDA when it imports and supports the cache (else Triton), torch on CPU.
    An unusable explicit choice raises ValueError saying why.
    """
    if name == "auto":
        return _auto_backend(kv_cache)
    if name == "torch":
        return TorchBackend(kv_cache)
    if name == "triton":
        return _triton_backend(kv_cache)
    if name == "flash_attn":
        from workers.engine.attention.flash_attn_backend import FlashAttnBackend
        return FlashAttnBackend(kv_cache)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")


def _auto_backend(kv_cache: KvCache) -> AttentionBackend:
    if not kv_cache.is_cuda:
        return TorchBackend(kv_cache)
    from workers.engine.attention import flash_attn_backend
    try:
        flash_attn_backend.load_flash_attn()
    except ValueError:
        return _triton_backend(kv_cache)
    try:
        return flash_attn_backend.FlashAttnBackend(kv_cache)
    except ValueError as err:
        logger.info("flash-attn cannot serve this KV cache (%s); using the Triton backend", err)
        return _triton_backend(kv_cache)


def _triton_backend(kv_cache: KvCache) -> AttentionBackend:
    if not kv_cache.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend 'triton' needs a CUDA KV cache, got device "
                         f"{kv_cache.device}; on CPU use 'torch' (or set TRITON_INTERPRET=1 to run "
                         f"the kernels in Triton's slow interpreter, for tests)")
    try:
        import triton  # noqa: F401
    except ImportError as err:
        raise ValueError(f"attention backend 'triton' needs the triton package ({err}); "
                         f"install it with `pip install triton`") from err
    from workers.engine.attention.triton_backend import TritonBackend
    return TritonBackend(kv_cache)
