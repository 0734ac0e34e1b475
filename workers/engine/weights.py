"""Validate new policy weights against the loaded model, then copy them in place."""

from __future__ import annotations

import re
from copy import deepcopy
from typing import Mapping

import numpy as np
import torch
from safetensors.torch import load_file
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from rollout.params import WeightSource
from workers.engine.checkpoint_files import not_plain, read_checkpoint, storage, tied_conflicts


def load_source(source: WeightSource) -> Mapping[str, torch.Tensor]:
    """A state dict as given, or every tensor of the `*.safetensors` files of a checkpoint directory."""
    return source if isinstance(source, Mapping) else read_checkpoint(source, load_file)


def to_model_names(model: torch.nn.Module, targets: Mapping[str, torch.Tensor],
                   state: Mapping[str, torch.Tensor]) -> tuple[Mapping[str, torch.Tensor], dict[str, str]]:
    """`state` with the names and layout of the model's own state dict `targets`, and the name each was given
    as. Checkpoints keep a family's original layout, which transformers converts when it loads them
    (GPT-NeoX's `embed_out` is `lm_head`, MoE experts are fused into one tensor per layer); the same conversions
    apply here. Names the model has stay as given."""
    conversions = [] if all(name in targets for name in state) else (
        getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model))
    if not conversions:
        return state, {name: name for name in state}
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    out: dict[str, torch.Tensor] = {}
    given: dict[str, str] = {}  # each model name: the name(s) it was given as
    pending: dict[str, WeightConverter] = {}
    sources: dict[str, list[str]] = {}
    for name, tensor in sorted(state.items(), key=lambda item: dot_natural_key(item[0])):
        new, pattern = (name, None) if name in targets else rename_source_key(
            name, renamings, converters, getattr(model, "base_model_prefix", None), targets)
        if pattern is None:
            target = new if new in targets else name
            out[_claim(given, target, name)] = tensor
        else:
            pending.setdefault(new, deepcopy(by_pattern[pattern])).add_tensor(new, name, pattern, tensor)
            sources.setdefault(new, []).append(name)
    for first, converter in pending.items():
        made = _convert(model, first, converter)
        names = sources[first]
        source = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
        out.update({_claim(given, target, source): value for target, value in made.items()})
    return out, given


def _claim(given: dict[str, str], target: str, source: str) -> str:
    """`target`, recorded as given as `source`; ValueError when another name gave it already (a stale shard
    in the other layout, say), as which of the two values would win is arbitrary."""
    if target in given:
        raise ValueError(f"weights refused, nothing was changed: {target!r} is given twice, as {given[target]!r} "
                         f"and as {source!r}")
    given[target] = source
    return target


def _convert(model: torch.nn.Module, first: str, converter: WeightConverter) -> dict[str, torch.Tensor]:
    """The tensors `converter` makes of what it collected; ValueError when they do not fit together (an
    expert missing or of another shape)."""
    sources = sorted(converter.collected_tensors)
    try:
        made = converter.convert(first, model=model, config=model.config)
    except (RuntimeError, ValueError, KeyError, IndexError) as err:
        raise ValueError(f"weights refused, nothing was changed: cannot convert {sources} into {first!r} "
                         f"as transformers does on load: {err}") from err
    return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}


def check_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor], values: bool = True,
                  checkpoint: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs for every entry of the model's state dict, the source given in the model's
    names or its checkpoint's; ValueError listing every missing or unexpected name and every shape or dtype
    mismatch (and, with `values`, every tensor on the "meta" device, which has none), before anything is
    copied. Names the model lacks that transformers ignores on load (Qwen3.5's vision tower and
    multi-token-prediction head, for its text-only causal LM) are ignored here too; with `checkpoint` (the
    tensors of a checkpoint directory) every name it lacks is, as `from_pretrained` ignores a value head saved
    beside the model, unless something else is refused."""
    targets = model.state_dict()
    state, _ = to_model_names(model, targets, _entries(state))
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    state = {name: tensor for name, tensor in state.items()
             if name in targets or not any(p.search(name) for p in ignored)}
    given = {storage(dst) for name, dst in targets.items() if name in state}
    missing = [f"missing {name!r}" for name, dst in targets.items() if storage(dst) not in given]
    unexpected = [name for name in state if name not in targets]
    mismatched = _mismatches(targets, state, values)
    problems = missing + mismatched
    if unexpected and (problems or not checkpoint):
        problems = _wrapper_hint(targets, unexpected) + missing + [f"unexpected {name!r}" for name in unexpected]
        problems += mismatched
    problems += [] if problems else tied_conflicts(_tied_groups(targets, state), state)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ValueError(f"weights refused, nothing was changed: {shown}")
    return [(dst, state[name]) for name, dst in targets.items() if name in state]


def _mismatches(targets: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], values: bool) -> list[str]:
    """A problem for each given tensor of another shape or dtype than the model's, or not plain, or (with
    `values`) without values."""
    problems = []
    for name, dst in targets.items():
        src = state.get(name)
        if src is None:
            continue
        if tuple(src.shape) != tuple(dst.shape):
            problems.append(f"{name!r} has shape {tuple(src.shape)}, the model's is {tuple(dst.shape)}")
        elif src.dtype != dst.dtype:
            problems.append(f"{name!r} has dtype {src.dtype}, the model's is {dst.dtype}")
        elif not_plain(src):  # copy_ would fail part way through the update
            problems.append(f"{name!r} is {not_plain(src)}")
        elif values and src.is_meta:
            problems.append(f"{name!r} is a meta tensor: it has no values")
    return problems


def tied_sources(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The names of `state`, as given, that `model` ties into one tensor (two or more of a group given): a
    sender must give them one value, which `tied_conflicts` checks where the values are."""
    targets = model.state_dict()
    converted, given = to_model_names(model, targets, _entries(state))
    return [[given[name] for name in group] for group in _tied_groups(targets, converted)]


def _tied_groups(targets: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The names of `state` (the model's names) that are one tensor in the model's state dict `targets`, for
    each tensor given under two names or more."""
    groups: dict[tuple, list[str]] = {}
    for name, dst in targets.items():
        if name in state:
            groups.setdefault(storage(dst), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


# Name components that wrappers add to a model's state dict: DDP's, torch.compile's, FSDP's, checkpointing's.
WRAPPERS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _wrapper_hint(targets: Mapping[str, torch.Tensor], unexpected: list[str]) -> list[str]:
    """A problem naming the wrapper components that unexpected names carry and the model's lack, said first:
    the list of problems would otherwise open with the model's names as missing, and cut before the cause."""
    found = set()
    for name in unexpected:
        parts = name.split(".")
        if ".".join(part for part in parts if part not in WRAPPERS) in targets:
            found.update(part for part in parts if part in WRAPPERS)
    if not found:
        return []
    return [f"the names carry {', '.join(repr(part + '.') for part in sorted(found))}, which a wrapper (DDP, FSDP, "
            "torch.compile) adds: send the unwrapped model's state dict (e.g. model.module.state_dict())"]


def _entries(state: Mapping) -> dict[str, torch.Tensor]:
    """`state` with every value a tensor; ValueError naming a key that is not a str, or a value that is no
    tensor and no array."""
    entries = {}
    for name, value in state.items():
        if not isinstance(name, str):
            raise ValueError(f"weights refused, nothing was changed: state dict key {name!r} is a "
                             f"{type(name).__name__}, not a str")
        try:
            entries[name] = _tensor(value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"weights refused, nothing was changed: state dict entry {name!r} is a "
                             f"{type(value).__name__}, not a tensor") from err
    return entries


def _tensor(value) -> torch.Tensor:
    """`value` as a tensor; a numpy array with negative strides (np.flip's), which torch cannot view, copied."""
    if isinstance(value, np.ndarray) and min(value.strides, default=0) < 0:
        value = np.ascontiguousarray(value)
    return torch.as_tensor(value)


@torch.no_grad()
def copy_weights(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy in place, so device buffers (and any captured CUDA graphs) stay valid. A Ctrl-C part way is
    raised only once every tensor is copied: an engine never keeps a mix of old and new weights."""
    stopped: KeyboardInterrupt | None = None
    for dst, src in pairs:
        while True:
            try:
                dst.copy_(src, non_blocking=True)
                break
            except KeyboardInterrupt as err:  # it came before or after this copy: copying again is the same
                stopped = err
    if pairs and pairs[0][0].is_cuda:
        torch.cuda.synchronize()
    if stopped is not None:
        raise stopped
