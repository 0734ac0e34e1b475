"""Mamba-2 one-token steps that clamp dt as the layer's forward does.

transformers' Mamba-2 layers (Mamba-2, Bamba, Granite-4.0-H, Falcon-H1, Nemotron-H) clamp each token's dt
to the layer's `time_step_limit` in their chunked scan, but not in their one-token recurrent step
(`mamba2_selective_state_update`). With a limit that bites (Nemotron-H's lower bound is its
`time_step_min`, 0.001 by default), `generate`'s decode steps and the model's own forward then differ. The
engine follows the forward, which a trainer computes its logprobs with: the step function of each modeling
module is wrapped once (`ClampedStep`), and while a layer with a limit runs, its steps clamp dt to it.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F

from workers.engine.wrapped_global import WrappedGlobal

STEP = "mamba2_selective_state_update"
_limit: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("dt_limit", default=None)


class ClampedStep(WrappedGlobal):
    """transformers' Mamba-2 step, wrapped: inside `clamping`, dt is biased, passed through softplus and
    clamped to the running layer's limit here (the order of the chunked scan), then handed on as is."""

    def __call__(self, state: torch.Tensor, hidden_states: torch.Tensor, dt: torch.Tensor, *args: Any,
                 dt_bias: torch.Tensor | None = None, dt_softplus: bool = False, **kwargs: Any) -> torch.Tensor:
        limit = _limit.get()
        if limit is None:
            return self.function(state, hidden_states, dt, *args, dt_bias=dt_bias, dt_softplus=dt_softplus, **kwargs)
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=limit[0], max=limit[1])
        return self.function(state, hidden_states, dt, *args, dt_bias=None, dt_softplus=False, **kwargs)


def clamping(module: torch.nn.Module, forward: Callable) -> Callable:
    """`forward` of a mixer `module`, its Mamba-2 steps clamped to the module's `time_step_limit` (wrapped
    in its modeling module once); `forward` itself where the module has no step or no limit that bites."""
    limit = tuple(getattr(module, "time_step_limit", None) or (0.0, float("inf")))
    namespace = inspect.unwrap(type(module).forward).__globals__
    if STEP not in namespace or limit == (0.0, float("inf")):
        return forward
    ClampedStep.install(namespace, STEP)

    def clamped_forward(*args, **kwargs):
        token = _limit.set(limit)
        try:
            return forward(*args, **kwargs)
        finally:
            _limit.reset(token)
    return clamped_forward
