"""Multi-head latent attention (DeepSeek-V2/V3 and kin) cached as its latent, as vLLM and SGLang do.

transformers' MLA layers compress each token's keys and values into a latent `c` (`kv_lora_rank` wide)
and one rotary key `k_rot` shared by every head, and expand both per head with `kv_b_proj` in
`expand_kv` before attention. Here `expand_kv` hands attention the latent itself, `[c, k_rot]`, as one KV
head whose keys are the latent and whose values are its first part `c`, so the paged cache holds
`kv_lora_rank + rope` numbers per token and layer, in one plane (DeepSeek-V3: 576, against 128 heads x
192 x 2 expanded). Attention runs in the latent space: each head's query is absorbed through its slice
of `kv_b_proj` (`q_nope W_UK`), so a score `q_nope W_UK . c + q_rot . k_rot` is the expanded keys' score,
and the attention-weighted sum of `c` is expanded through `W_UV` afterwards, equal to the weighted sum
of the expanded values.
"""

from __future__ import annotations

import torch
from torch import nn

_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def install_latent_attention(model: nn.Module) -> None:
    """Make every MLA layer of `model` attend from its latent. A layer whose `kv_b_proj` is not a plain
    bias-free `nn.Linear` (a quantized one, say) keeps expanded keys and values."""
    for module in model.modules():
        if _is_latent_attention(module):
            module.expand_kv = _pack_latent
            module.attends_latent = True


def _is_latent_attention(module: nn.Module) -> bool:
    proj = getattr(module, "kv_b_proj", None)
    return (callable(getattr(module, "expand_kv", None)) and type(proj) is nn.Linear and proj.bias is None
            and all(isinstance(getattr(module, name, None), int) for name in _DIMS))


def _pack_latent(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for `expand_kv` (`[B, 1, T, rank]`, `[B, 1, T, rope]`): keys and values are the latent."""
    latent = torch.cat((kv_nope, k_rot), dim=-1)
    return latent, latent


def _up_projections(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_b_proj`'s weight split per head into W_UK `[H, nope, rank]` and W_UV `[H, v, rank]` (views)."""
    nope = module.qk_nope_head_dim
    weight = module.kv_b_proj.weight.view(-1, nope + module.v_head_dim, module.kv_lora_rank)
    return weight[:, :nope], weight[:, nope:]


def absorb_query(module: nn.Module, q: torch.Tensor) -> torch.Tensor:
    """Queries `[T, H, nope + rope]` -> `[T, H, rank + rope]`: the non-rotary part absorbed through W_UK."""
    w_uk, _ = _up_projections(module)
    q_nope, q_rot = q.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    return torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rot), dim=-1)


def expand_output(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """Attention over the latent's values `[T, H, rank]` -> each head's values `[T, H, v]` through W_UV."""
    _, w_uv = _up_projections(module)
    return torch.einsum("thr,hvr->thv", out, w_uv)
