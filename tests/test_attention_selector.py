"""Backend selection by name, and the refusals of configurations a backend cannot serve."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.conftest import CudaLooking
from workers.engine.attention.selector import create_backend
from workers.engine.attention.torch_backend import TorchBackend
from workers.engine.kv_cache import KvCache


def kv_cache(dtype: torch.dtype = torch.float16, block_size: int = 256, head_dim: int = 64,
             tensor_type: type = torch.Tensor, planes: int = 2) -> KvCache:
    """A tiny one-layer cache on CPU (of `tensor_type`, a subclass that may pretend to be on CUDA); one plane:
    its values are its keys (latent attention)."""
    return KvCache.of(torch.zeros(1, planes, 2, block_size, 2, head_dim, dtype=dtype).as_subclass(tensor_type))


def stub_flash_attn() -> types.ModuleType:
    """A stand-in `flash_attn` module whose kernels are never called."""
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = module.flash_attn_with_kvcache = lambda *a, **k: None
    return module


@pytest.fixture
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import flash_attn` succeed with the stub module."""
    monkeypatch.setitem(sys.modules, "flash_attn", stub_flash_attn())


@pytest.mark.parametrize("name", ["torch", "auto"])
def test_cpu_cache_gets_torch_backend(name: str) -> None:
    """Explicit "torch", and "auto" for a CPU cache, give the torch reference."""
    assert type(create_backend(name, kv_cache(torch.float32, 16))) is TorchBackend


def test_auto_on_cpu_ignores_flash_attn(fake_flash_attn: None) -> None:
    """flash-attn being importable does not move a CPU cache off the torch backend."""
    assert type(create_backend("auto", kv_cache())) is TorchBackend


def test_unknown_name_is_refused() -> None:
    """A typo names the valid choices."""
    with pytest.raises(ValueError, match="unknown attention backend 'trition'.*flash_attn"):
        create_backend("trition", kv_cache())


def test_triton_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TRITON_INTERPRET=1 a CPU cache cannot use the Triton backend."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'triton' needs a CUDA KV cache, got device cpu"):
        create_backend("triton", kv_cache(torch.float32, 16))


def test_triton_on_cpu_with_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TRITON_INTERPRET=1 the Triton backend is built for a CPU cache."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from workers.engine.attention.triton_backend import TritonBackend
    assert type(create_backend("triton", kv_cache(torch.float32, 16))) is TritonBackend


def test_triton_missing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing triton package is a ValueError that says how to install it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ValueError, match="pip install triton"):
        create_backend("triton", kv_cache(torch.float32, 16))


def test_flash_attn_missing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit "flash_attn" without the package is a ValueError, not an ImportError."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(ValueError, match="needs the flash-attn package"):
        create_backend("flash_attn", kv_cache())


@pytest.mark.parametrize("cache, message", [
    (kv_cache(torch.float32), "float16 or bfloat16 KV cache, got torch.float32"),
    (kv_cache(block_size=16), "multiple of 256, got block_size=16"),
    (kv_cache(block_size=384), "multiple of 256, got block_size=384"),
    (kv_cache(head_dim=512), "head_dim <= 256, got 512"),
    (kv_cache(planes=1), "values as wide as keys; latent attention"),
    (kv_cache(torch.bfloat16, 512), "needs a CUDA KV cache, got device cpu"),
])
def test_flash_attn_refuses_unsupported_cache(fake_flash_attn: None, cache: KvCache,
                                              message: str) -> None:
    """Each flash-attn constraint is checked at construction and named in the error."""
    with pytest.raises(ValueError, match=message):
        create_backend("flash_attn", cache)


@pytest.mark.parametrize("flash_installed, block_size, expected", [
    (False, 256, "TritonBackend"),
    (True, 256, "FlashAttnBackend"),
    (True, 16, "TritonBackend"),
])
def test_auto_on_cuda(monkeypatch: pytest.MonkeyPatch, flash_installed: bool, block_size: int,
                      expected: str) -> None:
    """On CUDA, "auto" prefers flash-attn when it imports and supports the cache, else Triton."""
    pytest.importorskip("triton")
    monkeypatch.setitem(sys.modules, "flash_attn", stub_flash_attn() if flash_installed else None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(multi_processor_count=132))
    cache = kv_cache(block_size=block_size, tensor_type=CudaLooking)
    assert type(create_backend("auto", cache)).__name__ == expected
