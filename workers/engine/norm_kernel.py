"""The Triton kernel of fused_norm.py: an RMS norm over the last dimension in one launch, optionally gated by
SiLU or sigmoid, computed in float32 with the 16-bit roundings of transformers' variants where they round."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_ELEMENTS = 2048  # elements per program: rows of small norms (per head) share one


@triton.jit(do_not_specialize=["rows", "round_first", "silu"])
def _rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, stride_x, stride_g, stride_o, rows, n, eps, offset,
                     round_first, silu, ROWS: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr):
    rs = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (rs < rows)[:, None] & (cols < n)[None, :]
    x = tl.load(x_ptr + rs[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 1) / n + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32) + offset
    dtype = out_ptr.dtype.element_ty
    rounded = (y.to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)  # Llama's order, in x's dtype
    y = tl.where(round_first != 0, rounded, y * w[None, :])
    if GATED:
        g = tl.load(gate_ptr + rs[:, None] * stride_g + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        y = y * tl.where(silu != 0, g, 1.0) * tl.sigmoid(g)
    tl.store(out_ptr + rs[:, None] * stride_o + cols[None, :], y.to(dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool, round_first: bool,
             gate: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
    """`x * rsqrt(mean(x**2) + eps) * (weight (+ 1 with `offset`))` over the last dimension, times `silu(gate)`
    (`sigmoid(gate)` without `silu`) when given, in x's dtype. `round_first` rounds the normalized x to x's
    dtype before the weight and the weighted product before the gate (Llama's order); otherwise everything
    stays float32 until the output."""
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    gates = flat if gate is None else gate.reshape(-1, n)
    flat, gates = (t if t.stride(-1) == 1 else t.contiguous() for t in (flat, gates))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if flat.shape[0] == 0:
        return out
    block = triton.next_power_of_2(n)
    per_program = max(1, min(16, ROW_ELEMENTS // block))
    _rms_norm_kernel[(triton.cdiv(flat.shape[0], per_program),)](
        flat, gates, weight, out, flat.stride(0), gates.stride(0), n, flat.shape[0], n, eps, float(offset),
        int(round_first), int(silu), ROWS=per_program, BLOCK=block, GATED=gate is not None,
        num_warps=min(8, max(1, per_program * block // 512)))
    return out
