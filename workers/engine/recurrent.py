"""Recurrent state of linear-attention and state-space layers (Gated DeltaNet, Mamba, short convolutions).

Such a layer ("mixer") keeps a fixed-size state per sequence instead of a growing KV: a convolution
window and a recurrent matrix. The engine keeps each mixer's states in slot tensors `[slots, ...]`,
indexed by the sequence's block-table row (the last slot takes a decode graph's padding rows). The
model's own mixer code runs unchanged: its forward is wrapped to hand it a `SlotView`, which answers
the state calls of transformers' linear-attention cache for the rows of one call. A decode step runs
every sequence in one call (batch = sequences); prefill chunks run one sequence per call. A sequence
with nothing computed yet starts from zero state, whatever its slot holds.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

import msgspec
import numpy as np
import torch

from rollout.config import EngineConfig
from workers.engine.attention import AttentionMetadata, current_metadata
from workers.engine.delta_rule import SlotState, SlotWindow, install_in_place
from workers.engine.mamba_step import clamping
from workers.engine.state_cache import StateCache, StateKey

logger = logging.getLogger(__name__)

_CACHE_ARGS = ("cache", "cache_params", "past_key_values")
# Per-token arguments a decoder layer forwards to its mixer that transformers' mixers only pass along to
# kernels which ignore them; dropped, since a per-sequence call would need them sliced.
_DROPPED_ARGS = ("position_ids", "cache_position")


class SlotView:
    """transformers' linear-attention cache calls, answered for the slots `rows` of the state tensors.

    `fresh` (a bool, or a `[rows]` bool tensor): which rows start from zero state. Reads gather the
    rows once (a fresh row gathers the zero slot instead: no pass over the gathered states to clear it);
    writes stay local until `flush`, since a mixer may update a state it read in place. In a decode call
    (one token per row) the states `in_place` names, (layer, kind), are not gathered: those of layers that
    decode through the gated delta rule read as a `SlotState` or `SlotWindow`, which the rule and the
    convolution before it update in the slots (delta_rule.py).
    """

    def __init__(self, states: StateCache | None, rows: torch.Tensor | None, fresh: bool | torch.Tensor,
                 in_place: frozenset[tuple[int, str]] = frozenset()) -> None:
        self.states, self.rows, self.fresh, self.in_place = states, rows, fresh, in_place
        self.local: dict[StateKey, torch.Tensor] = {}
        self.sources = (torch.where(fresh, states.zero_slot, rows)
                        if isinstance(fresh, torch.Tensor) and states is not None else rows)

    def _read(self, key: StateKey) -> torch.Tensor | SlotState | None:
        if key not in self.local:
            if self.fresh is True or self.states is None:
                return None
            if key[:2] in self.in_place:
                handle = SlotState if key[1] == "recurrent" else SlotWindow
                return handle(self.states.tensors[key], self.sources, self.rows)
            self.local[key] = self.states.tensors[key].index_select(0, self.sources)
        return self.local[key]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The rows' convolution windows (None when they start afresh)."""
        return self._read((layer_idx, "conv", state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | SlotState | None:
        """The rows' recurrent states (None when they start afresh)."""
        return self._read((layer_idx, "recurrent", state_idx))

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        """Append new inputs to the window; returns window and inputs, zero-padded on the left to at
        least the window's width, as transformers' cache does."""
        key = (layer_idx, "conv", state_idx)
        width = self._width(key, conv_states, conv_kernel_size)
        old = self._read(key)
        full = conv_states if old is None else torch.cat([old, conv_states], dim=-1)
        if full.shape[-1] < width:
            full = torch.nn.functional.pad(full, (width - full.shape[-1], 0))
        self.local[key] = full[..., -width:]
        return full

    def _width(self, key: StateKey, conv_states: torch.Tensor, conv_kernel_size: int | None) -> int:
        if self.states is not None and key in self.states.tensors:
            return self.states.tensors[key].shape[-1]
        return conv_kernel_size or conv_states.shape[-1]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        """Keep the rows' new recurrent states (a `SlotState`: already in their slots)."""
        if not isinstance(recurrent_states, SlotState):
            self.local[(layer_idx, "recurrent", state_idx)] = recurrent_states
        return recurrent_states

    def is_recording_past(self, layer_idx: int) -> bool:
        """Never: the engine does not roll states back."""
        return False

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether the rows carry state from earlier tokens."""
        return self.fresh is not True

    @property
    def layers(self) -> _Layers:
        """Per layer, its states as transformers before 5.20 reads them (`layers[i].conv_states[0]`)."""
        return _Layers(self)

    def flush(self) -> None:
        """Write the rows' states back into their slots."""
        if self.states is not None:
            for key, value in self.local.items():
                self.states.tensors[key].index_copy_(0, self.rows, value.to(self.states.tensors[key].dtype))


class _Layers:
    """`view.layers[i]`: layer i's states, read through the view."""

    def __init__(self, view: SlotView) -> None:
        self.view = view

    def __getitem__(self, layer: int) -> _LayerStates:
        return _LayerStates(self.view, layer)


class _LayerStates:
    """One layer's `conv_states[k]` and `recurrent_states[k]`; the engine never records past states."""

    record_past = False

    def __init__(self, view: SlotView, layer: int) -> None:
        self.conv_states = _States(view, layer, "conv")
        self.recurrent_states = _States(view, layer, "recurrent")


class _States:
    def __init__(self, view: SlotView, layer: int, kind: str) -> None:
        self.view, self.layer, self.kind = view, layer, kind

    def __getitem__(self, state_idx: int) -> torch.Tensor | SlotState | None:
        return self.view._read((self.layer, self.kind, state_idx))


class Mixers:
    """The mixer layers of a model, their forwards wrapped to keep state in `states` (None until the
    probe forward has recorded `layout`, each state's shape and dtype). `stepwise`: the mixers' multi-token
    forward always starts from zero state (Jamba's Mamba layers), so a chunk continuing a sequence runs
    one token per call."""

    def __init__(self, model: torch.nn.Module, stepwise: bool = False) -> None:
        self.stepwise = stepwise
        self.layers: list[int] = []
        self.delta_rule_states: frozenset[tuple[int, str]] = frozenset()  # (layer, kind): delta_rule.py's
        self.in_place = False  # whether their decode calls update the states in their slots (Triton runs here)
        self.layout: dict[StateKey, tuple[torch.Size, torch.dtype]] = {}
        self.states: StateCache | None = None
        for module in model.modules():
            name = _cache_arg(module)
            if name is not None:
                self.layers.append(module.layer_idx)
                module.forward = self._wrap(clamping(module, module.forward), name)
                kinds = install_in_place(type(module))
                self.delta_rule_states |= {(module.layer_idx, kind) for kind in kinds}

    def nbytes(self, slots: int, extra: dict[StateKey, tuple[torch.Size, torch.dtype]] | None = None) -> int:
        """Bytes `slots` slots of every state take (with `extra`'s)."""
        layout = {**self.layout, **(extra or {})}
        return slots * sum(shape.numel() * dtype.itemsize for shape, dtype in layout.values())

    def num_slots(self, rows: int) -> int:
        """State slots for `rows` block-table rows: one each, one for a decode graph's padding rows and, when
        there are mixers, one kept zero (`StateCache`)."""
        return rows + 1 + bool(self.layout)

    def allocate(self, rows: int, device: torch.device,
                 extra: dict[StateKey, tuple[torch.Size, torch.dtype]] | None = None) -> StateCache | None:
        """The state slots of `rows` block-table rows for the mixers and `extra` (other per-row state:
        windowed layers' rings, window_ring.py), when there is any."""
        layout = {**self.layout, **(extra or {})}
        self.states = (StateCache(layout, self.num_slots(rows), device, zero_slot=bool(self.layout))
                       if layout else None)
        return self.states

    def _wrap(self, forward: Callable, cache_arg: str) -> Callable:
        def mixer_forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            for name in _CACHE_ARGS + _DROPPED_ARGS:
                kwargs.pop(name, None)
            _check_args(args, kwargs)
            meta = current_metadata()
            if meta is None or self.states is None:
                view = SlotView(None, None, True)  # the probe: every state starts afresh and is written
                out = forward(hidden_states, **kwargs, **{cache_arg: view})
                self.layout.update({key: (value.shape[1:], value.dtype) for key, value in view.local.items()})
                return out
            return self._run(forward, cache_arg, hidden_states, meta, kwargs)
        return mixer_forward

    def _run(self, forward: Callable, cache_arg: str, hidden: torch.Tensor, meta: AttentionMetadata,
             kwargs: dict) -> torch.Tensor:
        """The mixer over a packed step `[1, T, D]`: a decode step's sequences in one call (the batch being
        the sequences), else each run of one-token sequences in one call and each longer chunk alone."""
        in_place = self.delta_rule_states if self.in_place else frozenset()

        def call(x: torch.Tensor, rows: torch.Tensor, fresh: bool | torch.Tensor, decode: bool = False) -> torch.Tensor:
            view = SlotView(self.states, rows, fresh, in_place if decode else frozenset())
            out = forward(x, **kwargs, **{cache_arg: view})
            view.flush()
            return out

        if meta.max_seqlen_q == 1:
            return call(hidden.transpose(0, 1), meta.rows, meta.seq_lens <= 1, decode=True).transpose(0, 1)
        cu, seq_lens = meta.host_cu_seqlens_q, meta.host_seq_lens
        outs = []
        for a, b in _segments(cu):
            rows, x = meta.rows[a:b], hidden[:, cu[a]:cu[b]]
            fresh = bool(seq_lens[a] == cu[b] - cu[a])
            if cu[b] - cu[a] == b - a:  # one token each: the batch is the sequences
                outs.append(call(x.transpose(0, 1), rows, meta.seq_lens[a:b] <= 1, decode=True).transpose(0, 1))
            elif self.stepwise and not fresh:
                outs += [call(x[:, i:i + 1], rows, False) for i in range(x.shape[1])]
            else:
                outs.append(call(x, rows, fresh))
        return torch.cat(outs, dim=1)


def without_prefix_caching(config: EngineConfig) -> EngineConfig:
    """`config` for a model with per-row state: no prefix caching, since a cached prefix's KV comes without
    the state at its end (a preempted sequence is offloaded with its state, or recomputed)."""
    if config.enable_prefix_caching:
        logger.info("prefix caching off: this model keeps a state per sequence (of linear-attention or "
                    "state-space layers, or windowed layers' rings) that a cached prefix's KV comes without")
    return msgspec.structs.replace(config, enable_prefix_caching=False)


def _segments(cu: np.ndarray) -> list[tuple[int, int]]:
    """Sequence ranges `[a, b)` of a step: runs of one-token sequences, and each longer sequence alone."""
    lengths = np.diff(cu)
    out, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] != 1 or lengths[i - 1] != 1:
            out.append((start, i))
            start = i
    return out


def _cache_arg(module: torch.nn.Module) -> str | None:
    """The name under which `module.forward` takes transformers' cache, if `module` is a mixer: a layer
    whose code reads the linear-attention state (attention layers take the cache too, for their K/V)."""
    if not (hasattr(module, "layer_idx") and _reads_state(type(module))):
        return None
    params = inspect.signature(module.forward).parameters
    return next((name for name in _CACHE_ARGS if name in params), None)


@functools.cache
def _reads_state(cls: type) -> bool:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return any(call in source for call in ("get_conv_state(", "get_recurrent_state(", ".conv_states[",
                                           ".recurrent_states["))


def _check_args(args: tuple, kwargs: dict) -> None:
    """Refuse what a per-sequence call could not slice: positional extras, masks, other token tensors."""
    if args:
        raise NotImplementedError("a linear-attention or state-space layer called with positional arguments")
    tensors = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    if tensors:
        raise NotImplementedError(f"a linear-attention or state-space layer given {tensors} (the engine passes "
                                  "its layers no padding mask or per-token tensors)")
