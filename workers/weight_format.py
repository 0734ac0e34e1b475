"""How weights cross process boundaries: tensor metadata, numpy views for Ray's object store (bfloat16 has no
numpy dtype, so such tensors travel as a same-width integer view plus the dtype name), the tensor headers of
a safetensors checkpoint, and flat one-dtype buckets for a broadcast. Ray-free."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from safetensors import safe_open

from workers.engine.checkpoint_files import checkpoint_files, not_plain, read_checkpoint
from workers.messages import TensorMeta

_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool}
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                       "BOOL": "bool"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` ("float32", "bfloat16", ...); ValueError for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def check_state_dict(state: object) -> Mapping[str, torch.Tensor]:
    """`state` itself if it is a non-empty mapping of names to tensors that hold values; ValueError otherwise."""
    if not isinstance(state, Mapping) or not state:
        raise ValueError(f"weights must be a non-empty state dict (name -> torch.Tensor), got {type(state).__name__}")
    bad = next((name for name, t in state.items() if not isinstance(t, torch.Tensor)), None)
    if bad is not None:
        raise ValueError(f"state dict entry {bad!r} is a {type(state[bad]).__name__}, not a torch.Tensor")
    odd = next((name for name, t in state.items() if not_plain(t)), None)
    if odd is not None:
        raise ValueError(f"state dict entry {odd!r} is {not_plain(state[odd])}")
    empty = next((name for name, t in state.items() if t.is_meta), None)
    if empty is not None:
        raise ValueError(f"state dict entry {empty!r} is a meta tensor: it has no values")
    return state


def describe(state: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    """Name, dtype and shape of every tensor of a state dict, in its order."""
    return [TensorMeta(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in state.items()]


def checkpoint_tensors(path: str | Path) -> list[TensorMeta]:
    """The metadata of every tensor in the `*.safetensors` files of a directory, read from their headers
    only; ValueError if there are none, or if two files hold one name."""
    return list(read_checkpoint(path, _header).values())


def checkpoint_stamp(path: str | Path) -> list[tuple[str, int, int]]:
    """Name, size and modification time (ns) of each `*.safetensors` file of a checkpoint directory."""
    return [(file.name, (stat := file.stat()).st_size, stat.st_mtime_ns)
            for file in checkpoint_files(path)]


def check_unchanged(path: str, stamp: list[tuple[str, int, int]], version: int) -> None:
    """ValueError unless the checkpoint's files are as `stamp` (taken when version `version` was sent) has them:
    a directory rewritten since holds other weights, which would be served as that version."""
    changed = sorted({name for name, *_ in set(checkpoint_stamp(path)) ^ set(map(tuple, stamp))})
    if changed:
        raise ValueError(f"weights refused, nothing was changed: checkpoint {path!r} changed since version {version} "
                         f"was sent ({', '.join(changed)}); keep a checkpoint directory unchanged until the next "
                         "update, since a replacement worker loads it again")


def _header(file: Path) -> dict[str, TensorMeta]:
    """The metadata of the tensors of one safetensors file, by name."""
    with safe_open(file, framework="pt") as f:
        parts = {name: f.get_slice(name) for name in f.keys()}
        return {name: TensorMeta(name, _SAFETENSORS_DTYPES.get(p.get_dtype(), p.get_dtype()), list(p.get_shape()))
                for name, p in parts.items()}


def meta_state(tensors: list[TensorMeta]) -> dict[str, torch.Tensor]:
    """Data-free tensors (device "meta") with the given names, shapes and dtypes: enough to validate."""
    return {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for t in tensors}


def to_numpy(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Numpy arrays of a state dict, without copying CPU tensors; dtypes numpy lacks become an integer
    view of the same width (`from_numpy` views them back)."""
    arrays = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.dtype not in _NUMPY_DTYPES:
            tensor = tensor.view(_SAME_WIDTH_INT[tensor.element_size()])
        arrays[name] = tensor.numpy()
    return arrays


def from_numpy(arrays: Mapping[str, np.ndarray], tensors: list[TensorMeta]) -> dict[str, torch.Tensor]:
    """Tensors sharing the memory of `arrays` (read-only object-store buffers are fine: they are only
    copied from), viewed back to the dtypes of `tensors`."""
    state = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for meta in tensors:
            tensor = torch.from_numpy(arrays[meta.name])
            dtype = torch_dtype(meta.dtype)
            state[meta.name] = tensor if tensor.dtype == dtype else tensor.view(dtype)
    return state


def nbytes(meta: TensorMeta) -> int:
    """Bytes of one tensor's data."""
    return math.prod(meta.shape) * torch_dtype(meta.dtype).itemsize


def check_bucket_bytes(bucket_bytes: int) -> None:
    """ValueError unless `bucket_bytes` is a positive int."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be an int >= 1")


def plan_buckets(tensors: list[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Group the indices of `tensors` into buckets of one dtype and at most `bucket_bytes` each (a larger
    tensor gets a bucket of its own), in order within each dtype."""
    check_bucket_bytes(bucket_bytes)
    done: list[list[int]] = []
    open_buckets: dict[str, tuple[list[int], int]] = {}
    for index, meta in enumerate(tensors):
        bucket, used = open_buckets.get(meta.dtype, ([], 0))
        if bucket and used + nbytes(meta) > bucket_bytes:
            done.append(bucket)
            bucket, used = [], 0
        open_buckets[meta.dtype] = (bucket + [index], used + nbytes(meta))
    return done + [bucket for bucket, _ in open_buckets.values()]


def pack(state: Mapping[str, torch.Tensor], tensors: list[TensorMeta], bucket: list[int],
         device: torch.device | str) -> torch.Tensor:
    """One flat tensor on `device` holding the bucket's tensors one after another."""
    return torch.cat([state[tensors[i].name].detach().reshape(-1).to(device) for i in bucket])


def empty_bucket(tensors: list[TensorMeta], bucket: list[int], device: torch.device | str) -> torch.Tensor:
    """An uninitialised flat tensor to receive one bucket."""
    numel = sum(math.prod(tensors[i].shape) for i in bucket)
    return torch.empty(numel, dtype=torch_dtype(tensors[bucket[0]].dtype), device=device)


def unpack(flat: torch.Tensor, tensors: list[TensorMeta], bucket: list[int]) -> dict[str, torch.Tensor]:
    """The bucket's tensors as views of `flat`, by name."""
    parts = flat.split([math.prod(tensors[i].shape) for i in bucket])
    return {tensors[i].name: part.view(tensors[i].shape) for i, part in zip(bucket, parts)}
