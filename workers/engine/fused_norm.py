"""RMS norms in one launch: each transformers norm module a decode step calls (two per decoder layer, the final
one, per-head query and key norms, Gated DeltaNet's gated output norm) runs as about ten small kernels
(casts, power, mean, rsqrt, products). Such small kernels, norms, copies and other elementwise ones, took
about 7 ms of a 32 ms Qwen3.5 decode step on an H100 (2026-11-26). Where Triton runs, `fuse_norms` gives
each norm module a forward that launches one kernel (norm_kernel.py), the module's weight read at each call,
so weight updates and captured graphs see it.

transformers' RMS norms differ in small ways: a weight centred on zero (`1 + weight`, Gemma's, Qwen3.5's),
whether the normalized input is rounded to the model's dtype before the weight (Llama's) or after (Gemma's),
a SiLU or sigmoid gate after the norm. Which variant a module computes is not read from its code: each module is run
once, on a copy with a random weight, beside every variant of the kernel, at rows whose scale makes its eps
matter; the module is fused only where a variant gives its output to within rounding (the one that agrees
bit for bit most often). Anything else (a layer norm, a gate before the norm, a group norm, another
argument) keeps its own forward.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import logging
from collections import Counter
from typing import Callable

import torch

logger = logging.getLogger(__name__)

EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
MAX_WIDTH = 16384  # one program holds a row: the widest compiled without spills (kernel_resources.py)
# (offset, round_first, silu): a weight centred on zero, Llama's rounding order, a SiLU (else sigmoid) gate
VARIANTS = tuple(itertools.product((False, True), (True, False), (True, False)))


class FusedNorm:
    """A norm module's forward as one kernel launch with its variant; calls it was not verified for (another
    dtype, width or device, a missing gate) go to the module's own forward."""

    def __init__(self, module: torch.nn.Module, eps: float, offset: bool, round_first: bool, silu: bool,
                 gated: bool) -> None:
        self.module, self.eps, self.offset, self.round_first = module, eps, offset, round_first
        self.silu, self.gated = silu, gated
        self.original = module.forward

    def __call__(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        from workers.engine.norm_kernel import rms_norm  # Triton: only where it runs

        weight = self.module.weight
        if (hidden_states.dtype != weight.dtype or hidden_states.device != weight.device
                or hidden_states.shape[-1] != weight.shape[0] or (gate is None) == self.gated
                or (gate is not None and gate.shape != hidden_states.shape)):
            return self.original(hidden_states) if gate is None else self.original(hidden_states, gate)
        return rms_norm(hidden_states, weight, self.eps, self.offset, self.round_first, gate, self.silu)


def fuse_norms(model: torch.nn.Module) -> Counter:
    """Give every RMS norm module of `model` that one of the kernel's variants computes a fused forward;
    returns how many modules of each class were fused (and logs those kept)."""
    fused, kept = Counter(), Counter()
    for module in model.modules():
        inputs = _inputs(module)
        if not inputs:
            continue
        eps, gated = _eps(module), inputs == 2
        chosen = _verified_variant(module, eps, gated)
        name = type(module).__name__
        if chosen is None:
            kept[name] += 1
            continue
        module.forward = FusedNorm(module, eps, *chosen, gated)
        fused[name] += 1
    if kept:
        logger.warning("norm modules no fused variant computes, left to their own forward: %s", dict(kept))
    logger.info("fused norms: %s", dict(fused))
    return fused


def _inputs(module: torch.nn.Module) -> int:
    """How many tensors a candidate norm's forward takes (1, or 2 with a gate); 0 for a module that is not one:
    a candidate has one 1-D `weight` parameter (at most MAX_WIDTH wide), no buffers or children, a float eps,
    and its class's forward (not fused already)."""
    params = dict(module.named_parameters(recurse=False))
    if "forward" in vars(module) or list(params) != ["weight"] or params["weight"].dim() != 1:
        return 0
    if params["weight"].shape[0] > MAX_WIDTH:
        return 0
    if list(module.buffers(recurse=False)) or list(module.children()) or not isinstance(_eps(module), float):
        return 0
    count = len(_signature(module.forward))
    return count if count in (1, 2) else 0


def _signature(forward: Callable) -> list[str]:
    """The forward's parameter names; none if any is not plain (positional or keyword)."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return []
    plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    return [p.name for p in params] if plain else []


def _eps(module: torch.nn.Module) -> float | None:
    return next((getattr(module, name) for name in EPS_NAMES if hasattr(module, name)), None)


def _verified_variant(module: torch.nn.Module, eps: float, gated: bool) -> tuple[bool, bool, bool] | None:
    """(offset, round_first, silu) of the variant whose output equals the module's to within rounding on a
    probe, the one equal bit for bit most often; None if none does."""
    from workers.engine.norm_kernel import rms_norm

    probe, x, gate = _probe(module, eps)
    try:
        with torch.no_grad():
            expected = probe(x, gate) if gated else probe(x)
    except Exception:  # a forward that needs something else is not a norm this kernel computes
        return None
    if not isinstance(expected, torch.Tensor) or expected.shape != x.shape or expected.dtype != x.dtype:
        return None
    scores = {}
    for variant in VARIANTS if gated else VARIANTS[::2]:  # ungated: silu does not count
        ours = rms_norm(x, probe.weight, eps, *variant[:2], gate if gated else None, variant[2])
        if _within_rounding(ours, expected):
            scores[variant] = (ours == expected).float().mean().item()
    return max(scores, key=scores.get) if scores else None


def _probe(module: torch.nn.Module, eps: float) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A copy of `module` with a random weight, and inputs `[2, 3, n]` whose rows' scales are sqrt(eps)
    (where eps counts), 1 and 100; a gate of the same shape."""
    weight = module.weight
    probe = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(0)
    n = weight.shape[0]
    with torch.no_grad():
        probe.weight.copy_(torch.randn(n, generator=gen) * 0.5 + 0.2)
    scales = torch.tensor([max(eps, 1e-12) ** 0.5, 1.0, 100.0]).repeat(2).view(2, 3, 1)
    x = (torch.randn(2, 3, n, generator=gen) * scales).to(weight.device, weight.dtype)
    gate = (torch.randn(2, 3, n, generator=gen) * 2).to(weight.device, weight.dtype)
    return probe, x, gate


def _within_rounding(ours: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal to within two roundings of the dtype (float32: 1e-5, as reductions are ordered differently)."""
    tol = max(2 * torch.finfo(expected.dtype).eps, 1e-5)
    ours, expected = ours.float(), expected.float()
    return bool(((ours - expected).abs() <= tol * expected.abs() + 1e-6 * expected.abs().max()).all())
