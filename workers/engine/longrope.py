"""LongRoPE per sequence (Phi-3-128k, Phi-3.5, Phi-4-mini).

transformers picks the short or long RoPE factors from the largest position in the whole forward,
which couples every sequence of a packed step. In `generate` one sequence uses the short factors while
it is at most `original_max_position_embeddings` tokens long and the long ones after: the step that
crosses recomputes its whole cache (Phi-3's `prepare_inputs_for_generation`). `PerSequenceLongRope`
replaces the model's rotary embedding and picks the factors of each token from the length of its own
sequence, set by the runner once per step with `set_rope_step`; the scheduler recomputes a sequence
that crosses (`rope_switch_length`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class PerSequenceLongRope(torch.nn.Module):
    """The rotary embedding of a LongRoPE model, with the short/long choice made per token.

    Without flags for the current forward it defers to the wrapped module (transformers' rule).
    """

    def __init__(self, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.rotary = rotary
        config = rotary.config
        self.original_max = config.rope_parameters["original_max_position_embeddings"]
        device = rotary.inv_freq.device
        short, self.scaling = ROPE_INIT_FUNCTIONS["longrope"](config, device)
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, device, seq_len=self.original_max + 1)
        self.register_buffer("short_inv_freq", short, persistent=False)
        self.register_buffer("long_inv_freq", long, persistent=False)
        self.long_tokens: torch.Tensor | None = None

    def set_step(self, seq_lens: torch.Tensor) -> None:
        """Per packed token of the next forward: the full length of its sequence."""
        self.long_tokens = seq_lens > self.original_max

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[1, T, rotary_dim]` of the packed positions `[1, T]`, each token's own factors."""
        long, self.long_tokens = self.long_tokens, None
        if long is None:
            return self.rotary(x, position_ids)
        if position_ids.shape != (1, long.numel()):
            raise ValueError(f"LongRoPE flags for {long.numel()} tokens, forward of {tuple(position_ids.shape)}")
        inv_freq = torch.where(long[:, None], self.long_inv_freq, self.short_inv_freq)
        freqs = position_ids[0, :, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        return (emb.cos() * self.scaling).to(x.dtype), (emb.sin() * self.scaling).to(x.dtype)


def uses_longrope(config: transformers.PretrainedConfig) -> bool:
    """Whether a model of `config` has one LongRoPE rotary embedding (Phi-3's `rope_parameters`)."""
    return (getattr(config, "rope_parameters", None) or {}).get("rope_type") == "longrope"


def install_per_sequence_longrope(model: transformers.PreTrainedModel) -> None:
    """Replace the rotary embedding of a LongRoPE `model` (Phi-3: one shared `rotary_emb`) by a
    `PerSequenceLongRope`; other models are left untouched."""
    if not uses_longrope(model.config):
        return
    base = model.base_model
    base.rotary_emb = PerSequenceLongRope(base.rotary_emb)


def rope_switch_length(model: transformers.PreTrainedModel) -> int | None:
    """The sequence length past which a per-sequence LongRoPE model switches to its long factors."""
    rotary = getattr(model.base_model, "rotary_emb", None)
    return rotary.original_max if isinstance(rotary, PerSequenceLongRope) else None


def set_rope_step(model: transformers.PreTrainedModel, seq_lens: Seq[int] | torch.Tensor) -> None:
    """Tell a per-sequence LongRoPE model the packed tokens of the next forward; no-op for other models.

    `seq_lens[t]` is the full length (prompt and generated tokens) of the sequence of packed token t.
    """
    rotary = getattr(model.base_model, "rotary_emb", None)
    if isinstance(rotary, PerSequenceLongRope):
        rotary.set_step(torch.as_tensor(seq_lens, device=rotary.long_inv_freq.device))
