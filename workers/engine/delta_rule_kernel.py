"""The Triton kernels of delta_rule.py: one token per row of the gated delta rule and of the short convolution
before it, each state read from its source slot and written to its row's slot, computed in float32 whatever
the state's dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 64  # value columns of a state per program, and its warps: scripts/bench_delta_rule.py --tiles
NUM_WARPS = 4
BLOCK_C = 128


@triton.jit
def _gated_delta_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, src_ptr, dst_ptr,
                               stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb,
                               stride_bb, stride_ob, stride_oh, stride_ss, stride_sh, sqrt_k,
                               GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                               BV: tl.constexpr, L2NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ks = tl.arange(0, BK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok, v_ok = ks < K, vs < V
    q = tl.load(q_ptr + row * stride_qb + (head // GROUP) * stride_qh + ks, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_kb + (head // GROUP) * stride_kh + ks, mask=k_ok, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
    q = q / sqrt_k
    v = tl.load(v_ptr + row * stride_vb + head * stride_vh + vs, mask=v_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + row * stride_gb + head).to(tl.float32))
    beta = tl.load(beta_ptr + row * stride_bb + head).to(tl.float32)
    cell = head * stride_sh + ks[:, None] * V + vs[None, :]
    mask = k_ok[:, None] & v_ok[None, :]
    src = tl.load(src_ptr + row).to(tl.int64)
    s = tl.load(state_ptr + src * stride_ss + cell, mask=mask, other=0.0).to(tl.float32) * decay
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    out = tl.sum(s * q[:, None], 0)
    dst = tl.load(dst_ptr + row).to(tl.int64)
    tl.store(state_ptr + dst * stride_ss + cell, s.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + vs, out.to(out_ptr.dtype.element_ty), mask=v_ok)


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, sources: torch.Tensor, rows: torch.Tensor, l2norm: bool) -> torch.Tensor:
    """One token of the gated delta rule for each of B rows: q, k `[B, 1, HK, K]`, v `[B, 1, HV, V]`, g (log
    decay) and beta `[B, 1, HV]`; row b's state is read from `state[sources[b]]` (`[slots, HV, K, V]`) and
    written to `state[rows[b]]`. Returns `[B, 1, HV, V]` in q's dtype, as transformers' rule does."""
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    batch, _, kv_heads, head_k = q.shape
    heads, head_v = v.shape[2:]
    out = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    assert state.shape[1:] == (heads, head_k, head_v) and state.stride()[2:] == (head_v, 1)
    grid = (batch, heads, triton.cdiv(head_v, BLOCK_V))
    _gated_delta_decode_kernel[grid](
        q, k, v, g, beta, out, state, sources, rows, q.stride(0), q.stride(2), k.stride(0), k.stride(2),
        v.stride(0), v.stride(2), g.stride(0), beta.stride(0), out.stride(0), out.stride(2), state.stride(0),
        state.stride(1), head_k ** 0.5, GROUP=heads // kv_heads, K=head_k, V=head_v,
        BK=triton.next_power_of_2(head_k), BV=min(BLOCK_V, triton.next_power_of_2(head_v)), L2NORM=l2norm,
        num_warps=NUM_WARPS)
    return out


@triton.jit
def _short_conv_decode_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, src_ptr, dst_ptr, stride_xb, stride_xc,
                              stride_wc, stride_ob, stride_oc, stride_ss, stride_sc, channels,
                              K: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
                              HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    ws = tl.arange(0, BW)
    c_ok = cs < channels
    x = tl.load(x_ptr + row * stride_xb + cs * stride_xc, mask=c_ok, other=0.0).to(tl.float32)
    cells = cs[:, None] * stride_sc + ws[None, :]
    src = tl.load(src_ptr + row).to(tl.int64)
    old = tl.load(state_ptr + src * stride_ss + cells + 1, mask=c_ok[:, None] & (ws[None, :] < W - 1), other=0.0)
    window = tl.where(ws[None, :] == W - 1, x[:, None], old.to(tl.float32))  # shifted left, the new input last
    taps = ws - (W - K)  # weight j meets the window's position W - K + j
    tap_ok = c_ok[:, None] & (taps[None, :] >= 0) & (ws[None, :] < W)
    w = tl.load(w_ptr + cs[:, None] * stride_wc + taps[None, :], mask=tap_ok, other=0.0).to(tl.float32)
    out = tl.sum(window * w, 1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cs, mask=c_ok, other=0.0).to(tl.float32)
    if SILU:
        out = out * tl.sigmoid(out)
    dst = tl.load(dst_ptr + row).to(tl.int64)
    tl.store(state_ptr + dst * stride_ss + cells, window.to(state_ptr.dtype.element_ty),
             mask=c_ok[:, None] & (ws[None, :] < W))
    tl.store(out_ptr + row * stride_ob + cs * stride_oc, out.to(out_ptr.dtype.element_ty), mask=c_ok)


def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool,
                      state: torch.Tensor, sources: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One token of a depthwise causal convolution for each of B rows: x `[B, C, 1]`, weight `[C, K]`; row b's
    window of the last W inputs (K <= W) is read from `state[sources[b]]` (`[slots, C, W]`) and written,
    shifted by x, to `state[rows[b]]`. Returns `[B, C, 1]` in x's dtype (SiLU applied if `silu`), as
    transformers' `causal_conv1d_update` does."""
    batch, channels, _ = x.shape
    width, kernel = state.shape[-1], weight.shape[-1]
    assert state.shape[1] == channels and state.stride(2) == 1 and weight.stride(1) == 1 and kernel <= width
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid = (batch, triton.cdiv(channels, BLOCK_C))
    _short_conv_decode_kernel[grid](
        x, weight, x if bias is None else bias, out, state, sources, rows, x.stride(0), x.stride(1),
        weight.stride(0), out.stride(0), out.stride(1), state.stride(0), state.stride(1), channels,
        K=kernel, W=width, BW=triton.next_power_of_2(width), BC=BLOCK_C, HAS_BIAS=bias is not None, SILU=silu)
    return out
