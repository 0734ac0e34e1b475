"""What the engine accepts as weights, as rules the trainer side checks too (workers/weight_format.py and
rollout/weight_sync.py import them from here, the engine being the lower layer): plain dense tensors, checkpoint
files that read whole and name each tensor once, and one value for the names of one tied tensor."""

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


def checkpoint_files(path: str | Path) -> list[Path]:
    """The `*.safetensors` files of checkpoint directory `path`, by name ([] when it is no directory)."""
    return sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []


def read_checkpoint(path: str | Path, read: Callable[[Path], Mapping[str, T]]) -> dict[str, T]:
    """What `read` gives for each file of checkpoint directory `path`, merged by tensor name; ValueError when it
    holds no such file, a file cannot be read, or two files hold one name."""
    files = checkpoint_files(path)
    if not files:
        raise ValueError(f"checkpoint {str(path)!r} is not a directory of *.safetensors files")
    loaded = {file: read_checkpoint_file(file, read) for file in files}
    refuse_repeated_names(path, loaded)
    return {name: value for values in loaded.values() for name, value in values.items()}


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


def storage(tensor: torch.Tensor) -> tuple:
    """Where a tensor's values live: tied parameters (an LM head sharing the embedding, left out of
    checkpoints) have the same, and are updated through whichever name is given."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, bit for bit (two copies of weights holding NaN are the same)."""
    if a.dtype.is_floating_point and a.dtype == b.dtype:
        as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


def tied_conflicts(groups: Iterable[list[str]], state: Mapping[str, torch.Tensor]) -> list[str]:
    """A problem for each name of a group that a model ties into one tensor which `state` gives another value
    than the group's first name it holds (a trainer's untied copy of a tied model: one value would silently
    win). Names `state` lacks, and tensors without values ("meta"), are passed over."""
    problems = []
    for group in groups:
        given = [name for name in group if name in state]
        for name in given[1:]:
            a, b = state[given[0]], state[name]
            if a.is_meta or b.is_meta or storage(a) == storage(b):
                continue
            if not same_bits(a, b.to(a.device)):
                problems.append(f"{given[0]!r} and {name!r} are one tied tensor in this model, but the update "
                                "gives them different values")
    return problems
