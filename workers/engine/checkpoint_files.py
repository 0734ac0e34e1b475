"""What the engine accepts as weights, as rules the trainer side checks too (workers/weight_format.py, which
imports them from here, the engine being the lower layer): plain dense tensors, and checkpoint files that read
whole and name each tensor once."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Mapping, TypeVar

import torch
from safetensors import SafetensorError

T = TypeVar("T")


def not_plain(tensor: torch.Tensor) -> str | None:
    """Why a tensor cannot be copied into a model's parameter as it is (a sparse tensor, or a tensor subclass
    such as FSDP2's sharded DTensor), or None for a plain dense tensor or parameter."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(tensor).__name__}, not a plain torch.Tensor (gather a DTensor with .full_tensor())"
    if tensor.layout != torch.strided:
        return f"a {tensor.layout} tensor, not a dense (torch.strided) one"
    return None


def refuse_repeated_names(path: str | Path, names_by_file: Mapping[Path, Iterable[str]]) -> None:
    """ValueError naming a tensor that two files of checkpoint `path` both hold (a stale shard left beside the
    new ones, say): one copy would silently win."""
    where: dict[str, Path] = {}
    for file, names in names_by_file.items():
        for name in names:
            if where.setdefault(name, file) != file:
                raise ValueError(f"checkpoint {str(path)!r} holds {name!r} twice, in {where[name].name} and "
                                 f"{file.name}: one copy would silently win")


def read_checkpoint_file(file: Path, read: Callable[[Path], T]) -> T:
    """`read(file)`; ValueError naming the file when it is not a whole safetensors file (truncated, corrupt)."""
    try:
        return read(file)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"weights refused, nothing was changed: checkpoint file {str(file)!r} cannot be read "
                         f"({err})") from err
