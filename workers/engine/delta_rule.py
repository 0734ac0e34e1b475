"""A Gated DeltaNet decode step that updates each sequence's states (recurrent and convolution) in their slots.

transformers' Gated DeltaNet layers (Qwen3.5, Qwen3-Next, OLMo hybrid and their kin) decode through two
module-level functions: `causal_conv1d_update`, which shifts each row's convolution window in place, and
`torch_recurrent_gated_delta_rule` (fla's fused kernel when it is installed), which takes the batch's
states as one `[B, HV, K, V]` tensor and returns new ones. Served from state slots, that means a gather
before and a scatter after: for the rule two extra reads and writes of every state per layer and step,
most of a Qwen3.5 decode step's memory traffic; for the convolution, whose torch path is itself a
concatenation, a copy and a depthwise convolution, six launches per layer where one will do (3 ms of a
32 ms step on an H100, 2026-11-26). Here the layer's own forward runs as it is; its state reads return
handles (`SlotState`, `SlotWindow`) which the wrapped functions (`InPlace`, installed once per modeling
module) recognise and serve with one kernel each: each state is read from its source slot (the zero slot
for a row starting afresh) and written to the row's slot. Any other call goes to the function unchanged,
and a call these kernels do not know gathers the states and takes the function's own path. The kernels
(delta_rule_kernel.py, Triton) serve the decode calls where Triton runs: on CUDA, or with the Triton
attention backend under its interpreter.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

import torch

from workers.engine.wrapped_global import WrappedGlobal

logger = logging.getLogger(__name__)

RULE, CONV = "torch_recurrent_gated_delta_rule", "causal_conv1d_update"
# the rule's arguments its kernel serves, and the flags decoder layers pass along, which the rule ignores
_KNOWN_ARGS = {"g", "beta", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens",
               "use_cache", "output_router_logits", "output_attentions", "output_hidden_states"}
_ACTIVATIONS = {None: False, "silu": True, "swish": True}  # the convolution kernel's: whether it applies SiLU


class SlotState:
    """What a Gated DeltaNet layer reads as its decode state: slots `sources` of `tensor`, to be written to
    slots `rows` (recurrent.py's `SlotView` hands it out)."""

    def __init__(self, tensor: torch.Tensor, sources: torch.Tensor, rows: torch.Tensor) -> None:
        self.tensor, self.sources, self.rows = tensor, sources, rows

    def gather(self) -> torch.Tensor:
        """The states as a `[B, ...]` tensor, for the function's own path."""
        return self.tensor.index_select(0, self.sources)

    def decode(self, rule: Callable, args: tuple, kwargs: dict) -> tuple[torch.Tensor, object]:
        """Serve one call of the rule in place; returns (output, self), self standing for the states written."""
        q, k, v = args if len(args) == 3 else (None, None, None)
        unknown = tuple(name for name, value in kwargs.items() if name not in _KNOWN_ARGS and value is not None)
        if q is None or unknown or kwargs.get("cu_seqlens") is not None or q.shape[1] != 1:
            _log_once(RULE, f"{len(args)} positional arguments, {unknown or 'no'} unknown ones, cu_seqlens "
                      f"{kwargs.get('cu_seqlens') is not None}, {'?' if q is None else q.shape[1]} tokens")
            return rule(*args, **{**kwargs, "initial_state": self.gather()})
        from workers.engine.delta_rule_kernel import gated_delta_decode  # Triton: only where it runs

        out = gated_delta_decode(q, k, v, kwargs["g"], kwargs["beta"], self.tensor, self.sources, self.rows,
                                 bool(kwargs.get("use_qk_l2norm_in_kernel")))
        return out, self


class SlotWindow(SlotState):
    """What a Gated DeltaNet layer reads as its decode convolution windows `[B, C, W]`, in slots."""

    def decode(self, update: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        """Serve one call of `causal_conv1d_update(x, window, weight, bias, activation)` in place: returns
        the convolution's output `[B, C, 1]`, the windows shifted in their slots."""
        call = _signature(update).bind(*args, **kwargs)
        call.apply_defaults()
        names = list(call.arguments)
        x, _, weight, bias, activation = (call.arguments[name] for name in names[:5])
        unknown = [name for name in names[5:] if call.arguments[name] not in (None, {}, ())]
        channels, width = self.tensor.shape[1:]
        if (unknown or activation not in _ACTIVATIONS or x.dim() != 3 or x.shape[1:] != (channels, 1)
                or weight.shape != (channels, weight.shape[-1]) or weight.shape[-1] > width):
            _log_once(CONV, f"{unknown or 'no'} unknown arguments, activation {activation!r}, input "
                      f"{tuple(x.shape)}, weight {tuple(weight.shape)}, windows {(channels, width)}")
            call.arguments[names[1]] = window = self.gather()
            out = update(*call.args, **call.kwargs)
            self.tensor.index_copy_(0, self.rows, window.to(self.tensor.dtype))
            return out
        from workers.engine.delta_rule_kernel import short_conv_decode  # Triton: only where it runs

        return short_conv_decode(x, weight, bias, _ACTIVATIONS[activation], self.tensor, self.sources, self.rows)


@functools.cache
def _signature(function: Callable) -> inspect.Signature:
    return inspect.signature(function)


@functools.cache
def _log_once(function: str, call: str) -> None:
    logger.warning("a %s call this engine's decode kernels do not serve (%s): its states are gathered for "
                   "transformers' function and written back, which reads and writes them once more", function,
                   call)


class InPlace(WrappedGlobal):
    """A transformers function, wrapped: a call given a `SlotState` (any argument) is served by it in place,
    any other goes to the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = next((a for a in (*args, *kwargs.values()) if isinstance(a, SlotState)), None)
        if state is not None:
            return state.decode(self.function, args, kwargs)
        return self.function(*args, **kwargs)


def install_in_place(cls: type) -> frozenset[str]:
    """The states ("recurrent", with it "conv") that layers of `cls` decode in place: those of a layer whose
    forward calls transformers' gated delta rule, and its short convolution's window where the forward calls
    `causal_conv1d_update` too. Each function called is wrapped in an `InPlace` (once)."""
    forward = inspect.unwrap(cls.forward)
    namespace = forward.__globals__
    if RULE not in namespace:  # a mixer of another kind (Mamba, short convolutions): its source is not read
        return frozenset()
    source = inspect.getsource(forward)
    kinds = {kind: name for kind, name in (("recurrent", RULE), ("conv", CONV))
             if name in namespace and f"{name}(" in source}
    if "recurrent" not in kinds:
        return frozenset()
    for name in kinds.values():
        InPlace.install(namespace, name)
    return frozenset(kinds)
