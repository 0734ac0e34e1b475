"""The Triton kernel of delta_rule.py: one token of the gated delta rule per row, each state read from its
source slot and written to its row's slot, in float32 whatever the state's dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32


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
        BK=triton.next_power_of_2(head_k), BV=min(BLOCK_V, triton.next_power_of_2(head_v)), L2NORM=l2norm)
    return out
