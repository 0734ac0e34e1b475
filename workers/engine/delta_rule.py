"""A Gated DeltaNet decode step that updates each sequence's recurrent state in its slot.

transformers' Gated DeltaNet layers (Qwen3.5, Qwen3-Next, OLMo hybrid and their kin) decode through the
module-level `torch_recurrent_gated_delta_rule` (fla's fused kernel when it is installed): it takes the
batch's states as one `[B, HV, K, V]` tensor and returns new ones. Served from state slots, that means a
gather before and a scatter after, two extra reads and writes of every state per layer and step, which for
Qwen3.5's 2 MiB states is most of a decode step's memory traffic. Here the layer's own forward runs as it
is; its state read returns a `SlotState` handle, which the wrapped rule (`InPlaceRule`, installed once per
modeling module) recognises and serves with one kernel: each state is read from its source slot (the zero
slot for a row starting afresh) and written back to the row's slot. Any other call goes to the rule
unchanged, and a call this kernel does not know gathers the states and takes the rule's own path. The
kernel (delta_rule_kernel.py, Triton) serves the decode calls where Triton runs: on CUDA, or with the
Triton attention backend under its interpreter.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)

RULE = "torch_recurrent_gated_delta_rule"
# the rule's arguments this kernel serves, and the flags decoder layers pass along, which the rule ignores
_KNOWN_ARGS = {"g", "beta", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens",
               "use_cache", "output_router_logits", "output_attentions", "output_hidden_states"}


class SlotState:
    """What a Gated DeltaNet layer reads as its decode state: slots `sources` of `tensor`, to be written to
    slots `rows` (recurrent.py's `SlotView` hands it out)."""

    def __init__(self, tensor: torch.Tensor, sources: torch.Tensor, rows: torch.Tensor) -> None:
        self.tensor, self.sources, self.rows = tensor, sources, rows

    def gather(self) -> torch.Tensor:
        """The states as a `[B, ...]` tensor, for the rule's own path."""
        return self.tensor.index_select(0, self.sources)

    def decode(self, rule: Callable, args: tuple, kwargs: dict) -> tuple[torch.Tensor, object]:
        """Serve one call of `rule` in place; returns (output, self), self standing for the states written."""
        q, k, v = args if len(args) == 3 else (None, None, None)
        unknown = tuple(name for name, value in kwargs.items() if name not in _KNOWN_ARGS and value is not None)
        if q is None or unknown or kwargs.get("cu_seqlens") is not None or q.shape[1] != 1:
            _log_once(f"{len(args)} positional arguments, {unknown or 'no'} unknown ones, "
                      f"cu_seqlens {kwargs.get('cu_seqlens') is not None}, {'?' if q is None else q.shape[1]} tokens")
            return rule(*args, **{**kwargs, "initial_state": self.gather()})
        from workers.engine.delta_rule_kernel import gated_delta_decode  # Triton: only where it runs

        out = gated_delta_decode(q, k, v, kwargs["g"], kwargs["beta"], self.tensor, self.sources, self.rows,
                                 bool(kwargs.get("use_qk_l2norm_in_kernel")))
        return out, self


@functools.cache
def _log_once(call: str) -> None:
    logger.warning("a gated delta rule call this engine's decode kernel does not serve (%s): its states are "
                   "gathered for transformers' rule and written back, which reads and writes them twice more", call)


class InPlaceRule:
    """transformers' rule, wrapped: a call whose `initial_state` is a `SlotState` runs in place, any other
    goes to the rule."""

    def __init__(self, rule: Callable) -> None:
        self.rule = rule

    def __call__(self, *args, **kwargs):
        state = kwargs.get("initial_state")
        if isinstance(state, SlotState):
            return state.decode(self.rule, args, kwargs)
        return self.rule(*args, **kwargs)


def install_in_place_rule(cls: type) -> bool:
    """Whether layers of `cls` decode through transformers' gated delta rule; if so, the rule their forward
    calls is wrapped in an `InPlaceRule` (once)."""
    forward = inspect.unwrap(cls.forward)
    namespace = forward.__globals__
    if RULE not in namespace or f"{RULE}(" not in inspect.getsource(forward):
        return False
    if not isinstance(namespace[RULE], InPlaceRule):
        namespace[RULE] = InPlaceRule(namespace[RULE])
    return True
